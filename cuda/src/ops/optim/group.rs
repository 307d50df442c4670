//! `update_group` on CUDA: a device's fused updates as multi-tensor launches of
//! `regflow_update_group_{sgd,adamw}_*` (`optim.cu`), each updating up to
//! [`GROUP_MEMBERS`] parameters, where one `update` launch per parameter would cost one
//! launch (and its few microseconds) per parameter: 196 per step for GPT-2.
//!
//! A launch takes its members as one [`UpdateTable`] by value (kernel parameters: no copy
//! to the device before it, nothing to free after it). Each block updates one chunk of
//! [`BLOCK_ELEMENTS`] elements of one member, found from the table's prefix sums of blocks
//! per member, which [`plan_launches`] computes once, when the kernel is made; a firing
//! only writes its registers' addresses into a copy of each table on the stack. Every
//! element is computed by the element functions and from the step constants the single
//! `update` entries use, so the group's results are bitwise those of one `update` each.

use super::{check_update, run_typed, scalar_code, QueueTyped, Rule};
use crate::driver::{launch, Function, Grid, LINEAR_THREADS, MAX_LINEAR_BLOCKS};
use crate::ops::chunks::plan_chunks;
use crate::ops::fail;
use crate::ops::{function, op_conf, stream, suffix};
use regflow_kernels::{Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::{Update, UpdateGroup};
use regflow_plan::{DType, OpConf};

/// Members one launch updates (`GROUP_MEMBERS` in `optim.cu`).
const GROUP_MEMBERS: usize = 32;

/// Addresses per member in the table (`SLOTS` in `optim.cu`): the parameter, the gradient,
/// two states, the new parameter and two new states, in that order.
const SLOTS: usize = 7;

/// Slots of the parameter, the gradient and the first state (the second follows it).
const SLOT_P: usize = 0;
const SLOT_G: usize = 1;
const SLOT_STATE0: usize = 2;
/// Slot of the new parameter; the new states follow it.
const SLOT_P_OUT: usize = 4;

/// Elements one block updates (16 per thread of a block of [`LINEAR_THREADS`]): enough for
/// each block to amortize finding its member, few enough that a small member does not keep
/// a whole block idle. A member of more than [`MAX_LINEAR_BLOCKS`] such chunks gets larger
/// ones (see [`plan_launches`]).
const BLOCK_ELEMENTS: u64 = 4096;

/// The members of one launch (`struct UpdateTable` in `optim.cu`: the same fields in the
/// same order, 2192 bytes, 8-aligned, no padding).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct UpdateTable {
    /// Each member's device addresses, by slot (0 for a state the rule does not keep).
    addr: [[u64; SLOTS]; GROUP_MEMBERS],
    /// Each member's elements.
    n: [u64; GROUP_MEMBERS],
    /// Elements of one block's chunk.
    block_elements: u64,
    /// Member `m`'s blocks are `first_block[m]..first_block[m + 1]`; `first_block[members]`
    /// (and every entry after it) is the launch's block count.
    first_block: [u32; GROUP_MEMBERS + 1],
    /// Members in this launch (1..=[`GROUP_MEMBERS`]).
    members: u32,
}

impl UpdateTable {
    const EMPTY: Self = Self {
        addr: [[0; SLOTS]; GROUP_MEMBERS],
        n: [0; GROUP_MEMBERS],
        block_elements: BLOCK_ELEMENTS,
        first_block: [0; GROUP_MEMBERS + 1],
        members: 0,
    };

    /// Blocks of the launch.
    fn blocks(&self) -> u32 {
        self.first_block[self.members as usize]
    }
}

/// One launch of a group: the table of members `first_member..first_member +
/// table.members`, without addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct GroupLaunch {
    /// The group's index of the launch's first member.
    first_member: usize,
    /// Its members' lengths and blocks.
    table: UpdateTable,
}

