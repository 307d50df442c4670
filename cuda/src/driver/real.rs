//! The driver over cudarc's `result` layer: raw handles, no per-launch allocation (cudarc's
//! safe launch builder collects arguments in `Vec`s and tracks events per buffer; regflow's
//! registers are raw arena addresses whose order the actor protocol already guarantees).
//!
//! **Dry runs.** After [`enable_dry_run`], [`Device::open`] gives a device with no GPU
//! behind it: kernels are compiled by NVRTC as for a real device, but a launch only checks
//! its arguments against the entry point's compiled parameters (count and byte sizes) and
//! its grid against CUDA's limits, and runs nothing; memory is host memory. That lets CI,
//! which has NVRTC but no GPU, run every op kernel's factory and launches (the op tests do
//! when no GPU is found). Real launches make the same argument check.

include!("api.rs");

use crate::sources::{self, KernelSource};
use crate::CudaError;
use cudarc::driver::result::{self, DriverError};
use cudarc::driver::{sys, CudaContext};
use regflow_memory::ArenaMemory;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock};

/// The architecture dry-run devices compile for, once [`enable_dry_run`] was called.
static DRY_RUN: OnceLock<String> = OnceLock::new();

/// Makes every later [`Device::open`] in this process give a dry-run device compiling for
/// `arch` (`compute_80`): launches are checked, nothing runs (see the module docs). For
/// tests on machines without a GPU; a process that already opened a real device keeps it.
pub fn enable_dry_run(arch: &str) -> Result<(), CudaError> {
    crate::nvrtc::available()?;
    let _ = DRY_RUN.set(arch.to_string());
    Ok(())
}

/// The library error as a [`CudaError::Call`] naming the call and the device.
fn failed(call: impl Into<String>, ordinal: usize) -> impl FnOnce(DriverError) -> CudaError {
    let call = call.into();
    move |e| CudaError::Call { call, ordinal, message: format!("{e:?}") }
}

/// Whether libcuda can be loaded; cudarc panics on its first call otherwise.
fn driver_library() -> Result<(), CudaError> {
    // SAFETY: only tries to open the library by its candidate names.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    Err(CudaError::MissingLibrary {
        library: "libcuda (the NVIDIA driver)",
        searched: crate::distinct(cudarc::get_lib_name_candidates("cuda")).join(", "),
        hint: "install the NVIDIA driver, or add the folder holding libcuda.so.1 to LD_LIBRARY_PATH",
    })
}

fn attribute(device: sys::CUdevice, ordinal: usize, which: sys::CUdevice_attribute) -> Result<i32, CudaError> {
    // SAFETY: `device` came from `cuDeviceGet`.
    unsafe { result::device::get_attribute(device, which) }
        .map_err(failed(format!("cuDeviceGetAttribute({which:?})"), ordinal))
}

