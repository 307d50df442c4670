//! `regflow trace merge`: one Perfetto timeline from the Chrome traces each node of a job wrote.
//!
//! Every event of every input is kept, in input order. Pids are nodes: a pid with events
//! in one input keeps its number; when a later input has events on a pid an earlier one
//! already has events on (two traces of node 0, say), that input's pid gets a fresh number
//! above every pid in the inputs and its process name says which file it came from
//! (`node 0 (b.json)`).
//! Metadata-only pids (each node's trace names every node of the plan) keep their number.
//! Flow events keep their id, category and binding, so an arrow that starts in one node's
//! trace and ends in another's stays connected.
//!
//! Timestamps are kept as written: each trace counts microseconds from its own job's
//! start, so the merged traces are aligned at their starts. The runtime writes no clock
//! offset, so there is nothing finer to align by.

use crate::{emit, CliError};
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// One input trace.
struct Input {
    /// The file as given on the command line.
    file: String,
    /// Its events, each checked to be an object with a whole-number pid (or none).
    events: Vec<Value>,
    /// Its `displayTimeUnit`, if it has one.
    display_time_unit: Option<Value>,
}

/// Merges `inputs` into one trace written to `output`; notes about renumbered pids and
/// arrows that look joined across separate jobs go to stderr.
pub(crate) fn merge(output: &Path, inputs: &[PathBuf]) -> Result<(), CliError> {
    let inputs = inputs.iter().map(|path| read(path)).collect::<Result<Vec<_>, _>>()?;
    let maps = assign_pids(&inputs);
    for (input, map) in inputs.iter().zip(&maps) {
        for (old, new) in map.iter().filter(|(old, new)| old != new) {
            eprintln!(
                "note: {}'s pid {old} is pid {new} in {} (an earlier file has events on pid {old})",
                input.file,
                output.display()
            );
        }
    }
    warn_shared_flow_starts(&inputs);
    let display_time_unit = inputs.iter().find_map(|i| i.display_time_unit.clone());
    let mut events = Vec::with_capacity(inputs.iter().map(|i| i.events.len()).sum());
    for (input, map) in inputs.into_iter().zip(&maps) {
        // The file's name, not its path, keeps the process names short in Perfetto.
        let label = Path::new(&input.file).file_name().map_or(input.file.clone(), |n| n.to_string_lossy().into());
        let renamed = rename_processes(&label, input.events, map, &mut events);
        for (old, new) in map.iter().filter(|(old, new)| old != new && !renamed.contains(new)) {
            events.push(process_name(*new, &format!("pid {old} ({label})")));
        }
    }
    let mut merged = Map::new();
    merged.insert("traceEvents".into(), Value::Array(events));
    if let Some(unit) = display_time_unit {
        merged.insert("displayTimeUnit".into(), unit);
    }
    let text = Value::Object(merged).to_string();
    emit(&text, Some(output))
}

/// Reads and checks one input: a JSON object with a `traceEvents` array (or a bare array,
/// Chrome's other form) of objects whose `pid`, where present, is a whole number.
fn read(path: &Path) -> Result<Input, CliError> {
    let file = path.display().to_string();
    let error = |message: String| CliError::Trace { file: file.clone(), message };
    let text = std::fs::read_to_string(path).map_err(|e| error(format!("cannot read it: {e}")))?;
    let value: Value = serde_json::from_str(&text).map_err(|e| error(format!("it is not JSON: {e}")))?;
    let (events, display_time_unit) = match value {
        Value::Object(mut object) => match object.remove("traceEvents") {
            Some(Value::Array(events)) => (events, object.remove("displayTimeUnit")),
            Some(other) => return Err(error(format!("its traceEvents is {}, not an array", kind(&other)))),
            None => {
                return Err(error(
                    "it has no traceEvents array, so it is not a Chrome trace (the JSON that \
                     `Job::builder(plan).trace(path)` writes)"
                        .into(),
                ))
            }
        },
        Value::Array(events) => (events, None),
        other => return Err(error(format!("it is {}, not a Chrome trace object with traceEvents", kind(&other)))),
    };
    for (index, event) in events.iter().enumerate() {
        let Some(object) = event.as_object() else {
            return Err(error(format!("event {index} is {}, not an object", kind(event))));
        };
        if let Some(pid) = object.get("pid").filter(|pid| pid.as_u64().is_none()) {
            return Err(error(format!("event {index} has pid {pid}, not a whole number")));
        }
    }
    Ok(Input { file, events, display_time_unit })
}

