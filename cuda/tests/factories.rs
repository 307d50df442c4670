//! Every CUDA factory accepts well-formed op confs up to the device lookup, and refuses
//! malformed ones naming the actor: runs on machines without a GPU (the lookup then fails
//! with "no GPU", "built without CUDA", never with a meta error).

use regflow_kernels::{Execution, KernelRegistry, KernelSpec};
use regflow_plan::ops::*;
use regflow_plan::{DType, DeviceKind, KernelConf, OpConf, Shape, TensorMeta};

fn make(conf: &OpConf) -> Result<(), String> {
    let mut registry = KernelRegistry::new();
    regflow_cuda::register(&mut registry);
    let bytes = |metas: &[TensorMeta]| metas.iter().map(|m| m.bytes() as u64).collect::<Vec<u64>>();
    // Each actor input's register holds the first op input mapped to it (ops that read one
    // register twice, an update_group's shared learning rate, have fewer actor inputs).
    let actor_inputs = conf.input_map.iter().max().map_or(0, |&a| a + 1);
    let input_bytes: Vec<u64> = (0..actor_inputs)
        .map(|a| conf.input_map.iter().position(|&i| i == a).map_or(0, |i| conf.inputs[i].bytes() as u64))
        .collect();
    let output_bytes = bytes(&conf.outputs);
    let spec = KernelSpec {
        actor: "a1",
        device: DeviceKind::Cuda,
        device_index: 0,
        op: Some(conf),
        input_bytes: &input_bytes,
        output_bytes: &output_bytes,
        input_repeats: &[],
    };
    registry.make(&KernelConf::Op(conf.clone()), &spec).map(|_| ()).map_err(|e| e.0)
}

/// Accepted: the only error is the device's (no GPU or no CUDA in this build).
fn accepted(conf: &OpConf) {
    if let Err(e) = make(conf) {
        // The device's error: no CUDA in this build, or no GPU or driver on this machine.
        let device = ["no CUDA backend", "CUDA library", "no CUDA device", "cuda:"];
        assert!(
            device.iter().any(|d| e.contains(d)) && !e.contains("on CUDA:"),
            "{}: refused a valid conf: {e}",
            conf.op_type
        );
    }
}

fn m(dims: &[usize], dtype: DType) -> TensorMeta {
    TensorMeta::new(dims.to_vec(), dtype)
}

fn conf(op: &dyn OpAttrs, inputs: Vec<TensorMeta>, outputs: Vec<TensorMeta>) -> OpConf {
    let n = inputs.len();
    OpConf::new(op, inputs, (0..n).collect(), outputs)
}

