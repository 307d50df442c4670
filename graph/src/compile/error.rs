//! Why a step could not be compiled, in the step's own terms: the tensor, op, placement
//! or option involved and the values that do not fit.

use crate::plan::PlanError;

/// A step that cannot be lowered to a plan (wrapped upward as
/// [`GraphError::Compile`](crate::GraphError::Compile)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    /// Neither a fed input nor a dataset input: no piece ever arrives, so no step starts or
    /// ends.
    #[error(
        "the step reads no input, so nothing paces it: feed it an input (even a dummy one) or read one from a dataset"
    )]
    NoInput,
    /// A dataset names something that is not an input of the graph.
    #[error("the dataset produces '{name}', which is not an input of the graph{}", suggestion(nearest.as_deref()))]
    DatasetInput {
        /// The name the dataset options list.
        name: String,
        /// The graph input whose name is closest, if the graph has inputs.
        nearest: Option<String>,
    },
    /// `check_finite` asked of a step with dynamic loss scaling.
    #[error(
        "check_finite stops the job at the first infinity, but this step scales its loss dynamically (f16 mixed \
         precision or Optimizer::with_loss_scale): its gradients overflow now and then by design, and the scaler \
         skips those steps; turn check_finite off, or train without loss scaling to look for the op that overflows"
    )]
    CheckFiniteWithLossScaling,
    /// A dataset that produces nothing.
    #[error("the dataset produces no inputs: list the graph inputs its records hold, in record order")]
    EmptyDataset,
    /// Inputs of one dataset source placed on different meshes.
    #[error("the dataset's inputs must share one placement: '{first}' is on {first_mesh}, '{other}' on {other_mesh}")]
    DatasetPlacements {
        /// The dataset's first input.
        first: String,
        /// Its mesh.
        first_mesh: String,
        /// An input on another mesh.
        other: String,
        /// That mesh.
        other_mesh: String,
    },
    /// A tensor the step needs was given no mesh (placement covers every needed tensor).
    #[error("tensor '{tensor}' has no placement (broken invariant of the compiler)")]
    UnknownPlacement {
        /// The tensor's name.
        tensor: String,
    },
    /// A tensor the step needs was given no layout (layout inference covers every needed
    /// tensor).
    #[error("tensor '{tensor}' has no layout (broken invariant of the compiler)")]
    UnknownLayout {
        /// The tensor's name.
        tensor: String,
    },
    /// An input's or variable's layout does not fit its shape or its mesh.
    #[error("'{tensor}': {meta} cannot take its layout: {reason}")]
    LayoutDoesNotFit {
        /// The tensor's name.
        tensor: String,
        /// Its shape and dtype.
        meta: String,
        /// What does not fit.
        reason: String,
    },
    /// A variable pinned `Partial`: a stored value must be whole or split.
    #[error(
        "'{tensor}': {meta} is a variable, and a variable cannot be Partial ({layout}): store it Broadcast or Split"
    )]
    PartialVariable {
        /// The variable's name.
        tensor: String,
        /// Its shape and dtype.
        meta: String,
        /// Its layout, with the mesh axis names.
        layout: String,
    },
    /// No SBP signature of an op produces the layout pinned on its output.
    #[error("{0}")]
    NoSignature(Box<NoSignature>),
    /// The plan the compiler emitted does not validate.
    #[error("the compiled plan is invalid: {0}")]
    Plan(#[from] PlanError),
    /// Memory sharing could not lay out the shared registers.
    #[error("memory sharing cannot lay out the shared registers: {reason}")]
    MemorySharing {
        /// What the layout planner reported.
        reason: String,
    },
    /// Two registers share the name of a variable's register, so preloading it by name
    /// (`JobBuilder::preload`) would be ambiguous.
    #[error(
        "variable '{variable}' is held by register '{regst}', but another register has that name too: rename the variable"
    )]
    AmbiguousVariableRegister {
        /// The variable's name.
        variable: String,
        /// The register name.
        regst: String,
    },
    /// An option with a value that means nothing (zero micro-batches, zero slots).
    #[error("option `{option}` is {value}: {expected}")]
    BadOption {
        /// The option, as its field or method is named.
        option: &'static str,
        /// The value given.
        value: String,
        /// What it must be.
        expected: &'static str,
    },
    /// The emitted plan cannot make progress: a cycle of waits its register counts allow.
    #[error("the compiled plan cannot run: {report}{}", hint.as_deref().map(|h| format!(" ({h})")).unwrap_or_default())]
    WouldDeadlock {
        /// The progress check's report (who waits on whom, through which registers).
        report: String,
        /// The option that sizes the registers on the cycle, when one does.
        hint: Option<String>,
    },
    /// Something the earlier passes guarantee does not hold: a bug in the compiler.
    #[error("broken invariant of the compiler: {what}")]
    Invariant {
        /// What does not hold.
        what: String,
    },
}

/// An op whose signatures cannot give the layout pinned on its output.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{op} (node {node})({}): no SBP signature gives the pinned layout ({pinned}); its signatures on one mesh axis are {signatures}{}{}",
    inputs.join(", "),
    if *partial_pinned { PARTIAL_HINT } else { "" },
    closest.as_deref().map(|c| format!("; the closest signature fails: {c}")).unwrap_or_default()
)]
pub struct NoSignature {
    /// The op's name.
    pub op: String,
    /// Its node index in the graph.
    pub node: usize,
    /// Its inputs, as `dtype[shape] (layout)`.
    pub inputs: Vec<String>,
    /// The pinned output layouts, with the mesh axis names.
    pub pinned: String,
    /// The op's signatures on one mesh axis.
    pub signatures: String,
    /// Whether a pinned layout is `Partial`.
    pub partial_pinned: bool,
    /// Why the cheapest signature does not fit, if one was tried.
    pub closest: Option<String>,
}

const PARTIAL_HINT: &str = "; Partial(sum) only comes out of an op that is linear in its Partial inputs: \
                            box the input to Broadcast or Split first (to_global)";

fn suggestion(nearest: Option<&str>) -> String {
    match nearest {
        Some(name) => format!(" (did you mean '{name}'?)"),
        None => " (the graph has no inputs)".to_string(),
    }
}

impl CompileError {
    /// A broken invariant, saying what does not hold.
    pub(crate) fn invariant(what: impl Into<String>) -> Self {
        Self::Invariant { what: what.into() }
    }
}

/// The candidate closest to `name` by edit distance (ties: the first).
pub(crate) fn nearest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<String> {
    candidates.into_iter().min_by_key(|c| regflow_kernels::edit_distance(name, c)).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;
    use regflow_kernels::edit_distance;

    #[test]
    fn the_nearest_name_has_the_fewest_edits() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(nearest("lables", ["x", "labels", "mask"]), Some("labels".into()));
        assert_eq!(nearest("x", []), None);
    }
}
