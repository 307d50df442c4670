//! Bad plans are rejected at load with errors that name the actor, register, stream or
//! device and the values involved; good plans survive a JSON round trip unchanged.

use regflow::graph::plan::ops::{Binary, BinaryKind, MatMul};
use regflow::graph::plan::{
    ActorIndex, DType, Init, InputSignature, OpConf, OutputSignature, Region, RegstDescId, StreamIndex, TensorMeta,
    TensorPart, VariableDesc, PLAN_SCHEMA_VERSION,
};
use regflow::prelude::*;

/// `src -> f -> sink` on one cpu stream, plus the ids to break it with.
fn chain() -> Plan {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(4) });
    let x = b.regst("src.out", src, 64, 2);
    let f = b.actor("f", s, ActorKind::Compute { kernel: KernelConf::Copy });
    b.consume(f, x);
    let y = b.regst("f.out", f, 64, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, y);
    b.build().unwrap()
}

fn rejected(plan: Plan) -> String {
    let message = plan.validate().unwrap_err().to_string();
    // The runtime refuses it the same way, before starting anything.
    let job_error = Job::local(plan).unwrap_err();
    assert!(matches!(job_error, RuntimeError::Plan(_)), "{job_error}");
    assert_eq!(job_error.to_string(), format!("invalid plan: {message}"));
    message
}

#[test]
fn unknown_register_descriptor_is_rejected() {
    let mut plan = chain();
    plan.actors[1].inputs[0] = RegstDescId(9);
    assert_eq!(rejected(plan), "actor 'f' refers to unknown register descriptor 9 (the plan has 2)");
}

#[test]
fn register_num_zero_is_rejected() {
    let mut plan = chain();
    plan.regst_descs[1].register_num = 0;
    assert_eq!(rejected(plan), "register 'f.out' of actor 'f' has register_num 0: it needs at least 1 slot");
}

#[test]
fn cycle_with_no_free_register_is_rejected() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Count(4) });
    let x = b.regst("src.out", src, 8, 1);
    let a = b.actor("a", s, ActorKind::Compute { kernel: KernelConf::Copy });
    let bb = b.actor("b", s, ActorKind::Compute { kernel: KernelConf::Copy });
    let ya = b.regst("a.out", a, 8, 2);
    let yb = b.regst("b.out", bb, 8, 2);
    b.consume(a, x).consume(a, yb).consume(bb, ya);
    let sink = b.actor("sink", s, ActorKind::Sink);
    let z = b.regst("b.side", bb, 8, 1);
    b.consume(sink, z);
    let message = b.build().unwrap_err().to_string();
    assert_eq!(
        message,
        "cycle a -> b -> a has no free register to start from: every register on it starts empty, \
         so no actor on it can ever fire (preload a register on the cycle to give it a first piece)"
    );
}

#[test]
fn unknown_stream_is_rejected() {
    let mut plan = chain();
    plan.actors[2].stream = StreamIndex(3);
    assert_eq!(rejected(plan), "actor 'sink' is bound to unknown stream 3 (the plan has 1)");
}

#[test]
fn bytes_that_do_not_fit_are_rejected() {
    let mut plan = chain();
    plan.regst_descs[0].bytes = 1 << 20;
    plan.devices[0].memory_capacity = Some(1 << 20);
    assert_eq!(
        rejected(plan),
        "registers on device node0/cpu:0 need 2097216 bytes but it offers 1048576; largest: 'src.out' (2 x 1048576 \
         bytes), 'f.out' (1 x 64 bytes)"
    );
}

#[test]
fn sizes_that_overflow_are_rejected() {
    let mut plan = chain();
    plan.regst_descs[0].bytes = u64::MAX - 10;
    let message = rejected(plan);
    assert!(message.starts_with("memory layout of device node0/cpu:0: size of block 0 overflows"), "{message}");
}

