//! The CUDA kernel sources regflow compiles with NVRTC: one `.cu` file per op family under
//! `cuda/src/kernels/`, each compiled after the shared prelude. Plain data, in every build:
//! the entry points are read off the sources, so a kernel is named in one place.

use crate::CudaError;
use std::sync::OnceLock;

/// One kernel source file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// Its name (the file name without `.cu`); one module per source per device.
    pub name: &'static str,
    /// Its text, without the prelude.
    pub code: &'static str,
}

/// What every source is compiled after: types, bf16 conversions, grid-stride loops, block
/// reductions.
pub const PRELUDE: &str = include_str!("kernels/prelude.cu");

macro_rules! sources {
    ($($name:literal),* $(,)?) => {
        /// Every kernel source, by name.
        pub const SOURCES: &[KernelSource] = &[
            $(KernelSource { name: $name, code: include_str!(concat!("kernels/", $name, ".cu")) }),*
        ];
    };
}

sources!["fill", "elementwise", "movement", "optim", "reduce", "rows", "attention", "debug"];

/// The text NVRTC compiles for `source`: the prelude, then the source.
pub fn full_text(source: &KernelSource) -> String {
    format!("{PRELUDE}\n#line 1 \"{}.cu\"\n{}", source.name, source.code)
}

/// The environment variable whose macro definitions every kernel source is compiled with:
/// comma-separated `NAME` or `NAME=VALUE`. It picks a kernel variant the sources leave open
/// (the attention entries' `ATT_OCCUPANCY` and `ATT_PART`) at run time, so a session with a
/// GPU can time variants in one call without rebuilding. Read once per process; part of
/// the kernel cache's key ([`crate::ptx_cache`]), so each variant compiles once per machine.
pub const DEFINES_VARIABLE: &str = "REGFLOW_CUDA_DEFINES";

/// NVRTC's options for `value`, a value of [`DEFINES_VARIABLE`]: `-DNAME=VALUE`, or `-DNAME`
/// for a bare name, per definition (none for an empty value); or why `value` is not one.
pub fn define_options(value: &str) -> Result<Vec<String>, CudaError> {
    let refuse = |why: String| CudaError::Defines { value: value.to_string(), why };
    if value.trim().is_empty() {
        return Ok(Vec::new());
    }
    let is_name = |n: &str| {
        n.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let is_value = |v: &str| !v.is_empty() && v.chars().all(|c| c.is_ascii_alphanumeric() || "_.+-".contains(c));
    value
        .split(',')
        .enumerate()
        .map(|(k, item)| {
            let item = item.trim();
            let (name, defined) = match item.split_once('=') {
                Some((name, defined)) => (name.trim(), Some(defined.trim())),
                None => (item, None),
            };
            if !is_name(name) {
                return Err(refuse(format!("definition {} names {name:?}, which is not a C identifier", k + 1)));
            }
            match defined {
                None => Ok(format!("-D{name}")),
                Some(v) if is_value(v) => Ok(format!("-D{name}={v}")),
                Some(v) => Err(refuse(format!("definition {} gives {name} the value {v:?}", k + 1))),
            }
        })
        .collect()
}

/// How a kernel entry point is declared in a source.
const ENTRY_MARK: &str = "extern \"C\" __global__ void ";

/// The entry points `code` declares: the last word before each parameter list, as a
/// launch-bounds macro (`BLOCK_1024`) may stand between `void` and the name. An entry
/// declared in the body of a macro `#define NAME(S, ...)` as `regflow_..._##S` (the same
/// entries for several dtypes, written once) is counted once per line that invokes it,
/// `NAME(f32, ...)`, with `S` replaced by the invocation's first argument (and a name
/// pasted on after it, `regflow_..._##S##_qkv`, joined to it).
pub fn entries_of(code: &'static str) -> Vec<String> {
    let declared = |text: &'static str| {
        text.match_indices(ENTRY_MARK).filter_map(move |(at, _)| {
            let rest = &text[at + ENTRY_MARK.len()..];
            let end = rest.find('(')?;
            rest[..end].split_whitespace().last()
        })
    };
    let mut entries: Vec<String> = declared(code).filter(|e| !e.contains("##")).map(str::to_string).collect();
    for (name, param, body) in macros(code) {
        let templates: Vec<&str> = declared(body).filter(|e| e.contains("##")).collect();
        let invocation = format!("{name}(");
        for line in code.lines().filter(|l| l.starts_with(&invocation)) {
            let arg = line[invocation.len()..].split([',', ')']).next().unwrap_or("").trim();
            // `regflow_x_##S##_tail`: the parameter replaced, then the pasting of the rest.
            entries.extend(templates.iter().map(|t| t.replace(&format!("##{param}"), arg).replace("##", "")));
        }
    }
    entries
}

