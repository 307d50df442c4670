//! `regflow plan show`: per device its streams, actors by kind, collectives and peak memory.

use crate::describe::{collective, exact_bytes, kind_text, tensor_text, Role};
use regflow::graph::plan::{ActorIndex, Plan, PlanError, RegstDesc, StreamKind};
use std::fmt::Write;

/// Width of the field-name column.
const FIELD: usize = 12;

/// Appends `  name        first` and then `              rest` for each further line.
fn field(out: &mut String, name: &str, lines: &[String]) {
    for (i, line) in lines.iter().enumerate() {
        let name = if i == 0 { name } else { "" };
        // Writing to a String cannot fail.
        let _ = writeln!(out, "  {name:<FIELD$} {line}");
    }
}

/// `compute`, `comm`, ...
fn stream_kind(kind: StreamKind) -> &'static str {
    match kind {
        StreamKind::Compute => "compute",
        StreamKind::Copy => "copy",
        StreamKind::Comm => "comm",
        StreamKind::Net => "net",
    }
}

/// `"1 actor"`, `"2 actors"`.
fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("{n} {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Actor counts per role, roles with none left out: `source 2, compute 9`.
fn role_counts(roles: &[Role]) -> Vec<(Role, usize)> {
    Role::ALL.iter().map(|&role| (role, roles.iter().filter(|&&r| r == role).count())).filter(|&(_, n)| n > 0).collect()
}

/// The text of `regflow plan show` for a validated plan read from `file`.
pub(crate) fn render(file: &str, plan: &Plan, list_actors: bool) -> Result<String, PlanError> {
    let memory = plan.memory()?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "plan {file} (schema {}): {}, {}, {}, {}",
        plan.schema_version,
        count(plan.devices.len(), "device"),
        count(plan.streams.len(), "stream"),
        count(plan.actors.len(), "actor"),
        count(plan.regst_descs.len(), "register"),
    );
    let device_of = |a: usize| plan.device_of(ActorIndex(a as u32)).index();
    for (d, device) in plan.devices.iter().enumerate() {
        let _ = writeln!(out, "\ndevice {}", device.label());
        if let Some(m) = memory.devices.get(d) {
            let capacity = match device.memory_capacity {
                Some(c) => format!(", capacity {}", exact_bytes(c)),
                None => String::new(),
            };
            field(
                &mut out,
                "peak memory",
                &[format!(
                    "{}: own slots {}, shared region {}{capacity}",
                    exact_bytes(m.total_bytes()),
                    m.layout.total_bytes(),
                    m.shared_bytes
                )],
            );
        }
        let registers: Vec<&RegstDesc> =
            plan.regst_descs.iter().filter(|r| device_of(r.producer.index()) == d).collect();
        let slots: u64 = registers.iter().map(|r| u64::from(r.register_num)).sum();
        field(&mut out, "registers", &[format!("{} ({})", registers.len(), count(slots as usize, "slot"))]);
        // Inputs read through a window: parts of another register read in place.
        let windows: Vec<u64> = plan
            .actors
            .iter()
            .enumerate()
            .filter(|&(a, _)| device_of(a) == d)
            .flat_map(|(_, actor)| actor.windows.iter().map(|w| w.bytes))
            .collect();
        if !windows.is_empty() {
            let bytes = windows.iter().sum::<u64>();
            let line =
                format!("{} read in place, {} not copied per piece", count(windows.len(), "input"), exact_bytes(bytes));
            field(&mut out, "windows", &[line]);
        }

        let streams: Vec<String> = plan
            .streams
            .iter()
            .enumerate()
            .filter(|(_, s)| s.device.index() == d)
            .map(|(s, stream)| {
                let actors = plan.actors.iter().filter(|a| a.stream.index() == s).count();
                let noun = if actors == 1 { "actor" } else { "actors" };
                format!("#{s:<3} {:<8} {actors:>3} {noun}", stream_kind(stream.kind))
            })
            .collect();
        field(&mut out, "streams", &streams);

        let on_device: Vec<usize> = (0..plan.actors.len()).filter(|&a| device_of(a) == d).collect();
        let roles: Vec<Role> = on_device.iter().map(|&a| Role::of(&plan.actors[a].kind)).collect();
        let lines: Vec<String> =
            role_counts(&roles).iter().map(|(role, n)| format!("{:<11}{n:>4}", role.name())).collect();
        if lines.is_empty() {
            field(&mut out, "actors", &["none".into()]);
        } else {
            field(&mut out, "actors", &lines);
        }

        let collectives: Vec<usize> =
            on_device.iter().copied().filter(|&a| collective(&plan.actors[a]).is_some()).collect();
        let confs: Vec<_> =
            collectives.iter().filter_map(|&a| Some((&plan.actors[a], collective(&plan.actors[a])?))).collect();
        let name_width = confs.iter().map(|(actor, _)| actor.name.len()).max().unwrap_or(0);
        let op_width = confs.iter().map(|(_, conf)| conf.op_name().len()).max().unwrap_or(0);
        let group_width = confs.iter().map(|(_, conf)| conf.group.len()).max().unwrap_or(0);
        let lines: Vec<String> = confs
            .iter()
            .map(|(actor, conf)| {
                format!(
                    "{:<name_width$}  {:<op_width$}  group {:<group_width$}  rank {}/{}  {}",
                    actor.name,
                    conf.op_name(),
                    conf.group,
                    conf.rank,
                    conf.size,
                    tensor_text(conf)
                )
            })
            .collect();
        field(&mut out, "collectives", &lines);

        if list_actors {
            list(&mut out, plan, &on_device);
        }
    }

    let _ = writeln!(out, "\ntotal");
    let _ = writeln!(
        out,
        "  {:<FIELD$} {} over {}",
        "peak memory",
        exact_bytes(memory.report().total_bytes()),
        count(plan.devices.len(), "device")
    );
    let slots: u64 = plan.regst_descs.iter().map(|r| u64::from(r.register_num)).sum();
    let _ = writeln!(out, "  {:<FIELD$} {} ({})", "registers", plan.regst_descs.len(), count(slots as usize, "slot"));
    let by_kind =
        |kinds: Vec<(&str, usize)>| kinds.iter().map(|(k, n)| format!("{k} {n}")).collect::<Vec<_>>().join(", ");
    let stream_kinds: Vec<(&str, usize)> = [StreamKind::Compute, StreamKind::Copy, StreamKind::Comm, StreamKind::Net]
        .iter()
        .map(|&k| (stream_kind(k), plan.streams.iter().filter(|s| s.kind == k).count()))
        .filter(|&(_, n)| n > 0)
        .collect();
    let _ = writeln!(out, "  {:<FIELD$} {} ({})", "streams", plan.streams.len(), by_kind(stream_kinds));
    let roles: Vec<Role> = plan.actors.iter().map(|a| Role::of(&a.kind)).collect();
    let role_kinds = role_counts(&roles).into_iter().map(|(r, n)| (r.name(), n)).collect();
    let _ = writeln!(out, "  {:<FIELD$} {} ({})", "actors", plan.actors.len(), by_kind(role_kinds));
    Ok(out)
}

