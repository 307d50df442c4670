//! Tensor metadata (dtypes, shapes, broadcasting) and host arrays: the values a graph is
//! fed, evaluated to and checked against, and the typed slices host kernels compute on.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::Range;

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float (gradient checks, precise training).
    F64,
    /// 64-bit signed integer (labels, indices).
    I64,
    /// bfloat16: f32's sign and exponent with a 7-bit mantissa (2 bytes). Values travel
    /// as their 16 bits (`half::bf16`); host kernels compute on them in f32 and round the
    /// result to nearest even, as tensor cores do (mixed-precision training).
    Bf16,
    /// IEEE half precision: 5 exponent bits, 10 mantissa bits (2 bytes, `half::f16`),
    /// largest finite value 65504. Host kernels compute on it in f32 and round the
    /// result to nearest even, as for bf16; mixed-precision training in f16 needs loss
    /// scaling (`Optimizer::with_loss_scale`), which `Precision::F16` turns on.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bf16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::Bf16 | DType::F16)
    }

    /// The largest finite value of this dtype, as f64 (`i64::MAX` rounded for i64).
    pub fn max_finite(self) -> f64 {
        match self {
            DType::F32 => f64::from(f32::MAX),
            DType::F64 => f64::MAX,
            DType::I64 => i64::MAX as f64,
            DType::Bf16 => half::bf16::MAX.to_f64(),
            DType::F16 => half::f16::MAX.to_f64(),
        }
    }

    /// Whether this is a 16-bit float (bf16 or f16): stored narrow, computed in f32 by
    /// host kernels, the low dtype of mixed precision.
    pub fn is_half(self) -> bool {
        matches!(self, DType::Bf16 | DType::F16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        })
    }
}

/// Dimensions of a tensor, outermost first. `[]` is a scalar.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    /// A shape from its dimensions.
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }

    /// The scalar shape `[]`.
    pub fn scalar() -> Self {
        Shape(Vec::new())
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of elements (1 for a scalar). A shape whose count does not fit a `usize`
    /// gives `usize::MAX` rather than a wrapped small number, so it never matches a real
    /// buffer; [`Shape::checked_numel`] says so instead.
    pub fn numel(&self) -> usize {
        self.checked_numel().unwrap_or(usize::MAX)
    }

    /// Number of elements, or `None` when the dimensions multiply past `usize::MAX`. Zero
    /// dimensions count as 1 for the overflow test: a shape is only representable when
    /// every partial product of its dimensions (what strides and kernels compute) fits.
    pub fn checked_numel(&self) -> Option<usize> {
        let mut nonzero: usize = 1;
        for &d in &self.0 {
            nonzero = nonzero.checked_mul(d.max(1))?;
        }
        Some(if self.0.contains(&0) { 0 } else { nonzero })
    }

    /// Row-major strides in elements (saturating: an overflowing shape is refused where it
    /// is made, see [`Shape::checked_numel`]).
    pub fn strides(&self) -> Vec<usize> {
        let mut strides = vec![1usize; self.rank()];
        for i in (0..self.rank().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1].saturating_mul(self.0[i + 1]);
        }
        strides
    }

    /// The shape two shapes broadcast to (numpy rules: align from the right, a dimension
    /// of 1 stretches), or `None` if they do not broadcast.
    pub fn broadcast(a: &Shape, b: &Shape) -> Option<Shape> {
        let rank = a.rank().max(b.rank());
        let mut dims = vec![0; rank];
        for (i, dim) in dims.iter_mut().enumerate() {
            let da = if i + a.rank() >= rank { a.0[i + a.rank() - rank] } else { 1 };
            let db = if i + b.rank() >= rank { b.0[i + b.rank() - rank] } else { 1 };
            *dim = match (da, db) {
                (x, y) if x == y => x,
                (1, y) => y,
                (x, 1) => x,
                _ => return None,
            };
        }
        Some(Shape(dims))
    }

    /// Strides to read this shape as if broadcast to `target` (0 on stretched dimensions).
    /// `target` must be a broadcast of `self`.
    pub fn broadcast_strides(&self, target: &Shape) -> Vec<usize> {
        let own = self.strides();
        let offset = target.rank() - self.rank();
        (0..target.rank()).map(|i| if i < offset || self.0[i - offset] == 1 { 0 } else { own[i - offset] }).collect()
    }

    /// A negative axis counts from the end; `None` if out of range.
    pub fn axis(&self, axis: isize) -> Option<usize> {
        let rank = self.rank() as isize;
        let a = if axis < 0 { axis + rank } else { axis };
        (0..rank).contains(&a).then_some(a as usize)
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}

