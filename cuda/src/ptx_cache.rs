//! A disk cache of NVRTC's PTX, so only a machine's first process compiles the kernel sources.
//!
//! NVRTC takes about a second per source, and every process that builds a `cuda` job used to
//! compile all of them (GPT-2's job build on a GPU machine spent seconds there). PyTorch's
//! and Triton's kernel caches keep compiled code on disk; this one keeps PTX (the driver
//! caches the step from PTX to the device's code itself, in `~/.nv/ComputeCache`).
//!
//! **Where:** `REGFLOW_KERNEL_CACHE` names the folder, or turns the cache off with `off`
//! (or `0`); unset, it is `$XDG_CACHE_HOME/regflow/ptx`, else `$HOME/.cache/regflow/ptx`.
//!
//! **What makes an entry valid:** a file holds everything that went into the compile (the
//! full source text after the prelude, the architecture, the options, NVRTC's version)
//! and the PTX's length. A read compares all of it and takes the file only on an exact
//! match, so a changed kernel, another NVRTC or another option is a miss, never stale PTX,
//! and a truncated or foreign file is a miss too. The file's name (a hash of the same
//! inputs) only finds it.
//!
//! **Size:** one entry per source and architecture: storing a new one removes the others
//! of the same source and architecture, and temporary files that writers dying before
//! their rename left for an hour, so the folder holds a few MB whatever is edited.
//!
//! **Never an error:** the cache only saves time. A folder that cannot be made, read or
//! written means compiling as without it; a write goes to a temporary file renamed into
//! place, so processes sharing the folder never see half a file.

use std::path::{Path, PathBuf};

/// The environment variable naming the cache's folder, or `off`.
pub const CACHE_VARIABLE: &str = "REGFLOW_KERNEL_CACHE";

/// The first line of every cache file: the format, so a later format misses.
const MAGIC: &str = "regflow ptx cache 1\n";

/// Everything one compile depends on; a cached PTX is used only for exactly these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileKey {
    /// The source's name (the file name without `.cu`).
    pub name: String,
    /// The virtual architecture (`compute_90`).
    pub arch: String,
    /// NVRTC's options and version, in words.
    pub compiler: String,
    /// The full text compiled (prelude and source).
    pub text: String,
}

impl CompileKey {
    /// The header a cache file starts with: the key and the PTX's length, each field
    /// length-prefixed so no text can forge another field.
    fn header(&self, ptx_len: usize) -> String {
        let mut out = String::from(MAGIC);
        for field in [&self.name, &self.arch, &self.compiler, &self.text] {
            out.push_str(&field.len().to_string());
            out.push('\n');
            out.push_str(field);
            out.push('\n');
        }
        out.push_str(&ptx_len.to_string());
        out.push('\n');
        out
    }

    /// The file name: the source's name and a hash of the key (FNV-1a, 64 bits), which
    /// only finds the file; its contents decide.
    fn file_name(&self) -> String {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for field in [&self.name, &self.arch, &self.compiler, &self.text] {
            for byte in field.bytes().chain([0xff]) {
                hash ^= u64::from(byte);
                hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        format!("{}{hash:016x}.ptx", self.family())
    }

    /// The start of the file names of this source for this architecture, whatever the
    /// text: a newer entry replaces the older ones ([`store`]).
    fn family(&self) -> String {
        let safe = |s: &str| -> String {
            s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '-' }).collect()
        };
        format!("{}-{}-", safe(&self.name), safe(&self.arch))
    }
}

/// The cache's folder from the variable's value (`None`: unset) and the environment's
/// `XDG_CACHE_HOME` and `HOME`; `None` where the cache is off or no folder is known.
pub fn folder_from(variable: Option<&str>, xdg_cache_home: Option<&str>, home: Option<&str>) -> Option<PathBuf> {
    match variable.map(str::trim) {
        Some("off" | "0" | "") => None,
        Some(path) => Some(PathBuf::from(path)),
        None => xdg_cache_home
            .filter(|p| !p.is_empty())
            .map(|p| Path::new(p).join("regflow").join("ptx"))
            .or_else(|| home.filter(|p| !p.is_empty()).map(|p| Path::new(p).join(".cache/regflow/ptx"))),
    }
}

/// The cache's folder for this process (read from the environment each call: tests and
/// benchmarks set it).
pub fn folder() -> Option<PathBuf> {
    let var = |name: &str| std::env::var(name).ok();
    folder_from(var(CACHE_VARIABLE).as_deref(), var("XDG_CACHE_HOME").as_deref(), var("HOME").as_deref())
}

