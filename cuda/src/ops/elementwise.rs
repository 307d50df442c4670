//! Elementwise ops on CUDA (`elementwise.cu`): `unary`, `binary` with broadcasting,
//! `bias_gelu`, `bias_gelu_grad`, `dropout` and `dropout_part`. One grid-stride launch
//! each; broadcast index maps are computed when the kernel is made. Every op has entries
//! for f32, f64 and bf16; the bf16 ones compute in f32 and round each output once, as the
//! CPU's bf16 kernels do, and take their scalar arguments (constants, scales) as f32.

use super::layout::{self, Indexing};
use super::{factory, fail, function, op_conf, stream, suffix, Entry};
use crate::driver::{launch, Function, Grid};
use regflow_kernels::{HostCompute, Kernel, KernelError, KernelIo, KernelSpec};
use regflow_plan::ops::{BiasGelu, BiasGeluGrad, Binary, BinaryKind, Dropout, DropoutPart, Unary, UnaryKind};
use regflow_plan::{DType, OpConf};

const FLOAT: &[DType] = &[DType::F32, DType::F64, DType::Bf16, DType::F16];

pub(super) const ENTRIES: &[Entry] = &[
    ("unary", FLOAT, || factory(make_unary)),
    ("binary", FLOAT, || factory(make_binary)),
    ("bias_gelu", FLOAT, || factory(make_bias_gelu)),
    ("bias_gelu_grad", FLOAT, || factory(make_bias_gelu_grad)),
    ("dropout", FLOAT, || factory(make_dropout)),
    ("dropout_part", FLOAT, || factory(make_dropout_part)),
];

/// Runs the CPU kernel's meta check of `op`, so both devices refuse the same plans with
/// the same words.
pub(super) fn check<T: HostCompute>(spec: &KernelSpec<'_>, conf: &OpConf, op: &T) -> Result<(), KernelError> {
    op.check(&conf.inputs, &conf.outputs).map_err(|e| fail(spec, conf, e))
}

/// The float dtype of `conf`'s first output, or an error for an integer one.
pub(super) fn float_dtype(spec: &KernelSpec<'_>, conf: &OpConf) -> Result<DType, KernelError> {
    let dtype = conf.outputs.first().map(|m| m.dtype).ok_or_else(|| fail(spec, conf, "the op has no output"))?;
    if !dtype.is_float() {
        return Err(fail(spec, conf, format!("needs a float output, got {dtype}")));
    }
    Ok(dtype)
}

/// Checks that `conf` has `inputs` op inputs and `outputs` outputs.
pub(super) fn arity(spec: &KernelSpec<'_>, conf: &OpConf, inputs: usize, outputs: usize) -> Result<(), KernelError> {
    if conf.inputs.len() != inputs || conf.input_map.len() != inputs || conf.outputs.len() != outputs {
        return Err(fail(
            spec,
            conf,
            format!(
                "takes {inputs} input(s) and gives {outputs} output(s), but has {} (mapped {}) and {}",
                conf.inputs.len(),
                conf.input_map.len(),
                conf.outputs.len()
            ),
        ));
    }
    Ok(())
}

/// Which register of the actor holds each op input (a tick input comes after them).
pub(super) fn input_slots<const N: usize>(conf: &OpConf) -> [usize; N] {
    std::array::from_fn(|k| conf.input_map.get(k).copied().unwrap_or(k))
}

// ---- unary ---------------------------------------------------------------------------

/// The extra argument of a unary entry after (x, out).
#[derive(Debug, Clone, Copy)]
enum UnaryArg {
    /// `(x, out, n)`.
    None,
    /// `(x, out, c, n)`: the constant of `AddScalar`/`MulScalar`, rounded at launch to the
    /// type the entry computes in (f64 for f64, f32 for f32 and bf16).
    Scalar(f64),
    /// `(x, out, p: f64, n)`: `PowScalar`'s exponent, always f64.
    Exponent(f64),
}

