//! A catalogue of bad input, one short entry per case: every case must fail with the error
//! kind it names (the variant of the crate's error enum), with a message that is a
//! sentence (no `{ field: .. }` Debug output) naming the thing at fault and the offending
//! value. Cases that start a job use a short watchdog, so a regression that hangs ends as
//! an error instead.
//!
//! Adding a case is one entry in the area's module:
//!
//! ```text
//! c.case("matmul with mismatched inner dims", || x.matmul(&w), "GraphError::Op", &["matmul", "[2, 3]", "[4, 5]"]);
//! ```
//!
//! `REGFLOW_BAD_INPUT_PRINT=1 cargo test --test bad_input -- --nocapture` prints every
//! case's message (docs/errors.md quotes them).

#[path = "../common/mod.rs"]
mod common;

mod checkpoints;
mod cli;
mod feeds;
mod fetches;
mod graphs;
mod jobs;
mod meshes;
mod options;
mod plan_files;
mod plans;
mod serving;
mod values;

use regflow::prelude::*;
use std::fmt::{Debug, Display};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

/// The watchdog of every job a case starts: short, so that a case that would hang ends.
pub(crate) const WATCHDOG: Duration = Duration::from_millis(500);

/// Whether no GPU can run a `cuda` plan here (no driver, no device, or a build without the
/// backend): only then is such a plan bad input.
pub(crate) fn without_gpu() -> bool {
    regflow::cuda::probe().is_err()
}

/// A job builder with the catalogue's short watchdog.
pub(crate) fn quick(plan: Plan) -> JobBuilder {
    Job::builder(plan).watchdog(WATCHDOG)
}

/// The cases of one area; [`Catalogue::finish`] fails the test with every case that
/// did not hold, not just the first.
pub(crate) struct Catalogue {
    area: &'static str,
    cases: usize,
    failures: Vec<String>,
    print: bool,
}

impl Catalogue {
    pub(crate) fn new(area: &'static str) -> Self {
        let print = std::env::var_os("REGFLOW_BAD_INPUT_PRINT").is_some();
        Self { area, cases: 0, failures: Vec::new(), print }
    }

    /// One case: `run` must return `Err` of kind `kind` (`Type::Variant[::Inner...]`, the
    /// variant path as `Debug` writes it; a prefix of the path matches) whose message is a
    /// sentence containing every needle.
    pub(crate) fn case<T, E: Debug + Display>(
        &mut self,
        name: &str,
        run: impl FnOnce() -> Result<T, E>,
        kind: &str,
        needles: &[&str],
    ) -> &mut Self {
        self.cases += 1;
        let outcome = match catch_unwind(AssertUnwindSafe(run)) {
            Err(panic) => Err(format!("panicked: {}", panic_message(&*panic))),
            Ok(Ok(_)) => Err("was accepted".to_string()),
            Ok(Err(error)) => {
                let message = error.to_string();
                if self.print {
                    println!(
                        "[{}] {name}\n    {}\n    {}",
                        self.area,
                        kind_of(&error),
                        message.replace('\n', "\n    ")
                    );
                }
                check_error(&kind_of(&error), &message, kind, needles)
            }
        };
        if let Err(why) = outcome {
            self.failures.push(format!("{name}: {why}"));
        }
        self
    }

    /// Fails with every case that did not hold; returns the number of cases.
    pub(crate) fn finish(self) -> usize {
        assert!(
            self.failures.is_empty(),
            "{} of {} {} cases failed:\n  {}",
            self.failures.len(),
            self.cases,
            self.area,
            self.failures.join("\n  ")
        );
        self.cases
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "<non-string panic>".into())
}

/// `GraphError::Compile::Plan::ZeroRegisterNum`: the error type's name, then the variant
/// names `Debug` writes before the first field.
pub(crate) fn kind_of<E: Debug>(error: &E) -> String {
    let type_name = std::any::type_name::<E>();
    let type_name = type_name.split('<').next().unwrap_or(type_name);
    let mut path = vec![type_name.rsplit("::").next().unwrap_or(type_name).to_string()];
    let debug = format!("{error:?}");
    let mut rest = debug.as_str();
    loop {
        let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
        let ident = &rest[..end];
        if ident.is_empty() || !ident.starts_with(|c: char| c.is_ascii_uppercase()) {
            break;
        }
        path.push(ident.to_string());
        match rest[end..].strip_prefix('(') {
            Some(inner) => rest = inner,
            None => break,
        }
    }
    path.join("::")
}

fn check_error(actual: &str, message: &str, kind: &str, needles: &[&str]) -> Result<(), String> {
    if actual != kind && !actual.starts_with(&format!("{kind}::")) {
        return Err(format!("kind {actual}, expected {kind}: {message}"));
    }
    let missing: Vec<&&str> = needles.iter().filter(|n| !message.contains(**n)).collect();
    if !missing.is_empty() {
        return Err(format!("message lacks {missing:?}: {message}"));
    }
    sentence(message).map_err(|why| format!("{why}: {message}"))
}

/// A message a user can read: not empty, no panic, no `Type { field: .. }` or `Some(..)`
/// Debug output.
pub(crate) fn sentence(message: &str) -> Result<(), String> {
    if message.trim().is_empty() {
        return Err("empty message".into());
    }
    if message.contains("panicked") {
        return Err("a panic in the message".into());
    }
    for debug in ["Some(", "None)", "Os { code", "kind: "] {
        if message.contains(debug) {
            return Err(format!("Debug output ({debug}) in the message"));
        }
    }
    // `Name { field: ` is a Debug struct.
    for (at, _) in message.match_indices(" { ") {
        let before = message[..at].rsplit(|c: char| !c.is_alphanumeric()).next().unwrap_or("");
        let after = &message[at + 3..];
        let field_end = after.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(after.len());
        if before.starts_with(|c: char| c.is_ascii_uppercase()) && after[field_end..].starts_with(": ") {
            return Err("Debug struct output in the message".into());
        }
    }
    Ok(())
}

#[test]
fn kinds_are_read_from_the_variant_path() {
    let error =
        regflow::graph::GraphError::Compile(Box::new(regflow::graph::CompileError::Plan(PlanError::ZeroRegisterNum {
            desc: "x".into(),
            producer: "p".into(),
        })));
    assert_eq!(kind_of(&error), "GraphError::Compile::Plan::ZeroRegisterNum");
    assert_eq!(kind_of(&"text".to_string()), "String");
    assert!(sentence("Xavier { seed: 0 } needs a float variable").is_err());
    assert!(sentence("register 'x' of actor 'p' has register_num 0").is_ok());
    assert!(sentence("digraph plan { a0 }").is_ok());
}