fn read_info(ordinal: usize) -> Result<DeviceInfo, CudaError> {
    let device = result::device::get(ordinal as i32).map_err(failed("cuDeviceGet", ordinal))?;
    let name = result::device::get_name(device).map_err(failed("cuDeviceGetName", ordinal))?;
    // SAFETY: as above.
    let total = unsafe { result::device::total_mem(device) }.map_err(failed("cuDeviceTotalMem", ordinal))?;
    use sys::CUdevice_attribute::*;
    let major = attribute(device, ordinal, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(device, ordinal, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let concurrent = attribute(device, ordinal, CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS)?;
    Ok(DeviceInfo {
        ordinal,
        name,
        total_bytes: total as u64,
        compute_capability: (major.max(0) as u32, minor.max(0) as u32),
        concurrent_managed_access: concurrent != 0,
    })
}

/// The devices of this machine, read once per process: an error naming what is missing
/// when there is no driver library, the driver fails to start, or it has no device.
pub fn probe() -> Result<Vec<DeviceInfo>, CudaError> {
    static PROBED: OnceLock<Result<Vec<DeviceInfo>, CudaError>> = OnceLock::new();
    PROBED
        .get_or_init(|| {
            driver_library()?;
            result::init().map_err(failed("cuInit", 0))?;
            let count = result::device::get_count().map_err(failed("cuDeviceGetCount", 0))?.max(0) as usize;
            if count == 0 {
                return Err(CudaError::NoDevice { ordinal: 0, count: 0 });
            }
            (0..count).map(read_info).collect()
        })
        .clone()
}

/// A device: its primary context and the kernel modules loaded into it.
#[derive(Debug, Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

#[derive(Debug)]
struct DeviceInner {
    info: DeviceInfo,
    /// `None` on a dry-run device.
    context: Option<Arc<CudaContext>>,
    /// Loaded modules (0 on a dry-run device) and their entries' parameter sizes, by source
    /// name; each source is compiled and loaded once per process.
    modules: Mutex<HashMap<&'static str, Module>>,
}

#[derive(Debug, Clone)]
struct Module {
    raw: usize,
    /// Byte sizes of each entry's parameters, read off the PTX (kept for the process).
    params: HashMap<&'static str, &'static [usize]>,
}

impl Device {
    /// Opens device `ordinal` (once per process; later calls share it). Refuses a device
    /// without concurrent managed access, which regflow's arenas need.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        static OPEN: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
        let mut open = OPEN.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        if let Some(device) = open.get(&ordinal) {
            return Ok(device.clone());
        }
        if let Some(arch) = DRY_RUN.get() {
            let digits: String = arch.chars().filter(char::is_ascii_digit).collect();
            let (major, minor) = digits.split_at(digits.len().saturating_sub(1));
            let info = DeviceInfo {
                ordinal,
                name: format!("dry run ({arch})"),
                total_bytes: 80 << 30,
                compute_capability: (major.parse().unwrap_or(8), minor.parse().unwrap_or(0)),
                concurrent_managed_access: true,
            };
            let device = Device { inner: Arc::new(DeviceInner { info, context: None, modules: Mutex::default() }) };
            open.insert(ordinal, device.clone());
            return Ok(device);
        }
        let devices = probe()?;
        let info = devices.get(ordinal).cloned().ok_or(CudaError::NoDevice { ordinal, count: devices.len() })?;
        if !info.concurrent_managed_access {
            return Err(CudaError::Unsuitable {
                ordinal,
                name: info.name,
                why: "it has no concurrent managed access (the host and the GPU may not use one arena at once; \
                      this needs Linux and a Pascal or newer GPU)"
                    .into(),
            });
        }
        let context = CudaContext::new(ordinal).map_err(failed("cuDevicePrimaryCtxRetain", ordinal))?;
        let device =
            Device { inner: Arc::new(DeviceInner { info, context: Some(context), modules: Mutex::default() }) };
        open.insert(ordinal, device.clone());
        Ok(device)
    }

    /// What the driver says about the device.
    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// Whether this is a dry-run device ([`enable_dry_run`]): launches are checked, not run.
    pub fn is_dry(&self) -> bool {
        self.inner.context.is_none()
    }

    fn ordinal(&self) -> usize {
        self.inner.info.ordinal
    }

    /// Free device memory in bytes, as the driver reads it now.
    pub fn free_bytes(&self) -> Result<u64, CudaError> {
        if self.is_dry() {
            return Ok(self.info().total_bytes);
        }
        self.bind()?;
        let (free, _) = result::mem_get_info().map_err(failed("cuMemGetInfo", self.ordinal()))?;
        Ok(free as u64)
    }

    /// Makes the device's context current on the calling thread (a no-op when it is).
    pub fn bind(&self) -> Result<(), CudaError> {
        match &self.inner.context {
            Some(context) => context.bind_to_thread().map_err(failed("cuCtxSetCurrent", self.ordinal())),
            None => Ok(()),
        }
    }

    /// A new non-blocking stream of the device.
    pub fn stream(&self) -> Result<Stream, CudaError> {
        if self.is_dry() {
            return Ok(Stream { raw: 0, device: self.clone() });
        }
        self.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(failed("cuStreamCreate", self.ordinal()))?;
        Ok(Stream { raw: raw as usize, device: self.clone() })
    }

    /// `bytes` of managed memory for an arena, preferring to live on the device (so kernels
    /// read it at device speed) and mapped for the host (feeds, fetches and host kernels
    /// read it in place). Allocated once per plan.
    pub fn managed(&self, label: &str, bytes: u64) -> Result<Box<dyn ArenaMemory>, CudaError> {
        let ordinal = self.ordinal();
        if self.is_dry() {
            use regflow_memory::ArenaAllocator;
            return regflow_memory::HostAllocator.allocate(label, regflow_memory::MemoryKind::Host, bytes).map_err(
                |e| CudaError::Call { call: format!("dry-run memory for {label}"), ordinal, message: e.to_string() },
            );
        }
        self.bind()?;
        let len = usize::try_from(bytes.max(1)).map_err(|_| CudaError::Call {
            call: format!("cuMemAllocManaged({bytes} bytes) for {label}"),
            ordinal,
            message: "more bytes than this machine can address".into(),
        })?;
        // SAFETY: a fresh allocation of `len` bytes, zeroed below before any register is
        // viewed.
        let ptr = unsafe { result::malloc_managed(len, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL) }
            .map_err(failed(format!("cuMemAllocManaged({bytes} bytes) for {label}"), ordinal))?;
        let memory = ManagedMemory { ptr, len, device: self.clone() };
        let location =
            sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: ordinal as i32 };
        // SAFETY: the whole range of the allocation above. Advice only steers migration;
        // where a driver refuses it the arena still works, so a failure is not an error.
        unsafe {
            let _ = result::mem_advise(ptr, len, sys::CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION, location);
        }
        // Zeroed by the device, so the pages start where kernels use them (a host write would
        // migrate them all to the host first) and count in the driver's free-memory reading.
        // SAFETY: the whole allocation above, which nothing uses yet.
        unsafe { result::memset_d8_sync(ptr, 0, len) }
            .map_err(failed(format!("cuMemsetD8({bytes} bytes) for {label}"), ordinal))?;
        Ok(Box::new(memory))
    }

    /// The kernel `entry` of the built-in sources, compiled by NVRTC for this device's
    /// architecture on first use (once per source per process) and loaded into its context.
    pub fn function(&self, entry: &str) -> Result<Function, CudaError> {
        let source: &'static KernelSource = sources::source_of(entry)?;
        self.bind()?;
        let ordinal = self.ordinal();
        let module = {
            let mut modules = self.inner.modules.lock().unwrap_or_else(|p| p.into_inner());
            match modules.get(source.name) {
                Some(module) => module.clone(),
                None => {
                    if modules.is_empty() {
                        // This device's first kernel: compile every source now, in
                        // parallel, rather than one at a time as kernels ask for them.
                        crate::nvrtc::compile_all(&self.info().arch());
                    }
                    let module = self.load(source)?;
                    modules.insert(source.name, module.clone());
                    module
                }
            }
        };
        let (&entry, &params) = module.params.get_key_value(entry).ok_or_else(|| CudaError::UnknownEntry {
            entry: entry.into(),
            nearest: format!(" in the PTX NVRTC made of '{}'", source.name),
        })?;
        if self.is_dry() {
            return Ok(Function { raw: 0, ordinal, entry, params });
        }
        let name =
            CString::new(entry).map_err(|_| CudaError::UnknownEntry { entry: entry.into(), nearest: String::new() })?;
        // SAFETY: the module was loaded above and is never unloaded while the process runs.
        let raw = unsafe { result::module::get_function(module.raw as sys::CUmodule, name) }
            .map_err(failed(format!("cuModuleGetFunction({entry})"), ordinal))?;
        Ok(Function { raw: raw as usize, ordinal, entry, params })
    }

    /// Compiles `source` for this device and loads it (not on a dry-run device), with the
    /// parameter sizes of each of its entries.
    fn load(&self, source: &'static KernelSource) -> Result<Module, CudaError> {
        let arch = self.info().arch();
        let ptx = crate::nvrtc::compile(source, &arch)?;
        let mut params = HashMap::new();
        for entry in sources::entries_in(source) {
            let sizes = sources::ptx_params(&ptx, entry).ok_or_else(|| CudaError::Compile {
                source_name: source.name,
                arch: arch.clone(),
                log: format!("the PTX has no readable parameter list for entry '{entry}'"),
            })?;
            // Kept for the process: a few hundred entries, read once per source.
            let sizes: &'static [usize] = Box::leak(sizes.into_boxed_slice());
            params.insert(entry, sizes);
        }
        if self.is_dry() {
            return Ok(Module { raw: 0, params });
        }
        let image = CString::new(ptx).map_err(|_| CudaError::Compile {
            source_name: source.name,
            arch,
            log: "NVRTC's PTX holds a NUL byte".into(),
        })?;
        // SAFETY: a NUL-terminated PTX text.
        let raw = unsafe { result::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(failed(format!("cuModuleLoadData({})", source.name), self.ordinal()))?;
        Ok(Module { raw: raw as usize, params })
    }
}

/// Managed memory of one arena, freed on drop.
#[derive(Debug)]
struct ManagedMemory {
    ptr: sys::CUdeviceptr,
    len: usize,
    device: Device,
}

// SAFETY: the allocation stays at `ptr` until drop and is reachable from the host (managed
// memory on a device with concurrent managed access, checked in `Device::open`).
unsafe impl ArenaMemory for ManagedMemory {
    fn base(&self) -> NonNull<u8> {
        NonNull::new(self.ptr as usize as *mut u8).unwrap_or(NonNull::dangling())
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for ManagedMemory {
    fn drop(&mut self) {
        // The job's streams were synchronized and dropped before its arenas.
        if self.device.bind().is_ok() {
            // SAFETY: allocated by `cuMemAllocManaged` and freed once.
            let _ = unsafe { result::memory_free(self.ptr) };
        }
    }
}

/// A non-blocking stream of a device, destroyed (after it drains) on drop.
#[derive(Debug)]
pub struct Stream {
    raw: usize,
    device: Device,
}

// SAFETY: a CUstream may be used from any thread whose current context is its device's;
// `Stream`'s methods bind it first.
unsafe impl Send for Stream {}

impl Stream {
    fn raw(&self) -> sys::CUstream {
        self.raw as sys::CUstream
    }

    /// The native handle kernels launch onto.
    pub fn handle(&self) -> StreamHandle {
        StreamHandle(self.raw as u64)
    }

    /// Waits until everything enqueued so far has run; reports a kernel's failure.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        if self.raw == 0 {
            return Ok(()); // a dry-run stream: nothing was queued
        }
        self.device.bind()?;
        // SAFETY: a live stream of the bound context.
        unsafe { result::stream::synchronize(self.raw()) }.map_err(failed("cuStreamSynchronize", self.device.ordinal()))
    }

    /// Enqueues `callback(arg)`: the driver calls it on its own thread once the stream
    /// reaches it.
    ///
    /// # Safety
    ///
    /// `arg` must stay valid until the callback has run, and the callback must not call
    /// CUDA.
    pub unsafe fn call_back(&self, callback: HostCallback, arg: *mut c_void) -> Result<(), CudaError> {
        if self.raw == 0 {
            // A dry-run stream has run everything queued: complete now.
            // SAFETY: forwarded to the caller.
            unsafe { callback(arg) };
            return Ok(());
        }
        // SAFETY: forwarded to the caller.
        unsafe { result::stream::launch_host_function(self.raw(), callback, arg) }
            .map_err(failed("cuLaunchHostFunc", self.device.ordinal()))
    }
}

/// Timing marks of one stream: CUDA events recorded between its kernels and read back as
/// host instants, so a timeline shows when the GPU ran each kernel while the stream runs
/// as it does untraced (nothing waits for a kernel to time it).
///
/// A mark is an event with timing recorded on the stream. [`StreamTimer::resolve`] waits
/// for the stream, reads each mark's offset from the batch's base event, and starts a new
/// batch: the base is recorded on an idle stream and its host instant taken right after
/// the wait for it returns, so every instant is late by that wait's return (microseconds),
/// the same for every mark of a batch. A batch holds up to `capacity` marks (events made
/// once); f32 milliseconds from the base keep sub-microsecond steps for batches of seconds.
/// On a dry-run stream a mark is the host's clock at recording.
#[derive(Debug)]
pub struct StreamTimer {
    /// Events, made once; 0s on a dry-run stream.
    events: Vec<usize>,
    /// The batch's base event (0 on a dry-run stream) and its host instant.
    base: usize,
    base_at: std::time::Instant,
    /// Marks a batch holds, and those recorded in this one (a dry run keeps their host
    /// instants in `dry`).
    capacity: usize,
    recorded: usize,
    dry: Vec<std::time::Instant>,
    device: Device,
}

// SAFETY: events may be used from any thread whose current context is their device's; the
// timer's methods take the stream, whose thread bound the context.
unsafe impl Send for StreamTimer {}

impl Stream {
    /// A timer of `capacity` marks per batch for this stream (events made now).
    pub fn timer(&self, capacity: usize) -> Result<StreamTimer, CudaError> {
        let ordinal = self.device.ordinal();
        let capacity = capacity.max(1);
        let mut timer = StreamTimer {
            events: Vec::with_capacity(capacity),
            base: 0,
            base_at: std::time::Instant::now(),
            capacity,
            recorded: 0,
            dry: Vec::new(),
            device: self.device.clone(),
        };
        if self.raw == 0 {
            timer.dry.reserve(capacity);
            return Ok(timer);
        }
        self.device.bind()?;
        let make =
            || result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(failed("cuEventCreate", ordinal));
        for _ in 0..capacity {
            timer.events.push(make()? as usize);
        }
        timer.base = make()? as usize;
        timer.rebase(self)?;
        Ok(timer)
    }
}

impl StreamTimer {
    /// Marks this batch can still record.
    pub fn room(&self) -> usize {
        self.capacity - self.recorded
    }

    /// Records the next mark on `stream` (the timer's) and returns its index in the batch;
    /// an error when the batch is full ([`StreamTimer::room`] says so beforehand).
    pub fn mark(&mut self, stream: &Stream) -> Result<usize, CudaError> {
        let index = self.recorded;
        if index >= self.capacity {
            return Err(CudaError::Call {
                call: "cuEventRecord".into(),
                ordinal: self.device.ordinal(),
                message: format!("the timer's batch of {} marks is full: resolve it first", self.capacity),
            });
        }
        if stream.raw == 0 {
            self.dry.push(std::time::Instant::now());
        } else {
            // SAFETY: an event of this timer and a live stream of the bound context.
            unsafe { result::event::record(self.events[index] as sys::CUevent, stream.raw()) }
                .map_err(failed("cuEventRecord", self.device.ordinal()))?;
        }
        self.recorded += 1;
        Ok(index)
    }

    /// Waits for `stream`, appends the host instant of every mark of the batch to `out` (in
    /// mark order), and starts a new batch.
    pub fn resolve(&mut self, stream: &Stream, out: &mut Vec<std::time::Instant>) -> Result<(), CudaError> {
        if stream.raw == 0 {
            out.append(&mut self.dry);
            self.recorded = 0;
            return Ok(());
        }
        stream.synchronize()?;
        let ordinal = self.device.ordinal();
        for &event in &self.events[..self.recorded] {
            // SAFETY: the base and the mark were recorded on this stream, which drained.
            let ms = unsafe { result::event::elapsed(self.base as sys::CUevent, event as sys::CUevent) }
                .map_err(failed("cuEventElapsedTime", ordinal))?;
            let offset = std::time::Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3);
            out.push(self.base_at + offset);
        }
        self.recorded = 0;
        self.rebase(stream)
    }

    /// Records the base event on the (drained) stream, waits for it and takes its instant.
    fn rebase(&mut self, stream: &Stream) -> Result<(), CudaError> {
        let ordinal = self.device.ordinal();
        // SAFETY: the timer's base event and a live stream of the bound context.
        unsafe {
            result::event::record(self.base as sys::CUevent, stream.raw()).map_err(failed("cuEventRecord", ordinal))?;
            result::event::synchronize(self.base as sys::CUevent).map_err(failed("cuEventSynchronize", ordinal))?;
        }
        self.base_at = std::time::Instant::now();
        Ok(())
    }
}

