//! The runtime's own checks of group members (plan validation checks them first, so a job
//! never reaches these; they guard kernels made from plans that skipped it).

use super::CollectiveGroups;
use crate::kernel::KernelSpec;
use regflow_plan::DType;
use regflow_plan::{CollectiveConf, CollectiveOp, DeviceKind};

fn conf(rank: u32, shape: &[usize]) -> CollectiveConf {
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
    let spec = KernelSpec { actor, device: DeviceKind::Cpu, op: None, input_bytes: &[bytes], output_bytes: &[bytes] };
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
    let spec =
        KernelSpec { actor: "a", device: DeviceKind::Cpu, op: None, input_bytes: &[16, 0], output_bytes: &[16, 0, 0] };
    assert!(groups.make_kernel(&conf(0, &[4]), &spec).is_ok());
    // A pacing input (the step's tick) may hold bytes; the kernel does not read it.
    let spec =
        KernelSpec { actor: "b", device: DeviceKind::Cpu, op: None, input_bytes: &[16, 16], output_bytes: &[16] };
    assert!(groups.make_kernel(&conf(1, &[4]), &spec).is_ok());
    let spec = KernelSpec { actor: "d", device: DeviceKind::Cpu, op: None, input_bytes: &[16], output_bytes: &[16, 8] };
    let err = CollectiveGroups::default().make_kernel(&conf(0, &[4]), &spec).map(|_| ()).unwrap_err();
    assert_eq!(
        err.0,
        "collective 'g' (all_reduce, rank 0 of 2): output 1 has 8 bytes; only output 0 carries data, further \
         registers are zero-byte order tokens"
    );
    let spec = KernelSpec { actor: "c", device: DeviceKind::Cpu, op: None, input_bytes: &[16], output_bytes: &[] };
    let err = CollectiveGroups::default().make_kernel(&conf(0, &[4]), &spec).map(|_| ()).unwrap_err();
    assert!(err.0.ends_with("needs a data input and a data output register; this one has 1 input(s) and 0 output(s)"));
}
