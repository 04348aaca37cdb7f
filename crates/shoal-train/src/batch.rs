//! Turning samples of `shoal-data` (plain vectors) into tensors: the only place
//! where data meets candle.

use crate::Real;
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

/// A batch as plain buffers: dense features `[rows, width]` with class labels
/// `[rows]`, or token windows `[rows, width]` with one target per token.
#[derive(Debug, Clone, PartialEq)]
pub struct Flat {
    pub rows: usize,
    pub width: usize,
    pub input: FlatInput,
    pub target: Vec<u32>,
}

/// The inputs of a [`Flat`] batch.
#[derive(Debug, Clone, PartialEq)]
pub enum FlatInput {
    Dense(Vec<Real>),
    Tokens(Vec<u32>),
}

/// Copies a batch's samples into plain buffers, checking they agree in shape.
/// `None` for an empty batch.
pub fn to_flat(samples: &[Sample]) -> Result<Option<Flat>> {
    let Some(first) = samples.first() else { return Ok(None) };
    let rows = samples.len();
    let width = first.features.len();
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
        return Ok(Some(Flat { rows, width, input: FlatInput::Tokens(xs), target: ys }));
    }
    let mut xs = Vec::with_capacity(rows * width);
    let mut ys = Vec::with_capacity(rows);
    for (i, s) in samples.iter().enumerate() {
        let (Some(x), Some(y)) = (s.features.as_dense().filter(|x| x.len() == width), s.class_label()) else {
            return Err(Error::InvalidArgument(format!(
                "sample {i} of the batch is not {width} dense features with a class"
            )));
        };
        xs.extend(x.iter().map(|&v| crate::kernels::from_f32(v)));
        ys.push(y);
    }
    Ok(Some(Flat { rows, width, input: FlatInput::Dense(xs), target: ys }))
}

impl Flat {
    /// The batch as tensors (moves the buffers, no copy).
    pub fn into_tensors(self) -> Result<Tensors> {
        let dev = &Device::Cpu;
        let (rows, width) = (self.rows, self.width);
        let input = match self.input {
            FlatInput::Dense(x) => Tensor::from_vec(x, (rows, width), dev)?,
            FlatInput::Tokens(x) => Tensor::from_vec(x, (rows, width), dev)?,
        };
        let n = self.target.len();
        Ok(Tensors { input, target: Tensor::from_vec(self.target, n, dev)?, rows })
    }
}

/// Dense features with class labels (`[rows, features]` Real, `[rows]` u32), or
/// token windows (`[rows, context]` u32 inputs, `[rows*context]` u32 targets).
/// `None` for an empty batch.
pub fn to_tensors(samples: &[Sample]) -> Result<Option<Tensors>> {
    to_flat(samples)?.map(Flat::into_tensors).transpose()
}
