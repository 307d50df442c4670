//! The serializable plan types.

use crate::{DatasetConf, Signature, VariableDesc};
use regflow_memory::MemoryKind;
use serde::{Deserialize, Serialize};

/// Most consumers one register descriptor may have (a bound on the per-slot table of who
/// still holds a slot, which is allocated once per plan).
pub const MAX_CONSUMERS: usize = 65_536;

/// Most slots one register descriptor may have: the job sizes each stream's inbox and each
/// register's slot tables from the slot counts, once per plan, so a count from a file must
/// stay far from what would exhaust memory.
pub const MAX_REGISTER_NUM: u32 = 65_536;

/// Schema version written into every plan file; loading any other version is an error.
pub const PLAN_SCHEMA_VERSION: u32 = 2;

macro_rules! index_type {
    ($(#[$doc:meta])* $name:ident, $prefix:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u32);

        impl $name {
            /// The index as a `usize`, for indexing the plan's vectors.
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

index_type!(
    /// Index of a device in [`Plan::devices`].
    DeviceIndex,
    "device#"
);
index_type!(
    /// Index of a stream in [`Plan::streams`].
    StreamIndex,
    "stream#"
);
index_type!(
    /// Index of an actor in [`Plan::actors`].
    ActorIndex,
    "actor#"
);
index_type!(
    /// Index of a register descriptor in [`Plan::regst_descs`].
    RegstDescId,
    "regst#"
);

/// A physical plan: everything the runtime needs to run a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Must equal [`PLAN_SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Devices, on any node.
    pub devices: Vec<DeviceDesc>,
    /// Streams; each runs on one OS thread of its device's node.
    pub streams: Vec<StreamDesc>,
    /// Actors; each is bound to one stream.
    pub actors: Vec<ActorDesc>,
    /// Register descriptors; each has one producing actor.
    pub regst_descs: Vec<RegstDesc>,
    /// The typed inputs a user feeds and outputs a user fetches (empty for hand-built
    /// plans, which are fed and fetched by actor name).
    #[serde(default)]
    pub signature: Signature,
    /// Loop registers' first values, as initializers (a plan file carries no weights).
    #[serde(default)]
    pub variables: Vec<VariableDesc>,
    /// Anomaly checking: after every op kernel, the job scans its floating-point outputs
    /// and stops at the first NaN or infinity, naming the op, the step and the device.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub check_finite: bool,
}

/// The kind of a device and what its backend needs to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceKind {
    /// Host CPU: kernels run synchronously on the stream thread.
    Cpu,
    /// Simulated device: kernels compute on the host but complete after a modeled duration.
    Sim,
    /// An NVIDIA GPU. Plans may name it; a runtime without a CUDA backend refuses such a
    /// plan when the job is built, naming the device.
    Cuda,
}

impl DeviceKind {
    /// Short name used in labels such as `cpu:0`.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Sim => "sim",
            DeviceKind::Cuda => "cuda",
        }
    }
}

/// One device of one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceDesc {
    /// Node (process / machine) that owns the device.
    pub node: u16,
    /// Backend kind.
    pub kind: DeviceKind,
    /// Index among the node's devices of this kind (`cpu:0`, `cpu:1`, …).
    pub index: u16,
    /// Bytes the device can give this plan; `None` means unbounded (host memory).
    #[serde(default)]
    pub memory_capacity: Option<u64>,
}

impl DeviceDesc {
    /// Label such as `node0/sim:1`.
    pub fn label(&self) -> String {
        format!("node{}/{}:{}", self.node, self.kind.name(), self.index)
    }
}

/// What a stream is for; several streams per device let compute and copies overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamKind {
    /// Kernels.
    Compute,
    /// Host↔device copies.
    Copy,
    /// Collectives.
    Comm,
    /// Network send/recv.
    Net,
}

/// One stream of one device: one OS thread at run time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamDesc {
    /// Device the stream belongs to.
    pub device: DeviceIndex,
    /// What the stream is for.
    pub kind: StreamKind,
}

/// How a source actor gets its pieces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SourcePieces {
    /// Produces this many pieces, each tagged with its piece number, then ends.
    Count(u64),
    /// Produces one piece per buffer the user pushes, and ends when the user closes it.
    Fed,
    /// Produces `count` pieces with a kernel the embedding program registers under
    /// `kernel` (a dataset reader, a generator), then ends.
    Custom {
        /// Pieces to produce.
        count: u64,
        /// Registered kernel name.
        kernel: String,
    },
    /// Produces the batches of a dataset file the plan names.
    Dataset(DatasetConf),
}

