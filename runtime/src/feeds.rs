//! Typed feeds and fetches of a plan's signature: each logical value fed is checked
//! against the input's shape and dtype, cut into its devices' parts by the regions the plan
//! records, and pushed to each part's fed source; each value fetched comes back as a
//! [`HostArray`] of the output's meta.

use crate::io::Patience;
use crate::{Feeder, Fetcher, Job, RuntimeError};
use regflow_plan::{HostArray, HostData, Region, TensorMeta};
use std::time::{Duration, Instant};

/// Typed feeds of every input of a plan's signature.
#[derive(Debug)]
pub struct GraphFeeds {
    inputs: Vec<FedInput>,
}

#[derive(Debug)]
struct FedInput {
    name: String,
    meta: TensorMeta,
    /// Each part's region and its source's feeder.
    parts: Vec<(Region, Feeder)>,
}

impl Job {
    /// Takes the feeders of every input of the plan's signature, for typed pushes of whole
    /// (logical) values.
    ///
    /// In a job that runs one node of several, only the parts whose sources run on this
    /// node are fed: every node pushes the same logical values (as every rank of a
    /// `torchrun` program loads the same batches) and each keeps its own parts.
    pub fn graph_feeds(&mut self) -> Result<GraphFeeds, RuntimeError> {
        let signature = self.plan().signature.inputs.clone();
        let mut inputs = Vec::with_capacity(signature.len());
        for input in signature {
            let mut parts = Vec::with_capacity(input.parts.len());
            for part in input.parts {
                if !self.runs(part.actor) {
                    continue;
                }
                let name = self.plan().actors[part.actor.index()].name.clone();
                parts.push((part.region, self.feeder(&name)?));
            }
            inputs.push(FedInput { name: input.name, meta: input.meta, parts });
        }
        Ok(GraphFeeds { inputs })
    }
}

impl GraphFeeds {
    /// The inputs' names and metas, in the plan's order.
    pub fn inputs(&self) -> impl Iterator<Item = (&str, &TensorMeta)> {
        self.inputs.iter().map(|i| (i.name.as_str(), &i.meta))
    }

    /// Pushes the next value of input `name`, waiting while its sources are full (the
    /// job's backpressure). An unknown name is an error listing the nearest inputs; if the
    /// job stops while the push waits, the error says why (see [`Feeder::push`]).
    pub fn push(&mut self, name: &str, value: &HostArray) -> Result<(), RuntimeError> {
        self.push_within(name, value, Patience::Forever).map(|_| ())
    }

    /// Pushes the next value of input `name` if every one of its sources has room now:
    /// `Ok(true)` when pushed, `Ok(false)` (nothing pushed, to any part) when one is full.
    /// Errors as [`GraphFeeds::push`].
    pub fn try_push(&mut self, name: &str, value: &HostArray) -> Result<bool, RuntimeError> {
        self.push_within(name, value, Patience::None)
    }

    /// Pushes the next value of input `name`, waiting at most `timeout` for room in its
    /// sources: `Ok(true)` when pushed, `Ok(false)` (nothing pushed, to any part) when one
    /// stayed full. Errors as [`GraphFeeds::push`].
    pub fn push_timeout(&mut self, name: &str, value: &HostArray, timeout: Duration) -> Result<bool, RuntimeError> {
        self.push_within(name, value, Patience::Until(Instant::now() + timeout))
    }

    fn push_within(&mut self, name: &str, value: &HostArray, patience: Patience) -> Result<bool, RuntimeError> {
        let Some(input) = self.inputs.iter_mut().find(|i| i.name == name) else {
            let known: Vec<&str> = self.inputs.iter().map(|i| i.name.as_str()).collect();
            return Err(RuntimeError::unknown_name("input", name, &known));
        };
        if value.meta() != input.meta {
            return Err(RuntimeError::Feed {
                input: name.to_string(),
                message: format!("got {}, expected {}", value.meta(), input.meta),
            });
        }
        let element = input.meta.dtype.size();
        let part_bytes = |region: &Region| region.shape.iter().product::<usize>() * element;
        for (region, feeder) in &input.parts {
            feeder.check(part_bytes(region))?;
        }
        // A buffer for every part before any part is sent: a value is pushed whole or not
        // at all. A buffer reserved for a push that then gives up stays with its feeder for
        // the next push; it withholds no piece from the job.
        for (_, feeder) in &mut input.parts {
            if !feeder.reserve(patience)? {
                return Ok(false);
            }
        }
        for (region, feeder) in &mut input.parts {
            feeder.send_reserved(part_bytes(region), |buffer| write_part(value, region, buffer))?;
        }
        Ok(true)
    }