/// The launches updating members of `lens` elements, in member order: up to
/// [`GROUP_MEMBERS`] members and `max_blocks` blocks each, chunks of [`BLOCK_ELEMENTS`]
/// (larger for a member too large for one launch, alone: [`plan_chunks`]). Launches with no
/// element to update (only empty members) are left out.
fn plan_launches(lens: &[u64], max_blocks: u64) -> Vec<GroupLaunch> {
    plan_chunks(lens, GROUP_MEMBERS, BLOCK_ELEMENTS, max_blocks)
        .into_iter()
        .filter(|planned| planned.blocks() > 0)
        .map(|planned| {
            let mut table = UpdateTable::EMPTY;
            table.block_elements = planned.chunk;
            table.members = planned.fill(lens, &mut table.n, &mut table.first_block);
            GroupLaunch { first_member: planned.first_member, table }
        })
        .collect()
}

/// Where one member's tensors are: actor inputs of the parameter, the gradient and the
/// states, and actor outputs of the new parameter and states (only the first `1 + states`
/// of each are used after the gradient).
#[derive(Debug, Clone, Copy)]
struct MemberSlots {
    /// Actor inputs of `(param, grad, state0, state1)`.
    inputs: [usize; 4],
    /// Actor outputs of `(param', state0', state1')`.
    outputs: [usize; 3],
}

/// Makes the kernel of an `update_group`: every member checked as one `update` is
/// (`check_update`), all of the group's dtype and reading member 0's learning rate, step
/// and gradient scale registers (the compiler fuses only such updates); its launches
/// planned once.
pub(super) fn make_update_group(spec: &KernelSpec<'_>) -> Result<UpdateGroupKernel, KernelError> {
    let conf = op_conf(spec)?;
    let group: UpdateGroup = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    let (inputs, outputs, params) = (group.member_inputs(), group.member_outputs(), group.params as usize);
    if params == 0
        || conf.inputs.len() != params * inputs
        || conf.input_map.len() != conf.inputs.len()
        || conf.outputs.len() != params * outputs
    {
        let error = format!(
            "has {params} member(s) of {inputs} inputs and {outputs} outputs each, but its conf has {} inputs ({} \
             mapped) and {} outputs",
            conf.inputs.len(),
            conf.input_map.len(),
            conf.outputs.len()
        );
        return Err(fail(spec, conf, error));
    }
    let dtype = super::float_dtype(spec, conf)?;
    let (rule, states, stem) = Rule::of(&group.kind);
    // lr (2), step (3) and the scale (last): read once per launch, from member 0's registers.
    let shared: Vec<usize> = [2, 3].into_iter().chain(group.scaled.then_some(inputs - 1)).collect();
    let mut members = Vec::with_capacity(params);
    let mut lens = Vec::with_capacity(params);
    for m in 0..params {
        let (ins, outs) = (m * inputs..(m + 1) * inputs, m * outputs..(m + 1) * outputs);
        let member = OpConf::new(
            &Update(group.kind.clone()),
            conf.inputs[ins.clone()].to_vec(),
            conf.input_map[ins].to_vec(),
            conf.outputs[outs.clone()].to_vec(),
        );
        check_update(&member, states).map_err(|e| fail(spec, conf, format!("member {m}: {e}")))?;
        let param = &member.inputs[0];
        if param.dtype != dtype {
            return Err(fail(spec, conf, format!("member {m}'s parameter is {param}, but member 0's is {dtype}")));
        }
        if let Some(&i) = shared.iter().find(|&&i| member.input_map[i] != conf.input_map[i]) {
            let error = format!(
                "member {m} reads input {i} (learning rate, step or gradient scale) from actor input {}, member 0 \
                 from {}: a group shares them",
                member.input_map[i], conf.input_map[i]
            );
            return Err(fail(spec, conf, error));
        }
        let input = |k: usize| member.input_map[k];
        members.push(MemberSlots {
            inputs: [input(0), input(1), input(4), if states == 2 { input(5) } else { 0 }],
            outputs: [outs.start, outs.start + 1, if states == 2 { outs.start + 2 } else { 0 }],
        });
        lens.push(param.shape.numel() as u64);
    }
    Ok(UpdateGroupKernel {
        function: function(spec, &format!("regflow_update_group_{stem}_{}", suffix(dtype)))?,
        launches: plan_launches(&lens, MAX_LINEAR_BLOCKS),
        members,
        scalars: [conf.input_map[2], conf.input_map[3], conf.input_map[inputs - 1]],
        lr_code: scalar_code(conf.inputs[2].dtype),
        step_code: scalar_code(conf.inputs[3].dtype),
        scale_code: group.scaled.then(|| scalar_code(conf.inputs[inputs - 1].dtype)),
        rule,
        dtype,
    })
}

