//! Optimizer updates written in place: where the compiler fixes a cpu device's order, each
//! parameter's and optimizer state's loop register is one buffer (`aliased_slots`) that its
//! update overwrites, so a plan holds each of them once instead of twice and trains to the
//! same bits as with two buffers.

use regflow::graph::plan::{ActorKind, KernelConf, Plan, PlanError, RegstDescId};
use regflow::graph::{CompileOptions, CompiledGraph, Graph, HostArray, Optimizer, ParallelOptions};

use crate::tiny_mlp;
use tiny_mlp::model;

/// Losses (as bits) and final state of `steps` steps of `plan`, on one thread.
fn train(compiled: &CompiledGraph, plan: Plan, steps: u64) -> (Vec<u64>, Vec<(String, HostArray)>) {
    tiny_mlp::train(compiled, plan, 1, steps, 1)
}

/// The plan with every register's slots separate again (and no register within or held in
/// another).
fn two_buffers(plan: &Plan) -> Plan {
    let mut plan = plan.clone();
    for desc in &mut plan.regst_descs {
        desc.aliased_slots = false;
        desc.within = None;
        desc.home = None;
    }
    plan.validate().unwrap();
    plan
}

/// Names of the variables (device parts) whose register is one buffer, sorted.
fn aliased_variables(plan: &Plan) -> Vec<String> {
    let mut names: Vec<String> = plan
        .variables
        .iter()
        .filter(|v| plan.regst_descs[v.regst.index()].aliased_slots)
        .map(|v| v.name.clone())
        .collect();
    names.sort();
    names
}

fn bytes_of(plan: &Plan) -> u64 {
    plan.memory().unwrap().report().total_bytes()
}

#[test]
fn updates_write_in_place_hold_each_variable_once_and_change_no_bit() {
    for (optimizer, states) in [
        (Optimizer::adamw(5e-2, 1e-2).with_clip_norm(0.5), &["adam_m", "adam_v"][..]),
        (Optimizer::sgd(0.1, 0.9, 1e-3), &["velocity"][..]),
    ] {
        let g = Graph::new();
        let (train_step, _) = model(&g, &optimizer);
        let compiled = g.compile(&[train_step.loss], &train_step.updates, &CompileOptions::default()).unwrap();
        let plan = &compiled.plan;
        // Every parameter and state, not the step counter (an `assign` copy writes its loop:
        // the schedule reads the new value in the same step).
        let mut want: Vec<String> = ["b0", "w0", "w1"]
            .iter()
            .flat_map(|p| std::iter::once(p.to_string()).chain(states.iter().map(move |s| format!("{p}.{s}"))))
            .collect();
        want.sort();
        assert_eq!(aliased_variables(plan), want);

        // One slot's bytes less per aliased register (slots are 64-byte aligned).
        let saved: u64 = plan
            .regst_descs
            .iter()
            .filter(|d| d.aliased_slots)
            .map(|d| d.bytes.next_multiple_of(64) * u64::from(d.register_num - 1))
            .sum();
        let separate = two_buffers(plan);
        assert_eq!(bytes_of(&separate) - bytes_of(plan), saved);
        assert!(saved >= 2 * 4 * (12 * 16 + 16 + 16 * 5), "{saved}");

        let (losses, state) = train(&compiled, plan.clone(), 7);
        let (want_losses, want_state) = train(&compiled, separate, 7);
        assert_eq!(losses, want_losses, "losses, bit for bit");
        assert_eq!(state, want_state, "weights and optimizer state, bit for bit");
        assert_eq!(state.len(), want.len() + 1);
    }
}