/// The PTX cached in `folder` for exactly `key`, or `None` (no file, another key, a file
/// cut short or not ours).
pub fn load(folder: &Path, key: &CompileKey) -> Option<String> {
    let contents = std::fs::read(folder.join(key.file_name())).ok()?;
    let contents = String::from_utf8(contents).ok()?;
    let rest = contents.strip_prefix(MAGIC)?;
    let mut rest = rest;
    for field in [&key.name, &key.arch, &key.compiler, &key.text] {
        let (len, after) = rest.split_once('\n')?;
        if len.parse::<usize>().ok()? != field.len() {
            return None;
        }
        let value = after.get(..field.len())?;
        if value != field.as_str() {
            return None;
        }
        rest = after.get(field.len()..)?.strip_prefix('\n')?;
    }
    let (len, ptx) = rest.split_once('\n')?;
    (len.parse::<usize>().ok()? == ptx.len()).then(|| ptx.to_string())
}

/// Keeps `ptx` for `key` in `folder` (made if missing); whether it was written. Written to
/// a temporary file of this process, then renamed over the entry, so a reader sees the
/// old file or the new one, never part of one. The entries of the same source and
/// architecture for other texts, options or NVRTC versions are removed, so editing a kernel
/// does not grow the folder without end (two builds sharing a folder then take turns
/// compiling; each still reads only its own PTX).
pub fn store(folder: &Path, key: &CompileKey, ptx: &str) -> bool {
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(folder)?;
        let target = folder.join(key.file_name());
        // Unique to this process and this call: threads compiling the same source at once
        // each write their own file.
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let write = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let temporary = folder.join(format!(".{}.{}.{write}.tmp", key.file_name(), std::process::id()));
        let mut contents = key.header(ptx.len());
        contents.push_str(ptx);
        std::fs::write(&temporary, contents)?;
        std::fs::rename(&temporary, &target).inspect_err(|_| {
            let _ = std::fs::remove_file(&temporary);
        })
    };
    if write().is_err() {
        return false;
    }
    let (family, kept) = (key.family(), key.file_name());
    if let Ok(entries) = std::fs::read_dir(folder) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let older_entry = name.starts_with(&family) && name.ends_with(".ptx") && name != kept;
            if older_entry || is_abandoned_temporary(&name, &entry) {
                // Another process may have removed it first, or still read it: only space.
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    true
}

/// A temporary file of a write that never finished (its process died before the rename):
/// ours by its name, and untouched for [`ABANDONED_AFTER`].
fn is_abandoned_temporary(name: &str, entry: &std::fs::DirEntry) -> bool {
    name.starts_with('.')
        && name.ends_with(".tmp")
        && entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|modified| modified.elapsed().ok())
            .is_some_and(|age| age > ABANDONED_AFTER)
}