impl Drop for StreamTimer {
    fn drop(&mut self) {
        if self.events.is_empty() || self.device.bind().is_err() {
            return;
        }
        for &event in self.events.iter().chain([&self.base]) {
            // SAFETY: made by cuEventCreate, destroyed once; a pending event is released by
            // the driver when it completes.
            let _ = unsafe { result::event::destroy(event as sys::CUevent) };
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.raw != 0 && self.device.bind().is_ok() {
            // SAFETY: a live stream, destroyed once, after its work and callbacks ran.
            unsafe {
                let _ = result::stream::synchronize(self.raw());
                let _ = result::stream::destroy(self.raw());
            }
        }
    }
}

/// Waits until everything queued on `stream` so far has run (for a host step that reads
/// what a queued kernel wrote, within one firing: the finite check, say). Reports a kernel's
/// failure.
pub fn synchronize(stream: StreamHandle) -> Result<(), CudaError> {
    if stream.0 == 0 {
        return Ok(()); // a dry-run stream
    }
    // SAFETY: the handle comes from a live `Stream` whose context the calling stream
    // thread bound.
    unsafe { result::stream::synchronize(stream.0 as usize as sys::CUstream) }.map_err(failed("cuStreamSynchronize", 0))
}

/// Page-locked host memory of one device's context, for copies between host and device
/// that the GPU's copy engines run while the host goes on: a copy from pageable memory is
/// staged by the driver and returns only once the bytes are taken, a copy from here is
/// queued and returns at once. Made once (a job's feeds and fetches make theirs when the
/// job is built), freed on drop, and read and written through an arena over it
/// (`ArenaMemory`). On a dry-run device it is plain host memory.
#[derive(Debug)]
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// `None` on a dry-run device, whose bytes `_dry_bytes` owns (`ptr` points into it).
    device: Option<Device>,
    _dry_bytes: Box<[u8]>,
}

