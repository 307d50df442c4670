//! `cast` on CUDA (`fill.cu`): one grid-stride conversion between f32, f64, bf16 and f16,
//! rounded to nearest even as the CPU's (`half`'s) conversions, eight elements per step
//! where aligned (`EIGHT` in the prelude); a cast to its own dtype is a copy (`movement.cu`).
//!
//! `cast_group` (the compiler's fused casts, `graph/src/compile/fuse_casts.rs`): up to
//! [`CAST_MEMBERS`] members per launch of `regflow_cast_group_*`, each block converting
//! one chunk of one member with the conversion one `cast` uses, so the bits are the same.
//! As `update_group`, a launch takes its members as one [`CastTable`] by value, the chunks
//! planned once ([`plan_chunks`]) and only the registers' addresses written per firing.

use super::chunks::plan_chunks;
use super::elementwise::input_slots;
use super::fail;
use super::{factory, function, op_conf, stream, suffix, Entry};
use crate::driver::{launch, Function, Grid, LINEAR_THREADS, MAX_LINEAR_BLOCKS};
use regflow_kernels::{Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::{Cast, CastGroup};
use regflow_plan::DType;

/// Keyed by the result's dtype (the registry's dtype of an op is its first float output's).
pub(super) const ENTRIES: &[Entry] =
    &[("cast", FLOATS, || factory(make)), ("cast_group", GROUP_RESULTS, || factory(make_group))];

/// The float dtypes `fill.cu` converts between (and copies).
const FLOATS: &[DType] = &[DType::F32, DType::F64, DType::Bf16, DType::F16];

#[derive(Debug)]
struct CastKernel {
    /// A conversion, or a copy for a cast to the input's own dtype.
    function: Function,
    input: usize,
    n: u64,
    /// The conversions step eight elements per thread (`Grid::eights`); the copy one.
    grid: Grid,
}

fn make(spec: &KernelSpec<'_>) -> Result<CastKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Cast = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    let (from, to) = match (&conf.inputs[..], &conf.outputs[..]) {
        ([x], [out]) if x.shape == out.shape && out.dtype == op.to => (x.dtype, out.dtype),
        _ => return Err(fail(spec, conf, format!("casts one tensor to {} of the same shape", op.to))),
    };
    if !FLOATS.contains(&from) || !FLOATS.contains(&to) {
        return Err(fail(spec, conf, format!("casts between f32, f64, bf16 and f16, not {from} to {to}")));
    }
    let [input] = input_slots::<1>(conf);
    let n = conf.outputs[0].shape.numel() as u64;
    let entry = match from == to {
        true => format!("regflow_copy_{}", suffix(to)),
        false => format!("regflow_cast_{}_{}", suffix(from), suffix(to)),
    };
    let grid = if from == to { Grid::linear(n) } else { Grid::eights(n) };
    Ok(CastKernel { function: function(spec, &entry)?, input, n, grid })
}

impl Kernel for CastKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (x, out, n) = (io.input_addr(self.input), io.output_addr(0), self.n);
        let f = self.function;
        // SAFETY: `x` and `out` hold `n` elements of their dtypes (checked when made); every
        // cast and copy entry takes (x, out, n).
        unsafe { launch(stream(io), f, self.grid, &mut args![x, out, n]) }?;
        Ok(())
    }
}

/// Members one `cast_group` launch converts (`CAST_MEMBERS` in `fill.cu`).
const CAST_MEMBERS: usize = 32;

/// Elements of one block's chunk: 16 per thread of a block of [`LINEAR_THREADS`], a
/// multiple of eight (an aligned member's chunks start aligned).
const CAST_BLOCK_ELEMENTS: u64 = 4096;

/// The results `cast_group` has entries for: mixed precision's pairs, f32 to bf16 or f16
/// and back (the compiler fuses no other).
const GROUP_RESULTS: &[DType] = &[DType::F32, DType::Bf16, DType::F16];

/// The members of one launch (`struct CastTable` in `fill.cu`: the same fields in the same
/// order, 912 bytes, 8-aligned, no padding).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CastTable {
    src: [u64; CAST_MEMBERS],
    dst: [u64; CAST_MEMBERS],
    n: [u64; CAST_MEMBERS],
    block_elements: u64,
    first_block: [u32; CAST_MEMBERS + 1],
    members: u32,
}

/// One launch: its table without addresses, and the group's index of its first member.
#[derive(Debug, Clone, Copy)]
struct CastLaunch {
    first_member: usize,
    table: CastTable,
}

/// The launches converting members of `lens` elements (empty launches left out).
fn plan_cast_launches(lens: &[u64]) -> Vec<CastLaunch> {
    plan_chunks(lens, CAST_MEMBERS, CAST_BLOCK_ELEMENTS, MAX_LINEAR_BLOCKS)
        .into_iter()
        .filter(|planned| planned.blocks() > 0)
        .map(|planned| {
            let mut table = CastTable {
                src: [0; CAST_MEMBERS],
                dst: [0; CAST_MEMBERS],
                n: [0; CAST_MEMBERS],
                block_elements: planned.chunk,
                first_block: [0; CAST_MEMBERS + 1],
                members: 0,
            };
            table.members = planned.fill(lens, &mut table.n, &mut table.first_block);
            CastLaunch { first_member: planned.first_member, table }
        })
        .collect()
}

