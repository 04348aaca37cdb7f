//! The built-in models: MLP, CNN, a decoder-only transformer (GPT) and a vision transformer (ViT), written
//! with candle tensor operations over [`Params`], so every parameter has a stable
//! name and order and its initial value depends only on the seed. Each declares
//! its layers and goes through them with [`Layers`], so a strategy that shards
//! the parameters (ZeRO-3) can gather each layer just before its use. The
//! transformers also build on tensor-parallel [`Params`]: each rank then holds
//! its part of every block (`crate::tensor_parallel`).
//!
//! Mixed precision (`crate::precision`): a model built on [`Params`] with a 16-bit compute type casts each weight
//! where it uses it and its input at the start; layer norms and softmax compute in f32, and the logits come out
//! in f32 whatever the compute type. On a GPU (`crate::device`) the same copies are made on the device: the
//! parameters stay on the host, the logits (and the loss) are on the device.

use crate::{REAL_DTYPE, Real};
use candle_core::{D, DType, Tensor};

use crate::batch::{Flat, FlatInput};
use crate::error::{Error, Result};
use crate::kernels::{Mat, cpu_f32, matmul};
use crate::layers::Layers;
use crate::params::{Params, SeededRng};
use crate::precision::{Compute, at, like};
use crate::tensor_parallel::{self as tp, Shard};
use crate::trainer::GradSink;

/// A model maps an input batch to logits of shape `[rows, classes]`.
pub trait Model: Send + Sync {
    fn forward(&self, input: &Tensor) -> candle_core::Result<Tensor>;

    /// The mean cross-entropy of `logits` (this model's output) against `target` (by default candle's; a model
    /// whose logits are cut across a tensor-parallel group computes it across the group).
    fn loss(&self, logits: &Tensor, target: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::loss::cross_entropy(logits, &target.to_device(logits.device())?)
    }

    /// How many rows of `logits` predict their target (the largest logit is the target's).
    fn correct(&self, logits: &Tensor, target: &Tensor) -> candle_core::Result<f64> {
        argmax_correct(logits, target)
    }

    /// The model's hand-written loss and backward pass, when it has one; the
    /// worker then trains through it instead of candle's autograd.
    fn hand_backward(&self) -> Option<&dyn HandBackward> {
        None
    }
}

/// A loss and backward pass written by hand on plain buffers: no graph, no
/// temporary tensors, no gradient for the inputs, and each gradient written
/// straight into the trainer's buckets as soon as its layer is done.
pub trait HandBackward {
    /// Cross-entropy of `batch` (mean over rows, times `weight`) and its
    /// gradients, put into `sink` in reverse parameter order; returns the loss.
    fn loss_and_grads(&self, batch: &Flat, weight: Real, sink: &mut dyn GradSink) -> Result<Real>;
}

fn linear(p: &mut Params, rng: &mut SeededRng, name: &str, fan_in: usize, fan_out: usize) -> Result<(Tensor, Tensor)> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    let w = p.uniform(rng, &format!("{name}.weight"), &[fan_in, fan_out], bound)?;
    let b = p.uniform(rng, &format!("{name}.bias"), &[fan_out], bound)?;
    Ok((w, b))
}

/// `x · w + b`, the weights copied where `x` is, in its type.
fn apply_linear(x: &Tensor, (w, b): &(Tensor, Tensor)) -> candle_core::Result<Tensor> {
    x.broadcast_matmul(&like(w, x)?)?.broadcast_add(&like(b, x)?)
}

/// Multi-layer perceptron: `features -> hidden... -> classes`, ReLU between layers.
#[derive(Debug)]
pub struct Mlp {
    layers: Vec<(Tensor, Tensor)>,
    /// Index of the first layer's weight in the [`Params`] it was built in.
    first: usize,
    /// The layers of those [`Params`], and the index of this model's first one.
    gate: Layers,
    first_layer: usize,
    /// What the forward pass computes in.
    compute: Compute,
}