// SAFETY: the buffer is owned memory at a fixed address; moving it between threads moves
// its ownership (the driver frees page-locked memory from any thread once bound).
unsafe impl Send for PinnedBuffer {}
// SAFETY: a `&PinnedBuffer` gives out only its address (`ArenaMemory::base`); who writes
// there is ruled by the arena's views, as for any arena's memory.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// `len` bytes of page-locked memory for `device`, zeroed.
    pub fn new(device: &Device, len: usize) -> Result<Self, CudaError> {
        if device.is_dry() || len == 0 {
            let mut dry = vec![0u8; len].into_boxed_slice();
            let ptr = NonNull::new(dry.as_mut_ptr()).unwrap_or(NonNull::dangling());
            return Ok(Self { ptr, len, device: None, _dry_bytes: dry });
        }
        device.bind()?;
        // SAFETY: a plain allocation in the bound context; flags 0 = portable to this
        // context only, which is the one its copies run in.
        let raw = unsafe { result::malloc_host(len, 0) }
            .map_err(failed(format!("cuMemHostAlloc({len} bytes)"), device.ordinal()))?;
        let ptr = NonNull::new(raw as *mut u8).ok_or_else(|| CudaError::Call {
            call: format!("cuMemHostAlloc({len} bytes)"),
            ordinal: device.ordinal(),
            message: "the driver returned a null pointer".into(),
        })?;
        // SAFETY: `len` bytes just allocated, owned here.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(Self { ptr, len, device: Some(device.clone()), _dry_bytes: Box::default() })
    }
}

