//! Emit: the plan's variables, the validated plan, and what the program gets with it (the
//! names it feeds, fetches and preloads by; for a mesh, the layouts and collectives).

use super::compiled::{CompiledGraph, CompiledVariable, ParallelInfo};
use super::error::CompileError;
use super::lower::Lowering;
use super::options::Scope;
use crate::sbp::NdSbp;

/// Builds (and so validates) the plan and the [`CompiledGraph`] around it.
pub(crate) fn emit(low: Lowering<'_>, collectives: Vec<String>, scope: Scope) -> Result<CompiledGraph, CompileError> {
    let Lowering { graph, layouts, options, collectives_on_compute, copies_on_compute, mut b, out, .. } = low;
    b.plan_mut().variables = out.variables;
    b.plan_mut().check_finite = options.check_finite;
    let plan = b.build()?;
    let mut variables = Vec::with_capacity(plan.variables.len());
    let mut named: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for desc in &plan.regst_descs {
        *named.entry(desc.name.as_str()).or_default() += 1;
    }
    for variable in &plan.variables {
        // The register is named by the plan itself, and preloading by that name must
        // find this register alone.
        let regst = plan.regst_descs[variable.regst.index()].name.clone();
        if named.get(regst.as_str()) != Some(&1) {
            return Err(CompileError::AmbiguousVariableRegister { variable: variable.name.clone(), regst });
        }
        variables.push(CompiledVariable { name: variable.name.clone(), regst });
    }
    let parallel = match scope {
        Scope::OneDevice => None,
        Scope::Placements => {
            let mut named: Vec<(String, NdSbp)> =
                layouts.visible.iter().map(|(t, l)| (graph.info(*t).name, l.clone())).collect();
            named.sort_by(|a, b| a.0.cmp(&b.0));
            Some(ParallelInfo {
                mesh: options.mesh.clone(),
                inputs: out.parallel_inputs,
                fetch_layouts: out.fetch_layouts,
                fetch_parts: out.fetch_parts,
                layouts: named,
                collectives,
                collectives_on_compute_streams: collectives_on_compute,
                copies_on_compute_streams: copies_on_compute,
            })
        }
    };
    Ok(CompiledGraph { plan, inputs: out.inputs, fetches: out.fetches, variables, parallel })
}
