// Types shared by the real NCCL module and its dummy.

/// An element type NCCL reduces: regflow's dtypes that have one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Element {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// 64-bit signed integer.
    I64,
    /// bfloat16 (summed by NCCL in bf16).
    Bf16,
    /// IEEE half (summed by NCCL in f16).
    F16,
}

impl Element {
    /// The NCCL element of a plan dtype, or `None` where NCCL has none regflow uses.
    pub fn of(dtype: regflow_plan::DType) -> Option<Self> {
        match dtype {
            regflow_plan::DType::F32 => Some(Self::F32),
            regflow_plan::DType::F64 => Some(Self::F64),
            regflow_plan::DType::I64 => Some(Self::I64),
            regflow_plan::DType::Bf16 => Some(Self::Bf16),
            regflow_plan::DType::F16 => Some(Self::F16),
        }
    }
}

/// One collective call on device buffers (addresses as the register views give them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// `out = Σ input` over the ranks, `count` elements.
    AllReduce {
        /// Input address.
        input: u64,
        /// Output address.
        output: u64,
        /// Elements.
        count: usize,
    },
    /// Rank r gets elements `r·count .. (r+1)·count` of the sum.
    ReduceScatter {
        /// Input address (`size · count` elements).
        input: u64,
        /// Output address (`count` elements).
        output: u64,
        /// Elements per rank.
        count: usize,
    },
    /// Every rank gets all ranks' `count` elements, rank after rank.
    AllGather {
        /// Input address (`count` elements).
        input: u64,
        /// Output address (`size · count` elements).
        output: u64,
        /// Elements per rank.
        count: usize,
    },
}