// SAFETY: the buffer's `len` bytes stay at `ptr`, reachable from the host, until drop.
unsafe impl ArenaMemory for PinnedBuffer {
    fn base(&self) -> NonNull<u8> {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if let Some(device) = &self.device {
            if device.bind().is_ok() {
                // SAFETY: allocated by `cuMemHostAlloc` and freed once; the stream that
                // copied from it drained before the job dropped its kernels.
                let _ = unsafe { result::free_host(self.ptr.as_ptr() as *mut c_void) };
            }
        }
    }
}

/// Queues a copy of `bytes` bytes from `src`, an address inside a [`PinnedBuffer`], to
/// `dst` on `stream`, and returns at once: the stream's copy engine reads the page-locked
/// bytes when it gets there. On a dry-run stream the memory is host memory and this is a
/// plain copy.
///
/// # Safety
///
/// `src` must lie in a live [`PinnedBuffer`] with `bytes` bytes from it, `dst` must be
/// valid for `bytes` bytes, nothing queued elsewhere may use them until the copy ran, and
/// `src`'s bytes must not be written or freed before the copy ran.
pub unsafe fn copy_to_device_async(stream: StreamHandle, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
    if stream.0 == 0 {
        // SAFETY: forwarded to the caller; a dry run's registers are host memory.
        unsafe { std::ptr::copy_nonoverlapping(src as usize as *const u8, dst as usize as *mut u8, bytes) };
        return Ok(());
    }
    // SAFETY: forwarded to the caller; the handle comes from a live `Stream` whose context
    // the calling stream thread bound.
    let src = unsafe { std::slice::from_raw_parts(src as usize as *const u8, bytes) };
    // SAFETY: as above.
    unsafe { result::memcpy_htod_async(dst as sys::CUdeviceptr, src, stream.0 as usize as sys::CUstream) }
        .map_err(failed(format!("cuMemcpyHtoDAsync({bytes} bytes)"), 0))
}

