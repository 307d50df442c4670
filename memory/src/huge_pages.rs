//! Transparent huge pages for large host buffers: a plan's arena asks the kernel to back it
//! with 2 MiB pages instead of 4 KiB ones, before its first touch.
//!
//! Why: a CPU matrix product packs its weight by reading `k` rows a row apart, 4 KiB for a
//! 1024-wide `f32` weight, so every step of its packing loop lands on a new 4 KiB page, and
//! the optimizer and the elementwise kernels stream through tens of megabytes of registers
//! per step; with 4 KiB pages both walk the page tables far more often. With the arena's
//! pages at 2 MiB, the digits MLP's five products ran in 0.95–0.98 of the time, alternated
//! call by call within one process on a Zen 3 host (BENCHMARKS.md, issue 13,
//! "thirty-seventh"). Linux gives anonymous memory huge pages only where a program asks
//! (`madvise`) unless configured to always (`/sys/kernel/mm/transparent_hugepage/enabled`),
//! and Debian's default asks for the `madvise` mode.
//!
//! The advice is a hint: where the kernel has no transparent huge pages, or is set to
//! `never`, nothing changes, and nothing fails. It applies to the whole 2 MiB extents
//! inside a buffer; a huge page is allocated whole at its first touch, so a buffer's memory
//! use can round up by its partly used extents (arenas are used nearly whole).

use std::sync::atomic::{AtomicBool, Ordering};

/// Buffers below this are left to 4 KiB pages: they span few whole 2 MiB extents, if any.
pub const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

static ON: AtomicBool = AtomicBool::new(true);

/// Turns the huge-page advice for large host buffers on (the default) or off, process-wide,
/// for the buffers allocated from now on: for a process that would rather not round its
/// memory up to whole 2 MiB pages, and for tests.
pub fn set_huge_pages(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// The kernel's transparent huge page mode (`always`, `madvise` or `never`), from Linux's
/// `/sys/kernel/mm/transparent_hugepage/enabled`; `None` where the kernel has none (or
/// the platform is not Linux). With `never` the advice changes nothing.
pub fn huge_page_mode() -> Option<String> {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok().and_then(|text| selected_mode(&text))
}

/// The bracketed choice of a sysfs list such as `always [madvise] never`.
fn selected_mode(text: &str) -> Option<String> {
    let (_, rest) = text.split_once('[')?;
    let (mode, _) = rest.split_once(']')?;
    Some(mode.to_string())
}

/// Advises the kernel to back the whole 2 MiB extents of the `len` bytes at `ptr` with huge
/// pages, unless [`set_huge_pages`] turned that off, if `len` is at least
/// [`HUGE_PAGE_MIN_BYTES`]. Call it
/// before the bytes are first touched. A hint only: an error (an old kernel, a sandbox)
/// leaves the buffer on small pages, which is what it would have had.
pub(crate) fn advise(ptr: *mut u8, len: usize) {
    if len < HUGE_PAGE_MIN_BYTES || !ON.load(Ordering::Relaxed) {
        return;
    }
    #[cfg(target_os = "linux")]
    {
        // madvise wants a page-aligned start: the 4 KiB pages wholly inside the buffer.
        const PAGE: usize = 4096;
        let start = (ptr as usize).next_multiple_of(PAGE);
        let end = (ptr as usize + len) / PAGE * PAGE;
        if end > start {
            // SAFETY: the range lies inside a live allocation of the caller's; the advice
            // changes how its pages are backed, not their contents or their mapping.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_kernels_mode_is_the_bracketed_choice() {
        assert_eq!(super::selected_mode("always [madvise] never\n").as_deref(), Some("madvise"));
        assert_eq!(super::selected_mode("[always] madvise never").as_deref(), Some("always"));
        assert_eq!(super::selected_mode("always madvise never"), None);
    }

    /// The `VmFlags` of the mapping that holds `address`, from `/proc/self/smaps`.
    #[cfg(target_os = "linux")]
    fn vm_flags_at(address: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().and_then(|r| r.split_once('-'));
            if let Some((from, to)) =
                range.and_then(|(f, t)| Some((usize::from_str_radix(f, 16).ok()?, usize::from_str_radix(t, 16).ok()?)))
            {
                inside = from <= address && address < to;
            } else if inside && line.starts_with("VmFlags:") {
                return Some(line.to_string());
            }
        }
        None
    }

    /// Whether the mapping that holds `address` carries the huge-page advice (`hg`).
    #[cfg(target_os = "linux")]
    fn advised_at(address: usize) -> bool {
        let flags = vm_flags_at(address).expect("the mapping is in smaps");
        flags.split_whitespace().any(|flag| flag == "hg")
    }

    /// A fresh anonymous mapping of `bytes`, unmapped when dropped (not from `malloc`, so
    /// that no other allocation shares its flags).
    #[cfg(target_os = "linux")]
    struct Mapping(*mut u8, usize);

    #[cfg(target_os = "linux")]
    impl Mapping {
        fn new(bytes: usize) -> Mapping {
            // SAFETY: an anonymous private mapping; checked below.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(ptr, libc::MAP_FAILED, "mmap of {bytes} bytes");
            Mapping(ptr.cast(), bytes)
        }

        fn advised(&self) -> bool {
            advised_at(self.0 as usize + self.1 / 2)
        }
    }

    #[cfg(target_os = "linux")]
    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: mapped in `new` with this length.
            unsafe { libc::munmap(self.0.cast(), self.1) };
        }
    }

    /// Where the kernel has transparent huge pages: a large range is advised to huge pages
    /// (`hg` in its mapping's `VmFlags`), a small one is not, nor is a large one with the
    /// advice turned off; and a large host buffer is advised when allocated.
    #[test]
    #[cfg(target_os = "linux")]
    fn large_buffers_are_advised_to_huge_pages() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            eprintln!("skipped: this kernel has no transparent huge pages");
            return;
        }
        let advise = |bytes: usize, len: usize| {
            let mapping = Mapping::new(bytes);
            super::advise(mapping.0, len);
            mapping.advised()
        };
        assert!(advise(16 << 20, 16 << 20), "a 16 MiB range is advised");
        assert!(!advise(16 << 20, super::HUGE_PAGE_MIN_BYTES - 4096), "a range under the minimum is not");
        super::set_huge_pages(false);
        let off = advise(16 << 20, 16 << 20);
        super::set_huge_pages(true);
        assert!(!off, "with the advice off, a 16 MiB range is not advised");
        let buffer = crate::HostBuffer::zeroed("test", 16 << 20).expect("16 MiB");
        assert!(advised_at(buffer.base().as_ptr() as usize + (8 << 20)), "a 16 MiB host buffer is advised");
    }
}
