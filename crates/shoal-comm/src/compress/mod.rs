//! Gradient compression: a [`Compressor`] sums `f32` buffers over a communicator's ranks sending less than an
//! all-reduce of the buffer would, each rank keeping what its code left out (error feedback) and adding it to its
//! next contribution, so nothing is lost, only late.
//!
//! Each codec is reduced the way that moves fewest bytes for it:
//! - `fp16`, `bf16`, `int8`, `sign` (codes of each value): at 2 ranks, an all-gather of the codes, summed in f32
//!   (as many bytes as a ring all-reduce of the codes, and one rounding instead of one a hop); beyond, two stages as
//!   a ring does them: each rank sends segment `j` of its code to rank `j` ([`Communicator::all_to_all_bytes`]),
//!   rank `j` sums what it got in f32, codes the sum again (with error feedback of its own) and the codes are
//!   all-gathered — `2(n-1)/n` codes a rank like a ring, where an all-gather would send `n - 1`, and every rounding
//!   fed back.
//! - `topk`: the kept indices and values all-gathered while `n·k` is below the buffer's length, else an all-reduce
//!   of the buffer with everything else zero.
//! - `randk`: every rank draws the same indices (from the job's seed, the step and the bucket), so only the `k`
//!   values are all-reduced.
//! - `powersgd`: each matrix of the buffer that is worth it (it shrinks at least twofold) sent as the low-rank
//!   factors `P` and `Q`, two all-reduces a step; everything else (biases, small matrices) rides whole in the first.
//!
//! Every rank decodes the same bytes in the same order, so every rank ends with the same bits.
//!
//! The warm-up's steps go plain, or coded by a quantiser of their own (`warmup_codec`: fp16, bf16 or int8) with the
//! same error feedback, whose residual the codec then takes on: nothing is lost at the switch.
//!
//! Error feedback keeps, per bucket, `residual = (input + residual) - sent`, where `sent` is what this rank's code
//! decodes to. For the sparse codecs and the half-precision casts the identity `sent + residual = input` holds
//! exactly in f32; for the others to within a rounding of `input`.

pub mod codec;
pub mod powersgd;

use std::collections::BTreeMap;

use codec::SplitMix;

use crate::comm::Communicator;
use crate::dtype::ReduceOp;
use crate::error::{Error, Result};

/// What a [`Compressor`] sends in place of each value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Codec {
    /// Nothing: a plain all-reduce.
    None,
    Fp16,
    Bf16,
    /// A byte a value and a scale per [`codec::CHUNK`]; `stochastic` rounds up with the probability of the fraction.
    Int8 {
        stochastic: bool,
    },
    /// The `ratio` of values of largest magnitude.
    TopK {
        ratio: f64,
    },
    /// A `ratio` of the values, drawn at random (the same on every rank).
    RandK {
        ratio: f64,
    },
    /// A bit a value and a scale per [`codec::CHUNK`].
    Sign,
    /// Low-rank factors of each matrix.
    PowerSgd {
        rank: usize,
    },
}

impl Codec {
    /// The name the job spec gives it (`compression.codec`).
    pub fn name(&self) -> &'static str {
        match self {
            Codec::None => "none",
            Codec::Fp16 => "fp16",
            Codec::Bf16 => "bf16",
            Codec::Int8 { .. } => "int8",
            Codec::TopK { .. } => "topk",
            Codec::RandK { .. } => "randk",
            Codec::Sign => "sign",
            Codec::PowerSgd { .. } => "powersgd",
        }
    }

    /// Whether the codec needs to know which parts of a buffer are matrices.
    pub fn wants_matrices(&self) -> bool {
        matches!(self, Codec::PowerSgd { .. })
    }

    /// Whether [`Compressor::reduce_scatter`] can use it (PowerSGD needs every matrix whole on every rank).
    pub fn can_reduce_scatter(&self) -> bool {
        !matches!(self, Codec::PowerSgd { .. })
    }
}

/// How a [`Compressor`] compresses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CompressConfig {
    pub codec: Codec,
    /// Keep what the code left out and add it to the next step's input.
    pub error_feedback: bool,
    /// Steps sent uncompressed first ([`Compressor::set_step`] counts them)...
    pub warmup_steps: u64,
    /// ...or coded by this quantiser (fp16, bf16, int8; any other codec: plain), with the codec's error feedback.
    pub warmup_codec: Codec,
    /// Seeds random-k's indices, stochastic rounding and PowerSGD's first `Q`.
    pub seed: u64,
}