#[test]
fn edges_listed_on_one_side_only_are_rejected() {
    let mut plan = chain();
    plan.regst_descs[0].consumers.push(ActorIndex(2));
    assert_eq!(
        rejected(plan),
        "register 'src.out' and actor 'sink' disagree: the register lists the actor as a consumer, but the actor \
         lists it 0 times in its inputs"
    );
    let mut plan = chain();
    plan.actors[2].inputs.push(RegstDescId(0));
    assert_eq!(
        rejected(plan),
        "register 'src.out' and actor 'sink' disagree: the actor reads the register, but the register does not list \
         it as a consumer"
    );
}

#[test]
fn kinds_with_the_wrong_inputs_or_outputs_are_rejected() {
    let mut plan = chain();
    plan.actors[2].kind = ActorKind::Compute { kernel: KernelConf::Noop };
    // A compute with no outputs is allowed (a side-effect kernel); a sink with outputs is not.
    assert!(plan.validate().is_ok());
    let mut plan = chain();
    plan.actors[1].kind = ActorKind::Sink;
    assert_eq!(rejected(plan), "sink actor 'f' needs at least one input and no outputs, has 1 inputs and 1 outputs");
    let mut plan = chain();
    plan.actors[1].kind = ActorKind::Acc { count: 0, kernel: KernelConf::Copy };
    assert_eq!(rejected(plan), "acc actor 'f' has count 0: it must be at least 1");
    let mut plan = chain();
    plan.regst_descs[1].bytes = 32;
    plan.actors[1].kind = ActorKind::Repeat { count: 2 };
    assert_eq!(
        rejected(plan),
        "repeat actor 'f' hands its input register to its consumers, so output 'f.out' must have the input's 64 \
         bytes, not 32"
    );
}

#[test]
fn registers_without_consumers_and_duplicate_names_are_rejected() {
    let mut plan = chain();
    plan.actors[2].inputs.clear();
    plan.regst_descs[1].consumers.clear();
    assert_eq!(rejected(plan), "register 'f.out' of actor 'f' has no consumer");
    let mut plan = chain();
    plan.actors[2].name = "f".into();
    assert_eq!(rejected(plan), "two actors are named 'f'");
}

#[test]
fn plans_round_trip_through_json() {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let sim = b.device(1, DeviceKind::Sim, 0);
    b.memory_capacity(sim, 1 << 30);
    let s0 = b.stream(cpu, StreamKind::Compute);
    let s1 = b.stream(sim, StreamKind::Comm);
    let src = b.actor("src", s0, ActorKind::Source { pieces: SourcePieces::Fed });
    let x = b.regst("x", src, 16, 2);
    let rep = b.actor("rep", s1, ActorKind::Repeat { count: 3 });
    b.consume(rep, x);
    let y = b.regst("y", rep, 16, 1);
    let acc = b.actor("acc", s1, ActorKind::Acc { count: 3, kernel: KernelConf::SumF32 });
    b.sim_nanos(acc, 1_000);
    b.consume(acc, y);
    let z = b.regst("z", acc, 16, 1);
    let f = b.actor("f", s0, ActorKind::Compute { kernel: KernelConf::Custom { name: "mine".into() } });
    b.consume(f, z);
    let w = b.regst("w", f, 16, 1);
    let sink = b.actor("sink", s0, ActorKind::Sink);
    b.consume(sink, w);
    let plan = b.build().unwrap();
    let json = plan.to_json();
    assert!(json.contains(&format!("\"schema_version\": {PLAN_SCHEMA_VERSION}")), "{json}");
    assert_eq!(Plan::from_json(&json).unwrap(), plan);
    let text = plan.to_string();
    assert!(text.contains("rep [repeat x3] <- [x]"), "{text}");
    assert!(text.contains("-> z: 1 x 16 bytes (host), read by f"), "{text}");
}