/// The launches of an `update_group`.
#[derive(Debug)]
pub(super) struct UpdateGroupKernel {
    function: Function,
    launches: Vec<GroupLaunch>,
    members: Vec<MemberSlots>,
    /// Actor inputs of the learning rate, the step and (when `scale_code` is some) the
    /// gradient scale.
    scalars: [usize; 3],
    lr_code: u64,
    step_code: u64,
    scale_code: Option<u64>,
    rule: Rule,
    dtype: DType,
}

impl QueueTyped for UpdateGroupKernel {
    fn dtype(&self) -> DType {
        self.dtype
    }

    /// Queues every launch with the element type `T` (hyperparameters rounded by `round`,
    /// as `UpdateKernel::queue` rounds them).
    ///
    /// # Safety
    ///
    /// Every member's dense registers hold its elements of `T`, and lr, step and the scale
    /// at least one of theirs (checked when made); the argument lists are the group
    /// entries'.
    unsafe fn queue<T: Copy>(&self, io: &KernelIo<'_>, round: fn(f64) -> T) -> Result<(), crate::CudaError> {
        let [lr, step, scale] = self.scalars.map(|i| io.input_addr(i));
        let (lr_code, step_code) = (self.lr_code, self.step_code);
        // No scale: a null address, which the kernels read as 1.
        let (scale, scale_code) = self.scale_code.map_or((0, 0), |code| (scale, code));
        let (s, f) = (stream(io), self.function);
        for planned in &self.launches {
            // A copy on the stack: the firing's addresses are its own.
            let mut table = planned.table;
            let members = &self.members[planned.first_member..planned.first_member + table.members as usize];
            for (addr, member) in table.addr.iter_mut().zip(members) {
                addr[SLOT_P] = io.input_addr(member.inputs[0]);
                addr[SLOT_G] = io.input_addr(member.inputs[1]);
                addr[SLOT_P_OUT] = io.output_addr(member.outputs[0]);
                for k in 0..self.rule.states() {
                    addr[SLOT_STATE0 + k] = io.input_addr(member.inputs[2 + k]);
                    addr[SLOT_P_OUT + 1 + k] = io.output_addr(member.outputs[1 + k]);
                }
            }
            let grid = Grid::rows(u64::from(table.blocks()), LINEAR_THREADS, 0);
            // SAFETY: forwarded to the caller; the table holds this launch's members.
            unsafe {
                match self.rule {
                    Rule::Sgd { momentum, weight_decay } => {
                        let (mu, wd) = (round(momentum), round(weight_decay));
                        launch(s, f, grid, &mut args![table, lr, lr_code, scale, scale_code, mu, wd])
                    }
                    Rule::AdamW { beta1, beta2, eps, weight_decay } => {
                        let (b1, b2, one_b1, one_b2) =
                            (round(beta1), round(beta2), round(1.0 - beta1), round(1.0 - beta2));
                        let eps = round(eps);
                        launch(
                            s,
                            f,
                            grid,
                            &mut args![
                                table,
                                lr,
                                lr_code,
                                step,
                                step_code,
                                scale,
                                scale_code,
                                b1,
                                b2,
                                one_b1,
                                one_b2,
                                eps,
                                beta1,
                                beta2,
                                weight_decay
                            ],
                        )
                    }
                }
            }?;
        }
        Ok(())
    }
}