    /// Ends every input: the job finishes once the pushed steps are through.
    pub fn close(&mut self) -> Result<(), RuntimeError> {
        for input in &mut self.inputs {
            for (_, feeder) in &mut input.parts {
                feeder.close()?;
            }
        }
        Ok(())
    }
}

/// Typed fetches of one output of a plan's signature: each value a [`HostArray`] of the
/// output's meta, or a scalar as `f64`.
#[derive(Debug)]
pub struct GraphFetcher {
    name: String,
    meta: TensorMeta,
    fetcher: Fetcher,
}

/// Typed fetches of every output of a plan's signature, in fetch order.
#[derive(Debug)]
pub struct GraphFetches {
    outputs: Vec<GraphFetcher>,
}

impl Job {
    /// The typed fetcher of output `name`: the signature's name (`fetch:0`) or its sink's
    /// (what `CompiledGraph::fetches` lists). An unknown name is an error listing the
    /// nearest outputs.
    pub fn graph_fetcher(&mut self, name: &str) -> Result<GraphFetcher, RuntimeError> {
        let outputs = &self.plan().signature.outputs;
        let found = outputs.iter().find(|o| o.name == name || self.plan().actors[o.actor.index()].name == name);
        let Some(output) = found.cloned() else {
            let known: Vec<&str> = outputs.iter().map(|o| o.name.as_str()).collect();
            return Err(RuntimeError::unknown_name("output", name, &known));
        };
        let sink = self.plan().actors[output.actor.index()].name.clone();
        Ok(GraphFetcher { name: output.name, meta: output.meta, fetcher: self.fetcher(&sink)? })
    }

    /// Takes the fetchers of every output of the plan's signature, for typed fetches.
    pub fn graph_fetches(&mut self) -> Result<GraphFetches, RuntimeError> {
        let names: Vec<String> = self.plan().signature.outputs.iter().map(|o| o.name.clone()).collect();
        let outputs = names.iter().map(|name| self.graph_fetcher(name)).collect::<Result<_, _>>()?;
        Ok(GraphFetches { outputs })
    }
}

impl GraphFetcher {
    /// The output's name in the signature (`fetch:0`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Shape and dtype of every value.
    pub fn meta(&self) -> &TensorMeta {
        &self.meta
    }

    /// The next value; `Ok(None)` once the output has delivered its last one (or the job
    /// stopped: [`Job::wait`] says why).
    pub fn recv(&self) -> Result<Option<HostArray>, RuntimeError> {
        let Some(piece) = self.fetcher.recv() else { return Ok(None) };
        crate::job::host_array(&self.meta, piece.bytes())
            .map(Some)
            .map_err(|message| RuntimeError::Fetch { output: self.name.clone(), message })
    }

    /// The next value of a scalar output (one element of any dtype, e.g. a loss) as `f64`;
    /// `Ok(None)` at the end. An output of more elements is an error naming its meta.
    pub fn recv_scalar(&self) -> Result<Option<f64>, RuntimeError> {
        if self.meta.shape.numel() != 1 {
            return Err(RuntimeError::Fetch {
                output: self.name.clone(),
                message: format!("it is {}, not a scalar; use recv for tensors", self.meta),
            });
        }
        Ok(self.recv()?.map(|value| value.to_f64_vec()[0]))
    }

    /// The untyped fetcher underneath (its bytes, without a copy into a [`HostArray`]).
    pub fn fetcher(&self) -> &Fetcher {
        &self.fetcher
    }
}

impl GraphFetches {
    /// The outputs' names and metas, in fetch order.
    pub fn outputs(&self) -> impl Iterator<Item = (&str, &TensorMeta)> {
        self.outputs.iter().map(|o| (o.name.as_str(), &o.meta))
    }

    /// The fetcher of output `name` (`fetch:0`); an unknown name is an error listing the
    /// nearest outputs.
    pub fn get(&self, name: &str) -> Result<&GraphFetcher, RuntimeError> {
        self.outputs.iter().find(|o| o.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.outputs.iter().map(|o| o.name.as_str()).collect();
            RuntimeError::unknown_name("output", name, &known)
        })
    }

    /// The next value of output `name`, as [`GraphFetcher::recv`].
    pub fn recv(&self, name: &str) -> Result<Option<HostArray>, RuntimeError> {
        self.get(name)?.recv()
    }

    /// The next value of every output, in fetch order (one step's results); `Ok(None)` once
    /// any output has ended.
    pub fn recv_all(&self) -> Result<Option<Vec<HostArray>>, RuntimeError> {
        let mut values = Vec::with_capacity(self.outputs.len());
        for output in &self.outputs {
            match output.recv()? {
                Some(value) => values.push(value),
                None => return Ok(None),
            }
        }
        Ok(Some(values))
    }

    /// The fetchers, in fetch order.
    pub fn into_fetchers(self) -> Vec<GraphFetcher> {
        self.outputs
    }
}