impl From<Vec<usize>> for Shape {
    fn from(dims: Vec<usize>) -> Self {
        Shape(dims)
    }
}

impl From<&[usize]> for Shape {
    fn from(dims: &[usize]) -> Self {
        Shape(dims.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(dims: [usize; N]) -> Self {
        Shape(dims.to_vec())
    }
}

/// Shape and dtype of a tensor.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Shape.
    pub shape: Shape,
    /// Element type.
    pub dtype: DType,
}

impl TensorMeta {
    /// Metadata from a shape and a dtype.
    pub fn new(shape: impl Into<Shape>, dtype: DType) -> Self {
        Self { shape: shape.into(), dtype }
    }

    /// Bytes of the tensor's data (`usize::MAX` when that does not fit a `usize`; see
    /// [`TensorMeta::checked_bytes`]).
    pub fn bytes(&self) -> usize {
        self.checked_bytes().unwrap_or(usize::MAX)
    }

    /// Bytes of the tensor's data, or `None` when the element count or the byte size
    /// overflows a `usize`.
    pub fn checked_bytes(&self) -> Option<usize> {
        let nonzero = self.shape.0.iter().try_fold(self.dtype.size(), |n: usize, &d| n.checked_mul(d.max(1)))?;
        Some(if self.shape.0.contains(&0) { 0 } else { nonzero })
    }

    /// `Ok` when the element count and the byte size fit a `usize`; otherwise an error
    /// naming the shape, the dtype and the limit.
    pub fn check_size(&self) -> Result<(), ArrayError> {
        match self.checked_bytes() {
            Some(_) => Ok(()),
            None => Err(ArrayError::TooLarge { shape: self.shape.clone(), dtype: self.dtype }),
        }
    }
}

/// A host array, shape or meta that cannot exist: the reason as a sentence naming the
/// shape, the dtype and the counts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArrayError {
    /// The values do not fill the shape.
    #[error("a {shape} {dtype} array needs {needed} value{}; got {got}", if *needed == 1 { "" } else { "s" })]
    Length {
        /// The shape asked for.
        shape: Shape,
        /// The element type.
        dtype: DType,
        /// Elements the shape holds.
        needed: usize,
        /// Elements given.
        got: usize,
    },
    /// The element count or byte size does not fit in memory addresses.
    #[error(
        "a {shape} {dtype} tensor is too large: its element count or byte size exceeds {} (the largest size this machine can address)",
        usize::MAX
    )]
    TooLarge {
        /// The shape.
        shape: Shape,
        /// The element type.
        dtype: DType,
    },
}

impl fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

/// Owned elements of one dtype.
#[derive(Debug, Clone, PartialEq)]
pub enum HostData {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// i64 elements.
    I64(Vec<i64>),
    /// bf16 elements.
    Bf16(Vec<half::bf16>),
    /// f16 elements.
    F16(Vec<half::f16>),
}

impl HostData {
    /// `values` converted to `dtype`: floats rounded to nearest once (f64 → bf16 and f16
    /// through round-to-odd, see `bf16_from_f64`), integers truncated toward zero.
    pub fn from_f64(dtype: DType, values: &[f64]) -> Self {
        match dtype {
            DType::F32 => HostData::F32(values.iter().map(|&v| v as f32).collect()),
            DType::F64 => HostData::F64(values.to_vec()),
            DType::I64 => HostData::I64(values.iter().map(|&v| v as i64).collect()),
            DType::Bf16 => HostData::Bf16(values.iter().map(|&v| crate::bf16_from_f64(v)).collect()),
            DType::F16 => HostData::F16(values.iter().map(|&v| crate::f16_from_f64(v)).collect()),
        }
    }
}

