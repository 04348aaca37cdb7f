//! Turning samples of `shoal-data` (plain vectors) into tensors: the only place
//! where data meets candle.

use candle_core::{Device, Tensor};
use shoal_data::Sample;

use crate::error::{Error, Result};

/// Inputs and targets of one batch, and the number of samples in it.
#[derive(Debug)]
pub struct Tensors {
    pub input: Tensor,
    pub target: Tensor,
    pub rows: usize,
}

/// Dense features with class labels (`[rows, features]` f32, `[rows]` u32), or
/// token windows (`[rows, context]` u32 inputs, `[rows*context]` u32 targets).
/// `None` for an empty batch.
pub fn to_tensors(samples: &[Sample]) -> Result<Option<Tensors>> {
    let Some(first) = samples.first() else { return Ok(None) };
    let rows = samples.len();
    let width = first.features.len();
    let dev = &Device::Cpu;
    if first.features.as_tokens().is_some() {
        let (mut xs, mut ys) = (Vec::with_capacity(rows * width), Vec::with_capacity(rows * width));
        for (i, s) in samples.iter().enumerate() {
            let x = s.features.as_tokens().filter(|x| x.len() == width);
            let y = match &s.label {
                shoal_data::Label::Tokens(y) if y.len() == width => Some(y),
                _ => None,
            };
            let (Some(x), Some(y)) = (x, y) else {
                return Err(Error::InvalidArgument(format!(
                    "sample {i} of the batch is not a {width}-token window with targets"
                )));
            };
            xs.extend_from_slice(x);
            ys.extend_from_slice(y);
        }
        return Ok(Some(Tensors {
            input: Tensor::from_vec(xs, (rows, width), dev)?,
            target: Tensor::from_vec(ys, rows * width, dev)?,
            rows,
        }));
    }
    let mut xs = Vec::with_capacity(rows * width);
    let mut ys = Vec::with_capacity(rows);
    for (i, s) in samples.iter().enumerate() {
        let (Some(x), Some(y)) = (s.features.as_dense().filter(|x| x.len() == width), s.class_label()) else {
            return Err(Error::InvalidArgument(format!(
                "sample {i} of the batch is not {width} dense features with a class"
            )));
        };
        xs.extend_from_slice(x);
        ys.push(y);
    }
    Ok(Some(Tensors {
        input: Tensor::from_vec(xs, (rows, width), dev)?,
        target: Tensor::from_vec(ys, rows, dev)?,
        rows,
    }))
}
