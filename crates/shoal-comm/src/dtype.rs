//! Element types and reduction operators, and the reduction kernels that work on
//! raw little-endian bytes (what travels on the wire and sits in shared memory).
//!
//! Every operator is commutative bit for bit (IEEE `a + b == b + a`), so the
//! algorithms may combine contributions in any pairwise order and every rank still
//! ends with identical bits.

use bytemuck::Pod;
use half::{bf16, f16};

use crate::error::{Error, Result};

/// Element type of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I32,
    I64,
}

impl DType {
    /// All supported types.
    pub const ALL: [DType; 6] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Short lowercase name (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
        }
    }

    /// True for floating-point types.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32 | DType::I64)
    }
}

impl std::str::FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        DType::ALL.into_iter().find(|d| d.name() == s.to_ascii_lowercase()).ok_or_else(|| {
            Error::InvalidArgument(format!("unknown dtype {s:?} (expected one of f32, f64, f16, bf16, i32, i64)"))
        })
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Reduction operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the number of ranks (integer division for integer types).
    Avg,
    Min,
    Max,
    Prod,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 5] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod];

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Prod => "prod",
        }
    }

    /// The operator applied pairwise during the reduction (`Avg` reduces as `Sum`).
    pub fn combining(self) -> ReduceOp {
        if self == ReduceOp::Avg { ReduceOp::Sum } else { self }
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        ReduceOp::ALL.into_iter().find(|o| o.name() == s.to_ascii_lowercase()).ok_or_else(|| {
            Error::InvalidArgument(format!("unknown reduce op {s:?} (expected sum, avg, min, max or prod)"))
        })
    }
}

/// A Rust type that maps to a [`DType`].
pub trait Element: Pod + Send + Sync + PartialEq + std::fmt::Debug + 'static {
    const DTYPE: DType;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for f64 {
    const DTYPE: DType = DType::F64;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for i32 {
    const DTYPE: DType = DType::I32;
}
impl Element for i64 {
    const DTYPE: DType = DType::I64;
}

#[inline]
fn apply<T: Pod>(dst: &mut [u8], src: &[u8], f: impl Fn(T, T) -> T) {
    let n = dst.len().min(src.len()) / std::mem::size_of::<T>();
    let bytes = n * std::mem::size_of::<T>();
    match (bytemuck::try_cast_slice_mut::<u8, T>(&mut dst[..bytes]), bytemuck::try_cast_slice::<u8, T>(&src[..bytes])) {
        (Ok(d), Ok(s)) => {
            for (a, b) in d.iter_mut().zip(s) {
                *a = f(*a, *b);
            }
        }
        _ => {
            let sz = std::mem::size_of::<T>();
            for (a, b) in dst[..bytes].chunks_exact_mut(sz).zip(src[..bytes].chunks_exact(sz)) {
                let x: T = bytemuck::pod_read_unaligned(a);
                let y: T = bytemuck::pod_read_unaligned(b);
                a.copy_from_slice(bytemuck::bytes_of(&f(x, y)));
            }
        }
    }
}

macro_rules! float_kernels {
    ($t:ty, $dst:expr, $src:expr, $op:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => apply::<$t>($dst, $src, |a, b| a + b),
            ReduceOp::Prod => apply::<$t>($dst, $src, |a, b| a * b),
            ReduceOp::Min => apply::<$t>($dst, $src, |a, b| if b < a { b } else { a }),
            ReduceOp::Max => apply::<$t>($dst, $src, |a, b| if b > a { b } else { a }),
        }
    };
}

macro_rules! half_kernels {
    ($t:ty, $dst:expr, $src:expr, $op:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => apply::<$t>($dst, $src, |a, b| <$t>::from_f32(a.to_f32() + b.to_f32())),
            ReduceOp::Prod => apply::<$t>($dst, $src, |a, b| <$t>::from_f32(a.to_f32() * b.to_f32())),
            ReduceOp::Min => apply::<$t>($dst, $src, |a, b| if b < a { b } else { a }),
            ReduceOp::Max => apply::<$t>($dst, $src, |a, b| if b > a { b } else { a }),
        }
    };
}

