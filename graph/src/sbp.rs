//! Device meshes and SBP layouts: where a tensor lives (a [`Mesh`] of devices with named
//! axes) and how it is laid out on each mesh axis (`Split(dim)`, `Broadcast`, `Partial`),
//! with the reference semantics every parallel pass is tested against: [`scatter`] gives
//! each device its local value, [`gather`] rebuilds the logical tensor.
//!
//! Splits are balanced: a dimension of length `n` split into `p` parts gives the first
//! `n % p` parts one element more ([`part_range`]), so part sizes differ by at most one.
//! On an n-d mesh the axes apply in order: axis 0 splits the logical tensor, axis 1 splits
//! what axis 0 left, and so on (two axes may split one dimension; the parts nest).

use crate::plan::{DeviceKind, HostArray, Shape, TensorMeta};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::Range;

/// One device of a mesh: `(node, kind, index)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshDevice {
    /// Node (process) that owns it.
    pub node: u16,
    /// Backend kind.
    pub kind: DeviceKind,
    /// Index among the node's devices of this kind.
    pub index: u16,
}

impl fmt::Display for MeshDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.node == 0 {
            write!(f, "{}:{}", self.kind.name(), self.index)
        } else {
            write!(f, "node{}/{}:{}", self.node, self.kind.name(), self.index)
        }
    }
}

/// Most devices of one kind one node can hold: a [`MeshDevice`] index is 16-bit.
pub const MAX_DEVICES_PER_NODE: usize = 1 << 16;

/// The number of devices of a mesh shape, or an error when it overflows.
fn mesh_size(shape: &[usize]) -> Result<usize, String> {
    Shape::from(shape)
        .checked_numel()
        .ok_or_else(|| format!("mesh shape {} holds more than {} devices", Shape::from(shape), usize::MAX))
}

/// `'dp', 'tp'` (or `no names`).
fn quoted(names: &[&str]) -> String {
    if names.is_empty() {
        return "no names".to_string();
    }
    names.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ")
}

/// An n-d array of devices with named axes: a placement.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Mesh {
    devices: Vec<MeshDevice>,
    shape: Vec<usize>,
    axes: Vec<String>,
}

impl Mesh {
    /// A mesh of `devices` (row-major over `shape`) with one name per axis. Refused, in a
    /// sentence naming the shape and names: a mesh of no axis, axis names that do not
    /// match the axes one to one, an empty axis, a size that is not the device count.
    pub fn new(devices: Vec<MeshDevice>, shape: &[usize], axes: &[&str]) -> Result<Self, String> {
        let shown = Shape::from(shape);
        if shape.is_empty() {
            return Err("a mesh needs at least one axis, got shape []".to_string());
        }
        if shape.len() != axes.len() {
            return Err(format!(
                "mesh shape {shown} has {} axes and needs one name per axis, got {} name{} ({})",
                shape.len(),
                axes.len(),
                if axes.len() == 1 { "" } else { "s" },
                quoted(axes)
            ));
        }
        if let Some(axis) = shape.iter().position(|&n| n == 0) {
            return Err(format!(
                "mesh shape {shown} has an empty axis: axis {axis} ('{}') holds 0 devices",
                axes[axis]
            ));
        }
        let size = mesh_size(shape)?;
        if size != devices.len() {
            return Err(format!("mesh shape {shown} holds {size} devices, got {}", devices.len()));
        }
        let mut seen = std::collections::HashSet::with_capacity(devices.len());
        for d in &devices {
            if !seen.insert(*d) {
                return Err(format!("device {d} appears twice in the mesh"));
            }
        }
        for (i, a) in axes.iter().enumerate() {
            if a.is_empty() || axes[..i].contains(a) {
                return Err(format!("mesh axis names must be distinct and non-empty, got {}", quoted(axes)));
            }
        }
        Ok(Self { devices, shape: shape.to_vec(), axes: axes.iter().map(|a| a.to_string()).collect() })
    }