/// Gradient accumulation: each micro-batch reads the step's weights through a repeat
/// actor, which hands the loop register's bytes on without copying. With the updates
/// fused into one group, every such read feeds a gradient the group waits for, so every
/// parameter and state is one buffer, and training changes no bit. With one update per
/// parameter and no clipping, `w1`'s update waits only for `w1`'s gradient, not for the
/// last micro-batch's `dy · w1ᵀ` (which feeds `w0`'s): `w1` keeps two buffers, and a plan
/// file that aliases it anyway is refused, naming that product. With clipping every
/// update waits for the norm of all gradients, `w0`'s included, so `w1` qualifies again.
#[test]
fn micro_batches_update_in_place_where_every_read_feeds_the_update() {
    let every: Vec<String> = {
        let mut names: Vec<String> = ["b0", "w0", "w1"]
            .iter()
            .flat_map(|p| [p.to_string(), format!("{p}.adam_m"), format!("{p}.adam_v")])
            .collect();
        names.sort();
        names
    };
    let cases = [(2, true, true), (3, true, false), (2, false, true), (3, false, false), (2, false, false)];
    for (micro_batches, fuse_updates, clip) in cases {
        let optimizer = match clip {
            true => Optimizer::adamw(5e-2, 1e-2).with_clip_norm(0.5),
            false => Optimizer::adamw(5e-2, 1e-2),
        };
        let g = Graph::new();
        let (train_step, _) = model(&g, &optimizer);
        let options = CompileOptions {
            accumulate: Some(train_step.accumulate(micro_batches)),
            fuse_updates,
            ..CompileOptions::default()
        };
        let compiled = g.compile(&[train_step.loss], &train_step.updates, &options).unwrap();
        let aliased = aliased_variables(&compiled.plan);
        let want: Vec<String> = match fuse_updates || clip {
            true => every.clone(),
            false => every.iter().filter(|n| *n != "w1").cloned().collect(),
        };
        assert_eq!(aliased, want, "{micro_batches} micro-batches, fused updates {fuse_updates}, clipping {clip}");
        let steps = 4;
        let pieces = u64::from(micro_batches);
        let (losses, state) = tiny_mlp::train(&compiled, compiled.plan.clone(), 1, steps, pieces);
        let (want_losses, want_state) = tiny_mlp::train(&compiled, two_buffers(&compiled.plan), 1, steps, pieces);
        assert_eq!(losses, want_losses, "losses, bit for bit");
        assert_eq!(state, want_state, "weights and optimizer state, bit for bit");
        assert!(bytes_of(&compiled.plan) < bytes_of(&two_buffers(&compiled.plan)));

        if !fuse_updates && !clip {
            let mut plan = compiled.plan.clone();
            let w1 = plan.variables.iter().find(|v| v.name == "w1").unwrap().regst;
            plan.regst_descs[w1.index()].aliased_slots = true;
            let text = plan.validate().unwrap_err().to_string();
            // The product reads `w1` through the repeat's register; nothing else names it.
            let reader = plan
                .actors
                .iter()
                .find(|a| {
                    let reads_repeat = a.inputs.iter().any(|r| {
                        let producer = &plan.actors[plan.regst_descs[r.index()].producer.index()];
                        matches!(producer.kind, ActorKind::Repeat { .. }) && producer.inputs.first() == Some(&w1)
                    });
                    reads_repeat && text.contains(&format!("reader '{}'", a.name))
                })
                .map(|a| a.name.clone());
            assert!(reader.is_some_and(|r| r.starts_with("matmul")), "{text}");
        }
    }
}

#[test]
fn cuda_devices_update_in_place_and_sim_devices_do_not() {
    use regflow::graph::plan::DeviceKind;
    let g = Graph::new();
    let (train_step, _) = model(&g, &Optimizer::adamw(5e-2, 0.0));
    let on = |device| {
        let options = CompileOptions { device, ..CompileOptions::default() };
        aliased_variables(&g.compile(&[train_step.loss], &train_step.updates, &options).unwrap().plan)
    };
    // A cuda stream runs its kernels in launch order, and the update's kernel reads each
    // element before it writes it (`cuda/src/kernels/optim.cu`). Compiled without a GPU;
    // `tests/cuda_training.rs` runs these plans on a GPU, or dry.
    assert_eq!(on(DeviceKind::Cuda), on(DeviceKind::Cpu));
    assert_eq!(on(DeviceKind::Cuda).len(), 9);
    assert_eq!(on(DeviceKind::Sim), Vec::<String>::new());
}