#[derive(Debug)]
struct CastGroupKernel {
    function: Function,
    launches: Vec<CastLaunch>,
    /// Member `m`'s actor input (its output is actor output `m`).
    inputs: Vec<usize>,
}

/// Makes a `cast_group`'s kernel: every member one cast of the group's pair, its launches
/// planned once.
fn make_group(spec: &KernelSpec<'_>) -> Result<CastGroupKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: CastGroup = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    let members = op.members as usize;
    if members == 0 || conf.inputs.len() != members || conf.outputs.len() != members || conf.input_map.len() != members
    {
        let error = format!(
            "groups {members} cast(s), one input and one output each, but has {} inputs ({} mapped) and {} outputs",
            conf.inputs.len(),
            conf.input_map.len(),
            conf.outputs.len()
        );
        return Err(fail(spec, conf, error));
    }
    let from = conf.inputs[0].dtype;
    let pair_fits =
        matches!((from, op.to), (DType::F32, DType::Bf16 | DType::F16) | (DType::Bf16 | DType::F16, DType::F32));
    if !pair_fits {
        return Err(fail(spec, conf, format!("groups casts between f32 and bf16 or f16, not {from} to {}", op.to)));
    }
    let mut lens = Vec::with_capacity(members);
    for (m, (x, out)) in conf.inputs.iter().zip(&conf.outputs).enumerate() {
        if x.dtype != from || out.dtype != op.to || x.shape != out.shape {
            let error = format!("member {m} casts {x} to {out}, but the group casts {from} to {} of one shape", op.to);
            return Err(fail(spec, conf, error));
        }
        lens.push(x.shape.numel() as u64);
    }
    Ok(CastGroupKernel {
        function: function(spec, &format!("regflow_cast_group_{}_{}", suffix(from), suffix(op.to)))?,
        launches: plan_cast_launches(&lens),
        inputs: conf.input_map.clone(),
    })
}

impl Kernel for CastGroupKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (s, f) = (stream(io), self.function);
        for planned in &self.launches {
            // A copy on the stack: the firing's addresses are its own.
            let mut table = planned.table;
            let first = planned.first_member;
            for k in 0..table.members as usize {
                table.src[k] = io.input_addr(self.inputs[first + k]);
                table.dst[k] = io.output_addr(first + k);
            }
            let grid = Grid::rows(u64::from(table.first_block[table.members as usize]), LINEAR_THREADS, 0);
            // SAFETY: every member's registers hold its elements of the group's dtypes
            // (checked when made); the entries take the table alone.
            unsafe { launch(s, f, grid, &mut args![table]) }?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cast_table_has_the_c_structs_layout() {
        // 3 × 32 addresses and lengths, the chunk size, 33 + 1 u32s: a multiple of 8.
        const C_TABLE_BYTES: usize = 3 * 32 * 8 + 8 + 33 * 4 + 4;
        assert_eq!(std::mem::size_of::<CastTable>(), C_TABLE_BYTES);
        assert_eq!(C_TABLE_BYTES, 912);
        assert_eq!(std::mem::align_of::<CastTable>(), 8);
        let source = crate::sources::SOURCES.iter().find(|s| s.name == "fill").expect("fill.cu");
        assert!(source.code.contains(&format!("#define CAST_MEMBERS {CAST_MEMBERS}\n")));
        if crate::nvrtc::available().is_ok() {
            let ptx = crate::nvrtc::compile(source, "compute_80").unwrap_or_else(|e| panic!("{e}"));
            for pair in ["f32_bf16", "bf16_f32", "f32_f16", "f16_f32"] {
                let entry = format!("regflow_cast_group_{pair}");
                let params = crate::sources::ptx_params(&ptx, &entry).expect("the entry");
                assert_eq!(params, [std::mem::size_of::<CastTable>()], "{entry}");
            }
        }
    }

    /// Every element of every member is in one block's chunk of one launch, in order, and
    /// every chunk starts at a multiple of eight elements.
    #[test]
    fn launches_cover_every_member_once() {
        let lens = [1u64, 0, 4096, 4097, 7, 590_000, 3, 1 << 28];
        let lens: Vec<u64> = lens.iter().copied().chain((0..40).map(|k| 100 * k + 1)).collect();
        let launches = plan_cast_launches(&lens);
        let mut covered = vec![0u64; lens.len()];
        for l in &launches {
            let t = &l.table;
            assert!((1..=CAST_MEMBERS as u32).contains(&t.members));
            assert_eq!(t.block_elements % 8, 0);
            for k in 0..t.members as usize {
                let blocks = t.first_block[k + 1] - t.first_block[k];
                covered[l.first_member + k] += (u64::from(blocks) * t.block_elements).min(t.n[k]);
                assert!(u64::from(blocks) * t.block_elements >= t.n[k]);
            }
            assert!(u64::from(t.first_block[t.members as usize]) <= MAX_LINEAR_BLOCKS);
        }
        assert_eq!(covered, lens);
    }
}