/// Copies `dst.len()` bytes from `src` (device or managed memory) into `dst` on `stream`,
/// after what the stream queued before, and waits for it. Reading a managed register this
/// way leaves its pages on the device; a host read would fault them over to the host, and
/// the next kernel to write the register would fault them back. On a dry-run stream the
/// memory is host memory and this is a plain copy.
///
/// # Safety
///
/// `src` must be valid for `dst.len()` bytes, and nothing may write them until the call
/// returns.
pub unsafe fn copy_to_host(stream: StreamHandle, dst: &mut [u8], src: u64) -> Result<(), CudaError> {
    if stream.0 == 0 {
        // SAFETY: forwarded to the caller; a dry run's registers are host memory.
        unsafe { std::ptr::copy_nonoverlapping(src as usize as *const u8, dst.as_mut_ptr(), dst.len()) };
        return Ok(());
    }
    // SAFETY: as above; the handle comes from a live `Stream` whose context the calling
    // stream thread bound, and `dst` is borrowed until the wait below ends the copy.
    unsafe { result::memcpy_dtoh_async(dst, src as sys::CUdeviceptr, stream.0 as usize as sys::CUstream) }
        .map_err(failed(format!("cuMemcpyDtoHAsync({} bytes)", dst.len()), 0))?;
    synchronize(stream)
}