impl SourcePieces {
    /// How many pieces the source produces (`None`: as many as are fed).
    pub fn count(&self) -> Option<u64> {
        match self {
            SourcePieces::Count(n) | SourcePieces::Custom { count: n, .. } => Some(*n),
            SourcePieces::Dataset(d) => Some(d.pieces),
            SourcePieces::Fed => None,
        }
    }
}

/// Which kernel a compute (or acc) actor runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelConf {
    /// Does nothing.
    Noop,
    /// Copies input 0 into every output (up to the shorter length).
    Copy,
    /// Elementwise f32 sum of all inputs into every output. In an acc actor: the sum over
    /// the pieces of a group.
    SumF32,
    /// An op of the graph, as data: its type, attributes and local metas. Kernels come
    /// from the registry entry for (op type, the actor's device kind, the op's dtype).
    Op(crate::OpConf),
    /// A kernel the embedding program registers under this name.
    Custom {
        /// Registered name.
        name: String,
    },
    /// One member's share of a collective over a group of devices (runs on a comm stream;
    /// every member of `group` must issue it, and each device issues its collectives in
    /// one plan-fixed order).
    Collective(CollectiveConf),
}

/// One member of a collective: which group, which rank, and what it computes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveConf {
    /// Name of the collective instance, the same for all its members and unique in the plan.
    pub group: String,
    /// This member's rank in the group (`0..size`).
    pub rank: u32,
    /// Members in the group.
    pub size: u32,
    /// What the group computes.
    pub op: CollectiveOp,
    /// Element type.
    pub dtype: crate::DType,
    /// Shape of the whole tensor the group works on; parts along a dimension are balanced
    /// ([`crate::part_range`]).
    pub shape: Vec<usize>,
}

/// What a collective computes, on a tensor of the group's `shape`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveOp {
    /// Every member holds a summand of the whole tensor and gets the sum.
    AllReduce,
    /// Every member holds a summand of the whole tensor and gets its part (along `dim`) of the sum.
    ReduceScatter {
        /// Dimension the result is split along.
        dim: usize,
    },
    /// Every member holds its part along `dim` and gets the whole tensor.
    AllGather {
        /// Dimension the inputs are split along.
        dim: usize,
    },
    /// Every member holds its part along `from` and gets its part along `to`.
    AllToAll {
        /// Dimension the inputs are split along.
        from: usize,
        /// Dimension the outputs are split along.
        to: usize,
    },
    /// An all-reduce of `parts` tensors at once (a gradient bucket): data inputs and
    /// outputs `0..parts`, output `i` the sum of input `i`, reduced as one flat tensor of
    /// the group's `shape` (`[total elements]`, the parts end to end in input order). One
    /// rendezvous or one exchange instead of one per tensor.
    AllReduceBucket {
        /// Tensors in the bucket (at least 1).
        parts: u32,
    },
    /// A reduce-scatter of `parts` tensors at once (a ZeRO gradient bucket): data input `i`
    /// a whole summand of tensor `i`, data output `i` this member's part of its sum along
    /// dimension 0, in equal blocks (each tensor's elements divide evenly among the
    /// members). The group's `shape` is `[total elements]` of the whole tensors; the parts
    /// travel as one reduce-scatter of that flat tensor, each member's block holding its
    /// part of every tensor in input order. One rendezvous instead of one per tensor.
    ReduceScatterBucket {
        /// Tensors in the bucket (at least 1).
        parts: u32,
    },
    /// An all-gather of `parts` tensors at once (the updated parameters of a ZeRO bucket):
    /// data input `i` this member's equal block of tensor `i` along dimension 0, data
    /// output `i` the whole tensor. The group's `shape` is `[total elements]` of the whole
    /// tensors, gathered as one flat tensor as in [`CollectiveOp::ReduceScatterBucket`].
    AllGatherBucket {
        /// Tensors in the bucket (at least 1).
        parts: u32,
    },
}

impl CollectiveOp {
    /// Tensors a member reads and writes: `parts` for a bucket, else 1.
    pub fn parts(self) -> usize {
        match self {
            CollectiveOp::AllReduceBucket { parts }
            | CollectiveOp::ReduceScatterBucket { parts }
            | CollectiveOp::AllGatherBucket { parts } => parts as usize,
            _ => 1,
        }
    }