/// The entry name stem and argument of a unary kind.
fn unary_entry(kind: UnaryKind) -> (&'static str, UnaryArg) {
    match kind {
        UnaryKind::Neg => ("neg", UnaryArg::None),
        UnaryKind::Relu => ("relu", UnaryArg::None),
        UnaryKind::Step => ("step", UnaryArg::None),
        UnaryKind::Exp => ("exp", UnaryArg::None),
        UnaryKind::Log => ("log", UnaryArg::None),
        UnaryKind::Sqrt => ("sqrt", UnaryArg::None),
        UnaryKind::Tanh => ("tanh", UnaryArg::None),
        UnaryKind::Sigmoid => ("sigmoid", UnaryArg::None),
        UnaryKind::Gelu => ("gelu", UnaryArg::None),
        UnaryKind::GeluDerivative => ("gelu_derivative", UnaryArg::None),
        UnaryKind::AddScalar(c) => ("add_scalar", UnaryArg::Scalar(c)),
        UnaryKind::MulScalar(c) => ("mul_scalar", UnaryArg::Scalar(c)),
        UnaryKind::PowScalar(p) => ("pow_scalar", UnaryArg::Exponent(p)),
    }
}

fn make_unary(spec: &KernelSpec<'_>) -> Result<UnaryKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Unary = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    check(spec, conf, &op)?;
    let dtype = float_dtype(spec, conf)?;
    let (stem, arg) = unary_entry(op.0);
    Ok(UnaryKernel {
        function: function(spec, &format!("regflow_unary_{stem}_{}", suffix(dtype)))?,
        input: input_slots::<1>(conf)[0],
        arg,
        dtype,
        n: conf.outputs[0].shape.numel() as u64,
    })
}

#[derive(Debug)]
struct UnaryKernel {
    function: Function,
    input: usize,
    arg: UnaryArg,
    dtype: DType,
    n: u64,
}

impl Kernel for UnaryKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (x, out, n) = (io.input_addr(self.input), io.output_addr(0), self.n);
        let (s, f, grid) = (stream(io), self.function, Grid::eights(n));
        // SAFETY: x and out hold n elements of the dtype (the op's checked metas); each
        // entry's parameters are as `UnaryArg` says, the scalar in the type the entry
        // computes in (f32 for bf16 and f16).
        unsafe {
            match (self.arg, self.dtype) {
                (UnaryArg::None, _) => launch(s, f, grid, &mut args![x, out, n]),
                (UnaryArg::Scalar(c), DType::F32 | DType::Bf16 | DType::F16) => {
                    launch(s, f, grid, &mut args![x, out, c as f32, n])
                }
                (UnaryArg::Scalar(c), _) => launch(s, f, grid, &mut args![x, out, c, n]),
                (UnaryArg::Exponent(p), _) => launch(s, f, grid, &mut args![x, out, p, n]),
            }
        }?;
        Ok(())
    }
}

// ---- binary --------------------------------------------------------------------------

fn make_binary(spec: &KernelSpec<'_>) -> Result<BinaryKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Binary = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    check(spec, conf, &op)?;
    let dtype = float_dtype(spec, conf)?;
    let stem = match op.0 {
        BinaryKind::Add => "add",
        BinaryKind::Sub => "sub",
        BinaryKind::Mul => "mul",
        BinaryKind::Div => "div",
        BinaryKind::ReluGrad => "relu_grad",
    };
    let (a, b, out) = (conf.inputs[0].shape.dims(), conf.inputs[1].shape.dims(), conf.outputs[0].shape.dims());
    // Operands of the output's shape need no index map; any broadcast does.
    let broadcast =
        if a == out && b == out { None } else { Some(layout::broadcast(out, a, b).map_err(|e| fail(spec, conf, e))?) };
    let variant = if broadcast.is_some() { "_broadcast" } else { "" };
    // A second output, the result narrowed (a cast folded in), has entries for operands of
    // the output's shape, which is what the compiler folds.
    let entry = match conf.outputs.get(1) {
        None => format!("regflow_binary_{stem}{variant}_{}", binary_suffix(conf, dtype)),
        Some(_) if broadcast.is_some() => {
            return Err(fail(spec, conf, "a second, narrowed output needs operands of the output's shape"))
        }
        Some(narrow) => format!("regflow_binary_{stem}_f32_and_{}", suffix(narrow.dtype)),
    };
    Ok(BinaryKernel {
        function: function(spec, &entry)?,
        inputs: input_slots(conf),
        broadcast,
        narrow: conf.outputs.len() == 2,
        n: conf.outputs[0].shape.numel() as u64,
    })
}

