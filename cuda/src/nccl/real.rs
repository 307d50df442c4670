//! NCCL over cudarc's raw layer: communicators for the GPUs of one process
//! (`ncclCommInitAll`), collectives queued on a stream's native handle as one NCCL group
//! per firing (a gradient bucket's parts reduce in one launch, with no packing), the
//! asynchronous error check and abort.

include!("api.rs");

use crate::{CudaError, StreamHandle};
use cudarc::nccl::sys;
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether NCCL (`libnccl`) can be loaded; cudarc panics on its first call otherwise.
pub fn available() -> Result<(), CudaError> {
    // SAFETY: only tries to open the library by its candidate names.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    Err(CudaError::MissingLibrary {
        library: "libnccl (NCCL)",
        searched: crate::distinct(cudarc::get_lib_name_candidates("nccl")).join(", "),
        hint: "install NCCL (`pip install nvidia-nccl-cu13`, or the libnccl2 package) and add the folder \
               holding libnccl.so.2 to LD_LIBRARY_PATH",
    })
}

/// NCCL's description of `result`.
fn describe(result: sys::ncclResult_t) -> String {
    // SAFETY: NCCL returns a static NUL-terminated string for every result code.
    let text = unsafe { sys::ncclGetErrorString(result) };
    if text.is_null() {
        return format!("{result:?}");
    }
    // SAFETY: see above.
    format!("{result:?}: {}", unsafe { CStr::from_ptr(text) }.to_string_lossy())
}

fn check(result: sys::ncclResult_t, call: &str, ordinal: usize) -> Result<(), CudaError> {
    match result {
        sys::ncclResult_t::ncclSuccess => Ok(()),
        other => Err(CudaError::Call { call: call.to_string(), ordinal, message: describe(other) }),
    }
}

/// Runs `calls` (collectives of several ranks issued from this one thread) as one NCCL
/// group, which a thread driving more than one GPU needs: without it NCCL may wait inside
/// the first rank's call for the others.
pub fn group<R>(calls: impl FnOnce() -> Result<R, CudaError>) -> Result<R, CudaError> {
    // SAFETY: group calls nest; the group is ended below whatever `calls` returns.
    check(unsafe { sys::ncclGroupStart() }, "ncclGroupStart", 0)?;
    let outcome = calls();
    // SAFETY: ends the group started above.
    let ended = check(unsafe { sys::ncclGroupEnd() }, "ncclGroupEnd", 0);
    let value = outcome?;
    ended.map(|()| value)
}

/// One rank's communicator of a group of GPUs in this process, destroyed on drop (aborted
/// instead when the job aborted it).
#[derive(Debug)]
pub struct Communicator {
    raw: usize,
    ordinal: usize,
    aborted: AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; each is
// used by its rank's one comm-stream thread, and `abort` is NCCL's thread-safe way out.
unsafe impl Send for Communicator {}
// SAFETY: see above.
unsafe impl Sync for Communicator {}

impl Communicator {
    fn raw(&self) -> sys::ncclComm_t {
        self.raw as sys::ncclComm_t
    }

    /// One communicator per GPU of `ordinals` (distinct GPUs; NCCL refuses two ranks on
    /// one), rank `r` on `ordinals[r]`, made together from this thread.
    pub fn for_devices(ordinals: &[usize]) -> Result<Vec<Communicator>, CudaError> {
        available()?;
        let first = ordinals.first().copied().unwrap_or(0);
        let devices: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        let mut raw = vec![std::ptr::null_mut(); ordinals.len()];
        // SAFETY: `raw` has one slot per device of `devices`.
        let result = unsafe { sys::ncclCommInitAll(raw.as_mut_ptr(), devices.len() as i32, devices.as_ptr()) };
        check(result, &format!("ncclCommInitAll(GPUs {ordinals:?})"), first)?;
        Ok(raw
            .into_iter()
            .zip(ordinals)
            .map(|(raw, &ordinal)| Communicator { raw: raw as usize, ordinal, aborted: AtomicBool::new(false) })
            .collect())
    }

    /// Queues `calls` on `stream` as one NCCL group (one launch for a bucket's parts).
    pub fn queue(&self, calls: &[Call], element: Element, stream: StreamHandle) -> Result<(), CudaError> {
        let dtype = match element {
            Element::F32 => sys::ncclDataType_t::ncclFloat32,
            Element::F64 => sys::ncclDataType_t::ncclFloat64,
            Element::I64 => sys::ncclDataType_t::ncclInt64,
            Element::Bf16 => sys::ncclDataType_t::ncclBfloat16,
            Element::F16 => sys::ncclDataType_t::ncclFloat16,
        };
        let stream = stream.0 as usize as sys::cudaStream_t;
        let sum = sys::ncclRedOp_t::ncclSum;
        group(|| {
            for call in calls {
                // SAFETY: the addresses are device-reachable registers of the sizes the call
                // names (checked when the kernel was made), alive until the stream reaches the
                // completion callback queued after this group.
                let (result, name) = unsafe {
                    match *call {
                        Call::AllReduce { input, output, count } => (
                            sys::ncclAllReduce(
                                input as *const c_void,
                                output as *mut c_void,
                                count,
                                dtype,
                                sum,
                                self.raw(),
                                stream,
                            ),
                            "ncclAllReduce",
                        ),
                        Call::ReduceScatter { input, output, count } => (
                            sys::ncclReduceScatter(
                                input as *const c_void,
                                output as *mut c_void,
                                count,
                                dtype,
                                sum,
                                self.raw(),
                                stream,
                            ),
                            "ncclReduceScatter",
                        ),
                        Call::AllGather { input, output, count } => (
                            sys::ncclAllGather(
                                input as *const c_void,
                                output as *mut c_void,
                                count,
                                dtype,
                                self.raw(),
                                stream,
                            ),
                            "ncclAllGather",
                        ),
                    }
                };
                check(result, name, self.ordinal)?;
            }
            Ok(())
        })
    }

    /// An error NCCL met asynchronously (a peer failed, a network error), if any.
    pub fn async_error(&self) -> Result<(), CudaError> {
        let mut result = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator; NCCL writes the result.
        check(unsafe { sys::ncclCommGetAsyncError(self.raw(), &mut result) }, "ncclCommGetAsyncError", self.ordinal)?;
        check(result, "an earlier NCCL collective (asynchronous error)", self.ordinal)
    }

    /// Aborts the communicator: pending and later operations fail instead of waiting.
    pub fn abort(&self) {
        if !self.aborted.swap(true, Ordering::AcqRel) {
            // SAFETY: a live communicator, aborted once; NCCL allows this while operations
            // are pending on other threads.
            let _ = unsafe { sys::ncclCommAbort(self.raw()) };
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if !self.aborted.load(Ordering::Acquire) {
            // SAFETY: a live communicator, destroyed once, after its streams drained (the
            // job's streams drop before its collective groups).
            let _ = unsafe { sys::ncclCommDestroy(self.raw()) };
        }
    }
}