    /// The same mesh with its node-0 devices spread over nodes, `per_node` devices each:
    /// device `kind:i` becomes device `kind:(i % per_node)` of node `i / per_node`. Meshes of
    /// several pipeline stages spread with the same `per_node` keep their devices distinct.
    /// Refused for `per_node` 0 and for a mesh already on other nodes.
    ///
    /// ```
    /// use regflow_graph::sbp::Mesh;
    /// let mesh = Mesh::cpu(&[2, 2], &["dp", "tp"]).unwrap().place_on_nodes(2).unwrap();
    /// let shown: Vec<String> = mesh.devices().iter().map(ToString::to_string).collect();
    /// assert_eq!(shown, ["cpu:0", "cpu:1", "node1/cpu:0", "node1/cpu:1"]);
    /// ```
    pub fn place_on_nodes(&self, per_node: usize) -> Result<Self, String> {
        if per_node == 0 {
            return Err("a node needs at least one device: per_node is 0".to_string());
        }
        let mut devices = Vec::with_capacity(self.devices.len());
        for d in &self.devices {
            if d.node != 0 {
                return Err(format!("device {d} is already on node {}; only node-0 meshes are spread", d.node));
            }
            let i = usize::from(d.index);
            let node = u16::try_from(i / per_node)
                .map_err(|_| format!("device {d} with {per_node} device(s) per node needs node {}", i / per_node))?;
            devices.push(MeshDevice { node, kind: d.kind, index: (i % per_node) as u16 });
        }
        let axes: Vec<&str> = self.axes.iter().map(String::as_str).collect();
        Self::new(devices, &self.shape, &axes)
    }

    /// `cpu:0 .. cpu:n` of node 0 arranged as `shape`.
    pub fn cpu(shape: &[usize], axes: &[&str]) -> Result<Self, String> {
        Self::of_kind(DeviceKind::Cpu, shape, axes)
    }

    /// Devices `0 .. n` of one kind on node 0 arranged as `shape`. Refused when `n` is
    /// more than one node can index ([`MAX_DEVICES_PER_NODE`]), naming both.
    pub fn of_kind(kind: DeviceKind, shape: &[usize], axes: &[&str]) -> Result<Self, String> {
        let size = mesh_size(shape)?;
        if size > MAX_DEVICES_PER_NODE {
            return Err(format!(
                "mesh shape {} holds {size} devices, but one node indexes at most {MAX_DEVICES_PER_NODE} devices of a \
                 kind (device indices are 16-bit)",
                Shape::from(shape)
            ));
        }
        let devices = (0..=u16::MAX).take(size).map(|index| MeshDevice { node: 0, kind, index }).collect();
        Self::new(devices, shape, axes)
    }

    /// Devices, row-major over the mesh shape (a device's position is its rank).
    pub fn devices(&self) -> &[MeshDevice] {
        &self.devices
    }

    /// Devices along each axis.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Axis names.
    pub fn axes(&self) -> &[String] {
        &self.axes
    }

    /// Number of axes.
    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    /// Number of devices.
    pub fn size(&self) -> usize {
        self.devices.len()
    }

    /// Coordinates of the device of rank `rank`.
    pub fn coords(&self, rank: usize) -> Vec<usize> {
        let mut coords = vec![0; self.shape.len()];
        let mut rest = rank;
        for axis in (0..self.shape.len()).rev() {
            coords[axis] = rest % self.shape[axis];
            rest /= self.shape[axis];
        }
        coords
    }

    /// Rank of the device at `coords`.
    pub fn rank(&self, coords: &[usize]) -> usize {
        coords.iter().zip(&self.shape).fold(0, |rank, (c, n)| rank * n + c)
    }

    /// Ranks that differ from `rank` only on `axis`, in axis order: `rank`'s group for a
    /// collective over that axis.
    pub fn group(&self, rank: usize, axis: usize) -> Vec<usize> {
        let mut coords = self.coords(rank);
        (0..self.shape[axis])
            .map(|c| {
                coords[axis] = c;
                self.rank(&coords)
            })
            .collect()
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let first = self.devices[0];
        let contiguous = self.devices.iter().enumerate().all(|(i, d)| {
            d.node == first.node && d.kind == first.kind && usize::from(d.index) == usize::from(first.index) + i
        });
        if contiguous {
            write!(f, "{}:{}..{}", first.kind.name(), first.index, usize::from(first.index) + self.devices.len())?;
        } else {
            let names: Vec<String> = self.devices.iter().map(ToString::to_string).collect();
            write!(f, "{{{}}}", names.join(", "))?;
        }
        let axes: Vec<String> = self.axes.iter().zip(&self.shape).map(|(a, n)| format!("{a}={n}")).collect();
        write!(f, " [{}]", axes.join(", "))
    }
}

/// How a tensor is laid out along one mesh axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Sbp {
    /// Each device holds one part of dimension `.0` (balanced, sizes differ by at most one).
    Split(usize),
    /// Each device holds the whole tensor.
    Broadcast,
    /// Each device holds a summand: the tensor is the sum over the axis.
    Partial,
}

impl fmt::Display for Sbp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Sbp::Split(d) => write!(f, "S({d})"),
            Sbp::Broadcast => write!(f, "B"),
            Sbp::Partial => write!(f, "P"),
        }
    }
}