/// The entry suffix of a binary op's element types: the output's (`f32`), or, where the
/// check let one operand be 16-bit (a cast folded into the op), the output's, that
/// operand's and which one it is (`f32_bf16b`: `b` is bf16, read widened).
fn binary_suffix(conf: &OpConf, dtype: DType) -> String {
    let narrow = conf.inputs.iter().zip(["a", "b"]).find(|(meta, _)| meta.dtype != dtype);
    match narrow {
        None => suffix(dtype).to_string(),
        Some((meta, operand)) => format!("{}_{}{operand}", suffix(dtype), suffix(meta.dtype)),
    }
}

#[derive(Debug)]
struct BinaryKernel {
    function: Function,
    inputs: [usize; 2],
    broadcast: Option<Indexing>,
    /// Whether output 1 is output 0 narrowed (the `_f32_and_<narrow>` entries).
    narrow: bool,
    n: u64,
}

impl Kernel for BinaryKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (a, b, out, n) = (io.input_addr(self.inputs[0]), io.input_addr(self.inputs[1]), io.output_addr(0), self.n);
        let (s, f, grid) = (stream(io), self.function, Grid::eights(n));
        // SAFETY: operands and outputs hold the elements of their checked metas; the
        // broadcast map only reaches offsets inside the operands (strides of their shapes).
        unsafe {
            match (self.broadcast, self.narrow) {
                (None, false) => launch(s, f, grid, &mut args![a, b, out, n]),
                (None, true) => launch(s, f, grid, &mut args![a, b, out, io.output_addr(1), n]),
                (Some(map), _) => launch(s, f, grid, &mut args![a, b, out, map, n]),
            }
        }?;
        Ok(())
    }
}

// ---- bias GELU -----------------------------------------------------------------------

fn make_bias_gelu(spec: &KernelSpec<'_>) -> Result<BiasGeluKernel<2>, KernelError> {
    let conf = op_conf(spec)?;
    let op: BiasGelu = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    check(spec, conf, &op)?;
    bias_gelu_kernel(spec, conf, "regflow_bias_gelu")
}

fn make_bias_gelu_grad(spec: &KernelSpec<'_>) -> Result<BiasGeluKernel<3>, KernelError> {
    let conf = op_conf(spec)?;
    let op: BiasGeluGrad = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    check(spec, conf, &op)?;
    bias_gelu_kernel(spec, conf, "regflow_bias_gelu_grad")
}

fn bias_gelu_kernel<const N: usize>(
    spec: &KernelSpec<'_>,
    conf: &OpConf,
    stem: &str,
) -> Result<BiasGeluKernel<N>, KernelError> {
    let dtype = float_dtype(spec, conf)?;
    Ok(BiasGeluKernel {
        function: function(spec, &format!("{stem}_{}", suffix(dtype)))?,
        inputs: input_slots(conf),
        n: conf.inputs[0].shape.numel() as u64,
        // The check made the bias [width] for x [..., width] (rank >= 1).
        width: conf.inputs[1].shape.numel().max(1) as u64,
    })
}

/// `bias_gelu` (inputs x, bias) or its gradient (x, bias, dy).
#[derive(Debug)]
struct BiasGeluKernel<const N: usize> {
    function: Function,
    inputs: [usize; N],
    n: u64,
    width: u64,
}

impl<const N: usize> Kernel for BiasGeluKernel<N> {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (x, bias, out) = (io.input_addr(self.inputs[0]), io.input_addr(self.inputs[1]), io.output_addr(0));
        let (n, width) = (self.n, self.width);
        let (s, f, grid) = (stream(io), self.function, Grid::eights(n));
        // SAFETY: x, dy and out hold n elements, bias `width` (the checked metas); the
        // entries take (x, bias, [dy,] out, n, width).
        unsafe {
            if N == 3 {
                let dy = io.input_addr(self.inputs[N - 1]);
                launch(s, f, grid, &mut args![x, bias, dy, out, n, width])
            } else {
                launch(s, f, grid, &mut args![x, bias, out, n, width])
            }
        }?;
        Ok(())
    }
}