impl Default for CompressConfig {
    fn default() -> Self {
        CompressConfig { codec: Codec::None, error_feedback: true, warmup_steps: 0, warmup_codec: Codec::None, seed: 0 }
    }
}

/// A part of a buffer that is a row-major matrix (PowerSGD compresses these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Matrix {
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
}

/// Error feedback and warm-start state of one bucket.
#[derive(Debug, Default, Clone)]
struct BucketState {
    /// What this rank's codes have left out so far.
    residual: Vec<f32>,
    /// The two-stage codecs: what this rank's second code (of the segment it sums) left out.
    server: Vec<f32>,
    /// PowerSGD: every compressed matrix's `Q`, one after the other (the same on every rank).
    q: Vec<f32>,
}

/// The state of gradient compression over a run (see the module documentation).
#[derive(Debug)]
pub struct Compressor {
    cfg: CompressConfig,
    step: u64,
    buckets: BTreeMap<usize, BucketState>,
    idx: Vec<u32>,
    scratch: Scratch,
    /// A bucket summed whole for a sparse reduce-scatter.
    whole: Vec<f32>,
}

/// Buffers the reductions reuse from call to call: once grown to a bucket's size, a step allocates nothing.
#[derive(Debug, Default)]
struct Scratch {
    /// One code.
    enc: Vec<u8>,
    /// Codes to send and codes received.
    send: Vec<u8>,
    recv: Vec<u8>,
    /// A bucket's values padded to whole segments (the two-stage codecs).
    padded: Vec<f32>,
    /// What one segment's code decodes to (error feedback).
    sent: Vec<f32>,
    /// The segment this rank sums.
    mine: Vec<f32>,
}

/// A quantising codec: each value coded on its own (with per-chunk scales).
#[derive(Debug, Clone, Copy)]
enum Quant {
    F16,
    Bf16,
    Int8(bool),
    Sign,
}

impl Quant {
    /// The quantiser of `codec`; none for the codecs that are not one.
    fn of(codec: Codec) -> Option<Quant> {
        match codec {
            Codec::Fp16 => Some(Quant::F16),
            Codec::Bf16 => Some(Quant::Bf16),
            Codec::Int8 { stochastic } => Some(Quant::Int8(stochastic)),
            Codec::Sign => Some(Quant::Sign),
            Codec::None | Codec::TopK { .. } | Codec::RandK { .. } | Codec::PowerSgd { .. } => None,
        }
    }

    fn len(self, n: usize) -> usize {
        match self {
            Quant::F16 | Quant::Bf16 => codec::half_len(n),
            Quant::Int8(_) => codec::int8_len(n),
            Quant::Sign => codec::sign_len(n),
        }
    }

    fn encode(self, src: &[f32], out: &mut Vec<u8>, rng: &mut SplitMix) {
        match self {
            Quant::F16 => codec::encode_f16(src, out),
            Quant::Bf16 => codec::encode_bf16(src, out),
            Quant::Int8(stochastic) => codec::encode_int8(src, out, stochastic.then_some(rng)),
            Quant::Sign => codec::encode_sign(src, out),
        }
    }

    fn decode_add(self, src: &[u8], out: &mut [f32]) {
        match self {
            Quant::F16 => codec::decode_f16_add(src, out),
            Quant::Bf16 => codec::decode_bf16_add(src, out),
            Quant::Int8(_) => codec::decode_int8_add(src, out),
            Quant::Sign => codec::decode_sign_add(src, out),
        }
    }
}

impl Compressor {
    pub fn new(cfg: CompressConfig) -> Compressor {
        Compressor {
            cfg,
            step: 0,
            buckets: BTreeMap::new(),
            idx: Vec::new(),
            scratch: Scratch::default(),
            whole: Vec::new(),
        }
    }

    pub fn config(&self) -> &CompressConfig {
        &self.cfg
    }