/// Appends every actor of `actors` with its stream, inputs and outputs.
fn list(out: &mut String, plan: &Plan, actors: &[usize]) {
    let names = |ids: &mut dyn Iterator<Item = ActorIndex>| {
        ids.filter_map(|a| plan.actors.get(a.index())).map(|a| a.name.as_str()).collect::<Vec<_>>().join(", ")
    };
    let registers: Vec<(&str, &RegstDesc)> = actors.iter().flat_map(|&a| registers_of(plan, a)).collect();
    let register_width = registers.iter().map(|(_, r)| r.name.len()).max().unwrap_or(0);
    let slots_width = registers.iter().map(|(_, r)| r.register_num.to_string().len()).max().unwrap_or(0);
    let bytes_width = registers.iter().map(|(_, r)| r.bytes.to_string().len()).max().unwrap_or(0);
    let actor_width = actors.iter().map(|&a| plan.actors[a].name.len()).max().unwrap_or(0);
    let kind_width = actors.iter().map(|&a| kind_text(&plan.actors[a]).len()).max().unwrap_or(0);
    let _ = writeln!(out, "  actor list");
    for &a in actors {
        let actor = &plan.actors[a];
        let stream = actor.stream.index();
        let stream_kind = plan.streams.get(stream).map_or("?", |s| stream_kind(s.kind));
        let _ = writeln!(
            out,
            "    {:<actor_width$}  {:<kind_width$}  stream #{stream} {stream_kind}",
            actor.name,
            kind_text(actor)
        );
        for (direction, register) in registers_of(plan, a) {
            let peers = if direction == "in" {
                format!("from {}", names(&mut std::iter::once(register.producer)))
            } else {
                format!("to {}", names(&mut register.consumers.iter().copied()))
            };
            let preloaded =
                if register.preloaded > 0 { format!(" (preloaded {})", register.preloaded) } else { String::new() };
            let shared = match (register.shared_offset, register.aliased_slots, register.within) {
                (Some(offset), _, _) => format!(" (shared region at {offset})"),
                (None, true, _) => match register.home {
                    Some(home) => format!(
                        " (one buffer: held in '{}', once for the process)",
                        plan.regst_descs.get(home.index()).map_or("?", |r| r.name.as_str())
                    ),
                    None => " (one buffer: updated in place)".to_string(),
                },
                (None, false, Some(within)) => format!(
                    " (within '{}' at byte {})",
                    plan.regst_descs.get(within.regst.index()).map_or("?", |r| r.name.as_str()),
                    within.offset
                ),
                (None, false, None) => String::new(),
            };
            let _ = writeln!(
                out,
                "      {direction:<4}{:<register_width$}  {:>slots_width$} x {:>bytes_width$} bytes  {peers}{preloaded}{shared}",
                register.name,
                register.register_num,
                register.bytes
            );
        }
    }
}

/// The registers an actor reads (`in`) and writes (`out`), inputs first in kernel order.
fn registers_of(plan: &Plan, actor: usize) -> Vec<(&'static str, &RegstDesc)> {
    let inputs = plan.actors[actor].inputs.iter().filter_map(|r| plan.regst_descs.get(r.index())).map(|r| ("in", r));
    let outputs = plan.outputs_of(ActorIndex(actor as u32)).map(|r| ("out", &plan.regst_descs[r.index()]));
    inputs.chain(outputs).collect()
}