/// An owned host tensor: shape plus row-major elements.
#[derive(Debug, Clone, PartialEq)]
pub struct HostArray {
    /// Shape.
    pub shape: Shape,
    /// Elements, row-major.
    pub data: HostData,
}

impl HostArray {
    /// Zeros of the given metadata.
    pub fn zeros(meta: &TensorMeta) -> Self {
        let n = meta.shape.numel();
        let data = match meta.dtype {
            DType::F32 => HostData::F32(vec![0.0; n]),
            DType::F64 => HostData::F64(vec![0.0; n]),
            DType::I64 => HostData::I64(vec![0; n]),
            DType::Bf16 => HostData::Bf16(vec![half::bf16::ZERO; n]),
            DType::F16 => HostData::F16(vec![half::f16::ZERO; n]),
        };
        Self { shape: meta.shape.clone(), data }
    }

    /// An f32 array; an error when the number of values does not match the shape.
    pub fn f32(shape: impl Into<Shape>, data: Vec<f32>) -> Result<Self, ArrayError> {
        Self::checked(shape.into(), DType::F32, data.len(), HostData::F32(data))
    }

    /// An f64 array; an error when the number of values does not match the shape.
    pub fn f64(shape: impl Into<Shape>, data: Vec<f64>) -> Result<Self, ArrayError> {
        Self::checked(shape.into(), DType::F64, data.len(), HostData::F64(data))
    }

    /// An i64 array; an error when the number of values does not match the shape.
    pub fn i64(shape: impl Into<Shape>, data: Vec<i64>) -> Result<Self, ArrayError> {
        Self::checked(shape.into(), DType::I64, data.len(), HostData::I64(data))
    }

    /// A bf16 array; an error when the number of values does not match the shape.
    pub fn bf16(shape: impl Into<Shape>, data: Vec<half::bf16>) -> Result<Self, ArrayError> {
        Self::checked(shape.into(), DType::Bf16, data.len(), HostData::Bf16(data))
    }

    /// A bf16 array of f32 values rounded to nearest even; an error when the number of
    /// values does not match the shape.
    pub fn bf16_from_f32(shape: impl Into<Shape>, data: &[f32]) -> Result<Self, ArrayError> {
        Self::bf16(shape, data.iter().map(|&x| half::bf16::from_f32(x)).collect())
    }

    /// An f16 array; an error when the number of values does not match the shape.
    pub fn f16(shape: impl Into<Shape>, data: Vec<half::f16>) -> Result<Self, ArrayError> {
        Self::checked(shape.into(), DType::F16, data.len(), HostData::F16(data))
    }

    /// An f16 array of f32 values rounded to nearest even (overflowing to ±infinity past
    /// 65504); an error when the number of values does not match the shape.
    pub fn f16_from_f32(shape: impl Into<Shape>, data: &[f32]) -> Result<Self, ArrayError> {
        Self::f16(shape, data.iter().map(|&x| half::f16::from_f32(x)).collect())
    }

    /// An array of `shape` and `dtype` holding `values` converted as
    /// [`HostData::from_f64`] does; an error when the number of values does not match the
    /// shape.
    pub fn from_f64(shape: impl Into<Shape>, dtype: DType, values: &[f64]) -> Result<Self, ArrayError> {
        Self::checked(shape.into(), dtype, values.len(), HostData::from_f64(dtype, values))
    }