    /// Tells the compressor which step (0-based, the steps done before it) the next reductions belong to: it
    /// counts the warm-up and seeds the step's random draws.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Whether this step's reductions are compressed (a codec, and past the warm-up).
    pub fn active(&self) -> bool {
        self.cfg.codec != Codec::None && self.step >= self.cfg.warmup_steps
    }

    /// The quantiser of this step's reduction while not [`Self::active`] (`None`: plain).
    fn warming(&self) -> Option<Quant> {
        match self.cfg.codec {
            Codec::None => None,
            _ => Quant::of(self.cfg.warmup_codec),
        }
    }

    /// Sums `data` over `comm`'s ranks in place, compressed (see the module documentation); `bucket` names the
    /// buffer from step to step (its error feedback), `matrices` says where its matrices are (PowerSGD). Every rank
    /// must call it with the same bucket, length and matrices.
    pub fn all_reduce(
        &mut self,
        comm: &Communicator,
        bucket: usize,
        data: &mut [f32],
        matrices: &[Matrix],
    ) -> Result<()> {
        let n = comm.size();
        if n <= 1 || data.is_empty() {
            return Ok(());
        }
        let warm = match self.active() {
            true => None,
            false => match self.warming() {
                Some(q) => Some(q),
                None => return comm.all_reduce(data, ReduceOp::Sum),
            },
        };
        let (ef, seed, step) = (self.cfg.error_feedback, self.cfg.seed, self.step);
        let st = self.buckets.entry(bucket).or_default();
        if ef {
            compensate(&mut st.residual, data);
        }
        let mut rng = SplitMix::mixed(&[seed, step, bucket as u64, comm.rank() as u64]);
        let s = &mut self.scratch;
        if let Some(q) = warm.or_else(|| Quant::of(self.cfg.codec)) {
            return match n {
                2 => gathered(comm, q, data, st, ef, s, &mut rng),
                _ => two_stage(comm, q, data, st, ef, s, &mut rng),
            };
        }
        match self.cfg.codec {
            Codec::TopK { ratio } => {
                let k = codec::sparse_k(data.len(), ratio);
                codec::top_k(data, k, &mut self.idx);
                sparse_sum(comm, data, &self.idx, st, ef, s, false)
            }
            Codec::RandK { ratio } => {
                let k = codec::sparse_k(data.len(), ratio);
                // The same draw on every rank: seeded without the rank.
                codec::random_k(data.len(), k, &mut SplitMix::mixed(&[seed, step, bucket as u64]), &mut self.idx);
                sparse_sum(comm, data, &self.idx, st, ef, s, true)
            }
            Codec::PowerSgd { rank } => power_sgd(comm, data, matrices, rank, st, ef, seed, bucket),
            Codec::None | Codec::Fp16 | Codec::Bf16 | Codec::Int8 { .. } | Codec::Sign => {
                comm.all_reduce(data, ReduceOp::Sum)
            }
        }
    }

    /// Reduce-scatter, compressed: `data` (a bucket padded to `size` equal slices) summed over the ranks, this
    /// rank's slice written to `out`. For ZeRO, whose ranks each update only their slice: each slice's code goes
    /// only to its rank (the first of the two stages). A sparse code is summed whole and sliced. PowerSGD is refused.
    pub fn reduce_scatter(&mut self, comm: &Communicator, bucket: usize, data: &[f32], out: &mut [f32]) -> Result<()> {
        let (n, r) = (comm.size(), comm.rank());
        let s = out.len();
        if data.len() != s * n {
            return Err(Error::InvalidArgument(format!(
                "compressed reduce_scatter: {} values are not {n} slices of {s}",
                data.len()
            )));
        }
        if n <= 1 {
            return comm.reduce_scatter(data, out, ReduceOp::Sum);
        }
        let q = match self.cfg.codec {
            _ if !self.active() => match self.warming() {
                Some(q) => q,
                None => return comm.reduce_scatter(data, out, ReduceOp::Sum),
            },
            Codec::TopK { .. } | Codec::RandK { .. } => {
                // A sparse code is summed whole; this rank keeps its slice.
                let mut whole = std::mem::take(&mut self.whole);
                whole.clear();
                whole.extend_from_slice(data);
                let summed = self.all_reduce(comm, bucket, &mut whole, &[]);
                out.copy_from_slice(&whole[r * s..(r + 1) * s]);
                self.whole = whole;
                return summed;
            }
            Codec::PowerSgd { .. } => {
                return Err(Error::InvalidArgument(
                    "PowerSGD cannot compress a reduce-scatter: it needs every matrix whole on every rank".into(),
                ));
            }
            codec => match Quant::of(codec) {
                Some(q) => q,
                None => return comm.reduce_scatter(data, out, ReduceOp::Sum),
            },
        };
        let (ef, seed, step) = (self.cfg.error_feedback, self.cfg.seed, self.step);
        let st = self.buckets.entry(bucket).or_default();
        let sc = &mut self.scratch;
        sc.padded.clear();
        sc.padded.extend_from_slice(data);
        if ef {
            compensate(&mut st.residual, &mut sc.padded);
        }
        let mut rng = SplitMix::mixed(&[seed, step, bucket as u64, r as u64]);
        scatter(comm, q, s, ef.then_some(&mut st.residual[..]), sc, &mut rng)?;
        out.copy_from_slice(&sc.mine);
        Ok(())
    }