#[test]
fn bad_plan_files_are_rejected_with_the_reason() {
    let json = chain().to_json();
    let old = json.replace(&format!("\"schema_version\": {PLAN_SCHEMA_VERSION}"), "\"schema_version\": 0");
    assert_eq!(
        Plan::from_json(&old).unwrap_err().to_string(),
        format!("plan schema version 0 is not supported: this build reads version {PLAN_SCHEMA_VERSION}")
    );
    let unknown = json.replacen("\"register_num\"", "\"registers\"", 1);
    let message = Plan::from_json(&unknown).unwrap_err().to_string();
    assert!(message.contains("unknown field `registers`"), "{message}");
    let message = Plan::from_json("{\"schema_version\": 1, \"devices\": [").unwrap_err().to_string();
    assert!(message.starts_with("plan file is not valid JSON for a plan"), "{message}");
    let message = Plan::from_json("[]").unwrap_err().to_string();
    assert!(message.contains("missing field `schema_version`"), "{message}");
    // A well-formed file describing a bad plan is validated too.
    let zero = json.replacen("\"register_num\": 2", "\"register_num\": 0", 1);
    assert_eq!(
        Plan::from_json(&zero).unwrap_err().to_string(),
        "register 'src.out' of actor 'src' has register_num 0: it needs at least 1 slot"
    );
}

/// `src` (fed, 16 bytes) -> `f` (copy) -> `sink`, typed: input `x` f32[4] fed to `src`,
/// output `fetch:0` f32[4] delivered by `sink`.
fn typed_chain() -> Plan {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Fed });
    let x = b.regst("x", src, 16, 2);
    let f = b.actor("f", s, ActorKind::Compute { kernel: KernelConf::Copy });
    b.consume(f, x);
    let y = b.regst("f.out", f, 16, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, y);
    let meta = TensorMeta::new([4], DType::F32);
    b.plan_mut().signature.inputs.push(InputSignature {
        name: "x".into(),
        meta: meta.clone(),
        parts: vec![TensorPart { actor: src, region: Region::whole(&meta.shape) }],
    });
    b.plan_mut().signature.outputs.push(OutputSignature { name: "fetch:0".into(), meta, actor: sink });
    b.build().unwrap()
}

#[test]
fn signature_inputs_must_be_fed_sources_whose_registers_hold_their_part() {
    typed_chain().validate().unwrap();
    let mut plan = typed_chain();
    plan.signature.inputs[0].parts[0].actor = ActorIndex(1);
    assert_eq!(
        rejected(plan),
        "input 'x' of the signature has part 0 fed to actor 'f', a compute actor; the parts of an input must be \
         fed sources (`source` with `pieces: fed`)"
    );
    let mut plan = typed_chain();
    plan.signature.inputs[0].parts[0].actor = ActorIndex(9);
    assert_eq!(rejected(plan), "part 0 of input 'x' of the signature refers to unknown actor 9 (the plan has 3)");
    let mut plan = typed_chain();
    plan.signature.inputs[0].parts[0].region = Region { offsets: vec![1], shape: vec![4], zeros: false };
    assert_eq!(
        rejected(plan),
        "input 'x' of the signature has part 0 (source 'src') at offsets [1] of shape [4], which does not fit the \
         input's shape [4]"
    );
    let mut plan = typed_chain();
    plan.signature.inputs[0].meta = TensorMeta::new([8], DType::F32);
    plan.signature.inputs[0].parts[0].region = Region::whole(&[8].into());
    assert_eq!(
        rejected(plan),
        "input 'x' of the signature has part 0 f32[8] (32 bytes), but register 'x' of source 'src' holds 16 bytes"
    );
    let mut plan = typed_chain();
    let mut again = plan.signature.inputs[0].clone();
    again.name = "x2".into();
    plan.signature.inputs.push(again);
    assert_eq!(rejected(plan), "input 'x2' of the signature has part 0 fed to source 'src', which input 'x' feeds too");
}