    /// An array of `shape` holding `data`; an error when the number of values does not
    /// match the shape.
    pub fn new(shape: impl Into<Shape>, data: HostData) -> Result<Self, ArrayError> {
        let (dtype, len) = match &data {
            HostData::F32(v) => (DType::F32, v.len()),
            HostData::F64(v) => (DType::F64, v.len()),
            HostData::I64(v) => (DType::I64, v.len()),
            HostData::Bf16(v) => (DType::Bf16, v.len()),
            HostData::F16(v) => (DType::F16, v.len()),
        };
        Self::checked(shape.into(), dtype, len, data)
    }

    fn checked(shape: Shape, dtype: DType, got: usize, data: HostData) -> Result<Self, ArrayError> {
        let meta = TensorMeta { shape, dtype };
        meta.check_size()?;
        let needed = meta.shape.numel();
        if needed != got {
            return Err(ArrayError::Length { shape: meta.shape, dtype, needed, got });
        }
        Ok(Self { shape: meta.shape, data })
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self.data {
            HostData::F32(_) => DType::F32,
            HostData::F64(_) => DType::F64,
            HostData::I64(_) => DType::I64,
            HostData::Bf16(_) => DType::Bf16,
            HostData::F16(_) => DType::F16,
        }
    }

    /// Shape and dtype.
    pub fn meta(&self) -> TensorMeta {
        TensorMeta { shape: self.shape.clone(), dtype: self.dtype() }
    }

    /// The elements as f64 (integers converted), for comparisons in tests and reports.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            HostData::F32(v) => v.iter().map(|&x| f64::from(x)).collect(),
            HostData::F64(v) => v.clone(),
            HostData::I64(v) => v.iter().map(|&x| x as f64).collect(),
            HostData::Bf16(v) => v.iter().map(|&x| x.to_f64()).collect(),
            HostData::F16(v) => v.iter().map(|&x| x.to_f64()).collect(),
        }
    }

    /// A read view for kernels.
    pub fn view(&self) -> HostTensor<'_> {
        HostTensor {
            shape: &self.shape,
            data: match &self.data {
                HostData::F32(v) => HostSlice::F32(v),
                HostData::F64(v) => HostSlice::F64(v),
                HostData::I64(v) => HostSlice::I64(v),
                HostData::Bf16(v) => HostSlice::Bf16(v),
                HostData::F16(v) => HostSlice::F16(v),
            },
        }
    }

    /// A write view for kernels.
    pub fn view_mut(&mut self) -> HostTensorMut<'_> {
        HostTensorMut {
            shape: &self.shape,
            data: match &mut self.data {
                HostData::F32(v) => HostSliceMut::F32(v),
                HostData::F64(v) => HostSliceMut::F64(v),
                HostData::I64(v) => HostSliceMut::I64(v),
                HostData::Bf16(v) => HostSliceMut::Bf16(v),
                HostData::F16(v) => HostSliceMut::F16(v),
            },
        }
    }
}

