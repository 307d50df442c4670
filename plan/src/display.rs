//! Human-readable text form of a plan (`println!("{plan}")`).

use super::*;
use std::fmt;

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "plan (schema {})", self.schema_version)?;
        for (d, device) in self.devices.iter().enumerate() {
            writeln!(f, "device {}", device.label())?;
            for (s, stream) in self.streams.iter().enumerate() {
                if stream.device.index() != d {
                    continue;
                }
                writeln!(f, "  stream {s} ({:?})", stream.kind)?;
                for (a, actor) in self.actors.iter().enumerate() {
                    if actor.stream.index() != s {
                        continue;
                    }
                    let inputs: Vec<&str> = actor
                        .inputs
                        .iter()
                        .filter_map(|r| self.regst_descs.get(r.index()))
                        .map(|r| r.name.as_str())
                        .collect();
                    let kind = match &actor.kind {
                        ActorKind::Compute { kernel } => format!("compute {kernel:?}"),
                        ActorKind::Acc { count, kernel } => format!("acc x{count} {kernel:?}"),
                        ActorKind::Repeat { count } => format!("repeat x{count}"),
                        ActorKind::Source { pieces } => format!("source {pieces:?}"),
                        ActorKind::Sink => "sink".to_string(),
                        ActorKind::Discard => "discard".to_string(),
                    };
                    writeln!(f, "    {} [{kind}] <- [{}]", actor.name, inputs.join(", "))?;
                    for r in self.outputs_of(ActorIndex(a as u32)) {
                        let desc = &self.regst_descs[r.index()];
                        writeln!(
                            f,
                            "      -> {}: {} x {} bytes ({}), read by {}",
                            desc.name,
                            desc.register_num,
                            desc.bytes,
                            desc.memory,
                            desc.consumers
                                .iter()
                                .filter_map(|c| self.actors.get(c.index()))
                                .map(|c| c.name.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )?;
                    }
                }
            }
        }
        Ok(())
    }
}
