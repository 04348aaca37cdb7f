//! Plain-slice CPU kernels for the training hot path: matrix products through
//! the `gemm` crate (the same kernels as candle's CPU backend, with transposes
//! expressed as strides instead of copies), and read or in-place access to the
//! values of a candle tensor, so optimizer updates and hand-written backward
//! passes run without allocating a tensor per operation.
//!
//! Invariant: these functions only touch contiguous `Real` CPU tensors and say
//! so in an error otherwise; sizes are checked before any pointer is formed.

use std::cell::RefCell;

use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};

use crate::error::{Error, Result};
use crate::{REAL_NAME, Real};

/// The vector of a CPU storage holding [`Real`] values.
fn real_vec(storage: &mut CpuStorage) -> Option<&mut Vec<Real>> {
    match storage {
        #[cfg(not(feature = "f64"))]
        CpuStorage::F32(v) => Some(v),
        #[cfg(feature = "f64")]
        CpuStorage::F64(v) => Some(v),
        _ => None,
    }
}

/// A CPU storage of [`Real`] values.
pub(crate) fn real_storage(values: Vec<Real>) -> CpuStorage {
    <Real as candle_core::WithDType>::to_cpu_storage_owned(values)
}

/// The values of `storage` under `layout`, when it is a contiguous Real CPU tensor.
pub(crate) fn cpu_f32<'a>(storage: &'a Storage, layout: &Layout) -> Result<&'a [Real]> {
    let values = match storage {
        Storage::Cpu(s) => s.as_slice::<Real>().ok(),
        _ => None,
    };
    match (values, layout.contiguous_offsets()) {
        (Some(v), Some((a, b))) => {
            v.get(a..b).ok_or_else(|| Error::InvalidArgument("tensor layout outside its storage".into()))
        }
        (Some(_), None) => Err(Error::InvalidArgument("tensor is not contiguous".into())),
        (None, _) => Err(Error::InvalidArgument(format!("tensor is not a {REAL_NAME} tensor on the CPU"))),
    }
}

/// Runs `f` on the values of a contiguous Real CPU tensor.
pub fn with_slice<R>(t: &Tensor, f: impl FnOnce(&[Real]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    Ok(f(cpu_f32(&storage, layout)?))
}

struct InPlace<F, R> {
    f: RefCell<Option<F>>,
    out: RefCell<Option<R>>,
}

impl<F: FnOnce(&mut [Real]) -> R, R> InplaceOp1 for InPlace<F, R> {
    fn name(&self) -> &'static str {
        "shoal-in-place"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((a, b)) = layout.contiguous_offsets() else { candle_core::bail!("tensor is not contiguous") };
        let Some(v) = real_vec(storage) else { candle_core::bail!("tensor is not {}", REAL_NAME) };
        let Some(values) = v.get_mut(a..b) else { candle_core::bail!("tensor layout outside its storage") };
        let Some(f) = self.f.borrow_mut().take() else { candle_core::bail!("in-place kernel run twice") };
        *self.out.borrow_mut() = Some(f(values));
        Ok(())
    }
}

/// Runs `f` on the values of a contiguous Real CPU tensor, in place: every
/// tensor sharing its storage (the model's view of a parameter) sees the change.
pub fn with_slice_mut<R>(t: &Tensor, f: impl FnOnce(&mut [Real]) -> R) -> Result<R> {
    let op = InPlace { f: RefCell::new(Some(f)), out: RefCell::new(None) };
    t.inplace_op1(&op)?;
    op.out.into_inner().ok_or_else(|| Error::InvalidArgument("in-place kernel did not run".into()))
}

struct Replace(RefCell<Option<Vec<Real>>>);

impl InplaceOp1 for Replace {
    fn name(&self) -> &'static str {
        "shoal-replace-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some(values) = self.0.borrow_mut().take() else { candle_core::bail!("storage replaced twice") };
        if real_vec(storage).is_none() {
            candle_core::bail!("tensor is not {}", REAL_NAME)
        }
        let n = layout.shape().elem_count();
        if layout.start_offset() != 0 || !layout.is_contiguous() {
            candle_core::bail!("tensor is not a whole contiguous tensor");
        }
        if !values.is_empty() && values.len() != n {
            candle_core::bail!("{} values for a tensor of {n}", values.len());
        }
        *storage = real_storage(values);
        Ok(())
    }
}

/// Replaces what a whole contiguous Real CPU tensor holds: `values` (exactly as many as it has), or nothing
/// (`values` empty: its storage freed, its shape kept). Every tensor sharing the storage (the model's handles on a
/// parameter) sees the change. A tensor left holding nothing must not be computed with until it holds values again:
/// only ZeRO-3's layer store empties tensors, and only between a layer's uses (`crate::layers`).
pub(crate) fn replace_storage(t: &Tensor, values: Vec<Real>) -> Result<()> {
    t.inplace_op1(&Replace(RefCell::new(Some(values))))?;
    Ok(())
}

