//! CPU time of this process, all its threads together: how many cores a benchmark kept busy.

/// Seconds of CPU time this process has used so far (NaN where the clock cannot be read).
pub(crate) fn process_cpu_seconds() -> f64 {
    let mut time = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `time` is a valid timespec for the call to fill.
    let status = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut time) };
    if status != 0 {
        return f64::NAN;
    }
    time.tv_sec as f64 + time.tv_nsec as f64 * 1e-9
}
