//! `regflow plan dot`: the plan as a Graphviz `digraph`, one cluster per device.
//!
//! Nodes are actors (`a<index>`), edges are register descriptors from their producer to
//! each consumer, labelled `×register_num · bytes`. Boxing stands out: collective members
//! are filled orange with their op name, local boxing actors (names starting with `box`)
//! light orange, and registers that cross devices are bold red. Zero-byte registers (order
//! tokens) are dashed gray; preloaded registers (loop state) have a hollow arrowhead, say
//! `preloaded N`, and do not pull the layout backwards. An edge to a reader that reads a
//! window of the register (a device's rows of a replicated tensor, read in place) says
//! which bytes: `reads 2 MiB at +2 MiB`.

use crate::describe::{collective, exact_bytes, human_bytes, kind_text, Role};
use regflow::graph::plan::{ActorIndex, InputWindow, Plan, PlanError, RegstDesc};
use std::fmt::Write;

/// Fill of a collective member.
pub(crate) const COLLECTIVE_FILL: &str = "#f4a261";
/// Fill of a local boxing actor (a slice, a zero fill): the collective's family, lighter.
pub(crate) const LOCAL_BOXING_FILL: &str = "#fde2c6";
/// Color of a register whose producer and consumer are on different devices.
pub(crate) const CROSS_DEVICE_COLOR: &str = "#c1121f";
/// Color of a zero-byte register.
pub(crate) const ZERO_BYTES_COLOR: &str = "#9a9a9a";
/// Color of a preloaded register.
pub(crate) const PRELOADED_COLOR: &str = "#2a9d8f";

/// Escapes a string for a double-quoted DOT string.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => {}
            c => out.push(c),
        }
    }
    out
}

/// A DOT identifier made of the label's letters and digits: `node0/cpu:1` → `node0_cpu_1`.
fn identifier(label: &str) -> String {
    label.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect()
}

/// Node attributes of an actor: its label and, by role, its fill.
fn node(plan: &Plan, a: usize) -> String {
    let actor = &plan.actors[a];
    let role = Role::of(&actor.kind);
    let (kind, fill, extra) = match collective(actor) {
        Some(conf) => (
            format!("{} rank {}/{}", conf.op_name(), conf.rank, conf.size),
            COLLECTIVE_FILL,
            format!(", penwidth=2, tooltip=\"group {}\"", escape(&conf.group)),
        ),
        None => {
            let fill = match role {
                _ if actor.name.starts_with("box") => LOCAL_BOXING_FILL,
                Role::Source => "#d8f3dc",
                Role::Sink => "#dbe9f6",
                Role::Copy => "#eeeeee",
                Role::Acc | Role::Repeat => "#ece4f7",
                Role::Compute | Role::Collective => "#ffffff",
            };
            (kind_text(actor), fill, String::new())
        }
    };
    format!("a{a} [label=\"{}\\n{}\", fillcolor=\"{fill}\"{extra}];", escape(&actor.name), escape(&kind))
}

/// Edge attributes of a register read by one consumer (through `window`, if it has one):
/// count and size, and its style.
fn edge_attributes(register: &RegstDesc, cross_device: bool, window: Option<InputWindow>) -> String {
    let mut label = format!("×{}", register.register_num);
    if register.bytes > 0 {
        let _ = write!(label, " · {}", human_bytes(register.bytes));
    }
    if let Some(window) = window {
        let _ = write!(label, " · reads {} at +{}", human_bytes(window.bytes), human_bytes(window.offset));
    }
    if register.preloaded > 0 {
        let _ = write!(label, " · preloaded {}", register.preloaded);
    }
    let mut attributes =
        vec![format!("label=\"{}\"", escape(&label)), format!("tooltip=\"{}\"", escape(&register.name))];
    let mut color = None;
    if register.bytes == 0 {
        attributes.push("style=dashed".into());
        color = Some(ZERO_BYTES_COLOR);
    }
    if register.preloaded > 0 {
        attributes.push("arrowhead=empty".into());
        attributes.push("constraint=false".into());
        color = color.or(Some(PRELOADED_COLOR));
    }
    if cross_device {
        attributes.push("penwidth=2.5".into());
        color = Some(CROSS_DEVICE_COLOR);
    }
    if let Some(color) = color {
        attributes.push(format!("color=\"{color}\""));
        attributes.push(format!("fontcolor=\"{color}\""));
    }
    attributes.join(", ")
}

