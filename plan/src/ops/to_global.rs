//! Attributes of `to_global` ops.

use serde::{Deserialize, Serialize};

/// `to_global`: the identity, whose output has a pinned layout (boxing goes before it).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ToGlobal;