#[test]
fn signature_outputs_must_be_sinks_reading_the_whole_value() {
    let mut plan = typed_chain();
    plan.signature.outputs[0].actor = ActorIndex(1);
    assert_eq!(
        rejected(plan),
        "output 'fetch:0' of the signature is delivered by actor 'f', a compute actor; an output must be delivered \
         by a sink"
    );
    let mut plan = typed_chain();
    plan.signature.outputs[0].meta = TensorMeta::new([2], DType::F32);
    assert_eq!(
        rejected(plan),
        "output 'fetch:0' of the signature is f32[2] (8 bytes), but sink 'sink' reads it from register 'f.out' of \
         16 bytes"
    );
}

/// `tick` (4 counted pieces) paces `step`, which carries `state` (8 bytes, preloaded) in a
/// loop; variable `w` (f32[2], zeros) is the state's first value.
fn variable_loop() -> Plan {
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src = b.actor("tick", s, ActorKind::Source { pieces: SourcePieces::Count(4) });
    let tick = b.regst("tick", src, 8, 1);
    let step = b.actor("step", s, ActorKind::Compute { kernel: KernelConf::Copy });
    let state = b.regst("state", step, 8, 2);
    b.preload(state, 1);
    b.consume(step, tick).consume(step, state);
    let meta = TensorMeta::new([2], DType::F32);
    let region = Region::whole(&meta.shape);
    b.plan_mut().variables.push(VariableDesc {
        name: "w".into(),
        regst: state,
        meta,
        init: Init::Zeros,
        region,
        constant: false,
    });
    b.build().unwrap()
}

#[test]
fn variables_must_fill_preloaded_registers_with_a_part_that_fits() {
    variable_loop().validate().unwrap();
    let mut plan = variable_loop();
    plan.variables[0].regst = RegstDescId(7);
    assert_eq!(rejected(plan), "variable 'w' refers to unknown register descriptor 7 (the plan has 2)");
    let mut plan = variable_loop();
    plan.variables[0].regst = RegstDescId(0);
    assert_eq!(
        rejected(plan),
        "variable 'w' goes into register 'tick', which has no preloaded slots to hold its first value"
    );
    let mut plan = variable_loop();
    plan.variables[0].region = Region { offsets: vec![usize::MAX], shape: vec![2], zeros: false };
    assert_eq!(
        rejected(plan),
        format!(
            "variable 'w' has its part at offsets [{}] of shape [2], which does not fit the variable's shape [2]",
            usize::MAX
        )
    );
    let mut plan = variable_loop();
    plan.variables[0].meta = TensorMeta::new([4], DType::F32);
    plan.variables[0].region = Region::whole(&[4].into());
    assert_eq!(rejected(plan), "variable 'w' has its part f32[4] (16 bytes), but its register 'state' holds 8 bytes");
}

#[test]
fn plan_file_elements_that_do_not_parse_are_named_by_place_and_line() {
    let json = chain().to_json();
    let device = json.replacen("\"kind\": \"cpu\"", "\"kind\": \"tpu\"", 1);
    let message = Plan::from_json(&device).unwrap_err().to_string();
    assert!(
        message.starts_with("plan file: device 0: unknown variant `tpu`, expected one of `cpu`, `sim`, `cuda` (line "),
        "{message}"
    );
    let actor = json.replacen("\"kind\": \"sink\"", "\"kind\": \"sinc\"", 1);
    let message = Plan::from_json(&actor).unwrap_err().to_string();
    assert!(message.starts_with("plan file: actor 2 'sink': unknown variant `sinc`, expected one of "), "{message}");
    let Err(PlanError::Element { line, column, .. }) = Plan::from_json(&actor) else { panic!("{message}") };
    let at = actor.lines().nth(line - 1).unwrap();
    assert!(at[..column].contains("sinc"), "line {line} column {column}: {at}");
}