/// A read-only matrix view: `rows × cols`, element (r, c) at `data[r*rs + c*cs]`.
#[derive(Debug, Clone, Copy)]
pub struct Mat<'a> {
    data: &'a [Real],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    /// A row-major `rows × cols` matrix over `data`.
    pub fn new(data: &'a [Real], rows: usize, cols: usize) -> Result<Mat<'a>> {
        if data.len() < rows * cols {
            return Err(Error::InvalidArgument(format!(
                "a {rows}×{cols} matrix needs {} values, got {}",
                rows * cols,
                data.len()
            )));
        }
        Ok(Mat { data, rows, cols, rs: cols, cs: 1 })
    }

    /// The transpose, as a view (no copy).
    pub fn t(self) -> Mat<'a> {
        Mat { data: self.data, rows: self.cols, cols: self.rows, rs: self.cs, cs: self.rs }
    }
}

/// The thread count candle's own CPU kernels use (`RAYON_NUM_THREADS`, else all cores).
fn parallelism() -> gemm::Parallelism {
    match candle_core::utils::get_num_threads() {
        0 | 1 => gemm::Parallelism::None,
        n => gemm::Parallelism::Rayon(n),
    }
}

/// `dst = a · b` (or `dst += a · b` with `accumulate`), `dst` row-major `a.rows × b.cols`.
pub fn matmul(dst: &mut [Real], a: Mat<'_>, b: Mat<'_>, accumulate: bool) -> Result<()> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k || dst.len() < m * n {
        return Err(Error::InvalidArgument(format!("matmul of {m}×{k} by {}×{n} into {} values", b.rows, dst.len())));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(0.0);
        }
        return Ok(());
    }
    // SAFETY: the views were checked to hold rows×cols values under their strides
    // (Mat::new; a transpose keeps the extent), `dst` holds m×n row-major values,
    // and `dst` is a unique borrow, so it overlaps neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0 as Real,
            1.0 as Real,
            false,
            false,
            false,
            parallelism(),
        );
    }
    Ok(())
}

/// `v` as `f32` (the identity in an `f32` build), for what is `f32` in every build: the compression codecs, the
/// parameter servers' wire, the data's features.
#[allow(clippy::unnecessary_cast)]
pub fn to_f32(v: Real) -> f32 {
    v as f32
}

/// `v` as a [`Real`] (the identity in an `f32` build).
#[allow(clippy::unnecessary_cast)]
pub fn from_f32(v: f32) -> Real {
    v as Real
}

/// `buf` as `f32` values: borrowed in an `f32` build, a rounded copy in an `f64` one.
pub fn as_f32(buf: &[Real]) -> std::borrow::Cow<'_, [f32]> {
    #[cfg(not(feature = "f64"))]
    return std::borrow::Cow::Borrowed(buf);
    #[cfg(feature = "f64")]
    return std::borrow::Cow::Owned(buf.iter().map(|&v| to_f32(v)).collect());
}

/// Runs `f` on `buf` as `f32` values: in place in an `f32` build; in an `f64` one on a rounded copy, written back.
pub fn with_f32_mut<R>(buf: &mut [Real], f: impl FnOnce(&mut [f32]) -> R) -> R {
    #[cfg(not(feature = "f64"))]
    return f(buf);
    #[cfg(feature = "f64")]
    {
        let mut copy: Vec<f32> = buf.iter().map(|&v| to_f32(v)).collect();
        let out = f(&mut copy);
        buf.iter_mut().zip(&copy).for_each(|(b, &c)| *b = from_f32(c));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[Real], b: &[Real], m: usize, k: usize, n: usize) -> Vec<Real> {
        let mut out = vec![0.0 as Real; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        out
    }

    fn seq(n: usize, s: Real) -> Vec<Real> {
        (0..n).map(|i| ((i * 7 + 3) % 11) as Real * s - 0.3).collect()
    }

    #[test]
    fn matmul_and_transposed_views_match_the_naive_product() -> Result<()> {
        let (m, k, n) = (5, 7, 3);
        let a = seq(m * k, 0.1);
        let b = seq(k * n, 0.2);
        let want = naive(&a, &b, m, k, n);
        let mut got = vec![0.0 as Real; m * n];
        matmul(&mut got, Mat::new(&a, m, k)?, Mat::new(&b, k, n)?, false)?;
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
        // aᵀ stored as k×m, viewed transposed, gives the same product; accumulate adds.
        let at: Vec<Real> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
        matmul(&mut got, Mat::new(&at, k, m)?.t(), Mat::new(&b, k, n)?, true)?;
        for (g, w) in got.iter().zip(&want) {
            assert!((g - 2.0 * w).abs() < 1e-5, "{g} vs 2×{w}");
        }
        assert!(matmul(&mut got, Mat::new(&a, m, k)?, Mat::new(&a, m, k)?, false).is_err());
        assert!(Mat::new(&a, m, k + 1).is_err());
        Ok(())
    }

    #[test]
    fn in_place_access_changes_every_view_of_the_tensor() -> Result<()> {
        let t = Tensor::from_vec(vec![1f32, 2.0, 3.0], 3, &candle_core::Device::Cpu)?;
        let view = t.clone();
        let sum = with_slice_mut(&t, |v| {
            v.iter_mut().for_each(|x| *x *= 10.0);
            v.iter().sum::<Real>()
        })?;
        assert_eq!(sum, 60.0);
        assert_eq!(view.to_vec1::<Real>()?, vec![10.0, 20.0, 30.0]);
        assert_eq!(with_slice(&view, |v| v.to_vec())?, vec![10.0, 20.0, 30.0]);
        let ints = Tensor::from_vec(vec![1u32], 1, &candle_core::Device::Cpu)?;
        assert!(with_slice(&ints, |_| ()).is_err());
        Ok(())
    }
}
