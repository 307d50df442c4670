//! Plans built by hand with `PlanBuilder`: bad references, register counts of 0, cycles
//! with no preloaded register, actors whose inputs and outputs do not fit their kind,
//! signatures and variables that do not fit their registers, collectives, memory.

use crate::Catalogue;
use regflow::graph::plan::{
    ActorIndex, CollectiveConf, CollectiveOp, DType, DeviceIndex, Init, InputSignature, OutputSignature, Region,
    RegstDescId, StreamIndex, TensorMeta, VariableDesc,
};
use regflow::prelude::*;

/// `src -> f -> sink` on one cpu stream; `edit` may change anything before it is built.
pub(crate) fn chain(edit: impl FnOnce(&mut PlanBuilder, [ActorIndex; 3], [RegstDescId; 2])) -> Result<Plan, PlanError> {
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
    edit(&mut b, [src, f, sink], [x, y]);
    b.build()
}

/// Two members of collective `grad` on two cpu devices, each fed by a counted source and
/// read by a sink; `edit` changes the confs.
fn collective(edit: impl FnOnce(&mut [CollectiveConf; 2])) -> Result<Plan, PlanError> {
    let conf = |rank| CollectiveConf {
        group: "grad".into(),
        rank,
        size: 2,
        op: CollectiveOp::AllReduce,
        dtype: DType::F32,
        shape: vec![4],
    };
    let mut confs = [conf(0), conf(1)];
    edit(&mut confs);
    let mut b = PlanBuilder::new();
    for (rank, conf) in confs.into_iter().enumerate() {
        let device = b.device(0, DeviceKind::Cpu, rank as u16);
        let compute = b.stream(device, StreamKind::Compute);
        let comm = b.stream(device, StreamKind::Comm);
        let src = b.actor(&format!("src@{rank}"), compute, ActorKind::Source { pieces: SourcePieces::Count(2) });
        let x = b.regst(&format!("x@{rank}"), src, 16, 1);
        let reduce =
            b.actor(&format!("allreduce@{rank}"), comm, ActorKind::Compute { kernel: KernelConf::Collective(conf) });
        b.consume(reduce, x);
        let y = b.regst(&format!("y@{rank}"), reduce, 16, 1);
        let sink = b.actor(&format!("sink@{rank}"), compute, ActorKind::Sink);
        b.consume(sink, y);
    }
    b.build()
}

fn meta(shape: &[usize]) -> TensorMeta {
    TensorMeta::new(shape.to_vec(), DType::F32)
}