impl Mlp {
    pub fn new(p: &mut Params, rng: &mut SeededRng, features: usize, hidden: &[usize], classes: usize) -> Result<Mlp> {
        let mut dims = vec![features];
        dims.extend_from_slice(hidden);
        dims.push(classes);
        let first = p.vars().len();
        let first_layer = p.layers().count();
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(i, w)| {
                let name = format!("mlp.{i}");
                p.layer(&name);
                linear(p, rng, &name, w[0], w[1])
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Mlp { layers, first, gate: p.layers().clone(), first_layer, compute: p.compute() })
    }
}

impl Model for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = self.compute.put(x)?;
        for (i, l) in self.layers.iter().enumerate() {
            let hidden = i + 1 < self.layers.len();
            h = self.gate.run(self.first_layer + i, &h, |h| {
                let z = apply_linear(h, l)?;
                if hidden { z.relu() } else { at(&z, REAL_DTYPE) }
            })?;
        }
        Ok(h)
    }

    fn hand_backward(&self) -> Option<&dyn HandBackward> {
        Some(self)
    }
}

impl HandBackward for Mlp {
    fn loss_and_grads(&self, batch: &Flat, weight: Real, sink: &mut dyn GradSink) -> Result<Real> {
        let FlatInput::Dense(x) = &batch.input else {
            return Err(Error::InvalidArgument("the MLP takes dense features, not tokens".into()));
        };
        let rows = batch.rows;
        let dims: Vec<(usize, usize)> = self.layers.iter().map(|(w, _)| (w.dims()[0], w.dims()[1])).collect();
        let (Some(&(features, _)), Some(&(_, classes))) = (dims.first(), dims.last()) else {
            return Err(Error::InvalidArgument("an MLP with no layers".into()));
        };
        if batch.width != features || batch.target.len() != rows {
            return Err(Error::InvalidArgument(format!(
                "batch of {rows} rows × {} features with {} targets for an MLP of {features} features",
                batch.width,
                batch.target.len()
            )));
        }
        // Forward: outs[l] = relu(in · W + b) for hidden layers, the logits for the last. Each layer's weight and bias
        // are read in place (no copies) while the layer is entered.
        let layers = dims.len();
        let mut outs: Vec<Vec<Real>> = Vec::with_capacity(layers);
        for (l, &(fan_in, fan_out)) in dims.iter().enumerate() {
            let entered = self.gate.forward_layer(self.first_layer + l)?;
            let (w, b) = &self.layers[l];
            let (ws, wl) = w.storage_and_layout();
            let (bs, bl) = b.storage_and_layout();
            let input: &[Real] = if l == 0 { x } else { &outs[l - 1] };
            let mut z = Vec::with_capacity(rows * fan_out);
            let bias = cpu_f32(&bs, bl)?;
            for _ in 0..rows {
                z.extend_from_slice(bias);
            }
            matmul(&mut z, Mat::new(input, rows, fan_in)?, Mat::new(cpu_f32(&ws, wl)?, fan_in, fan_out)?, true)?;
            drop((ws, bs));
            entered.release()?;
            if l + 1 < layers {
                z.iter_mut().for_each(|v| *v = v.max(0.0));
            }
            outs.push(z);
        }

        // Softmax cross-entropy; the logits become their gradient, d(loss)/d(logits).
        let mut dz = outs.pop().unwrap_or_default();
        let scale = weight / rows as Real;
        let mut nll = 0f64;
        for (r, (row, &y)) in dz.chunks_exact_mut(classes).zip(&batch.target).enumerate() {
            let y = y as usize;
            let Some(&logit_y) = row.get(y) else {
                return Err(Error::InvalidArgument(format!("label {y} of row {r} is not a class of 0..{classes}")));
            };
            let max = row.iter().fold(Real::NEG_INFINITY, |m, &v| m.max(v));
            let mut sum: Real = 0.0;
            for v in row.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            nll += f64::from(max + sum.ln() - logit_y);
            let k = scale / sum;
            row.iter_mut().for_each(|v| *v *= k);
            row[y] -= scale;
        }

        // Backward, last layer first: bias, weight, then the gradient of the layer's input.
        for l in (0..layers).rev() {
            let entered = self.gate.backward_layer(self.first_layer + l)?;
            let (fan_in, fan_out) = dims[l];
            let input: &[Real] = if l == 0 { x } else { &outs[l - 1] };
            let (w_index, b_index) = (self.first + 2 * l, self.first + 2 * l + 1);
            sink.put(b_index, &mut |g| {
                for row in dz.chunks_exact(fan_out) {
                    g.iter_mut().zip(row).for_each(|(g, d)| *g += d);
                }
                Ok(())
            })?;
            sink.put(w_index, &mut |g| {
                matmul(g, Mat::new(input, rows, fan_in)?.t(), Mat::new(&dz, rows, fan_out)?, false)
            })?;
            if l > 0 {
                let mut dh = vec![0.0 as Real; rows * fan_in];
                let (ws, wl) = self.layers[l].0.storage_and_layout();
                matmul(
                    &mut dh,
                    Mat::new(&dz, rows, fan_out)?,
                    Mat::new(cpu_f32(&ws, wl)?, fan_in, fan_out)?.t(),
                    false,
                )?;
                drop(ws);
                dh.iter_mut().zip(&outs[l - 1]).for_each(|(d, &h)| {
                    if h <= 0.0 {
                        *d = 0.0;
                    }
                });
                dz = dh;
            }
            entered.release()?;
        }
        Ok((nll * f64::from(weight) / rows.max(1) as f64) as Real)
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
    /// The layers (one per convolution, then the head), and the index of the first.
    gate: Layers,
    first_layer: usize,
    /// What the forward pass computes in.
    compute: Compute,
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
        let first_layer = p.layers().count();
        for (i, &c) in channels.iter().enumerate() {
            if s < 2 {
                return Err(Error::InvalidArgument(format!(
                    "cnn: {} pooling layers are too many for {side}x{side} images",
                    channels.len()
                )));
            }
            let bound = 1.0 / ((cin * 9) as f64).sqrt();
            p.layer(&format!("cnn.conv{i}"));
            let w = p.uniform(rng, &format!("cnn.conv{i}.weight"), &[c, cin, 3, 3], bound)?;
            let b = p.uniform(rng, &format!("cnn.conv{i}.bias"), &[c], bound)?;
            convs.push((w, b));
            cin = c;
            s /= 2;
        }
        p.layer("cnn.head");
        let head = linear(p, rng, "cnn.head", cin * s * s, classes)?;
        Ok(Cnn { side, convs, head, gate: p.layers().clone(), first_layer, compute: p.compute() })
    }
}