    /// Error feedback and warm-start state, named `residual.B`, `server.B` and `q.B` by bucket (empty with no
    /// codec, or before the first coded step).
    pub fn state(&self) -> Vec<(String, Vec<f32>)> {
        let mut out = Vec::new();
        for (b, st) in &self.buckets {
            for (what, v) in [("residual", &st.residual), ("server", &st.server), ("q", &st.q)] {
                if !v.is_empty() {
                    out.push((format!("{what}.{b}"), v.clone()));
                }
            }
        }
        out
    }

    /// Restores what [`Self::state`] gave (from a checkpoint); a name it does not know is an error naming it.
    pub fn load_state(&mut self, named: Vec<(String, Vec<f32>)>) -> Result<()> {
        self.buckets.clear();
        for (name, v) in named {
            let parsed = name.split_once('.').and_then(|(w, b)| Some((w, b.parse::<usize>().ok()?)));
            let Some((what, b)) = parsed else {
                return Err(Error::InvalidArgument(format!("compression state {name:?}: not WHAT.BUCKET")));
            };
            let st = self.buckets.entry(b).or_default();
            match what {
                "residual" => st.residual = v,
                "server" => st.server = v,
                "q" => st.q = v,
                _ => return Err(Error::InvalidArgument(format!("compression state {name:?}: unknown part {what:?}"))),
            }
        }
        Ok(())
    }
}

/// `data += residual` (the residual grown with zeros to `data`'s length).
fn compensate(residual: &mut Vec<f32>, data: &mut [f32]) {
    residual.resize(data.len(), 0.0);
    data.iter_mut().zip(residual.iter()).for_each(|(d, r)| *d += r);
}

/// `residual = input - sent`, where `decode` adds what was sent into a zeroed buffer.
fn keep_residual(residual: &mut Vec<f32>, input: &[f32], decode: impl FnOnce(&mut [f32])) {
    residual.clear();
    residual.resize(input.len(), 0.0);
    decode(residual);
    residual.iter_mut().zip(input).for_each(|(r, v)| *r = v - *r);
}

/// Every rank's code all-gathered and summed, in rank order.
fn gathered(
    comm: &Communicator,
    q: Quant,
    data: &mut [f32],
    st: &mut BucketState,
    ef: bool,
    s: &mut Scratch,
    rng: &mut SplitMix,
) -> Result<()> {
    q.encode(data, &mut s.enc, rng);
    if ef {
        keep_residual(&mut st.residual, data, |sent| q.decode_add(&s.enc, sent));
    }
    s.recv.clear();
    s.recv.resize(s.enc.len() * comm.size(), 0);
    comm.all_gather_bytes(&s.enc, &mut s.recv)?;
    data.fill(0.0);
    for code in s.recv.chunks_exact(s.enc.len()) {
        q.decode_add(code, data);
    }
    Ok(())
}