/// Queues a copy of `bytes` from `src` to `dst`, device (or managed) memory both, on
/// `stream`: no wait, the stream orders it. On a dry-run stream the memory is host memory
/// and this is a plain copy.
///
/// # Safety
///
/// `src` and `dst` must be valid for `bytes` bytes until the copy ran, and must not overlap.
pub unsafe fn copy_on_device(stream: StreamHandle, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
    if stream.0 == 0 {
        // SAFETY: forwarded to the caller; a dry run's registers are host memory.
        unsafe { std::ptr::copy_nonoverlapping(src as usize as *const u8, dst as usize as *mut u8, bytes) };
        return Ok(());
    }
    // SAFETY: as above; the handle comes from a live `Stream` whose context the calling
    // stream thread bound.
    unsafe {
        result::memcpy_dtod_async(
            dst as sys::CUdeviceptr,
            src as sys::CUdeviceptr,
            bytes,
            stream.0 as usize as sys::CUstream,
        )
    }
    .map_err(failed(format!("cuMemcpyDtoDAsync({bytes} bytes)"), 0))
}

/// A compiled kernel of one device, with its parameters' byte sizes (read off the PTX).
#[derive(Debug, Clone, Copy)]
pub struct Function {
    /// The `CUfunction`; 0 on a dry-run device.
    raw: usize,
    ordinal: usize,
    entry: &'static str,
    params: &'static [usize],
}