/// A layout on an n-d mesh: one [`Sbp`] per mesh axis.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NdSbp(pub Vec<Sbp>);

impl NdSbp {
    /// `Broadcast` on each of `ndim` axes.
    pub fn broadcast(ndim: usize) -> Self {
        NdSbp(vec![Sbp::Broadcast; ndim])
    }

    /// Checks the layout against a mesh and a tensor shape, in terms of the mesh's axis names.
    pub fn check(&self, mesh: &Mesh, shape: &Shape) -> Result<(), String> {
        if self.0.len() != mesh.ndim() {
            return Err(format!(
                "layout {self} has {} entries but mesh {mesh} has {} axes ({})",
                self.0.len(),
                mesh.ndim(),
                mesh.axes().join(", ")
            ));
        }
        for (axis, sbp) in self.0.iter().enumerate() {
            if let Sbp::Split(d) = sbp {
                if *d >= shape.rank() {
                    return Err(format!(
                        "split axis {d} on mesh axis '{}' is out of range for shape {shape} (rank {})",
                        mesh.axes()[axis],
                        shape.rank()
                    ));
                }
            }
        }
        Ok(())
    }

    /// Describes the layout with the mesh's axis names: `dp: S(0), tp: B`.
    pub fn describe(&self, mesh: &Mesh) -> String {
        let parts: Vec<String> = self.0.iter().zip(mesh.axes()).map(|(s, a)| format!("{a}: {s}")).collect();
        parts.join(", ")
    }
}

impl fmt::Display for NdSbp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        write!(f, "({})", parts.join(", "))
    }
}

/// How an op may run along one mesh axis: the layout of each input and output. Running
/// every device on whole inputs (all `Broadcast`) is always possible and never listed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SbpSignature {
    /// Layout each input must have.
    pub inputs: Vec<Sbp>,
    /// Layout each output then has.
    pub outputs: Vec<Sbp>,
}

impl SbpSignature {
    /// A signature from its input and output layouts.
    pub fn new(inputs: impl Into<Vec<Sbp>>, outputs: impl Into<Vec<Sbp>>) -> Self {
        Self { inputs: inputs.into(), outputs: outputs.into() }
    }

    /// The all-`Broadcast` signature of an op with these arities.
    pub fn broadcast(inputs: usize, outputs: usize) -> Self {
        Self { inputs: vec![Sbp::Broadcast; inputs], outputs: vec![Sbp::Broadcast; outputs] }
    }
}

impl fmt::Display for SbpSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |v: &[Sbp]| v.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ");
        write!(f, "({}) -> ({})", list(&self.inputs), list(&self.outputs))
    }
}

/// Elements `part` of `parts` holds of a dimension of length `len`: the first `len % parts`
/// parts get one element more.
pub fn part_range(len: usize, parts: usize, part: usize) -> Range<usize> {
    let (base, extra) = (len / parts, len % parts);
    let start = part * base + part.min(extra);
    start..start + base + usize::from(part < extra)
}

/// The shape and the per-dimension start offsets of the local value of the device at
/// `coords` (offsets into the logical tensor; a `Partial` axis does not move them).
pub fn local_region(shape: &Shape, layout: &NdSbp, mesh: &Mesh, coords: &[usize]) -> (Shape, Vec<usize>) {
    let mut dims = shape.dims().to_vec();
    let mut offsets = vec![0; dims.len()];
    for (axis, sbp) in layout.0.iter().enumerate() {
        if let Sbp::Split(d) = *sbp {
            if d < dims.len() {
                let range = part_range(dims[d], mesh.shape()[axis], coords[axis]);
                offsets[d] += range.start;
                dims[d] = range.len();
            }
        }
    }
    (Shape(dims), offsets)
}

/// Where the device at `coords` holds its part of a tensor of `shape` in `layout`, as plan
/// data: its offsets and local shape, and whether it is a `Partial` summand of zeros.
pub fn part_region(shape: &Shape, layout: &NdSbp, mesh: &Mesh, coords: &[usize]) -> crate::plan::Region {
    let (local, offsets) = local_region(shape, layout, mesh, coords);
    crate::plan::Region { offsets, shape: local.dims().to_vec(), zeros: !holds_partial_value(layout, coords) }
}

/// Local shape and dtype of the device at `coords`.
pub fn local_meta(meta: &TensorMeta, layout: &NdSbp, mesh: &Mesh, coords: &[usize]) -> TensorMeta {
    TensorMeta { shape: local_region(&meta.shape, layout, mesh, coords).0, dtype: meta.dtype }
}

