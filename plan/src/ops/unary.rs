//! Attributes of `unary` ops.

use serde::{Deserialize, Serialize};

/// Which unary op.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum UnaryKind {
    /// -x
    Neg,
    /// max(x, 0)
    Relu,
    /// 1 where x > 0, else 0 (the derivative of relu; its own derivative is 0).
    Step,
    /// e^x
    Exp,
    /// ln x
    Log,
    /// √x
    Sqrt,
    /// tanh x
    Tanh,
    /// 1 / (1 + e^-x)
    Sigmoid,
    /// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    Gelu,
    /// d gelu / dx
    GeluDerivative,
    /// x + c
    AddScalar(f64),
    /// x · c
    MulScalar(f64),
    /// x^p
    PowScalar(f64),
}

/// An elementwise unary op.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Unary(pub UnaryKind);