/// The function-like macros `code` defines: (name, first parameter, body), the body
/// running to the first line not ended by a backslash.
fn macros(code: &str) -> Vec<(&str, &str, &str)> {
    code.match_indices("#define ")
        .filter_map(|(at, _)| {
            let rest = &code[at + "#define ".len()..];
            let open = rest.find('(')?;
            let name = &rest[..open];
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return None;
            }
            let param = rest[open + 1..].split([',', ')']).next()?.trim();
            let mut end = 0;
            for line in rest.split_inclusive('\n') {
                end += line.len();
                if !line.trim_end().ends_with('\\') {
                    break;
                }
            }
            Some((name, param, &rest[..end]))
        })
        .collect()
}

/// Every (entry point, source) pair, read once.
fn all_entries() -> &'static [(String, &'static KernelSource)] {
    static ENTRIES: OnceLock<Vec<(String, &'static KernelSource)>> = OnceLock::new();
    ENTRIES.get_or_init(|| SOURCES.iter().flat_map(|s| entries_of(s.code).into_iter().map(move |e| (e, s))).collect())
}

/// The entry points `source` declares (read once per process).
pub fn entries_in(source: &KernelSource) -> impl Iterator<Item = &'static str> + '_ {
    all_entries().iter().filter(move |(_, s)| s.name == source.name).map(|(e, _)| e.as_str())
}

/// Every entry point of every source (read once per process).
pub fn all_entry_names() -> impl Iterator<Item = &'static str> {
    all_entries().iter().map(|(e, _)| e.as_str())
}

/// The source that declares `entry`, or an error suggesting the nearest entry point.
pub fn source_of(entry: &str) -> Result<&'static KernelSource, CudaError> {
    let entries = all_entries();
    if let Some((_, source)) = entries.iter().find(|(e, _)| *e == entry) {
        return Ok(source);
    }
    let names: Vec<&str> = entries.iter().map(|(e, _)| e.as_str()).collect();
    let nearest = regflow_kernels::nearest(entry, &names).map(|n| format!(", did you mean '{n}'?")).unwrap_or_default();
    Err(CudaError::UnknownEntry { entry: entry.to_string(), nearest })
}