/// Whether the device at `coords` holds the value (rather than zeros) of a `Partial`
/// layout: the first device along every partial axis does.
fn holds_partial_value(layout: &NdSbp, coords: &[usize]) -> bool {
    layout.0.iter().zip(coords).all(|(s, &c)| *s != Sbp::Partial || c == 0)
}

/// Each device's local value of `value` under `layout`, by rank: its region of every split,
/// and for `Partial` axes the whole value on the first device of the axis, zeros elsewhere.
pub fn scatter(value: &HostArray, layout: &NdSbp, mesh: &Mesh) -> Vec<HostArray> {
    (0..mesh.size())
        .map(|rank| {
            let coords = mesh.coords(rank);
            let (shape, offsets) = local_region(&value.shape, layout, mesh, &coords);
            let ranges: Vec<Range<usize>> = offsets.iter().zip(shape.dims()).map(|(&o, &n)| o..o + n).collect();
            let part = value.region(&ranges);
            if holds_partial_value(layout, &coords) {
                part
            } else {
                HostArray::zeros(&part.meta())
            }
        })
        .collect()
}

/// The logical tensor of shape `shape` from every device's local value (by rank) under
/// `layout`: splits are placed at their offsets, and `Partial` summands are added. Devices
/// that hold the same region through a `Broadcast` axis are read once (the first).
pub fn gather(locals: &[HostArray], shape: &Shape, layout: &NdSbp, mesh: &Mesh) -> Result<HostArray, String> {
    if locals.len() != mesh.size() {
        return Err(format!("{} local values for a mesh of {} devices", locals.len(), mesh.size()));
    }
    let dtype = locals[0].dtype();
    let mut out = HostArray::zeros(&TensorMeta::new(shape.clone(), dtype));
    for (rank, local) in locals.iter().enumerate() {
        let coords = mesh.coords(rank);
        // One representative per region: coordinate 0 on every broadcast axis.
        if layout.0.iter().zip(&coords).any(|(s, &c)| *s == Sbp::Broadcast && c != 0) {
            continue;
        }
        let (local_shape, offsets) = local_region(shape, layout, mesh, &coords);
        if local.shape != local_shape || local.dtype() != dtype {
            return Err(format!(
                "rank {rank} holds {}, expected {}",
                local.meta(),
                TensorMeta::new(local_shape, dtype)
            ));
        }
        let ranges: Vec<Range<usize>> = offsets.iter().zip(local_shape.dims()).map(|(&o, &n)| o..o + n).collect();
        let mut sum = out.region(&ranges);
        sum.add_assign(local);
        out.set_region(&offsets, &sum);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_balanced_and_cover() {
        for len in 0..12 {
            for parts in 1..5 {
                let ranges: Vec<_> = (0..parts).map(|p| part_range(len, parts, p)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[parts - 1].end, len);
                for w in ranges.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len() && w[0].len() - w[1].len() <= 1);
                }
            }
        }
    }

    #[test]
    fn scatter_then_gather_is_identity() {
        let mesh = Mesh::cpu(&[2, 3], &["dp", "tp"]).unwrap();
        let value = HostArray::f64([5, 4], (0..20).map(f64::from).collect()).unwrap();
        let layouts = [
            NdSbp(vec![Sbp::Split(0), Sbp::Split(1)]),
            NdSbp(vec![Sbp::Split(0), Sbp::Split(0)]),
            NdSbp(vec![Sbp::Partial, Sbp::Split(1)]),
            NdSbp(vec![Sbp::Broadcast, Sbp::Partial]),
            NdSbp(vec![Sbp::Split(1), Sbp::Broadcast]),
        ];
        for layout in layouts {
            let locals = scatter(&value, &layout, &mesh);
            assert_eq!(gather(&locals, &value.shape, &layout, &mesh).unwrap(), value, "{layout}");
        }
    }

    #[test]
    fn mesh_groups_and_errors() {
        let mesh = Mesh::cpu(&[2, 2], &["dp", "tp"]).unwrap();
        assert_eq!(mesh.group(3, 0), vec![1, 3]);
        assert_eq!(mesh.group(3, 1), vec![2, 3]);
        assert_eq!(mesh.to_string(), "cpu:0..4 [dp=2, tp=2]");
        assert!(Mesh::cpu(&[2, 2], &["dp"]).unwrap_err().contains("one name per axis"));
        let err = NdSbp(vec![Sbp::Split(2), Sbp::Broadcast]).check(&mesh, &Shape::new([4, 4])).unwrap_err();
        assert!(err.contains("split axis 2 on mesh axis 'dp' is out of range for shape [4, 4]"), "{err}");
    }
}