/// Typed read-only elements.
#[derive(Debug, Clone, Copy)]
pub enum HostSlice<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f64 elements.
    F64(&'a [f64]),
    /// i64 elements.
    I64(&'a [i64]),
    /// bf16 elements.
    Bf16(&'a [half::bf16]),
    /// f16 elements.
    F16(&'a [half::f16]),
}

/// Typed writable elements.
#[derive(Debug)]
pub enum HostSliceMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// f64 elements.
    F64(&'a mut [f64]),
    /// i64 elements.
    I64(&'a mut [i64]),
    /// bf16 elements.
    Bf16(&'a mut [half::bf16]),
    /// f16 elements.
    F16(&'a mut [half::f16]),
}

/// A tensor a host kernel reads.
#[derive(Debug, Clone, Copy)]
pub struct HostTensor<'a> {
    /// Shape.
    pub shape: &'a Shape,
    /// Elements, row-major.
    pub data: HostSlice<'a>,
}

/// A tensor a host kernel writes.
#[derive(Debug)]
pub struct HostTensorMut<'a> {
    /// Shape.
    pub shape: &'a Shape,
    /// Elements, row-major.
    pub data: HostSliceMut<'a>,
}

impl<'a> HostTensor<'a> {
    /// How many elements its data holds (none for an input given in place).
    pub fn len(&self) -> usize {
        match self.data {
            HostSlice::F64(v) => v.len(),
            HostSlice::F32(v) => v.len(),
            HostSlice::I64(v) => v.len(),
            HostSlice::Bf16(v) => v.len(),
            HostSlice::F16(v) => v.len(),
        }
    }

    /// Whether its data holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as `T`, or an error naming the dtypes.
    pub fn as_slice<T: Element>(&self) -> Result<&'a [T], String> {
        T::from_slice(self.data).ok_or_else(|| format!("expected {} data, got {}", T::DTYPE, self.dtype()))
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self.data {
            HostSlice::F32(_) => DType::F32,
            HostSlice::F64(_) => DType::F64,
            HostSlice::I64(_) => DType::I64,
            HostSlice::Bf16(_) => DType::Bf16,
            HostSlice::F16(_) => DType::F16,
        }
    }
}

impl HostTensorMut<'_> {
    /// What it holds, read as an input (a kernel that reads back what it wrote).
    pub fn view(&self) -> HostTensor<'_> {
        let data = match &self.data {
            HostSliceMut::F32(v) => HostSlice::F32(v),
            HostSliceMut::F64(v) => HostSlice::F64(v),
            HostSliceMut::I64(v) => HostSlice::I64(v),
            HostSliceMut::Bf16(v) => HostSlice::Bf16(v),
            HostSliceMut::F16(v) => HostSlice::F16(v),
        };
        HostTensor { shape: self.shape, data }
    }

    /// How many elements its data holds.
    pub fn len(&self) -> usize {
        match &self.data {
            HostSliceMut::F64(v) => v.len(),
            HostSliceMut::F32(v) => v.len(),
            HostSliceMut::I64(v) => v.len(),
            HostSliceMut::Bf16(v) => v.len(),
            HostSliceMut::F16(v) => v.len(),
        }
    }

    /// Whether its data holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as `T`, or an error naming the dtypes.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T], String> {
        let dtype = self.dtype();
        T::from_slice_mut(&mut self.data).ok_or_else(|| format!("expected {} output, got {dtype}", T::DTYPE))
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self.data {
            HostSliceMut::F32(_) => DType::F32,
            HostSliceMut::F64(_) => DType::F64,
            HostSliceMut::I64(_) => DType::I64,
            HostSliceMut::Bf16(_) => DType::Bf16,
            HostSliceMut::F16(_) => DType::F16,
        }
    }
}

/// An element type host kernels can be generic over.
pub trait Element: Copy + Send + Sync + 'static {
    /// Its dtype.
    const DTYPE: DType;
    /// Borrows typed elements if the dtype matches.
    fn from_slice(s: HostSlice<'_>) -> Option<&[Self]>;
    /// Borrows typed writable elements if the dtype matches.
    fn from_slice_mut<'a>(s: &'a mut HostSliceMut<'_>) -> Option<&'a mut [Self]>;
}