impl Model for Cnn {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let b = x.dim(0)?;
        let mut h = self.compute.put(&x.reshape((b, 1, self.side, self.side))?)?;
        for (i, (w, bias)) in self.convs.iter().enumerate() {
            h = self.gate.run(self.first_layer + i, &h, |h| {
                let c = w.dim(0)?;
                let bias = like(&bias.reshape((1, c, 1, 1))?, h)?;
                h.conv2d(&like(w, h)?, 1, 1, 1, 1)?.broadcast_add(&bias)?.relu()?.max_pool2d(2)
            })?;
        }
        let head = self.first_layer + self.convs.len();
        self.gate.run(head, &h, |h| at(&apply_linear(&h.flatten_from(1)?, &self.head)?, REAL_DTYPE))
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

/// How a linear layer is cut across a tensor-parallel group (`crate::tensor_parallel`); whole without one (a
/// replicated linear is [`linear`]).
#[derive(Debug, Clone, Copy)]
enum Cut {
    /// Column-parallel: output features (in `groups` equal blocks), the bias with them.
    Columns(usize),
    /// Row-parallel: input features; the bias whole.
    Rows,
}

fn linear_cut(
    p: &mut Params,
    rng: &mut SeededRng,
    name: &str,
    fan_in: usize,
    fan_out: usize,
    cut: Cut,
) -> Result<(Tensor, Tensor)> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    let (w, b) = (format!("{name}.weight"), format!("{name}.bias"));
    Ok(match cut {
        Cut::Columns(g) => (
            p.uniform_split(rng, &w, &[fan_in, fan_out], bound, 1, g)?,
            p.uniform_split(rng, &b, &[fan_out], bound, 0, g)?,
        ),
        Cut::Rows => {
            (p.uniform_split(rng, &w, &[fan_in, fan_out], bound, 0, 1)?, p.uniform(rng, &b, &[fan_out], bound)?)
        }
    })
}