/// Appends the little-endian bytes of `region`'s part of `value` to `out`: the bytes of
/// `region.cut(value).to_le_bytes()`, without the two arrays in between (a push per part
/// per piece is the feeding hot path).
fn write_part(value: &HostArray, region: &Region, out: &mut Vec<u8>) {
    let dims = value.shape.dims();
    match &value.data {
        HostData::F32(elements) => write_rows(elements, dims, region, out),
        HostData::F64(elements) => write_rows(elements, dims, region, out),
        HostData::I64(elements) => write_rows(elements, dims, region, out),
        HostData::Bf16(elements) => write_rows(elements, dims, region, out),
        HostData::F16(elements) => write_rows(elements, dims, region, out),
    }
}

/// Appends `run`'s elements as little-endian bytes. On a little-endian host those are
/// the elements' own bytes, copied as one block: a feed of a batch is megabytes, and an
/// element-by-element conversion cost the feeding thread about 0.8 ms per 784 × 256 f32
/// batch, taken from the devices' cores (issue 13, "twentieth").
fn extend_le<T: bytemuck::Pod>(out: &mut Vec<u8>, run: &[T]) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(run));
    } else {
        // Every element type here is one number, whose bytes reverse between the orders.
        for x in run {
            out.extend(bytemuck::bytes_of(x).iter().rev());
        }
    }
}

/// [`write_part`] for elements of one type: the region's rows (runs along the last
/// dimension) are contiguous in `elements`, which are row-major of shape `dims`.
fn write_rows<T: bytemuck::Pod>(elements: &[T], dims: &[usize], region: &Region, out: &mut Vec<u8>) {
    if region.zeros {
        // Zero is all zero bytes in every dtype.
        out.resize(out.len() + region.shape.iter().product::<usize>() * std::mem::size_of::<T>(), 0);
        return;
    }
    if region.shape == dims {
        extend_le(out, elements);
        return;
    }
    let (row, outer) = region.shape.split_last().map_or((1, &[][..]), |(&row, outer)| (row, outer));
    let row_start = region.offsets.last().copied().unwrap_or(0);
    let row_stride = dims.last().copied().unwrap_or(1);
    for k in 0..outer.iter().product::<usize>() {
        // Row `k`'s index in the region's outer dimensions, last first, and with it the
        // row's start in `elements`.
        let (mut rest, mut start, mut stride) = (k, row_start, row_stride);
        for d in (0..outer.len()).rev() {
            start += (region.offsets[d] + rest % outer[d]) * stride;
            rest /= outer[d];
            stride *= dims[d];
        }
        extend_le(out, &elements[start..start + row]);
    }
}

#[cfg(test)]
mod tests {
    use super::write_part;
    use regflow_plan::{HostArray, Region};

    /// Every region of a few shapes, zero parts included, in every dtype.
    #[test]
    fn written_parts_are_the_cut_regions_bytes() {
        for dims in [vec![], vec![5], vec![3, 4], vec![2, 3, 4]] {
            let numel: usize = dims.iter().product();
            let values = [
                HostArray::f32(dims.clone(), (0..numel).map(|i| i as f32 + 0.5).collect()),
                HostArray::f64(dims.clone(), (0..numel).map(|i| -(i as f64)).collect()),
                HostArray::i64(dims.clone(), (0..numel as i64).map(|i| i * 7 - 3).collect()),
                HostArray::bf16_from_f32(dims.clone(), &(0..numel).map(|i| i as f32 - 1.5).collect::<Vec<_>>()),
                HostArray::f16_from_f32(dims.clone(), &(0..numel).map(|i| 0.25 * i as f32).collect::<Vec<_>>()),
            ];
            for value in values.iter().map(|v| v.as_ref().expect("element count matches the shape")) {
                for region in regions(&dims) {
                    let mut written = vec![9u8];
                    write_part(value, &region, &mut written);
                    assert_eq!(written[1..], region.cut(value).to_le_bytes(), "{dims:?} {region:?}");
                }
            }
        }
    }

    /// Every (offset, length) per dimension with length at least 1, each also as a zero part.
    fn regions(dims: &[usize]) -> Vec<Region> {
        let mut regions = vec![Region { offsets: vec![], shape: vec![], zeros: false }];
        for &d in dims {
            let mut longer = Vec::new();
            for region in &regions {
                for offset in 0..d {
                    for len in 1..=d - offset {
                        let mut r: Region = region.clone();
                        r.offsets.push(offset);
                        r.shape.push(len);
                        longer.push(r);
                    }
                }
            }
            regions = longer;
        }
        let zeros: Vec<Region> = regions.iter().map(|r| Region { zeros: true, ..r.clone() }).collect();
        regions.extend(zeros);
        regions
    }
}
