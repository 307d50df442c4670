//! The runtime's own checks of group members (plan validation checks them first, so a job
//! never reaches these; they guard kernels made from plans that skipped it).

use super::CollectiveGroups;
use crate::kernel::KernelSpec;
use regflow_plan::DType;
use regflow_plan::{CollectiveConf, CollectiveOp, DeviceKind};

/// Rank `rank` of group `g`: an f32 all-reduce of `shape` over 2 members.
pub(crate) fn conf(rank: u32, shape: &[usize]) -> CollectiveConf {
    CollectiveConf {
        group: "g".into(),
        rank,
        size: 2,
        op: CollectiveOp::AllReduce,
        dtype: DType::F32,
        shape: shape.to_vec(),
    }
}

fn make(groups: &CollectiveGroups, actor: &str, conf: &CollectiveConf, bytes: u64) -> Result<(), String> {
    let spec = KernelSpec {
        actor,
        device: DeviceKind::Cpu,
        device_index: 0,
        op: None,
        input_bytes: &[bytes],
        output_bytes: &[bytes],
        input_repeats: &[],
    };
    groups.make_kernel(conf, &spec).map(|_| ()).map_err(|e| e.0)
}

#[test]
fn a_second_member_that_disagrees_is_refused() {
    let groups = CollectiveGroups::default();
    make(&groups, "a", &conf(0, &[4]), 16).unwrap();
    let err = make(&groups, "b", &conf(1, &[2, 2]), 16).unwrap_err();
    assert_eq!(
        err,
        "collective 'g' (all_reduce, rank 1 of 2): members disagree on the shape: this actor has [2, 2], \
         member 'a' has [4]"
    );
}

#[test]
fn a_rank_taken_twice_is_refused() {
    let groups = CollectiveGroups::default();
    make(&groups, "a", &conf(0, &[4]), 16).unwrap();
    let err = make(&groups, "b", &conf(0, &[4]), 16).unwrap_err();
    assert_eq!(err, "collective 'g' (all_reduce, rank 0 of 2): rank 0 is already taken by actor 'a'");
}

#[test]
fn extra_inputs_pace_and_extra_outputs_must_be_zero_byte_tokens() {
    let groups = CollectiveGroups::default();
    let spec = KernelSpec {
        actor: "a",
        device: DeviceKind::Cpu,
        device_index: 0,
        op: None,
        input_bytes: &[16, 0],
        output_bytes: &[16, 0, 0],
        input_repeats: &[],
    };
    assert!(groups.make_kernel(&conf(0, &[4]), &spec).is_ok());
    // A pacing input (the step's tick) may hold bytes; the kernel does not read it.
    let spec = KernelSpec {
        actor: "b",
        device: DeviceKind::Cpu,
        device_index: 0,
        op: None,
        input_bytes: &[16, 16],
        output_bytes: &[16],
        input_repeats: &[],
    };
    assert!(groups.make_kernel(&conf(1, &[4]), &spec).is_ok());
    let spec = KernelSpec {
        actor: "d",
        device: DeviceKind::Cpu,
        device_index: 0,
        op: None,
        input_bytes: &[16],
        output_bytes: &[16, 8],
        input_repeats: &[],
    };
    let err = CollectiveGroups::default().make_kernel(&conf(0, &[4]), &spec).map(|_| ()).unwrap_err();
    assert_eq!(
        err.0,
        "collective 'g' (all_reduce, rank 0 of 2): output 1 has 8 bytes; only output 0 carries data, further \
         registers are zero-byte order tokens"
    );
    let spec = KernelSpec {
        actor: "c",
        device: DeviceKind::Cpu,
        device_index: 0,
        op: None,
        input_bytes: &[16],
        output_bytes: &[],
        input_repeats: &[],
    };
    let err = CollectiveGroups::default().make_kernel(&conf(0, &[4]), &spec).map(|_| ()).unwrap_err();
    assert!(err.0.ends_with("needs a data input and a data output register; this one has 1 input(s) and 0 output(s)"));
}