/// How long a temporary file may sit before a later write takes it for abandoned: far
/// longer than writing a few MB takes.
const ABANDONED_AFTER: std::time::Duration = std::time::Duration::from_secs(3600);

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str) -> CompileKey {
        CompileKey {
            name: "rows".into(),
            arch: "compute_90".into(),
            compiler: "nvrtc 13.0; --std=c++17".into(),
            text: text.into(),
        }
    }

    /// A fresh folder under the system's temporary folder, removed by the caller.
    fn scratch_folder(what: &str) -> PathBuf {
        let folder = std::env::temp_dir().join(format!("regflow-ptx-cache-test-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&folder);
        folder
    }

    #[test]
    fn a_stored_ptx_is_loaded_for_exactly_its_key() {
        let folder = scratch_folder("exact");
        let k = key("__global__ void f() {}\n");
        assert_eq!(load(&folder, &k), None, "an empty cache misses");
        assert!(store(&folder, &k, ".version 9.0\n// ptx\n"));
        assert_eq!(load(&folder, &k).as_deref(), Some(".version 9.0\n// ptx\n"));
        // Any other input misses, even where the file name would be the same.
        for other in [
            CompileKey { text: "__global__ void g() {}\n".into(), ..k.clone() },
            CompileKey { arch: "compute_80".into(), ..k.clone() },
            CompileKey { compiler: "nvrtc 13.1; --std=c++17".into(), ..k.clone() },
        ] {
            assert_eq!(load(&folder, &other), None, "{other:?}");
            let planted = folder.join(other.file_name());
            std::fs::copy(folder.join(k.file_name()), &planted).unwrap();
            assert_eq!(load(&folder, &other), None, "a file of another key under this key's name: {other:?}");
            std::fs::remove_file(planted).unwrap();
        }
        // A newer store replaces the entry.
        assert!(store(&folder, &k, "// newer\n"));
        assert_eq!(load(&folder, &k).as_deref(), Some("// newer\n"));
        std::fs::remove_dir_all(&folder).unwrap();
    }

    #[test]
    fn a_file_cut_short_or_not_ours_is_a_miss() {
        let folder = scratch_folder("damaged");
        let k = key("text with\nnewlines\n");
        assert!(store(&folder, &k, "0123456789"));
        let path = folder.join(k.file_name());
        let whole = std::fs::read(&path).unwrap();
        for cut in [1, 5, whole.len() - 10, whole.len() - 1] {
            std::fs::write(&path, &whole[..cut]).unwrap();
            assert_eq!(load(&folder, &k), None, "cut to {cut} bytes");
        }
        std::fs::write(&path, b"\xff\xfe not text").unwrap();
        assert_eq!(load(&folder, &k), None);
        std::fs::write(&path, whole.iter().chain(b"x").copied().collect::<Vec<u8>>()).unwrap();
        assert_eq!(load(&folder, &k), None, "a byte more than the PTX's length");
        std::fs::remove_dir_all(&folder).unwrap();
    }

    #[test]
    fn a_folder_that_cannot_be_made_stores_nothing_and_fails_nothing() {
        let folder = scratch_folder("blocked");
        std::fs::write(&folder, b"a file where the folder would be").unwrap();
        let k = key("x");
        assert!(!store(&folder, &k, "ptx"));
        assert_eq!(load(&folder, &k), None);
        std::fs::remove_file(&folder).unwrap();
    }

    #[test]
    fn the_folder_comes_from_the_variable_then_xdg_then_home() {
        assert_eq!(folder_from(Some("/x/ptx"), Some("/xdg"), Some("/home/u")), Some(PathBuf::from("/x/ptx")));
        for off in ["off", "0", " off "] {
            assert_eq!(folder_from(Some(off), Some("/xdg"), Some("/home/u")), None, "{off:?}");
        }
        assert_eq!(folder_from(None, Some("/xdg"), Some("/home/u")), Some(PathBuf::from("/xdg/regflow/ptx")));
        assert_eq!(folder_from(None, Some(""), Some("/home/u")), Some(PathBuf::from("/home/u/.cache/regflow/ptx")));
        assert_eq!(folder_from(None, None, None), None);
    }

    #[test]
    fn file_names_differ_with_the_inputs_and_keep_only_safe_characters() {
        let a = key("a");
        assert_ne!(a.file_name(), key("b").file_name());
        assert_ne!(a.file_name(), CompileKey { arch: "compute_80".into(), ..a.clone() }.file_name());
        let odd = CompileKey { name: "../evil name".into(), ..a };
        assert!(odd.file_name().starts_with("---evil-name-compute_90-"), "{}", odd.file_name());
    }

    #[test]
    fn a_newer_entry_replaces_the_older_ones_of_its_source_and_architecture_only() {
        let folder = scratch_folder("replace");
        let old = key("version 1");
        let other_arch = CompileKey { arch: "compute_80".into(), ..old.clone() };
        let other_source = CompileKey { name: "rows_extra".into(), ..old.clone() };
        for k in [&old, &other_arch, &other_source] {
            assert!(store(&folder, k, "ptx"));
        }
        let new = key("version 2");
        assert!(store(&folder, &new, "ptx 2"));
        assert_eq!(load(&folder, &old), None, "the older text's entry is gone");
        assert_eq!(load(&folder, &new).as_deref(), Some("ptx 2"));
        assert_eq!(load(&folder, &other_arch).as_deref(), Some("ptx"), "another architecture stays");
        assert_eq!(load(&folder, &other_source).as_deref(), Some("ptx"), "another source stays");
        let files = std::fs::read_dir(&folder).unwrap().count();
        assert_eq!(files, 3, "no temporary file is left");
        // A write that died before its rename left a temporary file: a later store removes
        // it once it is old, and leaves a fresh one (a write under way) alone.
        let (abandoned, fresh) = (folder.join(".rows-x.ptx.1.0.tmp"), folder.join(".rows-y.ptx.2.0.tmp"));
        for path in [&abandoned, &fresh] {
            std::fs::write(path, b"half a").unwrap();
        }
        let two_hours_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
        std::fs::File::options().write(true).open(&abandoned).unwrap().set_modified(two_hours_ago).unwrap();
        assert!(store(&folder, &key("version 3"), "ptx 3"));
        assert!(!abandoned.exists(), "an abandoned temporary file is removed");
        assert!(fresh.exists(), "a write under way is left alone");
        std::fs::remove_dir_all(&folder).unwrap();
    }
}