fn layer_norm_params(p: &mut Params, name: &str, w: usize) -> Result<(Tensor, Tensor)> {
    Ok((p.constant(&format!("{name}.weight"), &[w], 1.0)?, p.constant(&format!("{name}.bias"), &[w], 0.0)?))
}

/// One pre-norm transformer block, the GPT's and the ViT's: multi-head self-attention with a fused `q|k|v`
/// projection, then a GELU MLP of 4× the width, each with its residual. Under tensor parallelism the attention is
/// cut by heads (`q|k|v` column-parallel in three groups, the output projection row-parallel) and the MLP by its
/// hidden units (column then row); the norms and the row-parallel biases are whole on every rank.
#[derive(Debug)]
struct Block {
    ln1: (Tensor, Tensor),
    qkv: (Tensor, Tensor),
    proj: (Tensor, Tensor),
    ln2: (Tensor, Tensor),
    fc: (Tensor, Tensor),
    out: (Tensor, Tensor),
}

impl Block {
    fn new(p: &mut Params, rng: &mut SeededRng, n: &str, w: usize) -> Result<Block> {
        Ok(Block {
            ln1: layer_norm_params(p, &format!("{n}.ln1"), w)?,
            qkv: linear_cut(p, rng, &format!("{n}.attn.qkv"), w, 3 * w, Cut::Columns(3))?,
            proj: linear_cut(p, rng, &format!("{n}.attn.proj"), w, w, Cut::Rows)?,
            ln2: layer_norm_params(p, &format!("{n}.ln2"), w)?,
            fc: linear_cut(p, rng, &format!("{n}.mlp.fc"), w, 4 * w, Cut::Columns(1))?,
            out: linear_cut(p, rng, &format!("{n}.mlp.proj"), 4 * w, w, Cut::Rows)?,
        })
    }

    /// The block on `x` (`[batch, time, width]`) with heads of `head_dim` (this rank's share of them under
    /// `shard`); `causal`: each position sees only itself and those before it.
    fn forward(&self, x: &Tensor, head_dim: usize, causal: bool, shard: Option<&Shard>) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        // This rank's width of q (and k, v): its heads.
        let wl = self.qkv.0.dim(1)? / 3;
        let nh = wl / head_dim;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let h = tp::enter(shard, &layer_norm(x, &self.ln1)?)?;
        let qkv = apply_linear(&h, &self.qkv)?;
        let split = |i: usize| -> candle_core::Result<Tensor> {
            qkv.narrow(2, i * wl, wl)?.reshape((b, t, nh, head_dim))?.transpose(1, 2)?.contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        // Scores, mask and softmax in f32; back to the compute type for the product with v.
        let att = (at(&q.matmul(&k.t()?.contiguous()?)?, REAL_DTYPE)? * scale)?;
        let att = if causal {
            let mask = Tensor::tril2(t, DType::U8, att.device())?.broadcast_as((b, nh, t, t))?;
            let neg = Tensor::new(Real::NEG_INFINITY, att.device())?.broadcast_as((b, nh, t, t))?;
            mask.where_cond(&att, &neg)?
        } else {
            att
        };
        let att = at(&candle_nn::ops::softmax(&att, D::Minus1)?, v.dtype())?;
        let y = att.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((b, t, wl))?;
        let y = tp::reduce(shard, &y.broadcast_matmul(&like(&self.proj.0, &y)?)?)?
            .broadcast_add(&like(&self.proj.1, &y)?)?;
        let x = (x + y)?;
        let h = tp::enter(shard, &layer_norm(&x, &self.ln2)?)?;
        let a = apply_linear(&h, &self.fc)?.gelu_erf()?;
        let y =
            tp::reduce(shard, &a.broadcast_matmul(&like(&self.out.0, &a)?)?)?.broadcast_add(&like(&self.out.1, &a)?)?;
        x + y
    }
}