impl Kernel for UpdateGroupKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        run_typed(self, io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes of `struct UpdateTable` in `optim.cu`, by hand: 32 × 7 addresses, 32 lengths,
    /// the chunk size (u64), then 33 + 1 u32s; 2192 is a multiple of 8, so no tail padding.
    const C_TABLE_BYTES: usize = 32 * 7 * 8 + 32 * 8 + 8 + 33 * 4 + 4;

    #[test]
    fn the_update_table_has_the_c_structs_layout() {
        assert_eq!(std::mem::size_of::<UpdateTable>(), C_TABLE_BYTES);
        assert_eq!(C_TABLE_BYTES, 2192);
        assert_eq!(std::mem::align_of::<UpdateTable>(), 8);
        let source = crate::sources::SOURCES.iter().find(|s| s.name == "optim").expect("optim.cu");
        for (name, value) in [
            ("GROUP_MEMBERS", GROUP_MEMBERS),
            ("SLOTS", SLOTS),
            ("SLOT_P", SLOT_P),
            ("SLOT_G", SLOT_G),
            ("SLOT_STATE0", SLOT_STATE0),
            ("SLOT_P_OUT", SLOT_P_OUT),
        ] {
            assert!(source.code.contains(&format!("#define {name} {value}\n")), "{name}");
        }
        // Where NVRTC is there (built with `cuda`): the compiled entries take the table as
        // their first parameter.
        if crate::nvrtc::available().is_ok() {
            let ptx = crate::nvrtc::compile(source, "compute_80").unwrap_or_else(|e| panic!("{e}"));
            for entry in ["sgd_f32", "sgd_f64", "adamw_f32", "adamw_f64"] {
                let entry = format!("regflow_update_group_{entry}");
                let params = crate::sources::ptx_params(&ptx, &entry).expect("the entry");
                assert_eq!(params[0], std::mem::size_of::<UpdateTable>(), "{entry}");
                // Well under CUDA's 4 KiB of kernel parameters.
                assert!(params.iter().sum::<usize>() < 2400, "{entry}: {params:?}");
            }
        }
    }

    /// Every launch's blocks as (member, first element, elements) chunks, from its table as
    /// the kernel reads it (`chunk_of` in `optim.cu`).
    fn chunks(launch: &GroupLaunch) -> Vec<(usize, u64, u64)> {
        let t = &launch.table;
        (0..t.blocks())
            .map(|block| {
                let k = (0..t.members as usize).rev().find(|&k| t.first_block[k] <= block).expect("a member");
                let begin = u64::from(block - t.first_block[k]) * t.block_elements;
                (launch.first_member + k, begin, (begin + t.block_elements).min(t.n[k]) - begin)
            })
            .collect()
    }

    /// Asserts the launches of `lens` cover every element of every member exactly once, in
    /// member order, within the limits.
    fn assert_covered(lens: &[u64], max_blocks: u64, launches: &[GroupLaunch]) {
        let mut next = vec![0u64; lens.len()];
        let mut last_member = 0;
        for launch in launches {
            let t = &launch.table;
            assert!((1..=GROUP_MEMBERS as u32).contains(&t.members), "{t:?}");
            assert!(u64::from(t.blocks()) <= max_blocks && t.blocks() >= 1);
            assert_eq!(t.block_elements % u64::from(LINEAR_THREADS), 0);
            for k in 0..t.members as usize {
                assert_eq!(t.n[k], lens[launch.first_member + k]);
            }
            for (member, begin, elements) in chunks(launch) {
                assert!(member >= last_member, "member order");
                last_member = member;
                assert_eq!(begin, next[member], "member {member}'s chunks follow one another");
                assert!(elements > 0);
                next[member] += elements;
            }
        }
        assert_eq!(next, lens, "every element once");
    }

    #[test]
    fn launches_take_32_members_in_member_order() {
        let mut lens: Vec<u64> = [1, 7, 1023, 4096, 4097, 70_001].repeat(6);
        lens.push(5);
        let launches = plan_launches(&lens, MAX_LINEAR_BLOCKS);
        assert_eq!(launches.len(), 2);
        assert_eq!((launches[0].first_member, launches[0].table.members), (0, 32));
        assert_eq!((launches[1].first_member, launches[1].table.members), (32, 5));
        // 1, 7, 1023, 4096 take a block each, 4097 two, 70001 eighteen.
        assert_eq!(&launches[0].table.first_block[..8], &[0, 1, 2, 3, 4, 6, 24, 25]);
        assert_eq!(launches[0].table.block_elements, BLOCK_ELEMENTS);
        assert_covered(&lens, MAX_LINEAR_BLOCKS, &launches);
    }

    #[test]
    fn launches_split_where_blocks_would_pass_the_limit() {
        // 10 blocks at most: 4 + 4 fit, the third member of 4 blocks starts a launch.
        let lens = [4 * BLOCK_ELEMENTS, 4 * BLOCK_ELEMENTS - 1, 4 * BLOCK_ELEMENTS, 1];
        let launches = plan_launches(&lens, 10);
        let members: Vec<(usize, u32)> = launches.iter().map(|l| (l.first_member, l.table.members)).collect();
        assert_eq!(members, [(0, 2), (2, 2)]);
        assert_covered(&lens, 10, &launches);
    }

    #[test]
    fn a_member_of_more_than_the_most_blocks_gets_larger_chunks_and_a_launch_of_its_own() {
        // GPT-2's largest weight (50257 × 768) fits; one of 2^31 elements does not.
        let huge = 1u64 << 31;
        let lens = [3, BLOCK_ELEMENTS * MAX_LINEAR_BLOCKS, huge, 50_257 * 768, huge + 1, 8];
        let launches = plan_launches(&lens, MAX_LINEAR_BLOCKS);
        let members: Vec<(usize, u32)> = launches.iter().map(|l| (l.first_member, l.table.members)).collect();
        assert_eq!(members, [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1)]);
        // The exact fit keeps its chunk size; 2^31 elements need 9 × 4096 per block.
        assert_eq!(launches[1].table.blocks() as u64, MAX_LINEAR_BLOCKS);
        assert_eq!(launches[1].table.block_elements, BLOCK_ELEMENTS);
        assert_eq!(launches[2].table.block_elements, 9 * BLOCK_ELEMENTS);
        assert_eq!(launches[2].table.blocks() as u64, huge.div_ceil(9 * BLOCK_ELEMENTS));
        assert_covered(&lens, MAX_LINEAR_BLOCKS, &launches);
        // With a small limit too.
        let lens = [100 * BLOCK_ELEMENTS + 1, 5, 5];
        let launches = plan_launches(&lens, 7);
        assert_eq!(launches[0].table.block_elements, 15 * BLOCK_ELEMENTS);
        assert_covered(&lens, 7, &launches);
    }

    #[test]
    fn empty_members_take_no_block() {
        let lens = [0, 5, 0, 0, 9000, 0];
        let launches = plan_launches(&lens, MAX_LINEAR_BLOCKS);
        assert_eq!(launches.len(), 1);
        assert_eq!(&launches[0].table.first_block[..7], &[0, 0, 1, 1, 1, 4, 4]);
        assert_covered(&lens, MAX_LINEAR_BLOCKS, &launches);
        // A group of empty members launches nothing.
        assert!(plan_launches(&[0, 0], MAX_LINEAR_BLOCKS).is_empty());
    }
}