/// The first stage of a quantised reduction: segment `j` of `s.padded` (`n` segments of `seg` values) coded and
/// sent to rank `j`, and the codes this rank got summed into `s.mine`. With error feedback, `residual[i]` becomes
/// `padded[i]` less what its code decodes to, for every `i` of `residual` (at most as long as `s.padded`).
fn scatter(
    comm: &Communicator,
    q: Quant,
    seg: usize,
    mut residual: Option<&mut [f32]>,
    s: &mut Scratch,
    rng: &mut SplitMix,
) -> Result<()> {
    let (n, e) = (comm.size(), q.len(seg));
    s.send.clear();
    s.send.resize(e * n, 0);
    for j in 0..n {
        let part = &s.padded[j * seg..(j + 1) * seg];
        q.encode(part, &mut s.enc, rng);
        s.send[j * e..(j + 1) * e].copy_from_slice(&s.enc);
        if let Some(res) = residual.as_deref_mut() {
            let (lo, hi) = ((j * seg).min(res.len()), ((j + 1) * seg).min(res.len()));
            s.sent.clear();
            s.sent.resize(seg, 0.0);
            q.decode_add(&s.enc, &mut s.sent);
            res[lo..hi].iter_mut().zip(part).zip(&s.sent).for_each(|((r, v), d)| *r = v - d);
        }
    }
    s.recv.clear();
    s.recv.resize(e * n, 0);
    comm.all_to_all_bytes(&s.send, &mut s.recv)?;
    s.mine.clear();
    s.mine.resize(seg, 0.0);
    for code in s.recv.chunks_exact(e) {
        q.decode_add(code, &mut s.mine);
    }
    Ok(())
}

/// The two stages of a quantised reduction (see the module documentation).
fn two_stage(
    comm: &Communicator,
    q: Quant,
    data: &mut [f32],
    st: &mut BucketState,
    ef: bool,
    s: &mut Scratch,
    rng: &mut SplitMix,
) -> Result<()> {
    let n = comm.size();
    let seg = data.len().div_ceil(n);
    s.padded.clear();
    s.padded.resize(seg * n, 0.0);
    s.padded[..data.len()].copy_from_slice(data);
    scatter(comm, q, seg, ef.then_some(&mut st.residual[..]), s, rng)?;
    if ef {
        compensate(&mut st.server, &mut s.mine);
    }
    q.encode(&s.mine, &mut s.enc, rng);
    if ef {
        keep_residual(&mut st.server, &s.mine, |d| q.decode_add(&s.enc, d));
    }
    let e = s.enc.len();
    s.recv.clear();
    s.recv.resize(e * n, 0);
    comm.all_gather_bytes(&s.enc, &mut s.recv)?;
    s.padded.fill(0.0);
    for (j, code) in s.recv.chunks_exact(e).enumerate() {
        q.decode_add(code, &mut s.padded[j * seg..(j + 1) * seg]);
    }
    data.copy_from_slice(&s.padded[..data.len()]);
    Ok(())
}

/// The values at `idx` summed over the ranks (everything else zero); `shared`: every rank has the same indices
/// (random-k), so only the values are all-reduced.
fn sparse_sum(
    comm: &Communicator,
    data: &mut [f32],
    idx: &[u32],
    st: &mut BucketState,
    ef: bool,
    s: &mut Scratch,
    shared: bool,
) -> Result<()> {
    let (n, len) = (comm.size(), data.len());
    // Without error feedback random-k is scaled to stay unbiased; top-k is biased either way.
    let scale = if shared && !ef { len as f32 / idx.len().max(1) as f32 } else { 1.0 };
    let mut vals: Vec<f32> = idx.iter().map(|i| data[*i as usize] * scale).collect();
    if ef {
        st.residual.clear();
        st.residual.extend_from_slice(data);
        for i in idx {
            st.residual[*i as usize] = 0.0;
        }
    }
    if shared {
        comm.all_reduce(&mut vals, ReduceOp::Sum)?;
        data.fill(0.0);
        idx.iter().zip(&vals).for_each(|(i, v)| data[*i as usize] = *v);
    } else if n * idx.len() < len {
        codec::encode_sparse(data, idx, &mut s.enc);
        s.recv.clear();
        s.recv.resize(s.enc.len() * n, 0);
        comm.all_gather_bytes(&s.enc, &mut s.recv)?;
        data.fill(0.0);
        for (r, code) in s.recv.chunks_exact(s.enc.len()).enumerate() {
            codec::decode_sparse_add(code, data)
                .map_err(|e| Error::InvalidArgument(format!("top-k code from rank {r}: {e}")))?;
        }
    } else {
        data.fill(0.0);
        idx.iter().zip(&vals).for_each(|(i, v)| data[*i as usize] = *v);
        comm.all_reduce(data, ReduceOp::Sum)?;
    }
    Ok(())
}

