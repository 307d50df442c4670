//! What `show` and `dot` say about actors and sizes: roles, kind descriptions, byte counts.

use regflow::graph::plan::{ActorDesc, ActorKind, CollectiveConf, KernelConf, SourcePieces};

/// What an actor does, as `show` groups actors and `dot` colors them. A collective or a
/// copy is a compute actor with that kernel, set apart because it is communication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Produces pieces.
    Source,
    /// Runs a kernel that is neither a copy nor a collective.
    Compute,
    /// Runs `KernelConf::Copy`.
    Copy,
    /// Runs one member of a collective (`KernelConf::Collective`).
    Collective,
    /// Accumulates pieces.
    Acc,
    /// Repeats pieces.
    Repeat,
    /// Delivers pieces to the user.
    Sink,
}

impl Role {
    /// Every role, in the order `show` lists them.
    pub(crate) const ALL: [Role; 7] =
        [Role::Source, Role::Compute, Role::Copy, Role::Collective, Role::Acc, Role::Repeat, Role::Sink];

    /// The role of an actor of this kind.
    pub(crate) fn of(kind: &ActorKind) -> Role {
        match kind {
            ActorKind::Source { .. } => Role::Source,
            ActorKind::Compute { kernel: KernelConf::Copy } => Role::Copy,
            ActorKind::Compute { kernel: KernelConf::Collective(_) } => Role::Collective,
            ActorKind::Compute { .. } => Role::Compute,
            ActorKind::Acc { .. } => Role::Acc,
            ActorKind::Repeat { .. } => Role::Repeat,
            ActorKind::Sink | ActorKind::Discard => Role::Sink,
        }
    }

    /// Its name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Role::Source => "source",
            Role::Compute => "compute",
            Role::Copy => "copy",
            Role::Collective => "collective",
            Role::Acc => "acc",
            Role::Repeat => "repeat",
            Role::Sink => "sink",
        }
    }
}

/// The collective an actor runs, if it runs one.
pub(crate) fn collective(actor: &ActorDesc) -> Option<&CollectiveConf> {
    match &actor.kind {
        ActorKind::Compute { kernel: KernelConf::Collective(conf) } => Some(conf),
        _ => None,
    }
}

/// A kernel in a few words; `None` when the actor's name already says it (the compilers
/// name custom kernels after their actors).
fn kernel_text(kernel: &KernelConf, actor_name: &str) -> Option<String> {
    match kernel {
        KernelConf::Noop => Some("noop".into()),
        KernelConf::Copy => Some("copy".into()),
        KernelConf::SumF32 => Some("sum_f32".into()),
        KernelConf::Op(op) if actor_name.starts_with(op.op_type.as_str()) => None,
        // A device's fused optimizer updates: how many parameters it updates.
        KernelConf::Op(op) if op.op_type == "update_group" => match op.attrs["params"].as_u64() {
            Some(params) => Some(format!("update_group of {params} parameters")),
            None => Some(op.op_type.clone()),
        },
        KernelConf::Op(op) => Some(op.op_type.clone()),
        KernelConf::Custom { name } if name == actor_name => None,
        KernelConf::Custom { name } => Some(name.clone()),
        KernelConf::Collective(conf) => Some(conf.op_name().into()),
    }
}

/// The actor's kind in a few words: `source (fed)`, `compute (sum_f32)`, `all_reduce`,
/// `acc x4 (sum_f32)`, ...
pub(crate) fn kind_text(actor: &ActorDesc) -> String {
    let with_kernel = |head: String, kernel: &KernelConf| match kernel_text(kernel, &actor.name) {
        Some(k) => format!("{head} ({k})"),
        None => head,
    };
    match &actor.kind {
        ActorKind::Source { pieces: SourcePieces::Count(count) } => format!("source ({count} pieces)"),
        ActorKind::Source { pieces: SourcePieces::Fed } => "source (fed)".into(),
        ActorKind::Source { pieces: SourcePieces::Custom { count, kernel } } => {
            format!("source ({count} pieces from {kernel})")
        }
        ActorKind::Compute { kernel: KernelConf::Copy } => "copy".into(),
        ActorKind::Compute { kernel: KernelConf::Collective(conf) } => conf.op_name().into(),
        ActorKind::Compute { kernel } => with_kernel("compute".into(), kernel),
        ActorKind::Acc { count, kernel } => with_kernel(format!("acc x{count}"), kernel),
        ActorKind::Repeat { count } => format!("repeat x{count}"),
        ActorKind::Source { pieces: SourcePieces::Dataset(d) } => {
            format!("source ({} pieces from {})", d.pieces, d.path)
        }
        ActorKind::Sink => "sink".into(),
        ActorKind::Discard => "discard".into(),
    }
}

/// `f32[3, 2]`.
pub(crate) fn tensor_text(conf: &CollectiveConf) -> String {
    let dims: Vec<String> = conf.shape.iter().map(usize::to_string).collect();
    format!("{}[{}]", conf.dtype, dims.join(", "))
}

/// Bytes in binary units, one decimal: `48 B`, `1.5 KiB`, `3.0 GiB`.
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Exact bytes, with binary units after them from 1 KiB on: `480 bytes`,
/// `1536 bytes (1.5 KiB)`.
pub(crate) fn exact_bytes(bytes: u64) -> String {
    if bytes < 1024 {
        format!("{bytes} bytes")
    } else {
        format!("{bytes} bytes ({})", human_bytes(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fused_update_says_how_many_parameters_it_updates() {
        let op = |attrs| {
            let conf = regflow::graph::plan::OpConf {
                op_type: "update_group".into(),
                attrs,
                inputs: vec![],
                input_map: vec![],
                outputs: vec![],
            };
            KernelConf::Op(conf)
        };
        let attrs =
            serde_json::json!({"kind": {"Sgd": {"momentum": 0.0, "weight_decay": 0.0}}, "params": 36, "scaled": true});
        assert_eq!(kernel_text(&op(attrs), "adamw_update:245+35").as_deref(), Some("update_group of 36 parameters"));
        assert_eq!(kernel_text(&op(serde_json::Value::Null), "x").as_deref(), Some("update_group"));
    }

    #[test]
    fn bytes_read_in_binary_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
        assert_eq!(exact_bytes(480), "480 bytes");
        assert_eq!(exact_bytes(2048), "2048 bytes (2.0 KiB)");
    }
}