// ---- dropout -------------------------------------------------------------------------

/// The keep threshold of `Dropout::keeps`: `p · 2^64`, saturated by the cast as there.
pub(crate) fn dropout_threshold(p: f64) -> u64 {
    (p * 18_446_744_073_709_551_616.0) as u64
}

fn make_dropout(spec: &KernelSpec<'_>) -> Result<DropoutKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: Dropout = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    arity(spec, conf, 1, 1)?;
    dropout_kernel(spec, conf, op, None)
}

fn make_dropout_part(spec: &KernelSpec<'_>) -> Result<DropoutKernel, KernelError> {
    let conf = op_conf(spec)?;
    let op: DropoutPart = conf.parse_attrs().map_err(|e| fail(spec, conf, e))?;
    arity(spec, conf, 1, 1)?;
    let local = conf.inputs[0].shape.dims();
    if local.len() != op.offsets.len() || local.len() != op.logical.rank() {
        return Err(fail(
            spec,
            conf,
            format!(
                "a part of shape {} with {} offsets of a logical {}",
                conf.inputs[0].shape,
                op.offsets.len(),
                op.logical
            ),
        ));
    }
    // dims: the part's; a: the logical tensor's strides; b: the part's offsets.
    let map = Indexing::new(local, &op.logical.strides(), &op.offsets).map_err(|e| fail(spec, conf, e))?;
    dropout_kernel(spec, conf, op.dropout, Some(map))
}

fn dropout_kernel(
    spec: &KernelSpec<'_>,
    conf: &OpConf,
    op: Dropout,
    part: Option<Indexing>,
) -> Result<DropoutKernel, KernelError> {
    let dtype = float_dtype(spec, conf)?;
    if conf.inputs[0] != conf.outputs[0] {
        return Err(fail(
            spec,
            conf,
            format!("maps {} elementwise, but the output is {}", conf.inputs[0], conf.outputs[0]),
        ));
    }
    let stem = if part.is_some() { "dropout_part" } else { "dropout" };
    Ok(DropoutKernel {
        function: function(spec, &format!("regflow_{stem}_{}", suffix(dtype)))?,
        input: input_slots::<1>(conf)[0],
        part,
        n: conf.outputs[0].shape.numel() as u64,
        seed: op.seed,
        threshold: dropout_threshold(op.p),
        scale: 1.0 / (1.0 - op.p),
        dtype,
    })
}

#[derive(Debug)]
struct DropoutKernel {
    function: Function,
    input: usize,
    /// The index map of a `dropout_part`.
    part: Option<Indexing>,
    n: u64,
    seed: u64,
    threshold: u64,
    /// `1 / (1 - p)`, rounded at launch to the type the entry computes in (the CPU's
    /// `T::from_f64`): f64 for f64, f32 for f32 and bf16.
    scale: f64,
    dtype: DType,
}

impl Kernel for DropoutKernel {
    fn run(&mut self, io: &mut KernelIo<'_>) -> Result<(), KernelError> {
        let (x, out, n, seed, threshold) =
            (io.input_addr(self.input), io.output_addr(0), self.n, self.seed, self.threshold);
        let (s, f, grid) = (stream(io), self.function, Grid::linear(n));
        let scale32 = self.scale as f32;
        // SAFETY: x and out hold n elements of the dtype; the entries take (x, out, [map,]
        // n, seed, threshold, scale), the scale f32 for f32, bf16 and f16, f64 for f64.
        unsafe {
            match (self.part, self.dtype) {
                (None, DType::F32 | DType::Bf16 | DType::F16) => {
                    launch(s, f, grid, &mut args![x, out, n, seed, threshold, scale32])
                }
                (None, _) => launch(s, f, grid, &mut args![x, out, n, seed, threshold, self.scale]),
                (Some(map), DType::F32 | DType::Bf16 | DType::F16) => {
                    launch(s, f, grid, &mut args![x, out, map, n, seed, threshold, scale32])
                }
                (Some(map), _) => launch(s, f, grid, &mut args![x, out, map, n, seed, threshold, self.scale]),
            }
        }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::all_entry_names;

    fn declared() -> Vec<&'static str> {
        all_entry_names().collect()
    }

