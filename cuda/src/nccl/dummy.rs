//! NCCL without CUDA: every call answers [`CudaError::NotBuilt`].

include!("api.rs");

use crate::{CudaError, StreamHandle};

/// Whether NCCL can be loaded: not in this build.
pub fn available() -> Result<(), CudaError> {
    Err(CudaError::NotBuilt)
}

/// Runs `calls` as one NCCL group.
pub fn group<R>(calls: impl FnOnce() -> Result<R, CudaError>) -> Result<R, CudaError> {
    let _ = calls;
    Err(CudaError::NotBuilt)
}

/// One rank's communicator of a group (not in this build).
#[derive(Debug)]
pub struct Communicator {
    _private: (),
}

impl Communicator {
    /// One communicator per GPU of `ordinals`, rank `r` on `ordinals[r]`.
    pub fn for_devices(ordinals: &[usize]) -> Result<Vec<Communicator>, CudaError> {
        let _ = ordinals;
        Err(CudaError::NotBuilt)
    }

    /// Queues `calls` on `stream` as one NCCL group.
    pub fn queue(&self, calls: &[Call], element: Element, stream: StreamHandle) -> Result<(), CudaError> {
        let _ = (calls, element, stream);
        Err(CudaError::NotBuilt)
    }

    /// An error NCCL met asynchronously (a peer failed, a network error), if any.
    pub fn async_error(&self) -> Result<(), CudaError> {
        Err(CudaError::NotBuilt)
    }

    /// Aborts the communicator: pending and later operations fail instead of waiting.
    pub fn abort(&self) {}
}
