//! Helpers shared by the runtime's integration tests.
#![allow(dead_code)] // each test file uses some of them

use std::sync::mpsc;
use std::time::Duration;

/// Runs `f` on a thread and fails the test (instead of hanging it) if it takes longer than
/// `limit`. This bounds a hang; it asserts nothing about speed.
pub(crate) fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).expect("hung instead of ending")
}