    /// What a bucket is, to the group: the collective of its parts end to end (an
    /// all-reduce, or a reduce-scatter or all-gather along dimension 0); other ops as they are.
    pub fn flat(self) -> CollectiveOp {
        match self {
            CollectiveOp::AllReduceBucket { .. } => CollectiveOp::AllReduce,
            CollectiveOp::ReduceScatterBucket { .. } => CollectiveOp::ReduceScatter { dim: 0 },
            CollectiveOp::AllGatherBucket { .. } => CollectiveOp::AllGather { dim: 0 },
            op => op,
        }
    }

    /// Whether it is a bucket of several tensors.
    pub fn is_bucket(self) -> bool {
        self.flat() != self
    }
}

impl CollectiveConf {
    fn part_shape(&self, dim: usize) -> Vec<usize> {
        let mut shape = self.shape.clone();
        if let Some(len) = shape.get_mut(dim) {
            *len = crate::part_range(*len, self.size as usize, self.rank as usize).len();
        }
        shape
    }

    /// Shape of this member's input (for a bucket, all its data inputs end to end).
    pub fn input_shape(&self) -> Vec<usize> {
        match self.op.flat() {
            CollectiveOp::AllGather { dim } => self.part_shape(dim),
            CollectiveOp::AllToAll { from, .. } => self.part_shape(from),
            // `flat` leaves no bucket.
            _ => self.shape.clone(),
        }
    }

    /// For an all-gather along dimension 0, the bytes of its output where this member's own
    /// part goes (one run: the part's rows); `None` for other collectives, or where the
    /// sizes pass 2^64 (a plan file may say anything).
    pub fn own_part_bytes(&self) -> Option<std::ops::Range<u64>> {
        let (CollectiveOp::AllGather { dim: 0 }, Some((&rows, rest))) = (self.op, self.shape.split_first()) else {
            return None;
        };
        let row = rest.iter().try_fold(self.dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64))?;
        let part = crate::part_range(rows, self.size.max(1) as usize, self.rank as usize);
        Some((part.start as u64).checked_mul(row)?..(part.end as u64).checked_mul(row)?)
    }

    /// Shape of this member's output (for a bucket, all its data outputs end to end).
    pub fn output_shape(&self) -> Vec<usize> {
        match self.op.flat() {
            CollectiveOp::ReduceScatter { dim } => self.part_shape(dim),
            CollectiveOp::AllToAll { to, .. } => self.part_shape(to),
            // `flat` leaves no bucket.
            _ => self.shape.clone(),
        }
    }

    /// Short name of the operation (`all_reduce`, ...).
    pub fn op_name(&self) -> &'static str {
        match self.op {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::ReduceScatter { .. } => "reduce_scatter",
            CollectiveOp::AllGather { .. } => "all_gather",
            CollectiveOp::AllToAll { .. } => "all_to_all",
            CollectiveOp::AllReduceBucket { .. } => "all_reduce_bucket",
            CollectiveOp::ReduceScatterBucket { .. } => "reduce_scatter_bucket",
            CollectiveOp::AllGatherBucket { .. } => "all_gather_bucket",
        }
    }
}

/// What an actor does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActorKind {
    /// Produces pieces: no inputs, at least one output.
    Source {
        /// Where the pieces come from.
        pieces: SourcePieces,
    },
    /// Runs a kernel once per piece: at least one input.
    Compute {
        /// The kernel.
        kernel: KernelConf,
    },
    /// Delivers every piece of its inputs to the user: no outputs.
    Sink,
    /// Takes every piece of its inputs and drops it: the reader of a register nobody else
    /// reads (an optimizer state's last value). No outputs.
    Discard,
    /// Accumulates `count` input pieces into one output piece (one input, one output).
    Acc {
        /// Pieces per output.
        count: u32,
        /// Kernel that folds each input piece into the output register.
        kernel: KernelConf,
    },
    /// Hands one input register to `count` consecutive output pieces without copying
    /// (one input, one output of the same size).
    Repeat {
        /// Output pieces per input piece.
        count: u32,
    },
}

impl ActorKind {
    /// Short name of the kind.
    pub fn name(&self) -> &'static str {
        match self {
            ActorKind::Source { .. } => "source",
            ActorKind::Compute { .. } => "compute",
            ActorKind::Sink => "sink",
            ActorKind::Discard => "discard",
            ActorKind::Acc { .. } => "acc",
            ActorKind::Repeat { .. } => "repeat",
        }
    }
}

