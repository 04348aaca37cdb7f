//! The built-in models: MLP, CNN and a decoder-only transformer (GPT), written
//! with candle tensor operations over [`Params`], so every parameter has a stable
//! name and order and its initial value depends only on the seed.

use candle_core::{D, DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::params::{Params, SeededRng};

/// A model maps an input batch to logits of shape `[rows, classes]`.
pub trait Model: Send + Sync {
    fn forward(&self, input: &Tensor) -> candle_core::Result<Tensor>;
}

fn linear(p: &mut Params, rng: &mut SeededRng, name: &str, fan_in: usize, fan_out: usize) -> Result<(Tensor, Tensor)> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    let w = p.uniform(rng, &format!("{name}.weight"), &[fan_in, fan_out], bound)?;
    let b = p.uniform(rng, &format!("{name}.bias"), &[fan_out], bound)?;
    Ok((w, b))
}

fn apply_linear(x: &Tensor, (w, b): &(Tensor, Tensor)) -> candle_core::Result<Tensor> {
    x.broadcast_matmul(w)?.broadcast_add(b)
}

/// Multi-layer perceptron: `features -> hidden... -> classes`, ReLU between layers.
#[derive(Debug)]
pub struct Mlp {
    layers: Vec<(Tensor, Tensor)>,
}

impl Mlp {
    pub fn new(p: &mut Params, rng: &mut SeededRng, features: usize, hidden: &[usize], classes: usize) -> Result<Mlp> {
        let mut dims = vec![features];
        dims.extend_from_slice(hidden);
        dims.push(classes);
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(i, w)| linear(p, rng, &format!("mlp.{i}"), w[0], w[1]))
            .collect::<Result<Vec<_>>>()?;
        Ok(Mlp { layers })
    }
}

impl Model for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (i, l) in self.layers.iter().enumerate() {
            h = apply_linear(&h, l)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// Convolutional network for square single-channel images: per entry of
/// `channels`, a 3×3 convolution (padding 1), ReLU and 2×2 max-pooling; then a
/// linear classifier.
#[derive(Debug)]
pub struct Cnn {
    side: usize,
    convs: Vec<(Tensor, Tensor)>,
    head: (Tensor, Tensor),
}

impl Cnn {
    pub fn new(
        p: &mut Params,
        rng: &mut SeededRng,
        features: usize,
        channels: &[usize],
        classes: usize,
    ) -> Result<Cnn> {
        let side = (features as f64).sqrt().round() as usize;
        if side * side != features {
            return Err(Error::InvalidArgument(format!(
                "cnn needs square images; {features} features are not a square"
            )));
        }
        let mut cin = 1;
        let mut s = side;
        let mut convs = Vec::new();
        for (i, &c) in channels.iter().enumerate() {
            if s < 2 {
                return Err(Error::InvalidArgument(format!(
                    "cnn: {} pooling layers are too many for {side}x{side} images",
                    channels.len()
                )));
            }
            let bound = 1.0 / ((cin * 9) as f64).sqrt();
            let w = p.uniform(rng, &format!("cnn.conv{i}.weight"), &[c, cin, 3, 3], bound)?;
            let b = p.uniform(rng, &format!("cnn.conv{i}.bias"), &[c], bound)?;
            convs.push((w, b));
            cin = c;
            s /= 2;
        }
        let head = linear(p, rng, "cnn.head", cin * s * s, classes)?;
        Ok(Cnn { side, convs, head })
    }
}

impl Model for Cnn {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let b = x.dim(0)?;
        let mut h = x.reshape((b, 1, self.side, self.side))?;
        for (w, bias) in &self.convs {
            let c = w.dim(0)?;
            h = h.conv2d(w, 1, 1, 1, 1)?.broadcast_add(&bias.reshape((1, c, 1, 1))?)?.relu()?.max_pool2d(2)?;
        }
        let h = h.flatten_from(1)?;
        apply_linear(&h, &self.head)
    }
}

/// Sizes of a [`Gpt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GptConfig {
    pub vocab: usize,
    pub context: usize,
    pub layers: usize,
    pub heads: usize,
    pub width: usize,
}

#[derive(Debug)]
struct Block {
    ln1: (Tensor, Tensor),
    qkv: (Tensor, Tensor),
    proj: (Tensor, Tensor),
    ln2: (Tensor, Tensor),
    fc: (Tensor, Tensor),
    out: (Tensor, Tensor),
}