/// The Graphviz text of a validated plan.
pub(crate) fn render(plan: &Plan) -> Result<String, PlanError> {
    let memory = plan.memory()?;
    let device_of = |a: ActorIndex| plan.device_of(a).index();
    let mut out = String::new();
    out.push_str("digraph plan {\n");
    out.push_str("  graph [rankdir=TB, fontname=\"Helvetica\", fontsize=12, nodesep=0.3, ranksep=0.4];\n");
    out.push_str("  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10];\n");
    out.push_str("  edge [fontname=\"Helvetica\", fontsize=9];\n");
    for (d, device) in plan.devices.iter().enumerate() {
        let label = device.label();
        let peak = memory.devices.get(d).map_or(0, |m| m.total_bytes());
        let _ = writeln!(out, "  subgraph cluster_{} {{", identifier(&label));
        let _ = writeln!(out, "    label=\"{}\\npeak {}\";", escape(&label), escape(&exact_bytes(peak)));
        out.push_str("    style=\"rounded\"; color=\"#5c677d\";\n");
        for a in (0..plan.actors.len()).filter(|&a| device_of(ActorIndex(a as u32)) == d) {
            let _ = writeln!(out, "    {}", node(plan, a));
        }
        out.push_str("  }\n");
    }
    for (id, register) in plan.regst_descs.iter().enumerate() {
        let producer = register.producer.index();
        for consumer in &register.consumers {
            let cross_device = device_of(register.producer) != device_of(*consumer);
            let reader = &plan.actors[consumer.index()];
            let window = reader.inputs.iter().position(|r| r.index() == id).and_then(|i| reader.window(i));
            let attributes = edge_attributes(register, cross_device, window);
            let _ = writeln!(out, "  a{producer} -> a{} [{attributes}];", consumer.index());
        }
    }
    out.push_str("}\n");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_and_backslashes_are_escaped() {
        assert_eq!(escape(r#"a"b\c"#), r#"a\"b\\c"#);
        assert_eq!(escape("two\nlines"), "two\\nlines");
        assert_eq!(identifier("node0/cpu:1"), "node0_cpu_1");
    }

    #[test]
    fn a_window_is_labelled_on_its_reader_s_edge_only() {
        use regflow::graph::plan::{ActorKind, DeviceKind, KernelConf, PlanBuilder, SourcePieces, StreamKind};
        let mut b = PlanBuilder::new();
        let cpu = b.device(0, DeviceKind::Cpu, 0);
        let s = b.stream(cpu, StreamKind::Compute);
        let src = b.actor("src", s, ActorKind::Source { pieces: SourcePieces::Fed });
        let whole = b.regst("src.out", src, 4096, 1);
        let part = b.actor("part", s, ActorKind::Compute { kernel: KernelConf::Copy });
        b.consume_window(part, whole, 2048, 2048);
        let all = b.actor("all", s, ActorKind::Compute { kernel: KernelConf::Copy });
        b.consume(all, whole);
        for (name, from, bytes) in [("sink_part", part, 2048), ("sink_all", all, 4096)] {
            let r = b.regst(&format!("{name}.in"), from, bytes, 1);
            let sink = b.actor(name, s, ActorKind::Sink);
            b.consume(sink, r);
        }
        let dot = render(&b.build().unwrap()).unwrap();
        let edge = |to: usize| dot.lines().find(|l| l.starts_with(&format!("  a0 -> a{to} "))).unwrap().to_string();
        assert!(edge(1).contains("×1 · 4.0 KiB · reads 2.0 KiB at +2.0 KiB"), "{}", edge(1));
        assert!(!edge(2).contains("reads"), "{}", edge(2));
    }
}