    #[test]
    fn every_unary_kind_has_entries_for_every_float_dtype() {
        let kinds = [
            UnaryKind::Neg,
            UnaryKind::Relu,
            UnaryKind::Step,
            UnaryKind::Exp,
            UnaryKind::Log,
            UnaryKind::Sqrt,
            UnaryKind::Tanh,
            UnaryKind::Sigmoid,
            UnaryKind::Gelu,
            UnaryKind::GeluDerivative,
            UnaryKind::AddScalar(1.0),
            UnaryKind::MulScalar(1.0),
            UnaryKind::PowScalar(1.0),
        ];
        let entries = declared();
        for kind in kinds {
            for dtype in FLOAT {
                let name = format!("regflow_unary_{}_{}", unary_entry(kind).0, suffix(*dtype));
                assert!(entries.contains(&name.as_str()), "{name}");
            }
        }
    }

    #[test]
    fn binary_bias_gelu_and_dropout_entries_exist() {
        let entries = declared();
        for dtype in ["f32", "f64", "bf16"] {
            for stem in ["add", "sub", "mul", "div"] {
                for variant in ["", "_broadcast"] {
                    let name = format!("regflow_binary_{stem}{variant}_{dtype}");
                    assert!(entries.contains(&name.as_str()), "{name}");
                }
            }
            for stem in ["bias_gelu", "bias_gelu_grad", "dropout", "dropout_part"] {
                let name = format!("regflow_{stem}_{dtype}");
                assert!(entries.contains(&name.as_str()), "{name}");
            }
        }
    }

    #[test]
    fn a_binary_op_with_a_16_bit_operand_or_output_has_an_entry_per_kind_and_side() {
        let entries = declared();
        let meta = |dtype| regflow_plan::TensorMeta::new([4, 8], dtype);
        for narrow in [DType::Bf16, DType::F16] {
            for (a, b, side) in [(narrow, DType::F32, "a"), (DType::F32, narrow, "b")] {
                let conf =
                    OpConf::new(&Binary(BinaryKind::Add), vec![meta(a), meta(b)], vec![0, 1], vec![meta(DType::F32)]);
                let suffix = binary_suffix(&conf, DType::F32);
                assert_eq!(suffix, format!("f32_{narrow}{side}"));
                for stem in ["add", "sub", "mul", "div", "relu_grad"] {
                    for variant in ["", "_broadcast"] {
                        let name = format!("regflow_binary_{stem}{variant}_{suffix}");
                        assert!(entries.contains(&name.as_str()), "{name}");
                    }
                }
            }
        }
        for narrow in ["bf16", "f16"] {
            for stem in ["add", "sub", "mul", "div", "relu_grad"] {
                let name = format!("regflow_binary_{stem}_f32_and_{narrow}");
                assert!(entries.contains(&name.as_str()), "{name}");
            }
        }
        let same = OpConf::new(&Binary(BinaryKind::Add), vec![meta(DType::F32); 2], vec![0, 1], vec![meta(DType::F32)]);
        assert_eq!(binary_suffix(&same, DType::F32), "f32");
    }

    #[test]
    fn the_threshold_keeps_what_the_cpu_keeps() {
        // The device compares the same first SplitMix64 output against this threshold.
        for p in [0.0, 0.1, 0.5, 0.999] {
            let op = Dropout { p, seed: 42 };
            let threshold = dropout_threshold(p);
            for i in 0..1000usize {
                let mut rng = regflow_plan::SplitMix64::new(
                    42u64.wrapping_add((i as u64).wrapping_mul(regflow_plan::ops::GAMMA)),
                );
                assert_eq!(rng.next_u64() >= threshold, op.keeps(i), "p {p}, element {i}");
            }
        }
        assert_eq!(dropout_threshold(0.0), 0);
    }
}