/// Runs one all-reduce round of `size` members over `elements` f32 values per member and
/// returns every member's output; member `r`'s input is `values(r)`.
fn all_reduce_outputs(size: u32, elements: usize, values: impl Fn(u32, usize) -> f32 + Sync) -> Vec<Vec<f32>> {
    let conf = CollectiveConf { size, ..conf(0, &[elements]) };
    let members = crate::CollectiveMember::group(&conf).unwrap();
    std::thread::scope(|s| {
        let threads: Vec<_> = members
            .into_iter()
            .map(|mut member| {
                let values = &values;
                s.spawn(move || {
                    let rank = member.rank();
                    let input: Vec<f32> = (0..elements).map(|i| values(rank, i)).collect();
                    let mut output = vec![0f32; elements];
                    member.run(bytemuck::cast_slice(&input), bytemuck::cast_slice_mut(&mut output)).unwrap();
                    output
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

#[test]
fn large_all_reduces_in_two_steps_give_the_rank_order_sum_bitwise() {
    // Values whose sum depends on the order, so a part summed in another order would show.
    let values = |rank: u32, i: usize| ((i * 7 + rank as usize * 13) % 101) as f32 * 1.0e-3 + 1.0e4 * rank as f32;
    // 70 001 f32 is past the two-step threshold and divides unevenly among 3 and 4 members.
    for (size, elements) in [(2, 70_001), (3, 70_001), (4, 65_536), (3, 1_001)] {
        assert_eq!(super::layout::TWO_STEP_MIN_BYTES <= elements * 4, elements > 2_000);
        let outputs = all_reduce_outputs(size, elements, values);
        let expected: Vec<f32> =
            (0..elements).map(|i| (1..size).fold(values(0, i), |sum, r| sum + values(r, i))).collect();
        for (rank, output) in outputs.iter().enumerate() {
            assert!(output.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {rank} of {size}");
        }
    }
}

/// The spec of a cpu bucket member whose data registers have these sizes.
fn bucket_spec<'a>(input_bytes: &'a [u64], output_bytes: &'a [u64]) -> KernelSpec<'a> {
    KernelSpec {
        actor: "bucket",
        device: DeviceKind::Cpu,
        device_index: 0,
        op: None,
        input_bytes,
        output_bytes,
        input_repeats: &[],
    }
}

/// Makes the member `conf` in a group of its own, or says why not.
fn make_alone(conf: &CollectiveConf, input_bytes: &[u64], output_bytes: &[u64]) -> Result<(), String> {
    CollectiveGroups::default().make_kernel(conf, &bucket_spec(input_bytes, output_bytes)).map(|_| ()).map_err(|e| e.0)
}

#[test]
fn a_bucket_needs_its_parts_as_data_registers_of_matching_sizes() {
    let bucket = CollectiveConf { op: CollectiveOp::AllReduceBucket { parts: 2 }, ..conf(0, &[6]) };
    let make = |(input_bytes, output_bytes): (&[u64], &[u64])| make_alone(&bucket, input_bytes, output_bytes);
    // Parts of 4 and 2 floats, a pacing tick and an order token.
    assert_eq!(make((&[16, 8, 0], &[16, 8, 0])), Ok(()));
    assert_eq!(
        make((&[16, 8], &[8, 16])).unwrap_err(),
        "collective 'g' (all_reduce_bucket, rank 0 of 2): bucket part 0 has 16 input but 8 output bytes; each \
         part's sum is as long as its summands"
    );
    assert_eq!(
        make((&[16, 4], &[16, 4])).unwrap_err(),
        "collective 'g' (all_reduce_bucket, rank 0 of 2): its 2 input registers have 20 bytes, but input shape [6] \
         of f32 needs 24"
    );
    assert!(make((&[24], &[24])).unwrap_err().ends_with(
        "needs 2 data input and output registers (one per bucket part); this one has 1 input(s) and 1 output(s)"
    ));
    let empty = CollectiveConf { op: CollectiveOp::AllReduceBucket { parts: 0 }, ..conf(0, &[6]) };
    let err = CollectiveGroups::default().make_kernel(&empty, &bucket_spec(&[24], &[24])).map(|_| ()).unwrap_err();
    assert_eq!(err.0, "collective 'g' (all_reduce_bucket, rank 0 of 2): a bucket of 0 tensors");
}

#[test]
fn a_bucket_sums_each_part_through_one_round() {
    let bytes: [u64; 3] = [12, 4, 20];
    let value = |rank: usize, part: usize, e: usize| (100 * rank + 10 * part + e) as f32;
    let outputs = run_bucket(CollectiveOp::AllReduceBucket { parts: 3 }, 2, &bytes, &bytes, value);
    for per_rank in outputs {
        for (part, output) in per_rank.iter().enumerate() {
            let expected: Vec<f32> =
                (0..bytes[part] as usize / 4).map(|e| value(0, part, e) + value(1, part, e)).collect();
            assert_eq!(output, &expected, "part {part}");
        }
    }
}

/// Runs `f` on a thread per member of an all-gather of 7 rows of 3 f32 over 3 members
/// (parts of 3, 2 and 2 rows), with the member and its own part's rows; returns what each
/// returns, by rank.
fn on_gather_members<R: Send>(f: impl Fn(super::CollectiveMember, std::ops::Range<usize>) -> R + Sync) -> Vec<R> {
    let conf = CollectiveConf { op: CollectiveOp::AllGather { dim: 0 }, size: 3, ..conf(0, &[7, 3]) };
    let members = super::CollectiveMember::group(&conf).unwrap();
    std::thread::scope(|s| {
        let threads: Vec<_> = members
            .into_iter()
            .map(|member| {
                let f = &f;
                s.spawn(move || {
                    let own = regflow_plan::part_range(7, 3, member.rank() as usize);
                    f(member, own)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

/// An all-gather along dimension 0 whose inputs already lie at their own parts of the
/// outputs (`RegstDesc::within`): every member ends with every part, uneven parts included,
/// and its own part is left as it was (nobody writes it).
#[test]
fn an_all_gather_in_place_copies_the_other_parts_only() {
    let row = |r: usize| -> Vec<u8> { (0..3).flat_map(|c| (r as f32 * 10.0 + c as f32).to_le_bytes()).collect() };
    let whole: Vec<u8> = (0..7).flat_map(row).collect();
    let outputs = on_gather_members(|mut member, own| {
        let (start, end) = (own.start * 12, own.end * 12);
        // Only the own part is written; the rest is garbage the gather overwrites.
        let mut output = vec![0xAB_u8; 7 * 12];
        output[start..end].copy_from_slice(&whole[start..end]);
        let out = output.as_mut_ptr();
        // SAFETY: `output` lives through the call and nobody else touches it.
        unsafe { member.gather_in_place(out.add(start), end - start, out, output.len()) }.unwrap();
        output
    });
    for output in outputs {
        assert_eq!(output, whole);
    }
}

/// Members whose outputs are one buffer (`RegstDesc::home`: cpu devices of one process
/// holding a gathered weight once): each writes its own part there before its round, and
/// after the round (the members leave it only together) the buffer holds every part, round
/// after round (the kernel skips each part whose source is where it would copy it).
#[test]
fn members_sharing_one_output_buffer_end_each_round_with_every_part() {
    let row = |round: usize, r: usize| -> Vec<u8> {
        (0..3).flat_map(|c| (round as f32 * 100.0 + r as f32 * 10.0 + c as f32).to_le_bytes()).collect()
    };
    let mut shared = vec![0xAB_u8; 7 * 12];
    let address = shared.as_mut_ptr() as usize;
    // Between reading a round's buffer and writing the next round's parts (a test's own
    // order: in a plan, the readers of the weight come before any update, by the rule).
    let read = std::sync::Barrier::new(3);
    let rounds = 5;
    let seen = on_gather_members(|mut member, own| {
        let (start, end) = (own.start * 12, own.end * 12);
        let out = address as *mut u8;
        let mut seen = Vec::new();
        for round in 0..rounds {
            let part: Vec<u8> = own.clone().flat_map(|r| row(round, r)).collect();
            // SAFETY: this member alone writes its own part, while every member is between
            // the last `read` barrier and this round.
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), out.add(start), part.len()) };
            // SAFETY: the buffer outlives the scope; peers' parts are not written here.
            unsafe { member.gather_in_place(out.add(start), end - start, out, 7 * 12) }.unwrap();
            // SAFETY: nobody writes until every member has read (the barrier).
            seen.push(unsafe { std::slice::from_raw_parts(out, 7 * 12) }.to_vec());
            read.wait();
        }
        seen
    });
    drop(shared);
    assert_eq!(seen.len(), 3);
    for member in seen {
        assert_eq!(member.len(), rounds);
        for (round, buffer) in member.iter().enumerate() {
            let whole: Vec<u8> = (0..7).flat_map(|r| row(round, r)).collect();
            assert_eq!(buffer, &whole, "round {round}");
        }
    }
}

/// An input that overlaps the output anywhere but at the member's own part of an
/// all-gather is refused, naming the offsets, before any peer is waited for.
#[test]
fn an_input_overlapping_its_output_otherwise_is_refused() {
    use super::CollectiveMember;
    let gather = CollectiveConf { op: CollectiveOp::AllGather { dim: 0 }, ..conf(0, &[4, 2]) };
    let mut member = CollectiveMember::group(&gather).unwrap().remove(1);
    let mut output = vec![0u8; 32];
    let out = output.as_mut_ptr();
    // Rank 1's own part is bytes 16..32; its input given at 8..24 instead.
    // SAFETY: `output` lives through the call.
    let err = unsafe { member.gather_in_place(out.add(8), 16, out, 32) }.unwrap_err();
    assert_eq!(
        err.0,
        "collective 'g': rank 1's input (16 bytes at offset 8 of its output) overlaps its 32-byte output other than \
         as its own part of an all-gather along dimension 0 (bytes 16..32)"
    );
    let mut member = CollectiveMember::group(&conf(0, &[8])).unwrap().remove(0);
    // SAFETY: as above.
    let err = unsafe { member.gather_in_place(out, 32, out, 32) }.unwrap_err();
    assert!(err.0.ends_with("other than as its own part of an all-gather along dimension 0"), "{}", err.0);
}

/// Runs one firing of a bucket of `op` over `size` members on threads: part `i`'s input on
/// rank `r` holds `value(r, i, e)` at element `e`. Returns each rank's outputs, per part.
fn run_bucket(
    op: CollectiveOp,
    size: u32,
    inputs: &[u64],
    outputs: &[u64],
    value: impl Fn(usize, usize, usize) -> f32 + Sync,
) -> Vec<Vec<Vec<f32>>> {
    use crate::kernel::{KernelIo, StreamContext};
    use regflow_memory::{Arena, MemoryKind};
    let groups = CollectiveGroups::default();
    let total: u64 = match op {
        CollectiveOp::AllGatherBucket { .. } => outputs.iter().sum(),
        _ => inputs.iter().sum(),
    };
    let kernels: Vec<_> = (0..size)
        .map(|rank| {
            let conf = CollectiveConf { op, size, ..conf(rank, &[total as usize / 4]) };
            groups.make_kernel(&conf, &bucket_spec(inputs, outputs)).unwrap()
        })
        .collect();
    let value = &value;
    std::thread::scope(|s| {
        let threads: Vec<_> = kernels
            .into_iter()
            .enumerate()
            .map(|(rank, mut kernel)| {
                s.spawn(move || {
                    // Every register 256 bytes apart in one arena, inputs first.
                    let arena =
                        Arena::allocate("t", MemoryKind::Host, 256 * (inputs.len() + outputs.len()) as u64).unwrap();
                    let view = |i: usize, len: u64| arena.view(256 * i as u64, len).unwrap();
                    let ins: Vec<_> = inputs.iter().enumerate().map(|(i, &b)| view(i, b)).collect();
                    let outs: Vec<_> = outputs.iter().enumerate().map(|(i, &b)| view(inputs.len() + i, b)).collect();
                    for (i, input) in ins.iter().enumerate() {
                        let values: Vec<f32> = (0..input.len() / 4).map(|e| value(rank, i, e)).collect();
                        unsafe { input.as_mut_slice() }.copy_from_slice(bytemuck::cast_slice(&values));
                    }
                    let context = StreamContext::default();
                    let group = regflow_plan::GroupPosition { index: 0, count: 1 };
                    kernel.run(&mut KernelIo::new(0, group, &ins, &outs, &context)).unwrap();
                    outs.iter().map(|o| bytemuck::cast_slice::<u8, f32>(unsafe { o.as_slice() }).to_vec()).collect()
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

/// ZeRO's buckets over 3 members, parts of 6, 3 and 9 elements: a reduce-scatter bucket
/// gives each rank its block of each part's sum (summed in rank order, bit for bit), and
/// an all-gather bucket gives every rank each part whole, blocks in rank order.
#[test]
fn zero_buckets_scatter_and_gather_each_part_through_one_round() {
    let whole: [u64; 3] = [24, 12, 36];
    let block: [u64; 3] = [8, 4, 12];
    let value = |rank: usize, part: usize, e: usize| (rank * 100 + part * 10 + e) as f32 * 0.37;
    let scattered = run_bucket(CollectiveOp::ReduceScatterBucket { parts: 3 }, 3, &whole, &block, value);
    for (rank, outputs) in scattered.iter().enumerate() {
        for (part, output) in outputs.iter().enumerate() {
            let n = block[part] as usize / 4;
            let expected: Vec<f32> = (rank * n..(rank + 1) * n)
                .map(|e| (value(0, part, e) + value(1, part, e)) + value(2, part, e))
                .collect();
            assert_eq!(
                output.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "rank {rank}, part {part}"
            );
        }
    }
    // Rank r's block of part i holds value(r, i, e) at its element e.
    let gathered = run_bucket(CollectiveOp::AllGatherBucket { parts: 3 }, 3, &block, &whole, value);
    for (rank, outputs) in gathered.iter().enumerate() {
        for (part, output) in outputs.iter().enumerate() {
            let n = block[part] as usize / 4;
            let expected: Vec<f32> = (0..3).flat_map(|r| (0..n).map(move |e| value(r, part, e))).collect();
            assert_eq!(output, &expected, "rank {rank}, part {part}");
        }
    }
}

/// A ZeRO bucket's part must be one of `size` equal blocks of whole elements.
#[test]
fn a_zero_bucket_refuses_parts_that_are_not_equal_blocks() {
    let rs = CollectiveConf { op: CollectiveOp::ReduceScatterBucket { parts: 2 }, ..conf(0, &[6]) };
    let make = |conf: &CollectiveConf, (input_bytes, output_bytes): (&[u64], &[u64])| {
        make_alone(conf, input_bytes, output_bytes)
    };
    assert_eq!(make(&rs, (&[16, 8], &[8, 4])), Ok(()));
    assert_eq!(
        make(&rs, (&[16, 8], &[4, 8])).unwrap_err(),
        "collective 'g' (reduce_scatter_bucket, rank 0 of 2): bucket part 0 has 16 input and 4 output bytes; a \
         reduce-scatter bucket's part is a tensor of whole 4-byte elements and one of 2 equal blocks of it"
    );
    let ag = CollectiveConf { op: CollectiveOp::AllGatherBucket { parts: 2 }, ..conf(0, &[6]) };
    assert_eq!(make(&ag, (&[8, 4], &[16, 8])), Ok(()));
    // Blocks that match but do not add up to the group's shape.
    assert!(make(&ag, (&[8, 8], &[16, 16])).unwrap_err().contains("needs 12"));
}