#[test]
fn a_skipped_step_leaves_the_buffer_as_it_was() {
    // A fixed loss scale of 2^120 overflows every f32 gradient: every update is skipped.
    let optimizer = Optimizer::adamw(5e-2, 0.0).with_loss_scale(regflow::graph::LossScale::fixed(2f64.powi(120)));
    let g = Graph::new();
    let (train_step, _) = model(&g, &optimizer);
    let compiled = g.compile(&[train_step.loss], &train_step.updates, &CompileOptions::default()).unwrap();
    assert!(aliased_variables(&compiled.plan).contains(&"w0".to_string()));
    let (_, state) = train(&compiled, compiled.plan.clone(), 3);
    let (_, fresh) = train(&compiled, compiled.plan.clone(), 0);
    for ((name, value), (_, initial)) in state.iter().zip(&fresh) {
        if !name.starts_with("loss_scale") {
            assert_eq!(value, initial, "{name} after three skipped steps");
        }
    }
}

#[test]
fn registers_others_read_outside_the_order_keep_two_buffers() {
    let optimizer = Optimizer::adamw(5e-2, 0.0);
    // A fetched weight: its sink reads the loop register whenever it runs.
    let g = Graph::new();
    let (train_step, w0) = model(&g, &optimizer);
    let compiled = g.compile(&[train_step.loss, w0], &train_step.updates, &CompileOptions::default()).unwrap();
    let aliased = aliased_variables(&compiled.plan);
    assert!(!aliased.contains(&"w0".to_string()), "{aliased:?}");
    assert!(aliased.contains(&"w0.adam_m".to_string()) && aliased.contains(&"w1".to_string()), "{aliased:?}");
    let (losses, state) = train(&compiled, compiled.plan.clone(), 4);
    assert_eq!((losses, state), train(&compiled, two_buffers(&compiled.plan), 4));

    // Micro-batches with a fetched weight: the sink reads the weight's loop register, so
    // it keeps two buffers there too (`micro_batches_update_in_place_where_every_read_feeds_the_update`).
    let options = CompileOptions { accumulate: Some(train_step.accumulate(2)), ..CompileOptions::default() };
    let compiled = g.compile(&[train_step.loss, w0], &train_step.updates, &options).unwrap();
    let aliased = aliased_variables(&compiled.plan);
    assert!(!aliased.contains(&"w0".to_string()) && aliased.contains(&"w1".to_string()), "{aliased:?}");

    // Sharded AdamW state on two devices: the moments are updated in place, and so are the
    // weights, gathered in place (`sharded_weights_are_gathered_in_place`).
    let compiled = sharded(&Graph::new(), &optimizer);
    let aliased = aliased_variables(&compiled.plan);
    for device in 0..2 {
        assert!(aliased.contains(&format!("w0.adam_m@{device}")), "{aliased:?}");
        assert!(aliased.contains(&format!("w0@{device}")), "{aliased:?}");
    }
}

/// The tiny MLP data-parallel over two cpu devices with its optimizer state `S(0)`.
fn sharded(g: &Graph, optimizer: &Optimizer) -> CompiledGraph {
    sharded_fetching(g, optimizer, false)
}

/// [`sharded`], fetching `w0` too where `fetch_w0`.
fn sharded_fetching(g: &Graph, optimizer: &Optimizer, fetch_w0: bool) -> CompiledGraph {
    let (train_step, w0) = model(g, optimizer);
    let mesh = tiny_mlp::two_devices(g, &train_step, true);
    // Without buckets: this model's weights are small enough to be gathered in one ZeRO
    // bucket, through buffers of the bucket's own; these tests are about one gather each.
    let options = ParallelOptions { bucket_bytes: 0, ..ParallelOptions::new(mesh).train(&train_step) };
    let fetches = if fetch_w0 { vec![train_step.loss, w0] } else { vec![train_step.loss] };
    g.compile_parallel(&fetches, &train_step.updates, &options).unwrap()
}