/// One actor: a physical operation bound to one stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActorDesc {
    /// Unique name, used in errors, traces and to find sources and sinks.
    pub name: String,
    /// Stream that runs it.
    pub stream: StreamIndex,
    /// What it does.
    pub kind: ActorKind,
    /// Register descriptors it consumes, in kernel input order.
    pub inputs: Vec<RegstDescId>,
    /// Modeled kernel duration on a `sim` device, in nanoseconds (0 when absent).
    #[serde(default)]
    pub sim_nanos: Option<u64>,
    /// Inputs read in part: the kernel sees only a window of those registers' slots.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub windows: Vec<InputWindow>,
}

/// A window of one input register: a compute actor reads `bytes` bytes from `offset` of
/// every slot, as if they were the whole register. The compiler reads a device's rows of
/// a replicated tensor this way (`B -> S(0)`: the rows of a row-major tensor are one
/// contiguous block) instead of copying them out with a `take_part` actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputWindow {
    /// Which input of the actor (an index into its `inputs`).
    pub input: u32,
    /// First byte of the window in each slot.
    pub offset: u64,
    /// Bytes in the window.
    pub bytes: u64,
}

impl ActorDesc {
    /// The window input `i` is read through, if any.
    pub fn window(&self, i: usize) -> Option<InputWindow> {
        self.windows.iter().find(|w| w.input as usize == i).copied()
    }
}

impl Plan {
    /// The bytes actor `actor`'s kernel sees of its input `i`: its window's, or its whole
    /// register's (0 for an input the actor does not have).
    pub fn input_bytes(&self, actor: ActorIndex, i: usize) -> u64 {
        let desc = &self.actors[actor.index()];
        match desc.window(i) {
            Some(window) => window.bytes,
            None => desc.inputs.get(i).map_or(0, |r| self.regst_descs[r.index()].bytes),
        }
    }

    /// For how many consecutive pieces actor `actor`'s input `i` holds the same bytes: the
    /// product of the counts of the repeats that hand it on (a weight handed to every
    /// micro-batch of a step), 1 for an input no repeat makes. Pieces `j·n .. (j+1)·n` of
    /// the input are the bytes of one piece of the register the first repeat reads, and
    /// nothing writes them while those pieces are read: the repeat holds that piece until
    /// they come back, and an update that writes over it in place fires only after its
    /// readers (`InPlaceCheck`, which follows repeats). A kernel may keep what it derives
    /// from such an input (gemm's packed panels of a weight) for `n` pieces.
    pub fn input_repeats(&self, actor: ActorIndex, i: usize) -> u64 {
        let mut count: u64 = 1;
        let mut regst = self.actors.get(actor.index()).and_then(|a| a.inputs.get(i)).copied();
        // A plan file may loop repeats: at most one step per register.
        for _ in 0..self.regst_descs.len() {
            let Some(producer) = regst.and_then(|r| self.regst_descs.get(r.index())).map(|d| d.producer) else { break };
            let Some(ActorDesc { kind: ActorKind::Repeat { count: n }, inputs, .. }) =
                self.actors.get(producer.index())
            else {
                break;
            };
            count = count.saturating_mul(u64::from(*n).max(1));
            regst = inputs.first().copied();
        }
        count
    }
}

/// A register descriptor: `register_num` slots of `bytes` bytes, written by one producer
/// and read by its consumers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegstDesc {
    /// Name, used in errors and traces.
    pub name: String,
    /// Producing actor.
    pub producer: ActorIndex,
    /// Consuming actors; each must list this descriptor in its `inputs`.
    pub consumers: Vec<ActorIndex>,
    /// Number of slots: how many pieces the producer may have in flight.
    pub register_num: u32,
    /// Bytes per slot.
    pub bytes: u64,
    /// Where the slots live.
    pub memory: MemoryKind,
    /// Slots that start ready, holding pieces `0..preloaded` (their initial bytes), before
    /// the producer has fired: the initial tokens of a loop (a variable's first value).
    /// The producer numbers its own pieces from `preloaded` on. A register with preloaded
    /// slots carries loop state: its consumers see `preloaded` more pieces than the loop
    /// runs and give the extra ones back without firing when their other inputs end.
    #[serde(default)]
    pub preloaded: u32,
    /// Offset in its device's shared region, for a one-slot register that shares memory
    /// with others whose lifetimes never overlap with its own (the compiler guarantees
    /// that, and serializes steps so no later piece overtakes). `None`: memory of its own.
    #[serde(default)]
    pub shared_offset: Option<u64>,
    /// Every slot is the same bytes: the producer, an op that takes this register as an
    /// input too (an optimizer update reading the variable's value and writing its next
    /// one), writes its new piece in place over the piece it reads. The compiler sets it
    /// only where every other reader of a piece has finished before the producer fires
    /// (see [`OpConf::in_place_pairs`](crate::OpConf::in_place_pairs) and the compiler's
    /// memory sharing), so the register takes one slot's bytes instead of `register_num`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub aliased_slots: bool,
    /// The register's one slot is bytes of another register's one buffer, not memory of
    /// its own: a sharded update writes its part of a weight where that part lies in the
    /// gathered weight, and the all-gather that reads it as its own part copies only the
    /// other parts (see [`Within`] and [`InPlaceCheck::check_within`](crate::InPlaceCheck::check_within)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub within: Option<Within>,
    /// The register's one buffer is the one buffer of register `home`, made on another cpu
    /// device of the same node, not memory of its own: the members of an all-gather that
    /// gathers a sharded update's parts in place hold the gathered weight once for the
    /// process instead of once per device, each member's update writes its part there, and
    /// the all-gather copies nothing (see
    /// [`InPlaceCheck::check_home`](crate::InPlaceCheck::check_home)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub home: Option<RegstDescId>,
}

