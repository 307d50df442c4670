//! Errors raised while building or evaluating a logical graph, in logical terms: the op,
//! its input shapes and dtypes, and what does not fit.

/// A graph that cannot be built, differentiated or evaluated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphError {
    /// An op rejected its inputs.
    #[error("{op}({}): {message}", inputs.join(", "))]
    Op {
        /// The op's name.
        op: String,
        /// Its inputs, as `dtype[shape]`.
        inputs: Vec<String>,
        /// What does not fit.
        message: String,
    },
    /// Tensors from two different graphs were combined.
    #[error("{op}: input {index} belongs to another graph")]
    ForeignTensor {
        /// The op.
        op: String,
        /// Which input.
        index: usize,
    },
    /// Two inputs or variables with one name.
    #[error("a tensor named '{0}' already exists")]
    DuplicateName(String),
    /// `grad` of something that is not a scalar.
    #[error("loss must be a scalar to differentiate, got {0}")]
    NonScalarLoss(String),
    /// A value fed for a tensor that is not an input or variable, or of the wrong shape.
    #[error("feed for '{name}': {message}")]
    Feed {
        /// The tensor's name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// An input without a feed.
    #[error("input '{0}' has no feed")]
    MissingFeed(String),
    /// An op without a gradient rule on the path to the loss.
    #[error("{op} has no gradient with respect to input {index}")]
    NoGradient {
        /// The op.
        op: String,
        /// Which input.
        index: usize,
    },
    /// An optimizer option with a value it cannot train with.
    #[error("optimizer option '{option}' is {value}: {requirement}")]
    OptimizerOption {
        /// The option, as the API names it (`lr`, `beta1`, `warmup`, ...).
        option: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        requirement: String,
    },
    /// `minimize` of a loss that no trainable variable reaches.
    #[error("loss '{loss}' depends on no trainable variable: minimize has nothing to train")]
    NothingToTrain {
        /// The loss tensor's name.
        loss: String,
    },
    /// An input, variable or op result whose element count or byte size overflows.
    #[error("{tensor} of shape {shape} ({dtype}) is too large: its element count or byte size exceeds {} (the largest size this machine can address)", usize::MAX)]
    TooLarge {
        /// The tensor: `input 'x'`, `variable 'w'`, or an op result with its op and inputs.
        tensor: String,
        /// Its shape.
        shape: crate::plan::Shape,
        /// Its dtype.
        dtype: crate::plan::DType,
    },
    /// A step that cannot be compiled to a plan (boxed: it names many things).
    #[error(transparent)]
    Compile(Box<crate::CompileError>),
    /// A precision the graph cannot run in ([`crate::Graph::mixed_precision`]).
    #[error("{0}")]
    Precision(String),
    /// A host kernel failed (a broken invariant: inputs were checked when the op was built).
    #[error("{op}: kernel failed: {message}")]
    Kernel {
        /// The op.
        op: String,
        /// What failed.
        message: String,
    },
}

impl From<crate::CompileError> for GraphError {
    fn from(error: crate::CompileError) -> Self {
        Self::Compile(Box::new(error))
    }
}