/// Decoder-only transformer over byte (or char) tokens: token and position
/// embeddings, pre-norm blocks of causal multi-head attention and a GELU MLP,
/// a final layer norm and a linear head. Logits come out as `[batch*time, vocab]`.
///
/// Built on tensor-parallel [`Params`], each rank holds its heads and MLP units of every block, and its slice of the
/// vocabulary in the token embedding and the head (vocabulary-parallel; its logits are that slice, and
/// [`Model::loss`] is the vocabulary-parallel cross-entropy).
#[derive(Debug)]
pub struct Gpt {
    cfg: GptConfig,
    tok: Tensor,
    pos: Tensor,
    blocks: Vec<Block>,
    ln_f: (Tensor, Tensor),
    head: (Tensor, Tensor),
    /// The layers (the embeddings, one per block, the final norm with the head), and the index of the first.
    gate: Layers,
    first_layer: usize,
    shard: Option<Shard>,
    /// What the forward pass computes in.
    compute: Compute,
}

/// Layer norm over the last dimension, computed in f32 (the parameters' type) and given back in `x`'s.
fn layer_norm(x: &Tensor, (w, b): &(Tensor, Tensor)) -> candle_core::Result<Tensor> {
    let dt = x.dtype();
    let x = at(x, w.dtype())?;
    let (w, b) = (like(w, &x)?, like(b, &x)?);
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    at(&xc.broadcast_div(&(var + 1e-5)?.sqrt()?)?.broadcast_mul(&w)?.broadcast_add(&b)?, dt)
}

impl Gpt {
    pub fn new(p: &mut Params, rng: &mut SeededRng, cfg: GptConfig) -> Result<Gpt> {
        if cfg.heads == 0 || !cfg.width.is_multiple_of(cfg.heads) {
            return Err(Error::InvalidArgument(format!(
                "gpt: width {} is not divisible by heads {}",
                cfg.width, cfg.heads
            )));
        }
        let shard = p.shard().cloned();
        if let Some(s) = &shard
            && (!cfg.heads.is_multiple_of(s.parts()) || !cfg.vocab.is_multiple_of(s.parts()))
        {
            return Err(Error::InvalidArgument(format!(
                "gpt: {} tensor-parallel ranks do not divide its {} heads and vocabulary of {}",
                s.parts(),
                cfg.heads,
                cfg.vocab
            )));
        }
        let w = cfg.width;
        let emb = 0.02 * 3f64.sqrt();
        let first_layer = p.layer("gpt.embed");
        let tok = p.uniform_split(rng, "gpt.tok_emb", &[cfg.vocab, w], emb, 0, 1)?;
        let pos = p.uniform(rng, "gpt.pos_emb", &[cfg.context, w], emb)?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let n = format!("gpt.h{l}");
            p.layer(&n);
            blocks.push(Block::new(p, rng, &n, w)?);
        }
        p.layer("gpt.out");
        let ln_f = layer_norm_params(p, "gpt.ln_f", w)?;
        let head = linear_cut(p, rng, "gpt.head", w, cfg.vocab, Cut::Columns(1))?;
        let compute = p.compute();
        Ok(Gpt { cfg, tok, pos, blocks, ln_f, head, gate: p.layers().clone(), first_layer, shard, compute })
    }
}

impl Model for Gpt {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = ids.dims2()?;
        if t > self.cfg.context {
            candle_core::bail!("sequence of {t} tokens exceeds the context of {}", self.cfg.context);
        }
        let w = self.cfg.width;
        let shard = self.shard.as_ref();
        let first = self.first_layer;
        let mut x = self.gate.run(first, ids, |ids| {
            let x = match shard {
                Some(s) => s.embedding(&self.tok, ids)?,
                None => self.tok.embedding(&ids.flatten_all()?)?.reshape((b, t, w))?,
            };
            self.compute.put(&x.broadcast_add(&self.pos.narrow(0, 0, t)?)?)
        })?;
        let head_dim = w / self.cfg.heads;
        for (l, blk) in self.blocks.iter().enumerate() {
            x = self.gate.run(first + 1 + l, &x, |x| blk.forward(x, head_dim, true, shard))?;
        }
        self.gate.run(first + 1 + self.blocks.len(), &x, |x| {
            let x = tp::enter(shard, &layer_norm(x, &self.ln_f)?)?;
            let logits = at(&apply_linear(&x, &self.head)?, REAL_DTYPE)?;
            let v = logits.dim(2)?;
            logits.reshape((b * t, v))
        })
    }

    fn loss(&self, logits: &Tensor, target: &Tensor) -> candle_core::Result<Tensor> {
        match &self.shard {
            Some(s) => Ok(s.cross_entropy(logits, target)?.0),
            None => candle_nn::loss::cross_entropy(logits, &target.to_device(logits.device())?),
        }
    }

    fn correct(&self, logits: &Tensor, target: &Tensor) -> candle_core::Result<f64> {
        match &self.shard {
            Some(s) => Ok(s.cross_entropy(logits, target)?.1),
            None => argmax_correct(logits, target),
        }
    }
}