#[test]
fn sharded_weights_are_gathered_in_place() {
    let g = Graph::new();
    let compiled = sharded(&g, &Optimizer::adamw(5e-2, 1e-2));
    let plan = &compiled.plan;
    // Every weight's part, on each device, is written by its update where it lies in the
    // gathered weight: the register the all-gather reads is within the one it writes, at
    // the device's own rows. A part at an offset that is no multiple of 64 bytes is cut out
    // by a `take_part` copy instead of read through a window, and then the weight keeps a
    // part of its own on every device (a group gathers in place on all members or none).
    let mut gathered = Vec::new();
    let mut windowed_on: std::collections::BTreeMap<String, Vec<bool>> = Default::default();
    for variable in plan.variables.iter().filter(|v| !v.name.contains('.') && v.name != "optimizer.step") {
        let target = variable.regst;
        let desc = &plan.regst_descs[target.index()];
        let ActorKind::Compute { kernel: KernelConf::Collective(conf) } = &plan.actors[desc.producer.index()].kind
        else {
            continue;
        };
        let gather = &plan.actors[desc.producer.index()];
        let part = &plan.regst_descs[gather.inputs[0].index()];
        let update = &plan.actors[part.producer.index()];
        let windowed = update
            .inputs
            .iter()
            .position(|&i| i == target)
            .is_some_and(|k| update.windows.iter().any(|w| w.input as usize == k));
        let weight = variable.name.split('@').next().unwrap().to_string();
        windowed_on.entry(weight).or_default().push(windowed);
        let Some(within) = part.within else {
            assert!(!desc.aliased_slots, "{}: two slots when its part has its own", variable.name);
            continue;
        };
        assert_eq!(within.regst, target);
        let rows = conf.shape[0];
        let row_bytes = desc.bytes / rows as u64;
        let own = regflow::graph::plan::part_range(rows, 2, conf.rank as usize);
        assert_eq!((within.offset, part.bytes), (own.start as u64 * row_bytes, own.len() as u64 * row_bytes));
        assert!(desc.aliased_slots);
        gathered.push(variable.name.clone());
    }
    gathered.sort();
    let want: Vec<String> = windowed_on
        .iter()
        .filter(|(_, on)| on.iter().all(|&w| w))
        .flat_map(|(weight, on)| (0..on.len()).map(move |d| format!("{weight}@{d}")))
        .collect();
    assert_eq!(gathered, want);
    assert_eq!(gathered, ["w0@0", "w0@1"]);
    assert_eq!(windowed_on["b0"], [true, false], "b0's part on device 1 is copied out: {windowed_on:?}");

    // The gathered weight is held once for the process: device 1's is device 0's buffer,
    // where each device's update writes its part.
    let w0 = |d: usize| plan.variables.iter().find(|v| v.name == format!("w0@{d}")).unwrap().regst;
    assert_eq!(plan.regst_descs[w0(1).index()].home, Some(w0(0)));
    let homes: Vec<&str> = plan.regst_descs.iter().filter(|d| d.home.is_some()).map(|d| d.name.as_str()).collect();
    assert_eq!(homes, [plan.regst_descs[w0(1).index()].name.as_str()]);
    let memory = plan.memory().unwrap();
    assert_eq!(memory.slot(w0(1), 0), memory.slot(w0(0), 0), "one buffer");

    // Each weight once instead of twice (and once for both devices), and no bytes for its
    // updated part.
    let separate = two_buffers(plan);
    let saved: u64 = plan
        .regst_descs
        .iter()
        .filter(|d| d.aliased_slots)
        .map(|d| d.bytes.next_multiple_of(64) * u64::from(d.register_num - 1))
        .chain(plan.regst_descs.iter().filter(|d| d.within.is_some()).map(|d| d.bytes.next_multiple_of(64)))
        .chain(plan.regst_descs.iter().filter(|d| d.home.is_some()).map(|d| d.bytes.next_multiple_of(64)))
        .sum();
    assert_eq!(bytes_of(&separate) - bytes_of(plan), saved);
    // Held apart again (each device's weight its own buffer, gathered in place), too.
    let mut apart = plan.clone();
    for desc in &mut apart.regst_descs {
        desc.home = None;
    }
    apart.validate().unwrap();
    assert_eq!(bytes_of(&apart) - bytes_of(plan), plan.regst_descs[w0(1).index()].bytes.next_multiple_of(64));

    // The same bits as with a part of its own and two slots, step after step.
    let (losses, state) = train(&compiled, plan.clone(), 6);
    let (want_losses, want_state) = train(&compiled, separate, 6);
    assert_eq!(losses, want_losses, "losses, bit for bit");
    assert_eq!(state, want_state, "weights and optimizer state, bit for bit");
    assert_eq!(train(&compiled, apart, 6), (want_losses, want_state), "held apart, bit for bit");
}

