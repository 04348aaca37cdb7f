//! Plain-slice CPU kernels for the training hot path: matrix products through
//! the `gemm` crate (the same kernels as candle's CPU backend, with transposes
//! expressed as strides instead of copies), and read or in-place access to the
//! values of a candle tensor, so optimizer updates and hand-written backward
//! passes run without allocating a tensor per operation.
//!
//! Invariant: these functions only touch contiguous `f32` CPU tensors and say
//! so in an error otherwise; sizes are checked before any pointer is formed.

use std::cell::RefCell;

use candle_core::{CpuStorage, InplaceOp1, Layout, Storage, Tensor};

use crate::error::{Error, Result};

/// The values of `storage` under `layout`, when it is a contiguous f32 CPU tensor.
pub(crate) fn cpu_f32<'a>(storage: &'a Storage, layout: &Layout) -> Result<&'a [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => {
            v.get(a..b).ok_or_else(|| Error::InvalidArgument("tensor layout outside its storage".into()))
        }
        (Storage::Cpu(CpuStorage::F32(_)), None) => Err(Error::InvalidArgument("tensor is not contiguous".into())),
        _ => Err(Error::InvalidArgument("tensor is not an f32 tensor on the CPU".into())),
    }
}

/// Runs `f` on the values of a contiguous f32 CPU tensor.
pub fn with_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let (storage, layout) = t.storage_and_layout();
    Ok(f(cpu_f32(&storage, layout)?))
}

struct InPlace<F, R> {
    f: RefCell<Option<F>>,
    out: RefCell<Option<R>>,
}

impl<F: FnOnce(&mut [f32]) -> R, R> InplaceOp1 for InPlace<F, R> {
    fn name(&self) -> &'static str {
        "shoal-in-place"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((a, b)) = layout.contiguous_offsets() else { candle_core::bail!("tensor is not contiguous") };
        let CpuStorage::F32(v) = storage else { candle_core::bail!("tensor is not f32") };
        let Some(values) = v.get_mut(a..b) else { candle_core::bail!("tensor layout outside its storage") };
        let Some(f) = self.f.borrow_mut().take() else { candle_core::bail!("in-place kernel run twice") };
        *self.out.borrow_mut() = Some(f(values));
        Ok(())
    }
}

/// Runs `f` on the values of a contiguous f32 CPU tensor, in place: every
/// tensor sharing its storage (the model's view of a parameter) sees the change.
pub fn with_slice_mut<R>(t: &Tensor, f: impl FnOnce(&mut [f32]) -> R) -> Result<R> {
    let op = InPlace { f: RefCell::new(Some(f)), out: RefCell::new(None) };
    t.inplace_op1(&op)?;
    op.out.into_inner().ok_or_else(|| Error::InvalidArgument("in-place kernel did not run".into()))
}

struct Replace(RefCell<Option<Vec<f32>>>);

impl InplaceOp1 for Replace {
    fn name(&self) -> &'static str {
        "shoal-replace-storage"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some(values) = self.0.borrow_mut().take() else { candle_core::bail!("storage replaced twice") };
        let CpuStorage::F32(_) = storage else { candle_core::bail!("tensor is not f32") };
        let n = layout.shape().elem_count();
        if layout.start_offset() != 0 || !layout.is_contiguous() {
            candle_core::bail!("tensor is not a whole contiguous tensor");
        }
        if !values.is_empty() && values.len() != n {
            candle_core::bail!("{} values for a tensor of {n}", values.len());
        }
        *storage = CpuStorage::F32(values);
        Ok(())
    }
}

/// Replaces what a whole contiguous f32 CPU tensor holds: `values` (exactly as many as it has), or nothing
/// (`values` empty: its storage freed, its shape kept). Every tensor sharing the storage (the model's handles on a
/// parameter) sees the change. A tensor left holding nothing must not be computed with until it holds values again:
/// only ZeRO-3's layer store empties tensors, and only between a layer's uses (`crate::layers`).
pub(crate) fn replace_storage(t: &Tensor, values: Vec<f32>) -> Result<()> {
    t.inplace_op1(&Replace(RefCell::new(Some(values))))?;
    Ok(())
}

/// A read-only matrix view: `rows × cols`, element (r, c) at `data[r*rs + c*cs]`.
#[derive(Debug, Clone, Copy)]
pub struct Mat<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    /// A row-major `rows × cols` matrix over `data`.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Result<Mat<'a>> {
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
pub fn matmul(dst: &mut [f32], a: Mat<'_>, b: Mat<'_>, accumulate: bool) -> Result<()> {
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
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism(),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        out
    }

    fn seq(n: usize, s: f32) -> Vec<f32> {
        (0..n).map(|i| ((i * 7 + 3) % 11) as f32 * s - 0.3).collect()
    }

    #[test]
    fn matmul_and_transposed_views_match_the_naive_product() -> Result<()> {
        let (m, k, n) = (5, 7, 3);
        let a = seq(m * k, 0.1);
        let b = seq(k * n, 0.2);
        let want = naive(&a, &b, m, k, n);
        let mut got = vec![0f32; m * n];
        matmul(&mut got, Mat::new(&a, m, k)?, Mat::new(&b, k, n)?, false)?;
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
        // aᵀ stored as k×m, viewed transposed, gives the same product; accumulate adds.
        let at: Vec<f32> = (0..k * m).map(|i| a[(i % m) * k + i / m]).collect();
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
            v.iter().sum::<f32>()
        })?;
        assert_eq!(sum, 60.0);
        assert_eq!(view.to_vec1::<f32>()?, vec![10.0, 20.0, 30.0]);
        assert_eq!(with_slice(&view, |v| v.to_vec())?, vec![10.0, 20.0, 30.0]);
        let ints = Tensor::from_vec(vec![1u32], 1, &candle_core::Device::Cpu)?;
        assert!(with_slice(&ints, |_| ()).is_err());
        Ok(())
    }
}