/// Sizes of a [`Vit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VitConfig {
    /// The images' side in pixels (`side²` features, row-major).
    pub side: usize,
    /// The patches' side in pixels (divides `side`).
    pub patch: usize,
    pub layers: usize,
    pub heads: usize,
    pub width: usize,
    pub classes: usize,
}

/// Vision transformer for square single-channel images: the image cut into `patch × patch` patches, each projected
/// linearly to the width; a learned class token first and learned position embeddings; the GPT's pre-norm blocks
/// without the causal mask; a final layer norm and a linear head on the class token. Under tensor parallelism the
/// blocks are cut as the GPT's (heads, MLP units); the patch embedding, class token, positions and head are small
/// and whole on every rank, so the logits are whole too.
#[derive(Debug)]
pub struct Vit {
    cfg: VitConfig,
    patch: (Tensor, Tensor),
    cls: Tensor,
    pos: Tensor,
    blocks: Vec<Block>,
    ln_f: (Tensor, Tensor),
    head: (Tensor, Tensor),
    gate: Layers,
    first_layer: usize,
    shard: Option<Shard>,
    /// What the forward pass computes in.
    compute: Compute,
}

impl Vit {
    pub fn new(p: &mut Params, rng: &mut SeededRng, cfg: VitConfig) -> Result<Vit> {
        let parts = p.shard().map_or(1, Shard::parts);
        if cfg.heads == 0 || !cfg.width.is_multiple_of(cfg.heads) || !cfg.heads.is_multiple_of(parts) {
            return Err(Error::InvalidArgument(format!(
                "vit: {} heads must divide width {} and be a multiple of the {parts} tensor-parallel ranks",
                cfg.heads, cfg.width
            )));
        }
        if cfg.patch == 0 || !cfg.side.is_multiple_of(cfg.patch) {
            return Err(Error::InvalidArgument(format!(
                "vit: {}-pixel patches do not divide the {}x{} image",
                cfg.patch, cfg.side, cfg.side
            )));
        }
        let w = cfg.width;
        let patches = (cfg.side / cfg.patch).pow(2);
        let emb = 0.02 * 3f64.sqrt();
        let first_layer = p.layer("vit.embed");
        let patch = linear(p, rng, "vit.patch", cfg.patch * cfg.patch, w)?;
        let cls = p.uniform(rng, "vit.cls", &[1, 1, w], emb)?;
        let pos = p.uniform(rng, "vit.pos_emb", &[patches + 1, w], emb)?;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let n = format!("vit.h{l}");
            p.layer(&n);
            blocks.push(Block::new(p, rng, &n, w)?);
        }
        p.layer("vit.out");
        let ln_f = layer_norm_params(p, "vit.ln_f", w)?;
        let head = linear(p, rng, "vit.head", w, cfg.classes)?;
        let shard = p.shard().cloned();
        let compute = p.compute();
        Ok(Vit { cfg, patch, cls, pos, blocks, ln_f, head, gate: p.layers().clone(), first_layer, shard, compute })
    }
}

impl Model for Vit {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let c = self.cfg;
        let b = x.dim(0)?;
        let (g, ps) = (c.side / c.patch, c.patch);
        let first = self.first_layer;
        let mut h = self.gate.run(first, x, |x| {
            // [b, side²] → [b, patches, patch²], patches in row-major order, each patch's pixels row-major.
            let patches = x.reshape((b, g, ps, g, ps))?.permute((0, 1, 3, 2, 4))?.reshape((b, g * g, ps * ps))?;
            let tokens = apply_linear(&self.compute.put(&patches)?, &self.patch)?;
            let cls = self.compute.put(&self.cls)?.broadcast_as((b, 1, c.width))?;
            Tensor::cat(&[&cls, &tokens], 1)?.broadcast_add(&self.compute.put(&self.pos)?)
        })?;
        let head_dim = c.width / c.heads;
        let shard = self.shard.as_ref();
        for (l, blk) in self.blocks.iter().enumerate() {
            h = self.gate.run(first + 1 + l, &h, |h| blk.forward(h, head_dim, false, shard))?;
        }
        self.gate.run(first + 1 + self.blocks.len(), &h, |h| {
            let cls = layer_norm(h, &self.ln_f)?.narrow(1, 0, 1)?.squeeze(1)?;
            at(&apply_linear(&cls, &self.head)?, REAL_DTYPE)
        })
    }
}