#[test]
fn valid_confs_pass_validation() {
    let f = DType::F32;
    accepted(&conf(&SumSquaresGroup { carried: true }, vec![m(&[], f), m(&[3, 5], f), m(&[7], f)], vec![m(&[], f)]));
    let x = m(&[3, 5], f);
    accepted(&conf(&Unary(UnaryKind::PowScalar(2.0)), vec![x.clone()], vec![x.clone()]));
    accepted(&conf(&Binary(BinaryKind::Div), vec![x.clone(), m(&[5], f)], vec![x.clone()]));
    accepted(&conf(&BiasGelu, vec![x.clone(), m(&[5], f)], vec![x.clone()]));
    let h = DType::Bf16;
    accepted(&conf(&CastGroup { to: h, members: 2 }, vec![x.clone(), m(&[7], f)], vec![m(&[3, 5], h), m(&[7], h)]));
    let labels = m(&[3], DType::I64);
    accepted(&conf(&SparseCrossEntropy { classes: Some(4) }, vec![x.clone(), labels.clone()], vec![m(&[], f)]));
    accepted(&conf(
        &SparseCrossEntropyGrad { classes: Some(5) },
        vec![x.clone(), labels.clone(), m(&[], f)],
        vec![x.clone()],
    ));
    accepted(&conf(&BiasGeluGrad, vec![x.clone(), m(&[5], f), x.clone()], vec![x.clone()]));
    accepted(&conf(&Dropout { p: 0.5, seed: 1 }, vec![x.clone()], vec![x.clone()]));
    let part = DropoutPart { dropout: Dropout { p: 0.5, seed: 1 }, logical: Shape::new([6, 5]), offsets: vec![3, 0] };
    accepted(&conf(&part, vec![x.clone()], vec![x.clone()]));
    for dtype in [DType::F32, DType::F64, DType::I64] {
        let x = m(&[3, 5], dtype);
        accepted(&conf(&Reshape(vec![-1]), vec![x.clone()], vec![m(&[15], dtype)]));
        accepted(&conf(&BroadcastTo(Shape::new([2, 3, 5])), vec![x.clone()], vec![m(&[2, 3, 5], dtype)]));
        accepted(&conf(&Permute(vec![1, 0]), vec![x.clone()], vec![m(&[5, 3], dtype)]));
        accepted(&conf(&Slice { axis: 1, start: 1, end: 4 }, vec![x.clone()], vec![m(&[3, 3], dtype)]));
        accepted(&conf(&SliceGrad { axis: 1, start: 1, size: 9 }, vec![x.clone()], vec![m(&[3, 9], dtype)]));
        accepted(&conf(&Concat { axis: 0 }, vec![x.clone(), m(&[2, 5], dtype)], vec![m(&[5, 5], dtype)]));
        // Part 1 of 2 of 5 columns: columns 3..5.
        accepted(&conf(&TakePart { dim: 1, parts: 2, index: 1 }, vec![x.clone()], vec![m(&[3, 2], dtype)]));
        accepted(&conf(&KeepOnFirst { first: true }, vec![x.clone()], vec![x.clone()]));
        accepted(&conf(&KeepOnFirst { first: false }, vec![x.clone()], vec![x.clone()]));
        accepted(&conf(&ToGlobal, vec![x.clone()], vec![x.clone()]));
    }
    accepted(&conf(&SumTo(Shape::new([5])), vec![x.clone()], vec![m(&[5], f)]));
    accepted(&conf(&Embedding, vec![m(&[10, 4], f), m(&[2, 3], DType::I64)], vec![m(&[2, 3, 4], f)]));
    accepted(&conf(&EmbeddingGrad::new(10), vec![m(&[2, 3], DType::I64), m(&[2, 3, 4], f)], vec![m(&[10, 4], f)]));
    let held = Rows { vocab_size: 10, held: 5..10 };
    let gather = VocabPart { rows: held.clone(), grad: false };
    accepted(&conf(&gather, vec![m(&[5, 4], f), m(&[2, 3], DType::I64)], vec![m(&[2, 3, 4], f)]));
    let scatter = VocabPart { rows: held, grad: true };
    accepted(&conf(&scatter, vec![m(&[2, 3], DType::I64), m(&[2, 3, 4], f)], vec![m(&[5, 4], f)]));
    let s = m(&[], DType::F64);
    let sgd = Update(OptimizerKind::Sgd { momentum: 0.9, weight_decay: 0.0 });
    accepted(&conf(&sgd, vec![x.clone(), x.clone(), s.clone(), s.clone(), x.clone()], vec![x.clone(); 2]));
    let adamw = Update(OptimizerKind::AdamW { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 });
    accepted(&conf(&adamw, vec![x.clone(), x.clone(), s.clone(), s, x.clone(), x.clone()], vec![x.clone(); 3]));
    let mean = OpConf {
        op_type: ACCUMULATE_MEAN.into(),
        attrs: Default::default(),
        inputs: vec![x.clone()],
        input_map: vec![0],
        outputs: vec![x],
    };
    accepted(&mean);
    for scaled in [false, true] {
        accepted(&update_group(scaled, &[m(&[3, 5], f), m(&[7], f)], |_| {}));
    }
}