#[test]
fn hand_built_plans() {
    let mut c = Catalogue::new("plans");
    let copy = || ActorKind::Compute { kernel: KernelConf::Copy };
    c.case(
        "an actor reading an unknown register",
        || {
            chain(|b, [_, f, _], _| {
                b.consume(f, RegstDescId(9));
            })
        },
        "PlanError::UnknownRegstDesc",
        &["actor 'f'", "register descriptor 9", "has 2"],
    );
    c.case(
        "a register with register_num 0",
        || {
            chain(|b, [src, ..], _| {
                b.regst("zero", src, 8, 0);
            })
        },
        "PlanError::ZeroRegisterNum",
        &["'zero'", "'src'", "register_num 0"],
    );
    c.case(
        "a register preloading more slots than it has",
        || {
            chain(|b, _, [_, y]| {
                b.preload(y, 3);
            })
        },
        "PlanError::TooManyPreloaded",
        &["'f.out'", "preloads 3", "only 1"],
    );
    c.case(
        "a register produced by an unknown actor",
        || {
            chain(|b, _, _| {
                b.regst("ghost", ActorIndex(7), 8, 1);
            })
        },
        "PlanError::UnknownActor",
        &["register 'ghost'", "unknown actor 7", "has 3"],
    );
    c.case(
        "an actor on an unknown stream",
        || {
            chain(|b, _, _| {
                b.actor("lost", StreamIndex(4), ActorKind::Sink);
            })
        },
        "PlanError::UnknownStream",
        &["'lost'", "unknown stream 4", "has 1"],
    );
    c.case(
        "a stream of an unknown device",
        || {
            chain(|b, _, _| {
                b.stream(DeviceIndex(3), StreamKind::Copy);
            })
        },
        "PlanError::UnknownDevice",
        &["stream 1", "unknown device 3"],
    );
    c.case(
        "a device declared twice",
        || {
            chain(|b, _, _| {
                b.device(0, DeviceKind::Cpu, 0);
            })
        },
        "PlanError::DuplicateDevice",
        &["node0/cpu:0", "twice"],
    );
    c.case(
        "two actors with one name",
        || {
            chain(|b, _, _| {
                b.actor("f", StreamIndex(0), copy());
            })
        },
        "PlanError::DuplicateActorName",
        &["'f'"],
    );
    c.case(
        "a register nobody reads",
        || {
            chain(|b, [_, f, _], _| {
                b.regst("f.side", f, 8, 1);
            })
        },
        "PlanError::NoConsumer",
        &["'f.side'", "'f'", "no consumer"],
    );
    c.case(
        "an actor reading one register twice",
        || {
            chain(|b, [_, f, _], [x, _]| {
                b.consume(f, x);
            })
        },
        "PlanError::InconsistentEdge",
        &["'src.out'", "'f'", "2 times"],
    );
    c.case(
        "a source with an input",
        || {
            chain(|b, [src, ..], [_, y]| {
                b.consume(src, y);
            })
        },
        "PlanError",
        &["'src'"],
    );
    c.case(
        "a compute actor with no input",
        || {
            chain(|b, [_, _, sink], _| {
                let lonely = b.actor("lonely", StreamIndex(0), copy());
                let out = b.regst("lonely.out", lonely, 8, 1);
                b.consume(sink, out);
            })
        },
        "PlanError::BadArity",
        &["compute actor 'lonely'", "at least one input"],
    );
    c.case(
        "a sink with an output",
        || {
            chain(|b, [.., sink], _| {
                b.regst("sink.out", sink, 8, 1);
            })
        },
        "PlanError",
        &["sink"],
    );
    c.case(
        "a source with no output",
        || {
            chain(|b, _, _| {
                b.actor("idle", StreamIndex(0), ActorKind::Source { pieces: SourcePieces::Fed });
            })
        },
        "PlanError::BadArity",
        &["source actor 'idle'", "0 outputs"],
    );
    c.case(
        "an acc with count 0",
        || {
            chain(|b, [_, f, _], _| {
                b.plan_mut().actors[f.index()].kind = ActorKind::Acc { count: 0, kernel: KernelConf::SumF32 }
            })
        },
        "PlanError::BadArity",
        &["acc actor 'f'", "count 0"],
    );
    c.case(
        "a repeat with two inputs",
        || {
            chain(|b, [src, f, _], _| {
                b.plan_mut().actors[f.index()].kind = ActorKind::Repeat { count: 2 };
                let extra = b.regst("src.extra", src, 64, 1);
                b.consume(f, extra);
            })
        },
        "PlanError::BadArity",
        &["repeat actor 'f'", "exactly one input", "2 inputs"],
    );
    c.case(
        "a repeat whose output is smaller than its input",
        || {
            chain(|b, [_, f, _], [_, y]| {
                b.plan_mut().actors[f.index()].kind = ActorKind::Repeat { count: 2 };
                b.plan_mut().regst_descs[y.index()].bytes = 8;
            })
        },
        "PlanError::BadArity",
        &["repeat actor 'f'", "64 bytes", "not 8"],
    );
    c.case(
        "a repeat whose output is preloaded",
        || {
            chain(|b, [_, f, _], [_, y]| {
                b.plan_mut().actors[f.index()].kind = ActorKind::Repeat { count: 2 };
                b.plan_mut().regst_descs[y.index()].register_num = 2;
                b.preload(y, 1);
            })
        },
        "PlanError::BadArity",
        &["repeat actor 'f'", "'f.out'", "preload"],
    );
    c.case(
        "a cycle with no preloaded register",
        || {
            chain(|b, [_, f, _], _| {
                let back = b.actor("back", StreamIndex(0), copy());
                let f_loop = b.regst("f.loop", f, 8, 1);
                b.consume(back, f_loop);
                let back_out = b.regst("back.out", back, 8, 1);
                b.consume(f, back_out);
            })
        },
        "PlanError::Cycle",
        &["f -> back -> f", "preload a register"],
    );
    c.case(
        "an actor reading only its own loop",
        || {
            chain(|b, _, _| {
                let spin = b.actor("spin", StreamIndex(0), copy());
                let state = b.regst("spin.state", spin, 8, 2);
                b.preload(state, 1);
                b.consume(spin, state);
            })
        },
        "PlanError::BadArity",
        &["'spin'", "never end"],
    );
    c.case(
        "registers that do not fit the device's memory",
        || {
            chain(|b, _, [x, _]| {
                b.memory_capacity(DeviceIndex(0), 1000);
                b.plan_mut().regst_descs[x.index()].bytes = 4096;
            })
        },
        "PlanError::DoesNotFit",
        &["node0/cpu:0", "1000", "'src.out' (2 x 4096 bytes)"],
    );
    c.case(
        "a register size that overflows",
        || chain(|b, _, [x, _]| b.plan_mut().regst_descs[x.index()].bytes = u64::MAX / 2),
        "PlanError::Memory",
        &["node0/cpu:0", "overflows"],
    );
    c.case(
        "a signature input with no parts",
        || {
            chain(|b, _, _| {
                b.plan_mut().signature.inputs.push(InputSignature { name: "x".into(), meta: meta(&[4]), parts: vec![] })
            })
        },
        "PlanError::BadInput",
        &["input 'x'", "no parts"],
    );
    c.case(
        "a signature input fed to a counted source",
        || {
            chain(|b, [src, ..], _| {
                let m = meta(&[16]);
                let part = regflow::graph::plan::TensorPart { actor: src, region: Region::whole(&m.shape) };
                b.plan_mut().signature.inputs.push(InputSignature { name: "x".into(), meta: m, parts: vec![part] })
            })
        },
        "PlanError::BadInput",
        &["input 'x'", "'src'", "a source of 4 counted pieces", "pieces: fed"],
    );
    c.case(
        "a signature output delivered by a compute actor",
        || {
            chain(|b, [_, f, _], _| {
                b.plan_mut().signature.outputs.push(OutputSignature {
                    name: "fetch:0".into(),
                    meta: meta(&[16]),
                    actor: f,
                })
            })
        },
        "PlanError::BadOutput",
        &["output 'fetch:0'", "'f'", "a compute actor", "sink"],
    );
    c.case(
        "a signature output of the wrong size",
        || {
            chain(|b, [.., sink], _| {
                b.plan_mut().signature.outputs.push(OutputSignature {
                    name: "fetch:0".into(),
                    meta: meta(&[3]),
                    actor: sink,
                })
            })
        },
        "PlanError::BadOutput",
        &["'fetch:0'", "f32[3]", "12 bytes", "'f.out'", "64 bytes"],
    );
    c.case(
        "a signature output of an unknown actor",
        || {
            chain(|b, _, _| {
                b.plan_mut().signature.outputs.push(OutputSignature {
                    name: "fetch:0".into(),
                    meta: meta(&[16]),
                    actor: ActorIndex(40),
                })
            })
        },
        "PlanError::UnknownActor",
        &["output 'fetch:0'", "unknown actor 40"],
    );
    let variable = |regst: RegstDescId, shape: &[usize]| VariableDesc {
        name: "w".into(),
        regst,
        meta: meta(shape),
        init: Init::Zeros,
        region: Region::whole(&shape.to_vec().into()),
        constant: false,
    };
    c.case(
        "a variable in a register without preloaded slots",
        || chain(|b, _, [x, _]| b.plan_mut().variables.push(variable(x, &[16]))),
        "PlanError::BadVariable",
        &["variable 'w'", "'src.out'", "no preloaded slots"],
    );
    c.case(
        "a variable in an unknown register",
        || chain(|b, _, _| b.plan_mut().variables.push(variable(RegstDescId(30), &[16]))),
        "PlanError::UnknownRegstDesc",
        &["variable 'w'", "register descriptor 30"],
    );
    c.case(
        "a schema version this build does not read",
        || chain(|b, _, _| b.plan_mut().schema_version = 1),
        "PlanError::SchemaVersion",
        &["version 1", "reads version 2"],
    );
    c.case(
        "a collective with two members of rank 0",
        || collective(|confs| confs[1].rank = 0),
        "PlanError::Collective",
        &["'grad'", "rank 0"],
    );
    c.case(
        "a collective whose members disagree on the size",
        || collective(|confs| confs[1].size = 3),
        "PlanError::Collective",
        &["'grad'", "all_reduce of 3 on f32[4]", "all_reduce of 2 on f32[4]"],
    );
    c.case(
        "a collective whose members disagree on the op",
        || collective(|confs| confs[1].op = CollectiveOp::AllGather { dim: 0 }),
        "PlanError::Collective",
        &["'grad'"],
    );
    c.case(
        "a collective claiming 2^32 - 1 members",
        || {
            collective(|confs| {
                for conf in confs.iter_mut() {
                    conf.size = u32::MAX;
                }
            })
        },
        "PlanError::Collective",
        &["'grad'", "rank 2 of 4294967295 has no member"],
    );
    c.case(
        "a collective rank out of its group",
        || collective(|confs| confs[1].rank = 5),
        "PlanError::Collective",
        &["'grad'", "5"],
    );
    c.finish();
}