/// Most parameters a regflow kernel takes (the pointer array is built on the stack).
const MAX_ARGS: usize = 32;

/// Enqueues `function` on `stream` with `args`, after checking them against the entry's
/// compiled parameters (count and byte sizes) and `grid` against CUDA's limits. On a
/// dry-run device only checks. Allocates nothing.
///
/// # Safety
///
/// Each argument must point to a live value of the parameter's type; device addresses
/// among them must be valid for what the kernel does with them.
pub unsafe fn launch(
    stream: StreamHandle,
    function: Function,
    grid: Grid,
    args: &mut [crate::Arg],
) -> Result<(), CudaError> {
    let refuse = |message: String| CudaError::Call {
        call: format!("launch of {}", function.entry),
        ordinal: function.ordinal,
        message,
    };
    if args.len() != function.params.len() || args.iter().zip(function.params).any(|(a, &p)| a.size != p) {
        let sizes: Vec<usize> = args.iter().map(|a| a.size).collect();
        return Err(refuse(format!(
            "the kernel takes {} parameter(s) of {:?} bytes, but the launch passes {} of {sizes:?} bytes",
            function.params.len(),
            function.params,
            args.len(),
        )));
    }
    check_grid(&grid).map_err(refuse)?;
    if function.raw == 0 {
        return Ok(());
    }
    if args.len() > MAX_ARGS {
        return Err(refuse(format!("{} arguments, regflow launches at most {MAX_ARGS}", args.len())));
    }
    let mut pointers = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
    for (pointer, arg) in pointers.iter_mut().zip(args.iter()) {
        *pointer = arg.ptr;
    }
    // SAFETY: forwarded to the caller; the stream handle comes from a live `Stream` of the
    // function's device, whose context the stream thread bound.
    unsafe {
        result::launch_kernel(
            function.raw as sys::CUfunction,
            grid.blocks,
            grid.threads,
            grid.shared_bytes,
            stream.0 as usize as sys::CUstream,
            &mut pointers[..args.len()],
        )
    }
    .map_err(failed(format!("cuLaunchKernel({})", function.entry), function.ordinal))
}

/// `grid` against CUDA's limits for every current GPU: at most 1024 threads per block
/// (64 in z), 2^31 - 1 blocks in x and 65535 in y and z, at least one of each, and no more
/// dynamic shared memory than 48 KiB (more needs an opt-in regflow does not make).
fn check_grid(grid: &Grid) -> Result<(), String> {
    let (b, t) = (grid.blocks, grid.threads);
    let threads = u64::from(t.0) * u64::from(t.1) * u64::from(t.2);
    let blocks_ok = b.0 >= 1 && b.1 >= 1 && b.2 >= 1 && b.0 < (1 << 31) && b.1 <= 65_535 && b.2 <= 65_535;
    if threads == 0 || threads > 1024 || t.2 > 64 || !blocks_ok {
        return Err(format!("a grid of {b:?} blocks of {t:?} threads is beyond CUDA's limits"));
    }
    if grid.shared_bytes > 48 * 1024 {
        return Err(format!("{} bytes of dynamic shared memory is more than 48 KiB", grid.shared_bytes));
    }
    Ok(())
}
