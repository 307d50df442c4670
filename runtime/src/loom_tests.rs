//! Loom models of the cross-thread register protocol.