/// Decoder-only transformer over byte (or char) tokens: token and position
/// embeddings, pre-norm blocks of causal multi-head attention and a GELU MLP,
/// a final layer norm and a linear head. Logits come out as `[batch*time, vocab]`.
#[derive(Debug)]
pub struct Gpt {
    cfg: GptConfig,
    tok: Tensor,
    pos: Tensor,
    blocks: Vec<Block>,
    ln_f: (Tensor, Tensor),
    head: (Tensor, Tensor),
}

fn layer_norm(x: &Tensor, (w, b): &(Tensor, Tensor)) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + 1e-5)?.sqrt()?)?.broadcast_mul(w)?.broadcast_add(b)
}

impl Gpt {
    pub fn new(p: &mut Params, rng: &mut SeededRng, cfg: GptConfig) -> Result<Gpt> {
        if cfg.heads == 0 || !cfg.width.is_multiple_of(cfg.heads) {
            return Err(Error::InvalidArgument(format!(
                "gpt: width {} is not divisible by heads {}",
                cfg.width, cfg.heads
            )));
        }
        let w = cfg.width;
        let emb = 0.02 * 3f64.sqrt();
        let tok = p.uniform(rng, "gpt.tok_emb", &[cfg.vocab, w], emb)?;
        let pos = p.uniform(rng, "gpt.pos_emb", &[cfg.context, w], emb)?;
        let ln = |p: &mut Params, name: &str| -> Result<(Tensor, Tensor)> {
            Ok((p.constant(&format!("{name}.weight"), &[w], 1.0)?, p.constant(&format!("{name}.bias"), &[w], 0.0)?))
        };
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let n = format!("gpt.h{l}");
            blocks.push(Block {
                ln1: ln(p, &format!("{n}.ln1"))?,
                qkv: linear(p, rng, &format!("{n}.attn.qkv"), w, 3 * w)?,
                proj: linear(p, rng, &format!("{n}.attn.proj"), w, w)?,
                ln2: ln(p, &format!("{n}.ln2"))?,
                fc: linear(p, rng, &format!("{n}.mlp.fc"), w, 4 * w)?,
                out: linear(p, rng, &format!("{n}.mlp.proj"), 4 * w, w)?,
            });
        }
        let ln_f = ln(p, "gpt.ln_f")?;
        let head = linear(p, rng, "gpt.head", w, cfg.vocab)?;
        Ok(Gpt { cfg, tok, pos, blocks, ln_f, head })
    }
}

impl Model for Gpt {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        if t > self.cfg.context {
            candle_core::bail!("sequence of {t} tokens exceeds the context of {}", self.cfg.context);
        }
        let (w, nh) = (self.cfg.width, self.cfg.heads);
        let hd = w / nh;
        let mut x = self.tok.embedding(&ids.flatten_all()?)?.reshape((b, t, w))?;
        x = x.broadcast_add(&self.pos.narrow(0, 0, t)?)?;
        let mask = Tensor::tril2(t, DType::U8, &Device::Cpu)?.broadcast_as((b, nh, t, t))?;
        let neg = Tensor::new(f32::NEG_INFINITY, &Device::Cpu)?.broadcast_as((b, nh, t, t))?;
        let scale = 1.0 / (hd as f64).sqrt();
        for blk in &self.blocks {
            let h = layer_norm(&x, &blk.ln1)?;
            let qkv = apply_linear(&h, &blk.qkv)?;
            let split = |i: usize| -> candle_core::Result<Tensor> {
                qkv.narrow(2, i * w, w)?.reshape((b, t, nh, hd))?.transpose(1, 2)?.contiguous()
            };
            let (q, k, v) = (split(0)?, split(1)?, split(2)?);
            let att = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
            let att = mask.where_cond(&att, &neg)?;
            let att = candle_nn::ops::softmax(&att, D::Minus1)?;
            let y = att.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((b, t, w))?;
            x = (x + apply_linear(&y, &blk.proj)?)?;
            let h = layer_norm(&x, &blk.ln2)?;
            x = (x + apply_linear(&apply_linear(&h, &blk.fc)?.gelu_erf()?, &blk.out)?)?;
        }
        let x = layer_norm(&x, &self.ln_f)?;
        apply_linear(&x, &self.head)?.reshape((b * t, self.cfg.vocab))
    }
}
