//! Why a plan was rejected: every variant names the actor, register or stream involved.

/// A plan that cannot be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The text is not a plan.
    #[error("plan file is not valid JSON for a plan: {0}")]
    Parse(String),
    /// A part of the plan file that does not deserialize, located in the plan (which
    /// device, stream, actor, register, signature entry or variable) and in the text.
    #[error("plan file: {element}: {message} (line {line}, column {column})")]
    Element {
        /// Which element: `actor 3 'matmul5'`, `device 0`, ...
        element: String,
        /// What serde found wrong with it.
        message: String,
        /// Line of the error in the file (1-based).
        line: usize,
        /// Column of the error in the file (1-based).
        column: usize,
    },
    /// Written by another version of regflow.
    #[error("plan schema version {found} is not supported: this build reads version {expected}")]
    SchemaVersion {
        /// Version in the file.
        found: u64,
        /// Version this build reads.
        expected: u32,
    },
    /// A reference to a register descriptor that does not exist.
    #[error("{owner} refers to unknown register descriptor {desc} (the plan has {count})")]
    UnknownRegstDesc {
        /// Who refers to it.
        owner: String,
        /// The bad index.
        desc: u32,
        /// Number of descriptors in the plan.
        count: usize,
    },
    /// A reference to an actor that does not exist.
    #[error("{owner} refers to unknown actor {actor} (the plan has {count})")]
    UnknownActor {
        /// Who refers to it.
        owner: String,
        /// The bad index.
        actor: u32,
        /// Number of actors in the plan.
        count: usize,
    },
    /// A reference to a stream that does not exist.
    #[error("actor '{actor}' is bound to unknown stream {stream} (the plan has {count})")]
    UnknownStream {
        /// The actor.
        actor: String,
        /// The bad index.
        stream: u32,
        /// Number of streams in the plan.
        count: usize,
    },
    /// A reference to a device that does not exist.
    #[error("stream {stream} belongs to unknown device {device} (the plan has {count})")]
    UnknownDevice {
        /// The stream index.
        stream: u32,
        /// The bad index.
        device: u32,
        /// Number of devices in the plan.
        count: usize,
    },
    /// Two devices with the same node, kind and index.
    #[error("device {label} is declared twice")]
    DuplicateDevice {
        /// The device label.
        label: String,
    },
    /// Two actors with the same name.
    #[error("two actors are named '{name}'")]
    DuplicateActorName {
        /// The name.
        name: String,
    },
    /// A descriptor with no slots can never carry a piece.
    #[error("register '{desc}' of actor '{producer}' has register_num 0: it needs at least 1 slot")]
    ZeroRegisterNum {
        /// The descriptor.
        desc: String,
        /// Its producer.
        producer: String,
    },
    /// Consumers listed on one side only.
    #[error("register '{desc}' and actor '{actor}' disagree: {detail}")]
    InconsistentEdge {
        /// The descriptor.
        desc: String,
        /// The actor.
        actor: String,
        /// Which side lists what.
        detail: String,
    },
    /// More preloaded slots than slots.
    #[error("register '{desc}' preloads {preloaded} slots but has only {register_num}")]
    TooManyPreloaded {
        /// The descriptor.
        desc: String,
        /// Preloaded slots.
        preloaded: u32,
        /// Its slot count.
        register_num: u32,
    },
    /// A produced register nobody reads.
    #[error("register '{desc}' of actor '{producer}' has no consumer")]
    NoConsumer {
        /// The descriptor.
        desc: String,
        /// Its producer.
        producer: String,
    },
    /// More slots than a register may have.
    #[error(
        "register '{desc}' has register_num {register_num}; at most {max} slots are supported",
        max = super::MAX_REGISTER_NUM
    )]
    TooManySlots {
        /// The descriptor.
        desc: String,
        /// Its slot count.
        register_num: u32,
    },
    /// More consumers than a register can track.
    #[error("register '{desc}' has {count} consumers; at most {max} are supported", max = super::MAX_CONSUMERS)]
    TooManyConsumers {
        /// The descriptor.
        desc: String,
        /// Its consumer count.
        count: usize,
    },
    /// An actor whose inputs or outputs do not fit its kind.
    #[error("{kind} actor '{actor}' {detail}")]
    BadArity {
        /// The actor.
        actor: String,
        /// Its kind.
        kind: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A register whose slots are one buffer ([`RegstDesc::aliased_slots`](crate::RegstDesc))
    /// where its producer cannot write in place over what it reads.
    #[error("register '{regst}' has aliased slots (one buffer for all), but {detail}")]
    AliasedSlots {
        /// The register.
        regst: String,
        /// What is wrong, naming its producer.
        detail: String,
    },
    /// A register placed inside another ([`RegstDesc::within`](crate::RegstDesc)) where
    /// that is not safe or does not fit.
    #[error("register '{regst}' lies within register '{within}', but {detail}")]
    Within {
        /// The register.
        regst: String,
        /// The register it says it lies in (its index where that is out of range).
        within: String,
        /// What is wrong.
        detail: String,
    },
    /// A register held in another's buffer ([`RegstDesc::home`](crate::RegstDesc)) where
    /// that is not safe.
    #[error("register '{regst}' is held in the buffer of register '{home}', but {detail}")]
    Home {
        /// The register.
        regst: String,
        /// The register whose buffer it says it is held in (its index where that is out of
        /// range).
        home: String,
        /// What is wrong.
        detail: String,
    },
    /// An input window that does not fit its actor or its register.
    #[error("actor '{actor}' {detail}")]
    BadWindow {
        /// The actor.
        actor: String,
        /// What is wrong.
        detail: String,
    },
    /// A typed input of the signature that does not fit the plan.
    #[error("input '{input}' of the signature {detail}")]
    BadInput {
        /// The input's name.
        input: String,
        /// What is wrong, naming the part, actor or register.
        detail: String,
    },
    /// A typed output of the signature that does not fit the plan.
    #[error("output '{output}' of the signature {detail}")]
    BadOutput {
        /// The output's name.
        output: String,
        /// What is wrong, naming the actor or register.
        detail: String,
    },
    /// A variable whose register or region does not fit.
    #[error("variable '{variable}' {detail}")]
    BadVariable {
        /// The variable's name.
        variable: String,
        /// What is wrong, naming the register and the values.
        detail: String,
    },
    /// A dependency cycle: every register on it starts empty, so none of its actors can fire.
    #[error("cycle {} has no free register to start from: every register on it starts empty, so no actor on it can ever fire (preload a register on the cycle to give it a first piece)", path.join(" -> "))]
    Cycle {
        /// Actor names along the cycle, first repeated at the end.
        path: Vec<String>,
    },
    /// A device's registers do not fit its memory.
    #[error("registers on device {device} need {needed} bytes but it offers {capacity}; largest: {largest}")]
    DoesNotFit {
        /// Device label.
        device: String,
        /// Bytes needed by the layout.
        needed: u64,
        /// Bytes available.
        capacity: u64,
        /// The largest registers, `name (register_num x bytes)`.
        largest: String,
    },
    /// A size that overflows.
    #[error("memory layout of device {device}: {detail}")]
    Memory {
        /// Device label.
        device: String,
        /// The memory crate's message.
        detail: String,
    },
    /// A collective group whose members do not fit together.
    #[error("collective '{group}': {detail}")]
    Collective {
        /// The group.
        group: String,
        /// What is wrong.
        detail: String,
    },
    /// Devices that could issue collectives in different orders (a deadlock).
    #[error("collective order: {detail}")]
    CollectiveOrder {
        /// Which collectives and devices.
        detail: String,
    },
}