/// The byte size of each parameter of entry point `entry` in NVRTC's `ptx`, or `None` when
/// the PTX has no such entry. Scalars are `.param .u64 name` (or `.f32`, `.s32`, …);
/// structs passed by value are `.param .align 8 .b8 name[200]`.
pub fn ptx_params(ptx: &str, entry: &str) -> Option<Vec<usize>> {
    let start = ptx.find(&format!(".entry {entry}("))?;
    let list = &ptx[start..];
    let list = &list[list.find('(')? + 1..list.find(')')?];
    list.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|param| {
            let words: Vec<&str> = param.split_whitespace().collect();
            let ty = words
                .iter()
                .find(|w| w.len() > 2 && w.starts_with('.') && w[2..].chars().all(|c| c.is_ascii_digit()))?;
            let bits: usize = ty[2..].parse().ok()?;
            let count = match words.last()?.split_once('[') {
                Some((_, n)) => n.trim_end_matches(']').parse().ok()?,
                None => 1,
            };
            Some(bits / 8 * count)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_read_off_the_sources_and_unique() {
        let entries = all_entries();
        assert!(entries.iter().any(|(e, s)| *e == "regflow_fill_f32" && s.name == "fill"));
        // Entries declared in a macro (`UPDATE_ENTRIES`), single and multi-tensor.
        for rule in ["update_sgd", "update_adamw", "update_group_sgd", "update_group_adamw"] {
            for dtype in ["f32", "f64"] {
                let entry = format!("regflow_{rule}_{dtype}");
                assert!(entries.iter().any(|(e, s)| *e == entry && s.name == "optim"), "{entry}");
            }
        }
        let mut names: Vec<&str> = entries.iter().map(|(e, _)| e.as_str()).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len(), "an entry point is declared twice");
        assert!(names.iter().all(|n| n.starts_with("regflow_")), "{names:?}");
    }

    #[test]
    fn an_entry_may_have_launch_bounds_before_its_name() {
        let code = "extern \"C\" __global__ void BLOCK_1024 regflow_a_f32(float* x) {}\n\
                    extern \"C\" __global__ void regflow_b_f64(double* x) {}";
        assert_eq!(entries_of(code), ["regflow_a_f32", "regflow_b_f64"]);
        // The real sources' bounded entries are found too.
        for bounded in ["regflow_sum_to_f32", "regflow_sum_to_f64", "regflow_sum_to_bf16"] {
            assert!(all_entries().iter().any(|(e, _)| *e == bounded), "{bounded}");
        }
    }

    #[test]
    fn entries_declared_in_a_macro_count_once_per_invocation() {
        let code = "#define SUMS(S, T) \\\n\
                    extern \"C\" __global__ void BLOCK_1024 regflow_sum_##S(const T* x) { f(x); } \\\n\
                    extern \"C\" __global__ void regflow_parts_##S(const T* x) { g(x); }\n\
                    extern \"C\" __global__ void regflow_plain_f32(float* x) {}\n\
                    SUMS(f32, float)\n\
                    SUMS(bf16, bf16)\n";
        assert_eq!(
            entries_of(code),
            ["regflow_plain_f32", "regflow_sum_f32", "regflow_parts_f32", "regflow_sum_bf16", "regflow_parts_bf16"]
        );
    }

    #[test]
    fn ptx_parameters_give_their_sizes() {
        let ptx = "// header\n.visible .entry regflow_x_f32(\n\t.param .u64 regflow_x_f32_param_0,\n\t.param .f32 \
                   regflow_x_f32_param_1,\n\t.param .align 8 .b8 regflow_x_f32_param_2[200],\n\t.param .u32 p3\n)\n{\n}\n\
                   .visible .entry regflow_y()\n{\n}";
        assert_eq!(ptx_params(ptx, "regflow_x_f32"), Some(vec![8, 4, 200, 4]));
        assert_eq!(ptx_params(ptx, "regflow_y"), Some(vec![]));
        assert_eq!(ptx_params(ptx, "regflow_z"), None);
    }

    #[test]
    fn macro_definitions_become_nvrtc_options() {
        assert_eq!(define_options("").unwrap(), Vec::<String>::new());
        assert_eq!(define_options("  ").unwrap(), Vec::<String>::new());
        assert_eq!(
            define_options("ATT_OCCUPANCY=0, ATT_PART = 64,_FLAG,X1=-2.5e+3").unwrap(),
            ["-DATT_OCCUPANCY=0", "-DATT_PART=64", "-D_FLAG", "-DX1=-2.5e+3"]
        );
        // What would reach NVRTC as more than one definition, or none, is refused.
        for (bad, says) in [
            ("ATT_PART=64,", "definition 2 names \"\""),
            ("1ST=2", "\"1ST\", which is not a C identifier"),
            ("A B=1", "\"A B\""),
            ("ATT_PART=", "gives ATT_PART the value \"\""),
            ("ATT_PART=6 -DX", "the value \"6 -DX\""),
            ("X=\"s\"", "the value \"\\\"s\\\"\""),
        ] {
            let e = define_options(bad).unwrap_err().to_string();
            assert!(e.starts_with(&format!("REGFLOW_CUDA_DEFINES is {bad:?}, but ")), "{e}");
            assert!(e.contains(says), "{bad}: {e}");
            assert!(e.contains("NAME or NAME=VALUE"), "{e}");
        }
    }

    #[test]
    fn an_unknown_entry_names_the_nearest() {
        let e = source_of("regflow_fill_f33").unwrap_err().to_string();
        assert!(e.contains("'regflow_fill_f33'") && e.contains("did you mean 'regflow_fill_f3"), "{e}");
    }
}