/// Rows of `logits` whose largest value is at the target's index.
fn argmax_correct(logits: &Tensor, target: &Tensor) -> candle_core::Result<f64> {
    let pred = logits.argmax(D::Minus1)?;
    Ok(f64::from(pred.eq(&target.to_device(pred.device())?)?.to_dtype(REAL_DTYPE)?.sum_all()?.to_scalar::<Real>()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Records what a backward pass puts, in order.
    struct Capture {
        sizes: Vec<usize>,
        got: Vec<(usize, Vec<Real>)>,
    }

    impl Capture {
        fn new(params: &Params) -> Capture {
            Capture { sizes: params.vars().iter().map(|(_, v)| v.elem_count()).collect(), got: Vec::new() }
        }
    }

    impl GradSink for Capture {
        fn put(&mut self, index: usize, fill: &mut dyn FnMut(&mut [Real]) -> Result<()>) -> Result<()> {
            let mut buf = vec![0.0 as Real; self.sizes[index]];
            fill(&mut buf)?;
            self.got.push((index, buf));
            Ok(())
        }

        fn attach_scalars(&mut self, _values: &[Real]) {}
    }

    #[test]
    fn hand_backward_gives_autograds_loss_and_gradients() -> Result<()> {
        let mut params = Params::default();
        let mlp = Mlp::new(&mut params, &mut SeededRng::new(3), 6, &[5, 4], 3)?;
        let rows = 7;
        let x: Vec<Real> = (0..rows * 6).map(|i| ((i * 37 % 17) as Real - 8.0) / 5.0).collect();
        let y: Vec<u32> = (0..rows as u32).map(|r| r % 3).collect();
        let weight: Real = 0.75;

        let xt = Tensor::from_vec(x.clone(), (rows, 6), &Device::Cpu)?;
        let yt = Tensor::from_vec(y.clone(), rows, &Device::Cpu)?;
        let loss = (candle_nn::loss::cross_entropy(&mlp.forward(&xt)?, &yt)? * f64::from(weight))?;
        let grads = loss.backward()?;

        let flat = Flat { rows, width: 6, input: FlatInput::Dense(x), target: y };
        let mut got = Capture::new(&params);
        let hand_loss = mlp.loss_and_grads(&flat, weight, &mut got)?;
        assert!((hand_loss - loss.to_scalar::<Real>()?).abs() < 1e-5, "loss {hand_loss} vs {loss}");
        // Reverse parameter order, bias before weight.
        assert_eq!(got.got.iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![5, 4, 3, 2, 1, 0]);
        for (i, g) in &got.got {
            let (name, var) = &params.vars()[*i];
            let want = grads.get(var.as_tensor()).map(|g| g.flatten_all()?.to_vec1::<Real>()).transpose()?;
            let want = want.unwrap_or_default();
            assert_eq!(want.len(), g.len(), "{name}");
            for (a, b) in want.iter().zip(g) {
                assert!((a - b).abs() < 1e-5, "{name}: autograd {a}, hand {b}");
            }
        }

        let bad = Flat { rows: 1, width: 6, input: FlatInput::Dense(vec![0.0; 6]), target: vec![3] };
        let err = mlp.loss_and_grads(&bad, 1.0, &mut Capture::new(&params)).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("label 3 of row 0")));
        let tokens = Flat { rows: 1, width: 6, input: FlatInput::Tokens(vec![0; 6]), target: vec![0] };
        assert!(mlp.loss_and_grads(&tokens, 1.0, &mut Capture::new(&params)).is_err());
        Ok(())
    }
}