#[test]
fn a_plan_file_cannot_place_a_register_within_another_unsafely() {
    let g = Graph::new();
    let compiled = sharded(&g, &Optimizer::adamw(5e-2, 0.0));
    let view = |plan: &Plan| {
        let r = plan.regst_descs.iter().position(|d| d.within.is_some()).unwrap();
        (
            r,
            plan.regst_descs[r].name.clone(),
            plan.regst_descs[plan.regst_descs[r].within.unwrap().regst.index()].name.clone(),
        )
    };
    // At another offset than the all-gather's own part.
    let mut plan = compiled.plan.clone();
    let (r, name, target) = view(&plan);
    let within = plan.regst_descs[r].within.as_mut().unwrap();
    within.offset += 4;
    let err = plan.validate().unwrap_err();
    assert!(matches!(err, PlanError::Within { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.starts_with(&format!("register '{name}' lies within register '{target}', but it is bytes 4..")),
        "{text}"
    );
    assert!(text.contains("puts its own part at bytes 0.."), "{text}");
    // Through a plan file too.
    assert!(Plan::from_json(&serde_json::to_string(&plan).unwrap()).is_err());

    // Within a register whose slots are two buffers.
    let mut plan = compiled.plan.clone();
    let (r, name, target) = view(&plan);
    let target_index = plan.regst_descs[r].within.unwrap().regst.index();
    plan.regst_descs[target_index].aliased_slots = false;
    assert_eq!(
        plan.validate().unwrap_err().to_string(),
        format!("register '{name}' lies within register '{target}', but that register's slots are not one buffer of its own")
    );

    // Past the end of a register (the memory plan's own check), and a register that is not there.
    let mut plan = compiled.plan.clone();
    let (r, _, _) = view(&plan);
    plan.regst_descs[r].within.as_mut().unwrap().regst = RegstDescId(100_000);
    let text = plan.validate().unwrap_err().to_string();
    assert!(
        text.contains("within register '#100000'")
            && text.ends_with(&format!("the plan has {} registers", plan.regst_descs.len())),
        "{text}"
    );

    // A reader of the weight that nothing orders before the update (a fetched weight's
    // sink): the compiler keeps that weight's part of its own and two slots, and a plan
    // file that puts it within anyway is refused, naming the reader.
    let fetched = sharded_fetching(&Graph::new(), &Optimizer::adamw(5e-2, 0.0), true);
    let mut plan = fetched.plan.clone();
    let w0_register = plan.variables.iter().find(|v| v.name == "w0@0").unwrap().regst;
    let aliased = aliased_variables(&plan);
    assert!(!aliased.contains(&"w0@0".to_string()) && aliased.contains(&"w0.adam_m@0".to_string()), "{aliased:?}");
    let gather = &plan.actors[plan.regst_descs[w0_register.index()].producer.index()];
    let part = gather.inputs[0];
    assert_eq!(plan.regst_descs[part.index()].within, None);
    let reader = plan.regst_descs[w0_register.index()]
        .consumers
        .iter()
        .map(|c| plan.actors[c.index()].name.clone())
        .find(|n| n.starts_with("fetch"))
        .unwrap();
    plan.regst_descs[w0_register.index()].aliased_slots = true;
    plan.regst_descs[part.index()].within = Some(regflow::graph::plan::Within { regst: w0_register, offset: 0 });
    let text = plan.validate().unwrap_err().to_string();
    assert!(
        text.contains(&format!(
            "nothing makes its reader '{reader}' read a piece before the op that writes this part in place,"
        )),
        "{text}"
    );
}

#[test]
fn a_plan_file_cannot_alias_a_register_its_producer_does_not_update_in_place() {
    let g = Graph::new();
    let (train_step, _) = model(&g, &Optimizer::adamw(5e-2, 0.0));
    let compiled = g.compile(&[train_step.loss], &train_step.updates, &CompileOptions::default()).unwrap();
    let mut plan = compiled.plan.clone();
    let matmul = plan
        .regst_descs
        .iter()
        .position(|d| {
            let actor = &plan.actors[d.producer.index()];
            matches!(&actor.kind, ActorKind::Compute { kernel: KernelConf::Op(conf) } if conf.op_type == "matmul")
        })
        .unwrap();
    plan.regst_descs[matmul].aliased_slots = true;
    plan.regst_descs[matmul].shared_offset = None;
    let name = plan.regst_descs[matmul].name.clone();
    let producer = plan.actors[plan.regst_descs[matmul].producer.index()].name.clone();
    let err = plan.validate().unwrap_err();
    assert!(matches!(err, PlanError::AliasedSlots { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        format!(
            "register '{name}' has aliased slots (one buffer for all), but its producer '{producer}' (op 'matmul') does \
             not read it as the input it writes in place (that op writes nothing in place)"
        )
    );
    // The same through a plan file.
    let json = serde_json::to_string(&plan).unwrap();
    assert!(Plan::from_json(&json).is_err());
    // A register some reader may read after the update wrote over it: the sink of a
    // fetched weight (nothing orders it before the update).
    let g = Graph::new();
    let (train_step, w0) = model(&g, &Optimizer::adamw(5e-2, 0.0));
    let fetched = g.compile(&[train_step.loss, w0], &train_step.updates, &CompileOptions::default()).unwrap();
    let mut plan = fetched.plan.clone();
    let w0_register = plan.variables.iter().find(|v| v.name == "w0").unwrap().regst;
    plan.regst_descs[w0_register.index()].aliased_slots = true;
    let producer = plan.actors[plan.regst_descs[w0_register.index()].producer.index()].name.clone();
    let name = plan.regst_descs[w0_register.index()].name.clone();
    assert_eq!(
        plan.validate().unwrap_err().to_string(),
        format!(
            "register '{name}' has aliased slots (one buffer for all), but nothing makes its reader 'fetch:1' read a piece \
             before its producer '{producer}' writes the next over it (the reader must run on the stream of '{producer}' and \
             reach it through registers that are not preloaded)"
        )
    );
    // And a register aliased where it is also shared.
    let mut plan = compiled.plan.clone();
    let update = plan.regst_descs.iter().position(|d| d.aliased_slots).map(|r| RegstDescId(r as u32)).unwrap();
    plan.regst_descs[update.index()].shared_offset = Some(0);
    let err = plan.validate().unwrap_err().to_string();
    assert!(err.ends_with("but it also shares memory with other registers"), "{err}");
}

/// Every `within` a plan file could say, at the edges: only the compiler's own placement
/// validates; everything else is an error (never a panic), and the memory plan alone
/// (what a tool may call without validating) answers too.
#[test]
fn within_at_any_offset_or_register_is_checked() {
    let g = Graph::new();
    let compiled = sharded(&g, &Optimizer::adamw(5e-2, 0.0));
    let plan = &compiled.plan;
    let view = plan.regst_descs.iter().position(|d| d.within.is_some()).unwrap();
    let right = plan.regst_descs[view].within.unwrap();
    let count = plan.regst_descs.len() as u32;
    let registers = [0, view as u32, right.regst.0, right.regst.0 + 1, count - 1, count, u32::MAX];
    let target_bytes = plan.regst_descs[right.regst.index()].bytes;
    let offsets = [0, 1, 4, 63, 64, right.offset, right.offset + 4, target_bytes, u64::MAX - 3, u64::MAX];
    for regst in registers {
        for offset in offsets {
            let mut edited = plan.clone();
            let within = regflow::graph::plan::Within { regst: RegstDescId(regst), offset };
            edited.regst_descs[view].within = Some(within);
            let valid = edited.validate();
            assert_eq!(valid.is_ok(), within == right, "{within:?}: {valid:?}");
            if let Err(e) = valid {
                assert!(matches!(e, PlanError::Within { .. }), "{within:?}: {e:?}");
            }
            let _ = edited.memory();
        }
    }
}

/// What a plan file may say of a weight held once for the process (`RegstDesc::home`):
/// only the compiler's own homes validate, each error names the registers (and, for a
/// reader nothing orders, that reader, its device and the update that would write over
/// it), and nothing panics.
#[test]
fn a_plan_file_cannot_hold_a_weight_once_unsafely() {
    use regflow::graph::plan::{ActorDesc, ActorIndex};
    let compiled = sharded(&Graph::new(), &Optimizer::adamw(5e-2, 0.0));
    let plan = &compiled.plan;
    let variable = |name: &str| plan.variables.iter().find(|v| v.name == name).unwrap().regst;
    let (w0_0, w0_1, w1_1) = (variable("w0@0"), variable("w0@1"), variable("w1@1"));
    let name = |r: RegstDescId| plan.regst_descs[r.index()].name.clone();
    let json = serde_json::to_string(plan).unwrap();
    assert!(json.contains(&format!("\"home\":{}", w0_0.0)), "a plan file says it");
    assert_eq!(Plan::from_json(&json).unwrap().regst_descs[w0_1.index()].home, Some(w0_0));

    let refused = |edit: &dyn Fn(&mut Plan)| {
        let mut edited = plan.clone();
        edit(&mut edited);
        let _ = edited.memory();
        let err = edited.validate().unwrap_err();
        assert!(Plan::from_json(&serde_json::to_string(&edited).unwrap()).is_err());
        err.to_string()
    };
    let held = format!("register '{}' is held in the buffer of register", name(w0_1));
    // Itself, nothing, a register of another all-gather, one not gathered in place.
    let text = refused(&|p: &mut Plan| p.regst_descs[w0_1.index()].home = Some(w0_1));
    assert!(text.starts_with(&held) && text.ends_with("it is this one, or held elsewhere itself"), "{text}");
    let text = refused(&|p: &mut Plan| p.regst_descs[w0_1.index()].home = Some(RegstDescId(u32::MAX)));
    assert!(
        text.contains("'#4294967295'") && text.ends_with(&format!("the plan has {} registers", plan.regst_descs.len())),
        "{text}"
    );
    let w1_0 = variable("w1@0");
    let text = refused(&|p: &mut Plan| p.regst_descs[w0_1.index()].home = Some(w1_0));
    assert!(text.contains("only the outputs of one all-gather along dimension 0 share a buffer"), "{text}");
    let text = refused(&|p: &mut Plan| p.regst_descs[w1_1.index()].home = Some(w1_0));
    assert!(text.ends_with("is not gathered in place (its all-gather's own part does not lie within it)"), "{text}");

    // A reader of device 1's weight that runs before device 1's update but that no
    // collective orders before device 0's: device 0 could write its rows while it reads.
    let text = refused(&|p: &mut Plan| {
        let guest = &p.regst_descs[w0_1.index()];
        let gather = &p.actors[guest.producer.index()];
        let update_1 = p.regst_descs[gather.inputs[0].index()].producer;
        let stream = p.actors[update_1.index()].stream;
        let reader = ActorIndex(p.actors.len() as u32);
        p.actors.push(ActorDesc {
            name: "late_reader".into(),
            stream,
            kind: ActorKind::Compute { kernel: KernelConf::Noop },
            inputs: vec![w0_1],
            sim_nanos: None,
            windows: Vec::new(),
        });
        p.regst_descs[w0_1.index()].consumers.push(reader);
        // A zero-byte token from the reader to device 1's update.
        let mut token = p.regst_descs[w0_1.index()].clone();
        (token.name, token.producer, token.consumers) = ("late_reader.token".into(), reader, vec![update_1]);
        (token.register_num, token.bytes, token.preloaded) = (1, 0, 0);
        (token.aliased_slots, token.within, token.home, token.shared_offset) = (false, None, None, None);
        p.regst_descs.push(token);
        p.actors[update_1.index()].inputs.push(RegstDescId(p.regst_descs.len() as u32 - 1));
    });
    let gather_0 = &plan.actors[plan.regst_descs[w0_0.index()].producer.index()];
    let update_0 = &plan.actors[plan.regst_descs[gather_0.inputs[0].index()].producer.index()].name;
    assert!(
        text.contains(&format!(
            "nothing makes 'late_reader' on node0/cpu:1, which reads '{}' (the same bytes, held once for the process), \
             read them before '{update_0}' on node0/cpu:0 writes over them",
            name(w0_1)
        )),
        "{text}"
    );
}