/// An AdamW `update_group` of members with parameters `params`: actor inputs lr, step,
/// scale (when `scaled`), then each member's param, grad and two states; `edit` changes the
/// conf after.
fn update_group(scaled: bool, params: &[TensorMeta], edit: impl FnOnce(&mut OpConf)) -> OpConf {
    let s = m(&[], DType::F64);
    let kind = OptimizerKind::AdamW { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 };
    let (mut inputs, mut input_map, mut outputs) = (Vec::new(), Vec::new(), Vec::new());
    for (j, p) in params.iter().enumerate() {
        // Actor inputs: 0 lr, 1 step, 2 scale, then 4 per member from 3.
        let first = 3 + 4 * j;
        inputs.extend([p.clone(), p.clone(), s.clone(), s.clone(), p.clone(), p.clone()]);
        input_map.extend([first, first + 1, 0, 1, first + 2, first + 3]);
        if scaled {
            inputs.push(m(&[], DType::F32));
            input_map.push(2);
        }
        outputs.extend([p.clone(), p.clone(), p.clone()]);
    }
    let op = UpdateGroup { kind, params: params.len() as u32, scaled };
    let mut conf = OpConf { op_type: op.op_type().to_string(), attrs: op.attrs(), inputs, input_map, outputs };
    edit(&mut conf);
    conf
}

#[test]
fn malformed_update_groups_are_refused_naming_the_member() {
    let f = DType::F32;
    let params = [m(&[3, 5], f), m(&[7], f)];
    let cases: [(OpConf, &str); 5] = [
        // Member 1's second moment is not its parameter's shape.
        (update_group(false, &params, |c| c.inputs[6 + 5] = m(&[8], f)), "member 1: the gradient, states"),
        // Member 1 updates f64 in an f32 group.
        (
            update_group(false, &[m(&[3, 5], f), m(&[7], DType::F64)], |_| {}),
            "member 1's parameter is f64[7], but member 0's is f32",
        ),
        // Member 1 reads its own learning rate (actor input 2, which no scale takes).
        (update_group(false, &params, |c| c.input_map[6 + 2] = 2), "member 1 reads input 2"),
        // One output too few.
        (update_group(true, &params, |c| drop(c.outputs.pop())), "2 member(s) of 7 inputs and 3 outputs"),
        // No member.
        (update_group(false, &[], |_| {}), "0 member(s)"),
    ];
    for (conf, want) in &cases {
        let e = make(conf).expect_err("refused");
        assert!(
            e.contains("actor 'a1'") && e.contains("op 'update_group' on CUDA:") && e.contains(want),
            "{want}: {e}"
        );
    }
}