/// Where a register's one slot lies inside another register ([`RegstDesc::within`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Within {
    /// The register whose one buffer holds it (its slots aliased).
    pub regst: RegstDescId,
    /// Where it starts in that buffer, in bytes.
    pub offset: u64,
}

impl RegstDesc {
    /// How many slots' bytes the register takes: one where its slots are aliased, else
    /// one per slot.
    pub fn buffers(&self) -> u32 {
        if self.aliased_slots {
            1
        } else {
            self.register_num
        }
    }
}

impl Plan {
    /// An empty plan of the current schema version.
    pub fn empty() -> Self {
        Self {
            schema_version: PLAN_SCHEMA_VERSION,
            devices: Vec::new(),
            streams: Vec::new(),
            actors: Vec::new(),
            regst_descs: Vec::new(),
            signature: Signature::default(),
            variables: Vec::new(),
            check_finite: false,
        }
    }

    /// The actor with this name.
    pub fn actor_by_name(&self, name: &str) -> Option<ActorIndex> {
        self.actors.iter().position(|a| a.name == name).map(|i| ActorIndex(i as u32))
    }

    /// Register descriptors produced by `actor`, in descriptor order (the kernel's outputs).
    pub fn outputs_of(&self, actor: ActorIndex) -> impl Iterator<Item = RegstDescId> + '_ {
        self.regst_descs
            .iter()
            .enumerate()
            .filter(move |(_, d)| d.producer == actor)
            .map(|(i, _)| RegstDescId(i as u32))
    }

    /// The device an actor runs on. Panics on an index out of range (validate first).
    pub fn device_of(&self, actor: ActorIndex) -> DeviceIndex {
        self.streams[self.actors[actor.index()].stream.index()].device
    }

    /// Whether a descriptor's slots have memory of their own. A repeat actor's output
    /// hands out its input register without copying, so it owns none.
    pub fn owns_memory(&self, desc: RegstDescId) -> bool {
        let producer = self.regst_descs[desc.index()].producer;
        !matches!(self.actors[producer.index()].kind, ActorKind::Repeat { .. })
    }

    /// A fingerprint of the whole plan: 128 bits of its JSON, as 32 hex digits. Nodes of a
    /// multi-node job compare fingerprints when they connect, so a node running another
    /// plan (another model, another layout, another build's compiler) is refused by name.
    pub fn fingerprint(&self) -> String {
        // Two FNV-1a-style lanes with different seeds and multipliers, each finished with a
        // SplitMix64 mix: not cryptographic (the shared secret guards against strangers),
        // only a sure sign of two different plans.
        let json = serde_json::to_vec(self).unwrap_or_default();
        let mut lanes = [0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142u64];
        for &byte in &json {
            lanes[0] = (lanes[0] ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
            lanes[1] = (lanes[1] ^ u64::from(byte)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
        let mix = |mut x: u64| {
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x ^ (x >> 31)
        };
        format!("{:016x}{:016x}", mix(lanes[0]), mix(lanes[1] ^ json.len() as u64))
    }

    /// Serializes to pretty JSON.
    pub fn to_json(&self) -> String {
        // Serializing plain data with string keys cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// Where a firing sits in an acc group or a repeat fan-out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPosition {
    /// Position in the group, `0..count`.
    pub index: u32,
    /// Group size (1 for plain actors).
    pub count: u32,
}