macro_rules! int_kernels {
    ($t:ty, $dst:expr, $src:expr, $op:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => apply::<$t>($dst, $src, |a, b| a.wrapping_add(b)),
            ReduceOp::Prod => apply::<$t>($dst, $src, |a, b| a.wrapping_mul(b)),
            ReduceOp::Min => apply::<$t>($dst, $src, |a, b| a.min(b)),
            ReduceOp::Max => apply::<$t>($dst, $src, |a, b| a.max(b)),
        }
    };
}

/// `dst[i] = dst[i] op src[i]` over the elements of two equally long byte slices.
/// `Avg` combines as `Sum`; call [`finish_avg`] once at the end.
pub fn reduce_bytes(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    match dtype {
        DType::F32 => float_kernels!(f32, dst, src, op),
        DType::F64 => float_kernels!(f64, dst, src, op),
        DType::F16 => half_kernels!(f16, dst, src, op),
        DType::BF16 => half_kernels!(bf16, dst, src, op),
        DType::I32 => int_kernels!(i32, dst, src, op),
        DType::I64 => int_kernels!(i64, dst, src, op),
    }
}

fn scale<T: Pod>(buf: &mut [u8], f: impl Fn(T) -> T) {
    let sz = std::mem::size_of::<T>();
    match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        Ok(d) => d.iter_mut().for_each(|x| *x = f(*x)),
        Err(_) => {
            for a in buf.chunks_exact_mut(sz) {
                let x: T = bytemuck::pod_read_unaligned(a);
                a.copy_from_slice(bytemuck::bytes_of(&f(x)));
            }
        }
    }
}

/// Divides every element by `n` (the last step of an `Avg` reduction).
pub fn finish_avg(dtype: DType, buf: &mut [u8], n: usize) {
    match dtype {
        DType::F32 => scale::<f32>(buf, |x| x / n as f32),
        DType::F64 => scale::<f64>(buf, |x| x / n as f64),
        DType::F16 => scale::<f16>(buf, |x| f16::from_f32(x.to_f32() / n as f32)),
        DType::BF16 => scale::<bf16>(buf, |x| bf16::from_f32(x.to_f32() / n as f32)),
        DType::I32 => scale::<i32>(buf, |x| x / n as i32),
        DType::I64 => scale::<i64>(buf, |x| x / n as i64),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_match_scalar_arithmetic() {
        let mut a: Vec<f32> = vec![1.0, -2.0, 3.5];
        let b: Vec<f32> = vec![2.0, 5.0, -1.0];
        reduce_bytes(DType::F32, ReduceOp::Max, bytemuck::cast_slice_mut(&mut a), bytemuck::cast_slice(&b));
        assert_eq!(a, vec![2.0, 5.0, 3.5]);
        let mut i: Vec<i64> = vec![3, -4];
        reduce_bytes(DType::I64, ReduceOp::Prod, bytemuck::cast_slice_mut(&mut i), bytemuck::cast_slice(&[5i64, 6]));
        assert_eq!(i, vec![15, -24]);
        let mut h = vec![f16::from_f32(1.5), f16::from_f32(2.0)];
        let g = [f16::from_f32(0.5), f16::from_f32(-3.0)];
        reduce_bytes(DType::F16, ReduceOp::Sum, bytemuck::cast_slice_mut(&mut h), bytemuck::cast_slice(&g));
        assert_eq!(h, vec![f16::from_f32(2.0), f16::from_f32(-1.0)]);
        let mut s: Vec<i32> = vec![7, 9];
        finish_avg(DType::I32, bytemuck::cast_slice_mut(&mut s), 2);
        assert_eq!(s, vec![3, 4]);
    }

    #[test]
    fn unaligned_bytes_reduce_correctly() {
        let mut dst = [0u8; 9];
        let mut src = [0u8; 9];
        dst[1..5].copy_from_slice(&1.5f32.to_le_bytes());
        src[1..5].copy_from_slice(&2.25f32.to_le_bytes());
        reduce_bytes(DType::F32, ReduceOp::Sum, &mut dst[1..5], &src[1..5]);
        assert_eq!(f32::from_le_bytes(dst[1..5].try_into().unwrap_or_default()), 3.75);
    }

    #[test]
    fn names_parse() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().ok(), Some(d));
        }
        assert!("u8".parse::<DType>().is_err());
        assert_eq!("AVG".parse::<ReduceOp>().ok(), Some(ReduceOp::Avg));
    }
}