macro_rules! element {
    ($t:ty, $variant:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            fn from_slice(s: HostSlice<'_>) -> Option<&[Self]> {
                match s {
                    HostSlice::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn from_slice_mut<'a>(s: &'a mut HostSliceMut<'_>) -> Option<&'a mut [Self]> {
                match s {
                    HostSliceMut::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
element!(f32, F32);
element!(f64, F64);
element!(i64, I64);
element!(half::bf16, Bf16);
element!(half::f16, F16);

/// Real numbers host kernels compute in (f32 and f64), with the math they need.
pub trait Real:
    Element
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
    + std::ops::AddAssign
    + std::iter::Sum
{
    /// From an f64 constant.
    fn from_f64(x: f64) -> Self;
    /// To f64.
    fn to_f64(self) -> f64;
    /// e^x.
    fn exp(self) -> Self;
    /// Natural logarithm.
    fn ln(self) -> Self;
    /// Hyperbolic tangent.
    fn tanh(self) -> Self;
    /// Square root.
    fn sqrt(self) -> Self;
    /// The larger of two values (NaN-propagating is not required).
    fn max(self, other: Self) -> Self;
    /// Zero.
    fn zero() -> Self {
        Self::from_f64(0.0)
    }
    /// One.
    fn one() -> Self {
        Self::from_f64(1.0)
    }
}

macro_rules! real {
    ($t:ty) => {
        impl Real for $t {
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
        }
    };
}
real!(f32);
real!(f64);

impl HostArray {
    /// The elements at `ranges` (one range per dimension), as an array of their own.
    pub fn region(&self, ranges: &[Range<usize>]) -> HostArray {
        let out_shape = Shape(ranges.iter().map(|r| r.len()).collect());
        let runs = Runs::new(&self.shape, ranges);
        let data = match &self.data {
            HostData::F32(v) => HostData::F32(runs.gather(v)),
            HostData::F64(v) => HostData::F64(runs.gather(v)),
            HostData::I64(v) => HostData::I64(runs.gather(v)),
            HostData::Bf16(v) => HostData::Bf16(runs.gather(v)),
            HostData::F16(v) => HostData::F16(runs.gather(v)),
        };
        HostArray { shape: out_shape, data }
    }

    /// Writes `part` into this array at `offsets` (nothing where the dtypes differ).
    pub fn set_region(&mut self, offsets: &[usize], part: &HostArray) {
        let ranges: Vec<Range<usize>> = offsets.iter().zip(part.shape.dims()).map(|(&o, &n)| o..o + n).collect();
        let runs = Runs::new(&self.shape, &ranges);
        match (&mut self.data, &part.data) {
            (HostData::F32(d), HostData::F32(s)) => runs.scatter(d, s),
            (HostData::F64(d), HostData::F64(s)) => runs.scatter(d, s),
            (HostData::I64(d), HostData::I64(s)) => runs.scatter(d, s),
            (HostData::Bf16(d), HostData::Bf16(s)) => runs.scatter(d, s),
            (HostData::F16(d), HostData::F16(s)) => runs.scatter(d, s),
            _ => {}
        }
    }

    /// Elementwise sum with an array of the same shape and dtype.
    pub fn add_assign(&mut self, other: &HostArray) {
        match (&mut self.data, &other.data) {
            (HostData::F32(a), HostData::F32(b)) => a.iter_mut().zip(b).for_each(|(x, y)| *x += y),
            (HostData::F64(a), HostData::F64(b)) => a.iter_mut().zip(b).for_each(|(x, y)| *x += y),
            (HostData::I64(a), HostData::I64(b)) => a.iter_mut().zip(b).for_each(|(x, y)| *x += y),
            // Summed in f32 and rounded once per element.
            (HostData::Bf16(a), HostData::Bf16(b)) => {
                a.iter_mut().zip(b).for_each(|(x, y)| *x = half::bf16::from_f32(x.to_f32() + y.to_f32()))
            }
            (HostData::F16(a), HostData::F16(b)) => {
                a.iter_mut().zip(b).for_each(|(x, y)| *x = half::f16::from_f32(x.to_f32() + y.to_f32()))
            }
            _ => {}
        }
    }
}

impl HostArray {
    /// The array of `meta` whose elements are `bytes`, little-endian (what a register
    /// holds): an error says how many bytes the meta needs when `bytes` has another count.
    pub fn from_le_bytes(meta: &TensorMeta, bytes: &[u8]) -> Result<Self, ArrayError> {
        meta.check_size()?;
        let size = meta.dtype.size();
        if bytes.len() != meta.bytes() {
            let (needed, got) = (meta.shape.numel(), bytes.len() / size);
            return Err(ArrayError::Length { shape: meta.shape.clone(), dtype: meta.dtype, needed, got });
        }
        let words = bytes.chunks_exact(size);
        let data = match meta.dtype {
            DType::F32 => HostData::F32(words.map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            DType::F64 => HostData::F64(
                words.map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect(),
            ),
            DType::I64 => HostData::I64(
                words.map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])).collect(),
            ),
            DType::Bf16 => HostData::Bf16(words.map(|c| half::bf16::from_le_bytes([c[0], c[1]])).collect()),
            DType::F16 => HostData::F16(words.map(|c| half::f16::from_le_bytes([c[0], c[1]])).collect()),
        };
        Ok(Self { shape: meta.shape.clone(), data })
    }

    /// The elements as little-endian bytes.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match &self.data {
            HostData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostData::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostData::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostData::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            HostData::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// A region of a row-major array (one range per dimension) as runs of contiguous elements:
/// the innermost range, at each index of the outer ones in row-major order. Regions copy a
/// run at a time (`copy_from_slice`), not an element at a time through an index array:
/// GPT-2's 124 M initial values are cut into device parts this way when a job starts.
struct Runs {
    /// The start of each run in the array, in row-major order of the region.
    starts: Vec<usize>,
    /// Elements per run.
    len: usize,
}

impl Runs {
    fn new(shape: &Shape, ranges: &[Range<usize>]) -> Runs {
        let strides = shape.strides();
        let Some((inner, outer)) = ranges.split_last() else {
            // A scalar: one run of its one element.
            return Runs { starts: vec![0], len: 1 };
        };
        let count: usize = outer.iter().map(|r| r.len()).product();
        if count == 0 || inner.is_empty() {
            return Runs { starts: Vec::new(), len: 0 };
        }
        let mut starts = Vec::with_capacity(count);
        let mut index = vec![0usize; outer.len()];
        for _ in 0..count {
            let outer_start: usize = index.iter().zip(outer).zip(&strides).map(|((i, r), s)| (r.start + i) * s).sum();
            starts.push(outer_start + inner.start);
            for d in (0..outer.len()).rev() {
                index[d] += 1;
                if index[d] < outer[d].len() {
                    break;
                }
                index[d] = 0;
            }
        }
        Runs { starts, len: inner.len() }
    }

    /// The region's elements of `v`, in row-major order.
    fn gather<T: Copy>(&self, v: &[T]) -> Vec<T> {
        let mut out = Vec::with_capacity(self.starts.len() * self.len);
        for &start in &self.starts {
            out.extend_from_slice(&v[start..start + self.len]);
        }
        out
    }

    /// Writes `part` (the region's elements in row-major order) into `v`.
    fn scatter<T: Copy>(&self, v: &mut [T], part: &[T]) {
        for (&start, run) in self.starts.iter().zip(part.chunks_exact(self.len.max(1))) {
            v[start..start + self.len].copy_from_slice(run);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `region` and `set_region` against an element-by-element walk, over ranks 0 to 3,
    /// empty ranges and whole arrays.
    #[test]
    // One range per dimension: a rank-1 region is a slice of one range.
    #[allow(clippy::single_range_in_vec_init)]
    fn regions_are_copied_run_by_run_as_element_by_element() {
        let cases: &[(&[usize], &[std::ops::Range<usize>])] = &[
            (&[], &[]),
            (&[5], &[1..4]),
            (&[3, 4], &[0..3, 0..4]),
            (&[3, 4], &[1..3, 2..3]),
            (&[2, 3, 4], &[1..2, 0..3, 1..4]),
            (&[2, 3, 4], &[0..2, 1..1, 0..4]),
            (&[4, 0], &[1..3, 0..0]),
        ];
        for &(dims, ranges) in cases {
            let shape = Shape::new(dims.to_vec());
            let values: Vec<f64> = (0..shape.numel()).map(|i| i as f64).collect();
            let array = HostArray::f64(shape.clone(), values.clone()).unwrap();
            let strides = shape.strides();
            // Element by element, row-major over the region.
            let mut want = Vec::new();
            let count: usize = ranges.iter().map(|r| r.len()).product();
            let mut index = vec![0usize; ranges.len()];
            for _ in 0..count {
                want.push(
                    values[index.iter().zip(ranges).zip(&strides).map(|((i, r), s)| (r.start + i) * s).sum::<usize>()],
                );
                for d in (0..ranges.len()).rev() {
                    index[d] += 1;
                    if index[d] < ranges[d].len() {
                        break;
                    }
                    index[d] = 0;
                }
            }
            let part = array.region(ranges);
            assert_eq!(part.meta().shape.dims(), ranges.iter().map(|r| r.len()).collect::<Vec<_>>().as_slice());
            assert_eq!(part.to_f64_vec(), want, "{dims:?} {ranges:?}");
            // Written back into zeros, the region holds the part and nothing else changes.
            let mut zeros = HostArray::f64(shape.clone(), vec![0.0; shape.numel()]).unwrap();
            zeros.set_region(&ranges.iter().map(|r| r.start).collect::<Vec<_>>(), &part);
            let back = zeros.region(ranges);
            assert_eq!(back.to_f64_vec(), want, "{dims:?} {ranges:?} written back");
            let total: f64 = zeros.to_f64_vec().iter().sum();
            assert_eq!(total, want.iter().sum::<f64>(), "{dims:?} {ranges:?}: only the region written");
        }
    }

    #[test]
    fn broadcasting_follows_numpy() {
        let b = |a: &[usize], c: &[usize]| Shape::broadcast(&Shape::from(a), &Shape::from(c));
        assert_eq!(b(&[4, 1, 3], &[5, 1]), Some(Shape::from([4, 5, 3])));
        assert_eq!(b(&[], &[2, 3]), Some(Shape::from([2, 3])));
        assert_eq!(b(&[2, 3], &[3, 2]), None);
        assert_eq!(Shape::from([1, 3]).broadcast_strides(&Shape::from([4, 2, 3])), vec![0, 0, 1]);
        assert_eq!(Shape::from([2, 3, 4]).strides(), vec![12, 4, 1]);
        assert_eq!(Shape::from([2, 3]).axis(-1), Some(1));
        assert_eq!(Shape::from([2, 3]).axis(2), None);
    }

    #[test]
    fn sizes_that_overflow_are_refused_not_wrapped() {
        let huge = Shape::from([1 << 40, 1 << 40]);
        assert_eq!(huge.checked_numel(), None);
        assert_eq!(huge.numel(), usize::MAX);
        let meta = TensorMeta::new(huge, DType::F32);
        assert_eq!(meta.checked_bytes(), None);
        assert_eq!(
            meta.check_size().unwrap_err().to_string(),
            format!(
                "a [1099511627776, 1099511627776] f32 tensor is too large: its element count or byte size exceeds {} \
                 (the largest size this machine can address)",
                usize::MAX
            )
        );
        // Fits in elements, not in bytes.
        assert_eq!(TensorMeta::new([usize::MAX / 2], DType::F64).checked_bytes(), None);
        // A zero dimension does not hide an overflowing product of the others.
        assert_eq!(Shape::from([0, 1 << 40, 1 << 40]).checked_numel(), None);
        assert_eq!(Shape::from([0, 3]).checked_numel(), Some(0));
        assert_eq!(Shape::scalar().checked_numel(), Some(1));
    }

    #[test]
    fn host_arrays_say_what_does_not_fit() {
        let err = HostArray::f32([2, 3], vec![0.0; 5]).unwrap_err();
        assert_eq!(err, ArrayError::Length { shape: Shape::from([2, 3]), dtype: DType::F32, needed: 6, got: 5 });
        assert_eq!(err.to_string(), "a [2, 3] f32 array needs 6 values; got 5");
        assert_eq!(HostArray::i64([], vec![]).unwrap_err().to_string(), "a [] i64 array needs 1 value; got 0");
        assert!(matches!(HostArray::f64([1 << 40, 1 << 40], vec![]), Err(ArrayError::TooLarge { .. })));
        assert_eq!(HostArray::new([2], HostData::I64(vec![1, 2])).unwrap().dtype(), DType::I64);
    }
}
