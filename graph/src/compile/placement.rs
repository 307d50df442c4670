//! Placement: the mesh of every tensor the step needs, the meshes in pipeline order with
//! their stages, and the plan's devices, each with the meshes and ranks it serves.

use super::error::CompileError;
use super::options::Scope;
use super::step::StepFacts;
use crate::dsl::{Graph, TensorId};
use crate::sbp::{Mesh, MeshDevice};
use std::collections::HashMap;
use std::sync::Arc;

/// Where the step runs. Every index in it is made from the same list of meshes, so a
/// mesh's rank always has a device slot and every device a home mesh.
#[derive(Debug)]
pub(crate) struct Placement {
    /// Meshes in the order ops first run on them (graph order: the forward pass goes
    /// through the stages in order), then those only inputs or variables use.
    pub(crate) meshes: Vec<Arc<Mesh>>,
    /// Pipeline stage of each mesh: a mesh that shares no device with an earlier one
    /// starts a new stage.
    pub(crate) stage: Vec<usize>,
    /// Number of stages.
    pub(crate) stages: usize,
    /// The plan's devices (their *slots* are indices here), in order of first appearance.
    pub(crate) devices: Vec<MeshDevice>,
    /// For every device slot, the first mesh holding it (whose stage sets its tick's
    /// register count).
    pub(crate) home: Vec<usize>,
    /// Mesh index of every needed tensor.
    mesh_of: HashMap<TensorId, usize>,
    /// For every mesh, by rank, the device slot.
    slots: Vec<Vec<usize>>,
    names: HashMap<TensorId, String>,
}

impl Placement {
    /// The mesh (index into `meshes`) of tensor `t`.
    pub(crate) fn mesh_of(&self, t: TensorId) -> Result<usize, CompileError> {
        self.mesh_of.get(&t).copied().ok_or_else(|| CompileError::UnknownPlacement {
            tensor: self.names.get(&t).cloned().unwrap_or_else(|| format!("#{}", t.0)),
        })
    }

    /// The mesh of tensor `t`.
    pub(crate) fn mesh(&self, t: TensorId) -> Result<&Arc<Mesh>, CompileError> {
        Ok(&self.meshes[self.mesh_of(t)?])
    }

    /// The device slot of rank `rank` of mesh `mesh`.
    pub(crate) fn slot(&self, mesh: usize, rank: usize) -> usize {
        self.slots[mesh][rank]
    }

    /// Whether the plan has one device (its names then carry no `@device` suffix).
    pub(crate) fn single_device(&self) -> bool {
        self.devices.len() == 1
    }
}

/// Places every tensor the step needs on a mesh and lists the meshes, stages and devices.
pub(crate) fn place(graph: &Graph, facts: &StepFacts, default: &Mesh, scope: Scope) -> Result<Placement, CompileError> {
    let default = Arc::new(default.clone());
    let tensor_mesh = match scope {
        Scope::OneDevice => facts.needed_tensors().map(|t| (t, default.clone())).collect(),
        Scope::Placements => tensor_meshes(graph, facts, &default),
    };
    check_dataset(graph, facts, &tensor_mesh)?;
    // Meshes in the order ops first run on them, then any only inputs or variables use.
    let order = facts
        .nodes
        .iter()
        .flat_map(|n| n.outputs.iter().copied())
        .chain((0..graph.tensor_count()).map(|i| TensorId(i as u32)));
    let mut meshes: Vec<Arc<Mesh>> = Vec::new();
    let mut mesh_of = HashMap::new();
    for t in order {
        let Some(m) = tensor_mesh.get(&t) else { continue };
        let index = match meshes.iter().position(|x| **x == **m) {
            Some(index) => index,
            None => {
                meshes.push(m.clone());
                meshes.len() - 1
            }
        };
        mesh_of.insert(t, index);
    }
    let (stage, stages) = stages(&meshes);
    let mut devices: Vec<MeshDevice> = Vec::new();
    let mut home = Vec::new();
    let mut slots = Vec::with_capacity(meshes.len());
    for (index, m) in meshes.iter().enumerate() {
        let mut by_rank = Vec::with_capacity(m.size());
        for d in m.devices() {
            let slot = match devices.iter().position(|x| x == d) {
                Some(slot) => slot,
                None => {
                    devices.push(*d);
                    home.push(index);
                    devices.len() - 1
                }
            };
            by_rank.push(slot);
        }
        slots.push(by_rank);
    }
    let names = mesh_of.keys().map(|t| (*t, graph.info(*t).name)).collect();
    Ok(Placement { meshes, stage, stages, devices, home, mesh_of, slots, names })
}

/// The mesh of every tensor the step needs: its placement, or its consumers' (constants,
/// the optimizer's step counter and state), or the default mesh.
fn tensor_meshes(graph: &Graph, facts: &StepFacts, default: &Arc<Mesh>) -> HashMap<TensorId, Arc<Mesh>> {
    let mut mesh: HashMap<TensorId, Arc<Mesh>> =
        facts.needed_tensors().filter_map(|t| graph.placement(t).map(|m| (t, m))).collect();
    for node in facts.nodes.iter().rev() {
        let Some(m) = node.outputs.iter().find_map(|o| mesh.get(o).cloned()) else { continue };
        for i in node.inputs.iter().filter(|i| facts.needed(**i)) {
            mesh.entry(*i).or_insert_with(|| m.clone());
        }
    }
    for t in facts.needed_tensors() {
        mesh.entry(t).or_insert_with(|| default.clone());
    }
    // Op outputs follow their (now placed) inputs when they had no placement of their own.
    for node in &facts.nodes {
        if node.outputs.iter().any(|o| graph.placement(*o).is_some()) {
            continue;
        }
        if let Some(m) = node.inputs.iter().find_map(|i| graph.placement(*i)) {
            for o in node.outputs.iter().filter(|o| facts.needed(**o)) {
                mesh.insert(*o, m.clone());
            }
        }
    }
    mesh
}

/// One dataset source serves all its inputs, so they must share a mesh.
fn check_dataset(
    graph: &Graph,
    facts: &StepFacts,
    tensor_mesh: &HashMap<TensorId, Arc<Mesh>>,
) -> Result<(), CompileError> {
    let Some(first) = facts.dataset.first() else { return Ok(()) };
    let mesh_of =
        |t: &TensorId| tensor_mesh.get(t).ok_or_else(|| CompileError::UnknownPlacement { tensor: graph.info(*t).name });
    let first_mesh = mesh_of(first)?;
    for other in &facts.dataset[1..] {
        let other_mesh = mesh_of(other)?;
        if other_mesh != first_mesh {
            return Err(CompileError::DatasetPlacements {
                first: graph.info(*first).name,
                first_mesh: first_mesh.to_string(),
                other: graph.info(*other).name,
                other_mesh: other_mesh.to_string(),
            });
        }
    }
    Ok(())
}

/// The pipeline stage of every mesh, and the number of stages: a mesh that shares no
/// device with an earlier one starts a new stage.
fn stages(meshes: &[Arc<Mesh>]) -> (Vec<usize>, usize) {
    let mut stage = Vec::with_capacity(meshes.len());
    let mut stages = 0;
    for (i, m) in meshes.iter().enumerate() {
        let shared = (0..i).find(|&j| meshes[j].devices().iter().any(|d| m.devices().contains(d)));
        stage.push(match shared {
            Some(j) => stage[j],
            None => {
                stages += 1;
                stages - 1
            }
        });
    }
    (stage, stages)
}