/// Which matrices PowerSGD compresses, at which rank: those whose factors are at most half their size.
fn compressed(matrices: &[Matrix], rank: usize, len: usize) -> Vec<(Matrix, usize)> {
    matrices
        .iter()
        .filter(|m| m.offset + m.rows * m.cols <= len)
        .map(|m| (*m, rank.min(m.rows).min(m.cols).max(1)))
        .filter(|(m, r)| (m.rows + m.cols) * r * 2 <= m.rows * m.cols)
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn power_sgd(
    comm: &Communicator,
    data: &mut [f32],
    matrices: &[Matrix],
    rank: usize,
    st: &mut BucketState,
    ef: bool,
    seed: u64,
    bucket: usize,
) -> Result<()> {
    let ms = compressed(matrices, rank, data.len());
    // Everything outside the compressed matrices goes whole, after the P factors.
    let mut covered = vec![false; data.len()];
    for (m, _) in &ms {
        covered[m.offset..m.offset + m.rows * m.cols].fill(true);
    }
    let raw: Vec<usize> = (0..data.len()).filter(|i| !covered[*i]).collect();
    let p_len: usize = ms.iter().map(|(m, r)| m.rows * r).sum();
    let q_len: usize = ms.iter().map(|(m, r)| m.cols * r).sum();
    if st.q.len() != q_len {
        // Warm start from the same random Q on every rank.
        let mut g = SplitMix::mixed(&[seed, bucket as u64, 0x9051]);
        st.q = (0..q_len).map(|_| g.normal()).collect();
    }
    let mut pbuf = vec![0f32; p_len + raw.len()];
    let (mut po, mut qo) = (0, 0);
    for (m, r) in &ms {
        let mat = &data[m.offset..m.offset + m.rows * m.cols];
        powersgd::m_times_q(mat, m.rows, m.cols, &st.q[qo..qo + m.cols * r], *r, &mut pbuf[po..po + m.rows * r]);
        po += m.rows * r;
        qo += m.cols * r;
    }
    for (k, i) in raw.iter().enumerate() {
        pbuf[p_len + k] = data[*i];
    }
    comm.all_reduce(&mut pbuf, ReduceOp::Sum)?;
    let mut qbuf = vec![0f32; q_len];
    let (mut po, mut qo) = (0, 0);
    for (m, r) in &ms {
        let p = &mut pbuf[po..po + m.rows * r];
        powersgd::orthonormalise(p, m.rows, *r);
        let mat = &data[m.offset..m.offset + m.rows * m.cols];
        powersgd::mt_times_p(mat, m.rows, m.cols, p, *r, &mut qbuf[qo..qo + m.cols * r]);
        po += m.rows * r;
        qo += m.cols * r;
    }
    if ef {
        // What this rank sent of a matrix is P Qᵢᵀ (its own Q, before the sum); the rest waits.
        st.residual.clear();
        st.residual.extend_from_slice(data);
        let (mut po, mut qo) = (0, 0);
        for (m, r) in &ms {
            let res = &mut st.residual[m.offset..m.offset + m.rows * m.cols];
            powersgd::add_p_qt(res, m.rows, m.cols, &pbuf[po..po + m.rows * r], &qbuf[qo..qo + m.cols * r], *r, -1.0);
            po += m.rows * r;
            qo += m.cols * r;
        }
        for i in &raw {
            st.residual[*i] = 0.0;
        }
    }
    comm.all_reduce(&mut qbuf, ReduceOp::Sum)?;
    data.fill(0.0);
    let (mut po, mut qo) = (0, 0);
    for (m, r) in &ms {
        let out = &mut data[m.offset..m.offset + m.rows * m.cols];
        powersgd::add_p_qt(out, m.rows, m.cols, &pbuf[po..po + m.rows * r], &qbuf[qo..qo + m.cols * r], *r, 1.0);
        po += m.rows * r;
        qo += m.cols * r;
    }
    for (k, i) in raw.iter().enumerate() {
        data[*i] = pbuf[p_len + k];
    }
    st.q = qbuf;
    Ok(())
}