/// A JSON value's kind, for messages.
fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn pid(event: &Value) -> Option<u64> {
    event.get("pid").and_then(Value::as_u64)
}

fn is_metadata(event: &Value) -> bool {
    event.get("ph").and_then(Value::as_str) == Some("M")
}

/// For each input, the new number of each pid it has non-metadata events on.
fn assign_pids(inputs: &[Input]) -> Vec<BTreeMap<u64, u64>> {
    let highest = inputs.iter().flat_map(|i| i.events.iter().filter_map(pid)).max();
    let mut fresh = highest.map_or(0, |p| p.saturating_add(1));
    let mut claimed = BTreeSet::new();
    inputs
        .iter()
        .map(|input| {
            let active: BTreeSet<u64> = input.events.iter().filter(|e| !is_metadata(e)).filter_map(pid).collect();
            active
                .into_iter()
                .map(|old| {
                    if claimed.insert(old) {
                        (old, old)
                    } else {
                        let new = fresh;
                        fresh += 1;
                        claimed.insert(new);
                        (old, new)
                    }
                })
                .collect()
        })
        .collect()
}

/// Moves `events` to `out` with their pids renumbered by `map`; a renumbered process's
/// name gets `label` (its file's name) appended. Returns the renumbered pids that had a name.
fn rename_processes(label: &str, events: Vec<Value>, map: &BTreeMap<u64, u64>, out: &mut Vec<Value>) -> Vec<u64> {
    let mut renamed = Vec::new();
    for mut event in events {
        if let Some(new) = pid(&event).and_then(|old| map.get(&old).copied().filter(|&new| new != old)) {
            event["pid"] = Value::from(new);
            if is_metadata(&event) && event.get("name").and_then(Value::as_str) == Some("process_name") {
                let name = event.pointer("/args/name").and_then(Value::as_str).unwrap_or("process").to_string();
                event["args"] = serde_json::json!({ "name": format!("{name} ({label})") });
                renamed.push(new);
            }
        }
        out.push(event);
    }
    renamed
}

/// A `process_name` metadata event.
fn process_name(pid: u64, name: &str) -> Value {
    serde_json::json!({ "name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": { "name": name } })
}

/// Warns when an arrow id starts in more than one input: the runtime gives each register
/// hand-off of a job its own id, so such files come from separate jobs (or runs) and
/// Perfetto would join their arrows.
fn warn_shared_flow_starts(inputs: &[Input]) {
    let mut first_file: HashMap<(String, u64), usize> = HashMap::new();
    let mut shared: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    for (index, input) in inputs.iter().enumerate() {
        let starts: BTreeSet<(String, u64)> = input
            .events
            .iter()
            .filter(|e| e.get("ph").and_then(Value::as_str) == Some("s"))
            .filter_map(|e| {
                let category = e.get("cat").and_then(Value::as_str).unwrap_or("").to_string();
                Some((category, e.get("id")?.as_u64()?))
            })
            .collect();
        for start in starts {
            match first_file.get(&start) {
                Some(&first) => *shared.entry((first, index)).or_default() += 1,
                None => {
                    first_file.insert(start, index);
                }
            }
        }
    }
    for ((first, second), count) in shared {
        eprintln!(
            "warning: {count} flow arrows start in both {} and {}; they look like traces of separate jobs, \
             and Perfetto joins arrows by id",
            inputs[first].file, inputs[second].file
        );
    }
}