/// Fed `a` and `b` -> op actor `op` (with these metas) -> `sink`; registers sized by the metas.
fn one_op(op: &dyn regflow::graph::plan::OpAttrs, a: &[usize], b_shape: &[usize], out: &[usize]) -> Plan {
    let meta = |shape: &[usize]| TensorMeta::new(shape.to_vec(), DType::F32);
    let mut b = PlanBuilder::new();
    let cpu = b.device(0, DeviceKind::Cpu, 0);
    let s = b.stream(cpu, StreamKind::Compute);
    let src_a = b.actor("a", s, ActorKind::Source { pieces: SourcePieces::Fed });
    let ra = b.regst("a", src_a, meta(a).bytes() as u64, 1);
    let src_b = b.actor("b", s, ActorKind::Source { pieces: SourcePieces::Fed });
    let rb = b.regst("b", src_b, meta(b_shape).bytes() as u64, 1);
    let conf = OpConf::new(op, vec![meta(a), meta(b_shape)], vec![0, 1], vec![meta(out)]);
    let actor = b.actor("op", s, ActorKind::Compute { kernel: KernelConf::Op(conf) });
    b.consume(actor, ra).consume(actor, rb);
    let y = b.regst("y", actor, meta(out).bytes() as u64, 1);
    let sink = b.actor("sink", s, ActorKind::Sink);
    b.consume(sink, y);
    b.build().unwrap()
}

#[test]
fn op_metas_that_contradict_the_op_are_refused_at_job_build_naming_the_actor_and_shapes() {
    let build = |plan: Plan| Job::local(plan).map(|_| ()).map_err(|e| e.to_string());
    assert_eq!(build(one_op(&MatMul::default(), &[4, 3], &[3, 2], &[4, 2])), Ok(()));
    assert_eq!(
        build(one_op(&MatMul::default(), &[4, 3], &[5, 2], &[4, 2])),
        Err("cannot make the kernel of actor 'op': op 'matmul': inner dimensions differ: [4, 3] x [5, 2] \
             (3 vs 5)"
            .into())
    );
    assert_eq!(
        build(one_op(&MatMul { transpose_a: false, transpose_b: true }, &[4, 3], &[2, 3], &[2, 4])),
        Err("cannot make the kernel of actor 'op': op 'matmul': [4, 3] x [2, 3]ᵀ gives [4, 2], but the \
             output is [2, 4]"
            .into())
    );
    assert_eq!(
        build(one_op(&Binary(BinaryKind::Add), &[4], &[3], &[4])),
        Err("cannot make the kernel of actor 'op': op 'binary': shapes [4] and [3] do not broadcast".into())
    );
    assert_eq!(
        build(one_op(&Binary(BinaryKind::Mul), &[2, 3], &[3], &[3, 2])),
        Err("cannot make the kernel of actor 'op': op 'binary': shapes [2, 3] and [3] broadcast to \
             [2, 3], but the output is [3, 2]"
            .into())
    );
}

#[test]
fn input_windows_must_fit_their_register_and_actor() {
    let window = |input, offset, bytes| regflow::graph::plan::InputWindow { input, offset, bytes };
    // A window inside its register, on a compute actor, loads.
    let mut plan = chain();
    plan.regst_descs[1].bytes = 32;
    plan.actors[1].windows.push(window(0, 0, 32));
    assert!(plan.validate().is_ok());
    let cases = [
        (1, window(1, 0, 8), "actor 'f' has a window on input 1, but it has 1 inputs"),
        (1, window(0, 64, 64), "actor 'f' reads bytes 64..128 of register 'src.out', which holds 64 bytes"),
        (1, window(0, u64::MAX - 63, 64), "actor 'f' reads bytes 18446744073709551552..18446744073709551615 of register 'src.out', which holds 64 bytes"),
        (1, window(0, 8, 8), "actor 'f' has a window at byte 8 of input 0: windows start on a multiple of 64 bytes, as slots do"),
        (2, window(0, 0, 8), "actor 'sink' is a sink actor, which hands whole registers on; only compute actors read windows"),
    ];
    for (actor, w, message) in cases {
        let mut plan = chain();
        plan.actors[actor].windows.push(w);
        assert_eq!(rejected(plan), message);
    }
    let mut plan = chain();
    plan.actors[1].windows.extend([window(0, 0, 8), window(0, 0, 8)]);
    assert_eq!(rejected(plan), "actor 'f' has two windows on input 0");
}