#[test]
fn malformed_confs_are_refused_naming_the_actor() {
    let f = DType::F32;
    let x = m(&[3, 5], f);
    let cases = [
        conf(&Binary(BinaryKind::Add), vec![x.clone(), m(&[4], f)], vec![x.clone()]),
        conf(&Permute(vec![1, 0]), vec![x.clone()], vec![x.clone()]),
        conf(&Slice { axis: 1, start: 1, end: 4 }, vec![x.clone()], vec![m(&[3, 4], f)]),
        conf(&Concat { axis: 0 }, vec![x.clone(), m(&[2, 4], f)], vec![m(&[5, 5], f)]),
        conf(&SumTo(Shape::new([3])), vec![x.clone()], vec![m(&[3], f)]),
        conf(&Reshape(vec![4, 4]), vec![x.clone()], vec![m(&[4, 4], f)]),
        // Part 0 of 2 of 5 columns is 3 wide; part 2 of 2 does not exist; dim 2 neither.
        conf(&TakePart { dim: 1, parts: 2, index: 0 }, vec![x.clone()], vec![m(&[3, 2], f)]),
        conf(&TakePart { dim: 1, parts: 2, index: 2 }, vec![x.clone()], vec![m(&[3, 2], f)]),
        conf(&TakePart { dim: 2, parts: 2, index: 0 }, vec![x.clone()], vec![m(&[3, 5], f)]),
        conf(&KeepOnFirst { first: true }, vec![x.clone()], vec![m(&[5, 3], f)]),
        conf(&ToGlobal, vec![x.clone()], vec![m(&[15], f)]),
        // A part of 5 rows given a table of 6; rows past the vocabulary.
        conf(
            &VocabPart { rows: Rows { vocab_size: 10, held: 5..10 }, grad: false },
            vec![m(&[6, 4], f), m(&[2, 3], DType::I64)],
            vec![m(&[2, 3, 4], f)],
        ),
        conf(
            &VocabPart { rows: Rows { vocab_size: 10, held: 5..12 }, grad: true },
            vec![m(&[2, 3], DType::I64), m(&[2, 3, 4], f)],
            vec![m(&[7, 4], f)],
        ),
        conf(&Binary(BinaryKind::Add), vec![m(&[2; 9], f), m(&[2, 1, 2, 1, 2, 1, 2, 1, 2], f)], vec![m(&[2; 9], f)]),
        // A global norm's group: tensors of two dtypes, a carry that is no scalar, an output
        // that is no scalar.
        conf(&SumSquaresGroup { carried: false }, vec![x.clone(), m(&[4], DType::F64)], vec![m(&[], f)]),
        conf(&SumSquaresGroup { carried: true }, vec![m(&[2], f), x.clone()], vec![m(&[], f)]),
        conf(&SumSquaresGroup { carried: false }, vec![x.clone()], vec![m(&[3], f)]),
        // Fused casts: a member count that is not the conf's, a pair no group converts, a
        // member of another shape or dtype.
        conf(&CastGroup { to: DType::Bf16, members: 2 }, vec![x.clone()], vec![m(&[3, 5], DType::Bf16)]),
        conf(&CastGroup { to: f, members: 1 }, vec![m(&[3, 5], DType::F64)], vec![x.clone()]),
        conf(
            &CastGroup { to: DType::Bf16, members: 2 },
            vec![x.clone(), m(&[7], f)],
            vec![m(&[3, 5], DType::Bf16), m(&[8], DType::Bf16)],
        ),
        conf(
            &CastGroup { to: DType::Bf16, members: 2 },
            vec![x.clone(), m(&[7], DType::F16)],
            vec![m(&[3, 5], DType::Bf16), m(&[7], DType::Bf16)],
        ),
        // A cross-entropy over more classes than the logits' columns, or none.
        conf(&SparseCrossEntropy { classes: Some(6) }, vec![x.clone(), m(&[3], DType::I64)], vec![m(&[], f)]),
        conf(&SparseCrossEntropy { classes: Some(0) }, vec![x.clone(), m(&[3], DType::I64)], vec![m(&[], f)]),
    ];
    for c in &cases {
        let e = make(c).expect_err("refused");
        assert!(e.contains("actor 'a1'") && e.contains("on CUDA:"), "{}: {e}", c.op_type);
    }
}

/// Every op type the CPU has a kernel for has a CUDA kernel too (for some dtype), so no op
/// of a plan is left to run on the host of a GPU device for want of one.
#[test]
fn every_cpu_op_type_has_a_cuda_kernel() {
    let mut cpu = KernelRegistry::new();
    regflow_kernels::cpu::register(&mut cpu, DeviceKind::Cpu);
    let cuda: std::collections::BTreeSet<String> = regflow_cuda::queued_ops().into_iter().map(|k| k.op_type).collect();
    let mut missing: Vec<&str> = cpu.op_keys().map(|k| k.op_type.as_str()).filter(|op| !cuda.contains(*op)).collect();
    missing.sort_unstable();
    missing.dedup();
    assert!(missing.is_empty(), "op types with a CPU kernel but none on CUDA: {missing:?}");
}

/// A register copy (`KernelConf::Copy`: a variable's per-step assign) on a cuda device is
/// queued on the stream, not run on the host after the stream drains; on a cpu device it
/// stays the host copy.
#[test]
fn register_copies_on_cuda_are_queued_on_the_stream() {
    let mut registry = KernelRegistry::new();
    regflow_kernels::cpu::register(&mut registry, DeviceKind::Cpu);
    regflow_cuda::register(&mut registry);
    for (device, expected) in [(DeviceKind::Cuda, Execution::Queued), (DeviceKind::Cpu, Execution::Host)] {
        let spec = KernelSpec {
            actor: "assign:w",
            device,
            device_index: 0,
            op: None,
            input_bytes: &[64],
            output_bytes: &[64],
            input_repeats: &[],
        };
        let kernel = registry.make(&KernelConf::Copy, &spec).expect("a copy kernel");
        assert_eq!(kernel.execution(), expected, "{device:?}");
    }
}
