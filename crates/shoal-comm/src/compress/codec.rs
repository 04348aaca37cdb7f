//! The codecs themselves: `f32` values in, bytes out, and back. Each `encode_*` writes what travels (payload,
//! scales, indices) into a byte buffer it clears first; each `decode_*_add` adds what the bytes stand for into an
//! `f32` buffer, so a receiver sums several ranks' contributions without a temporary. Layouts are little-endian and
//! fixed by the input length alone, so every rank knows every other rank's encoded size.

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

/// Values that share one scale in `int8` and `sign` (a scale costs 4 bytes: 0.8% of an int8 chunk, 6% of a
/// 1-bit one).
pub const CHUNK: usize = 512;

/// A small, fast, seedable generator (SplitMix64): the same seed gives the same numbers on every rank and every
/// build.
#[derive(Debug, Clone)]
pub struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> SplitMix {
        SplitMix(seed)
    }

    /// A seed made of several parts (job seed, step, bucket, rank), well mixed.
    pub fn mixed(parts: &[u64]) -> SplitMix {
        let mut g = SplitMix(0x5EED_5EED_5EED_5EED);
        for p in parts {
            g.0 ^= p.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            g.next_u64();
        }
        g
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (((self.next_u64() >> 32) * n as u64) >> 32) as usize
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = (self.next_f32() + f32::EPSILON).min(1.0);
        let u2 = self.next_f32();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
}

// ------------------------------------------------------------------------------------------------------------------
// half precision

/// Bytes of `n` values as f16 or bf16.
pub fn half_len(n: usize) -> usize {
    n * 2
}

/// Values coded a block at a time: a block's codes and bytes stay in registers and L1, and the loops over a block
/// are simple enough to vectorise.
const BLOCK: usize = 256;

/// `src` as 16-bit codes in little-endian bytes, `code` turning each block of values into its codes.
fn encode_u16(src: &[f32], out: &mut Vec<u8>, code: impl Fn(&[f32], &mut [u16])) {
    out.clear();
    out.reserve(half_len(src.len()));
    let mut codes = [0u16; BLOCK];
    let mut bytes = [0u8; 2 * BLOCK];
    for s in src.chunks(BLOCK) {
        let c = &mut codes[..s.len()];
        code(s, c);
        let b = &mut bytes[..2 * s.len()];
        for (b, c) in b.chunks_exact_mut(2).zip(c.iter()) {
            b.copy_from_slice(&c.to_le_bytes());
        }
        out.extend_from_slice(b);
    }
}

/// Adds what 16-bit little-endian codes stand for into `out`, `value` turning each block of codes into values.
fn decode_u16_add(src: &[u8], out: &mut [f32], value: impl Fn(&[u16], &mut [f32])) {
    let mut codes = [0u16; BLOCK];
    let mut vals = [0f32; BLOCK];
    for (o, b) in out.chunks_mut(BLOCK).zip(src.chunks(2 * BLOCK)) {
        let n = o.len().min(b.len() / 2);
        for (c, b) in codes[..n].iter_mut().zip(b.chunks_exact(2)) {
            *c = u16::from_le_bytes([b[0], b[1]]);
        }
        value(&codes[..n], &mut vals[..n]);
        for (o, v) in o[..n].iter_mut().zip(&vals[..n]) {
            *o += v;
        }
    }
}

/// `src` as IEEE half precision (round to nearest even; beyond ±65504 it saturates to infinity, as a cast does).
/// Through `half`'s slice conversion, which uses the CPU's F16C instructions where it has them.
pub fn encode_f16(src: &[f32], out: &mut Vec<u8>) {
    encode_u16(src, out, |s, c| c.reinterpret_cast_mut::<f16>().convert_from_f32_slice(s));
}

pub fn decode_f16_add(src: &[u8], out: &mut [f32]) {
    decode_u16_add(src, out, |c, v| c.reinterpret_cast::<f16>().convert_to_f32_slice(v));
}

/// `src` as bfloat16 (f32's range, 8 bits of mantissa; round to nearest even).
pub fn encode_bf16(src: &[f32], out: &mut Vec<u8>) {
    // Value by value: measured, this loop is as fast as block-wise ones.
    out.clear();
    out.reserve(src.len() * 2);
    out.extend(src.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()));
}

pub fn decode_bf16_add(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
        *o += f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
    }
}

// ------------------------------------------------------------------------------------------------------------------
// int8 with a scale per chunk

/// Bytes of `n` values as int8: a scale per [`CHUNK`], then one byte a value.
pub fn int8_len(n: usize) -> usize {
    n.div_ceil(CHUNK) * 4 + n
}

/// Each chunk of [`CHUNK`] values scaled so its largest magnitude is 127, rounded to the nearest integer (or, with
/// `rng`, stochastically: up with probability equal to the fraction, so the code is unbiased). The error of a value
/// is at most half its chunk's scale (`max |v| / 127`) when rounding to nearest, less than one scale stochastically.
pub fn encode_int8(src: &[f32], out: &mut Vec<u8>, mut rng: Option<&mut SplitMix>) {
    out.clear();
    out.resize(int8_len(src.len()), 0);
    let (scales, payload) = out.split_at_mut(src.len().div_ceil(CHUNK) * 4);
    for ((c, s), p) in src.chunks(CHUNK).zip(scales.chunks_exact_mut(4)).zip(payload.chunks_mut(CHUNK)) {
        let max = max_abs(c);
        let scale = if max.is_finite() && max > 0.0 { max / 127.0 } else { 0.0 };
        s.copy_from_slice(&scale.to_le_bytes());
        if scale == 0.0 {
            continue;
        }
        let inv = 127.0 / max;
        match rng.as_deref_mut() {
            None => {
                for (q, v) in p.iter_mut().zip(c) {
                    *q = round_byte(v * inv);
                }
            }
            Some(g) => {
                for (q, v) in p.iter_mut().zip(c) {
                    *q = floor_byte(v * inv + g.next_f32());
                }
            }
        }
    }
}

/// The largest magnitude among `c`, NaN left out (0 when there is none), as a fold of `f32::max` gives it. Eight
/// running maxima, each `if a > m { a } else { m }` (a NaN compares false, so it is passed over): one `maxps` for
/// four lanes, where the fold of `f32::max` goes a value at a time.
fn max_abs(c: &[f32]) -> f32 {
    let more = |m: f32, a: f32| if a > m { a } else { m };
    let mut acc = [0f32; 8];
    let mut eights = c.chunks_exact(8);
    for e in &mut eights {
        for (m, v) in acc.iter_mut().zip(e) {
            *m = more(*m, v.abs());
        }
    }
    let m = acc.into_iter().fold(0f32, more);
    eights.remainder().iter().fold(m, |m, v| more(m, v.abs()))
}

/// Just under a half: `y + HALF.copysign(y)` truncated is `y.round()` (halves away from zero) for every `y` within
/// ±127, checked over all of them; a plain half would carry 0.49999997 up to 1.
const HALF: f32 = 0.499_999_97;

/// `y` clamped to ±127 (NaN: 0), which a conversion to integer can take unchecked.
#[inline]
fn clamped(y: f32) -> f32 {
    if y.is_nan() { 0.0 } else { y.clamp(-127.0, 127.0) }
}

/// `y.round().clamp(-127.0, 127.0) as i8 as u8` (NaN: 0), without the library call that `round` is on a CPU
/// without SSE4.1 nor the saturating conversion of `as`, either of which keeps the loop from vectorising. Clamping
/// first gives the same (±127 are whole).
#[inline]
fn round_byte(y: f32) -> u8 {
    let r = clamped(y) + HALF.copysign(y);
    // SAFETY: `r` is finite and within ±127.5, so its truncation fits an i32.
    unsafe { r.to_int_unchecked::<i32>() as u8 }
}

/// `y.floor().clamp(-127.0, 127.0) as i8 as u8` (NaN: 0), as [`round_byte`] goes: truncated, then one down where
/// that went up.
#[inline]
fn floor_byte(y: f32) -> u8 {
    let y = clamped(y);
    // SAFETY: `y` is finite and within ±127, so its truncation fits an i32.
    let t = unsafe { y.to_int_unchecked::<i32>() };
    (t - i32::from(t as f32 > y)) as u8
}

pub fn decode_int8_add(src: &[u8], out: &mut [f32]) {
    let (scales, payload) = src.split_at(out.len().div_ceil(CHUNK) * 4);
    for ((o, s), p) in out.chunks_mut(CHUNK).zip(scales.chunks_exact(4)).zip(payload.chunks(CHUNK)) {
        let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        for (o, q) in o.iter_mut().zip(p) {
            *o += f32::from(*q as i8) * scale;
        }
    }
}

// ------------------------------------------------------------------------------------------------------------------
// 1-bit sign with a scale per chunk

/// Bytes of `n` values as signs: a scale per [`CHUNK`], then one bit a value.
pub fn sign_len(n: usize) -> usize {
    n.div_ceil(CHUNK) * 4 + n.div_ceil(8)
}

/// Each value's sign (a set bit: not negative), and per chunk the mean magnitude, so a chunk's decoded values
/// keep its L1 norm.
pub fn encode_sign(src: &[f32], out: &mut Vec<u8>) {
    out.clear();
    out.resize(sign_len(src.len()), 0);
    let (scales, bits) = out.split_at_mut(src.len().div_ceil(CHUNK) * 4);
    // CHUNK is a multiple of 8: a byte of bits never spans two chunks, and a chunk's bytes are taken while its
    // values are in cache. A set bit: the sign bit clear.
    let byte = |c: &[f32]| !c.iter().enumerate().fold(0u32, |b, (k, v)| b | (v.to_bits() >> 31) << k) as u8;
    for ((c, s), b) in src.chunks(CHUNK).zip(scales.chunks_exact_mut(4)).zip(bits.chunks_mut(CHUNK / 8)) {
        // Eight running sums in f64, added at the end, so the loop vectorises: the same as one running sum unless
        // a partial sum rounds, which takes magnitudes more than about 2^20 apart in one chunk (then within a
        // rounding of it).
        let mut acc = [0f64; 8];
        let mut eights = c.chunks_exact(8);
        for (e, b) in (&mut eights).zip(b.iter_mut()) {
            for (a, v) in acc.iter_mut().zip(e) {
                *a += f64::from(v.abs());
            }
            *b = byte(e);
        }
        let rest = eights.remainder();
        for (a, v) in acc.iter_mut().zip(rest) {
            *a += f64::from(v.abs());
        }
        if !rest.is_empty()
            && let Some(b) = b.last_mut()
        {
            *b = byte(rest) & ((1u16 << rest.len()) - 1) as u8;
        }
        let sum: f64 = acc.iter().sum();
        let scale = (sum / c.len() as f64) as f32;
        s.copy_from_slice(&if scale.is_finite() { scale } else { 0.0f32 }.to_le_bytes());
    }
}

pub fn decode_sign_add(src: &[u8], out: &mut [f32]) {
    let (scales, bits) = src.split_at(out.len().div_ceil(CHUNK) * 4);
    for (ci, (o, s)) in out.chunks_mut(CHUNK).zip(scales.chunks_exact(4)).enumerate() {
        let scale = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let bits = &bits[ci * CHUNK / 8..];
        // `scale` or `-scale`: the sign bit flipped where the bit is clear.
        let add = |o: &mut [f32], b: u8| {
            for (k, o) in o.iter_mut().enumerate() {
                *o += f32::from_bits(scale ^ (u32::from(!b >> k & 1) << 31));
            }
        };
        let whole = o.len() / 8;
        let mut eights = o.chunks_exact_mut(8);
        for (o8, b) in (&mut eights).zip(bits) {
            add(o8, *b);
        }
        let rest = eights.into_remainder();
        if !rest.is_empty()
            && let Some(b) = bits.get(whole)
        {
            add(rest, *b);
        }
    }
}

// ------------------------------------------------------------------------------------------------------------------
// sparse: top-k and random-k

/// How many values of `n` a sparse codec keeps at `ratio` (at least one of a non-empty buffer).
pub fn sparse_k(n: usize, ratio: f64) -> usize {
    if n == 0 { 0 } else { ((n as f64 * ratio).ceil() as usize).clamp(1, n) }
}

/// Bytes of `k` kept values: their indices (u32), then their values (f32).
pub fn sparse_len(k: usize) -> usize {
    k * 8
}

/// The `k` values of largest magnitude (ties broken by index) as indices, in increasing order, and values. Exact:
/// a threshold estimated from a strided sample picks the candidates in one pass, and an exact selection among them
/// finds the `k`; when the sample misjudges, the selection runs over everything.
pub fn top_k(src: &[f32], k: usize, idx: &mut Vec<u32>) {
    idx.clear();
    let n = src.len();
    let k = k.min(n);
    if k == 0 {
        return;
    }
    let mag = |i: u32| src[i as usize].abs();
    // Larger magnitude first, then lower index: a total order (NaN counts as largest).
    let order = |a: &u32, b: &u32| mag(*b).total_cmp(&mag(*a)).then(a.cmp(b));
    if k * 4 < n && n > 4096 {
        let step = (n / 8192).max(1);
        let mut sample: Vec<f32> = src.iter().step_by(step).map(|v| v.abs()).collect();
        // Aim for about twice k candidates, so a sample off by a little still leaves enough.
        let want = ((k as f64 * 2.0 / n as f64) * sample.len() as f64).ceil() as usize;
        let pos = sample.len().saturating_sub(want.max(1));
        let (_, t, _) = sample.select_nth_unstable_by(pos, |a, b| a.total_cmp(b));
        let threshold = *t;
        idx.extend((0..n as u32).filter(|&i| mag(i) >= threshold));
    }
    if idx.len() < k {
        idx.clear();
        idx.extend(0..n as u32);
    }
    if idx.len() > k {
        idx.select_nth_unstable_by(k - 1, order);
        idx.truncate(k);
    }
    idx.sort_unstable();
}

/// `k` distinct indices of `0..n`, one drawn uniformly from each of `k` equal stretches (so every index is kept
/// with probability about `k/n`), in increasing order. Ranks that share `rng`'s seed draw the same ones.
pub fn random_k(n: usize, k: usize, rng: &mut SplitMix, idx: &mut Vec<u32>) {
    idx.clear();
    let k = k.min(n);
    for b in 0..k {
        let (lo, hi) = (b * n / k, (b + 1) * n / k);
        idx.push((lo + rng.below(hi - lo)) as u32);
    }
}

/// The values at `idx`, after the indices.
pub fn encode_sparse(src: &[f32], idx: &[u32], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(sparse_len(idx.len()));
    out.extend(idx.iter().flat_map(|i| i.to_le_bytes()));
    out.extend(idx.iter().flat_map(|i| src[*i as usize].to_le_bytes()));
}

/// Adds `src`'s values at their indices; an index outside `out` is an error (it came from another rank).
pub fn decode_sparse_add(src: &[u8], out: &mut [f32]) -> Result<(), String> {
    let k = src.len() / 8;
    let len = out.len();
    let (idx, vals) = src.split_at(k * 4);
    for (i, v) in idx.chunks_exact(4).zip(vals.chunks_exact(4)) {
        let i = u32::from_le_bytes([i[0], i[1], i[2], i[3]]) as usize;
        let o = out.get_mut(i).ok_or_else(|| format!("sparse index {i} outside a buffer of {len}"))?;
        *o += f32::from_le_bytes([v[0], v[1], v[2], v[3]]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut g = SplitMix::new(seed);
        (0..n).map(|i| g.normal() * if i % 97 == 0 { 10.0 } else { 1.0 }).collect()
    }

    fn decoded(n: usize, f: impl Fn(&mut [f32])) -> Vec<f32> {
        let mut out = vec![0f32; n];
        f(&mut out);
        out
    }

    /// The per-value definitions of the codes: the block-wise, vectorising codecs must give the very same bytes.
    mod reference {
        use super::super::{CHUNK, SplitMix, int8_len, sign_len};
        use half::{bf16, f16};

        pub fn f16(src: &[f32]) -> Vec<u8> {
            src.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect()
        }

        pub fn f16_add(src: &[u8], out: &mut [f32]) {
            for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o += f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }

        pub fn bf16(src: &[f32]) -> Vec<u8> {
            src.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect()
        }

        pub fn int8(src: &[f32], mut rng: Option<&mut SplitMix>) -> Vec<u8> {
            let mut out = vec![0u8; int8_len(src.len())];
            let (scales, payload) = out.split_at_mut(src.len().div_ceil(CHUNK) * 4);
            for ((c, s), p) in src.chunks(CHUNK).zip(scales.chunks_exact_mut(4)).zip(payload.chunks_mut(CHUNK)) {
                let max = c.iter().fold(0f32, |m, v| m.max(v.abs()));
                let scale = if max.is_finite() && max > 0.0 { max / 127.0 } else { 0.0 };
                s.copy_from_slice(&scale.to_le_bytes());
                if scale == 0.0 {
                    continue;
                }
                let inv = 127.0 / max;
                for (q, v) in p.iter_mut().zip(c) {
                    *q = match rng.as_deref_mut() {
                        None => (v * inv).round().clamp(-127.0, 127.0) as i8 as u8,
                        Some(g) => (v * inv + g.next_f32()).floor().clamp(-127.0, 127.0) as i8 as u8,
                    };
                }
            }
            out
        }

        pub fn sign(src: &[f32]) -> Vec<u8> {
            let mut out = vec![0u8; sign_len(src.len())];
            let (scales, bits) = out.split_at_mut(src.len().div_ceil(CHUNK) * 4);
            for (c, s) in src.chunks(CHUNK).zip(scales.chunks_exact_mut(4)) {
                let sum: f64 = c.iter().map(|v| f64::from(v.abs())).sum();
                let scale = (sum / c.len() as f64) as f32;
                s.copy_from_slice(&if scale.is_finite() { scale } else { 0.0f32 }.to_le_bytes());
            }
            for (b, c) in bits.iter_mut().zip(src.chunks(8)) {
                *b = c.iter().enumerate().fold(0, |b, (k, v)| b | (u8::from(!v.is_sign_negative()) << k));
            }
            out
        }

        pub fn sign_add(src: &[u8], out: &mut [f32]) {
            let (scales, bits) = src.split_at(out.len().div_ceil(CHUNK) * 4);
            for (ci, (o, s)) in out.chunks_mut(CHUNK).zip(scales.chunks_exact(4)).enumerate() {
                let scale = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                for (o8, b) in o.chunks_mut(8).zip(&bits[ci * CHUNK / 8..]) {
                    for (k, o) in o8.iter_mut().enumerate() {
                        *o += if (b >> k) & 1 == 1 { scale } else { -scale };
                    }
                }
            }
        }
    }

    /// Normal values at several scales, not a multiple of any block long, with the awkward ones among them: both
    /// zeros, NaNs, infinities, subnormals, f16's and bf16's rounding edges and ties; then chunks of their own
    /// (exact int8 ties, an infinity, a NaN, nothing but zeros, nothing but subnormals: their scale is not zero, its inverse infinite).
    fn awkward() -> Vec<f32> {
        let mut v = data(CHUNK * 7 + 13, 11);
        let specials = [
            0.0,
            -0.0,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7F80_0001),
            f32::from_bits(0xFFC0_1234),
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            65504.0,
            65519.99,
            65520.0,
            -65520.0,
            6.1e-5,
            5.96e-8,
            2.98e-8,
            f32::MAX,
            f32::MIN,
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::from_bits(0x3F80_8001),
            f32::from_bits(0xBF81_7FFF),
            f32::from_bits(0x7F7F_FFFF),
        ];
        for (k, x) in specials.iter().enumerate() {
            v[k * 37 + 5] = *x;
        }
        let ties = [0.5, -0.5, 1.5, -2.5, 126.5, -126.5, 0.499_999_97, -0.499_999_97, 127.0];
        let mut chunk = data(CHUNK, 12);
        chunk[..ties.len()].copy_from_slice(&ties);
        chunk.iter_mut().skip(ties.len()).for_each(|x| *x = x.clamp(-126.0, 126.0));
        v.extend(chunk);
        v.extend(data(CHUNK, 13).into_iter().enumerate().map(|(i, x)| if i == 100 { f32::INFINITY } else { x }));
        v.extend(data(CHUNK, 14).into_iter().enumerate().map(|(i, x)| if i == 7 { f32::NAN } else { x }));
        v.extend([0.0f32; CHUNK]);
        v.extend((0..CHUNK).map(|i| f32::from_bits(i as u32 * 15_000) * if i % 2 == 0 { 1.0 } else { -1.0 }));
        v.extend(data(300, 15));
        v
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    #[test]
    fn the_codecs_give_the_bytes_of_the_per_value_definitions() {
        let v = awkward();
        let mut b = Vec::new();
        encode_f16(&v, &mut b);
        assert_eq!(b, reference::f16(&v), "f16");
        encode_bf16(&v, &mut b);
        assert_eq!(b, reference::bf16(&v), "bf16");
        encode_int8(&v, &mut b, None);
        assert_eq!(b, reference::int8(&v, None), "int8");
        encode_int8(&v, &mut b, Some(&mut SplitMix::new(3)));
        assert_eq!(b, reference::int8(&v, Some(&mut SplitMix::new(3))), "stochastic int8");
        // Sums of magnitudes within 2^20 of each other are exact in any order; the chunks with the extremes need not be.
        let tame: Vec<f32> = v.iter().map(|x| if x.is_finite() { x.clamp(-1e3, 1e3) } else { *x }).collect();
        encode_sign(&tame, &mut b);
        let want = reference::sign(&tame);
        let scales = tame.len().div_ceil(CHUNK) * 4;
        assert_eq!(b[scales..], want[scales..], "sign bits");
        for (c, (x, y)) in b[..scales].chunks(4).zip(want[..scales].chunks(4)).enumerate() {
            let (x, y) = (f32::from_le_bytes([x[0], x[1], x[2], x[3]]), f32::from_le_bytes([y[0], y[1], y[2], y[3]]));
            assert!(x == y || (x - y).abs() <= y.abs() * 1e-6, "sign scale of chunk {c}: {x} against {y}");
        }
        // Every length up to a few blocks, so each remainder is taken.
        for n in (0..CHUNK + 20).chain([BLOCK * 3 + 1, CHUNK * 2 + 7]) {
            let w = data(n, n as u64);
            encode_f16(&w, &mut b);
            assert_eq!(b, reference::f16(&w), "f16 of {n}");
            encode_bf16(&w, &mut b);
            assert_eq!(b, reference::bf16(&w), "bf16 of {n}");
            encode_int8(&w, &mut b, None);
            assert_eq!(b, reference::int8(&w, None), "int8 of {n}");
            encode_sign(&w, &mut b);
            assert_eq!(b, reference::sign(&w), "sign of {n}");
        }
    }

    #[test]
    fn the_decoders_add_what_the_per_value_definitions_add() {
        // Any bytes at all: every f16 code (NaNs and infinities too), random sign bits under awkward scales.
        let mut g = SplitMix::new(21);
        for n in [0, 1, 7, 8, 9, BLOCK - 1, BLOCK + 3, CHUNK * 3 + 5, 70_000] {
            let codes: Vec<u8> = (0..n * 2)
                .map(|i| if n == 70_000 { ((i / 2) >> (8 * (i % 2))) as u8 } else { g.next_u64() as u8 })
                .collect();
            let base = data(n, 22);
            let (mut got, mut want) = (base.clone(), base.clone());
            decode_f16_add(&codes, &mut got);
            reference::f16_add(&codes, &mut want);
            assert!(same_bits(&got, &want), "f16 decode of {n}");
            let mut got = base.clone();
            decode_bf16_add(&codes, &mut got);
            for ((x, b), c) in got.iter().zip(&base).zip(codes.chunks_exact(2)) {
                let y = b + f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
                assert!(same_bits(&[*x], &[y]), "bf16 decode: {x} against {y}");
            }
            let chunks = n.div_ceil(CHUNK);
            let scales = [1.0f32, 0.0, -0.0, 3.5e-41, f32::INFINITY, f32::NAN, 2.5];
            let mut code: Vec<u8> = (0..chunks).flat_map(|c| scales[c % scales.len()].to_le_bytes()).collect();
            code.extend((0..n.div_ceil(8)).map(|_| g.next_u64() as u8));
            let (mut got, mut want) = (base.clone(), base.clone());
            decode_sign_add(&code, &mut got);
            reference::sign_add(&code, &mut want);
            assert!(same_bits(&got, &want), "sign decode of {n}");
        }
    }

    #[test]
    fn half_casts_round_to_nearest() {
        let v = data(3000, 1);
        let mut b = Vec::new();
        encode_f16(&v, &mut b);
        assert_eq!(b.len(), half_len(v.len()));
        let d = decoded(v.len(), |o| decode_f16_add(&b, o));
        for (x, y) in v.iter().zip(&d) {
            assert_eq!(*y, f16::from_f32(*x).to_f32());
            assert!((x - y).abs() <= x.abs() * 2f32.powi(-11) + 6e-8, "{x} {y}");
        }
        encode_bf16(&v, &mut b);
        let d = decoded(v.len(), |o| decode_bf16_add(&b, o));
        for (x, y) in v.iter().zip(&d) {
            assert_eq!(*y, bf16::from_f32(*x).to_f32());
            assert!((x - y).abs() <= x.abs() * 2f32.powi(-8), "{x} {y}");
        }
    }

    #[test]
    fn int8_error_is_within_half_a_scale_per_chunk_and_stochastic_within_one() {
        let v = data(CHUNK * 3 + 17, 2);
        let mut b = Vec::new();
        encode_int8(&v, &mut b, None);
        assert_eq!(b.len(), int8_len(v.len()));
        let d = decoded(v.len(), |o| decode_int8_add(&b, o));
        let mut g = SplitMix::new(9);
        let mut bs = Vec::new();
        encode_int8(&v, &mut bs, Some(&mut g));
        let ds = decoded(v.len(), |o| decode_int8_add(&bs, o));
        for (c, (dc, sc)) in v.chunks(CHUNK).zip(d.chunks(CHUNK).zip(ds.chunks(CHUNK))) {
            let scale = c.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
            for ((x, y), z) in c.iter().zip(dc).zip(sc) {
                assert!((x - y).abs() <= scale * 0.5 * (1.0 + 1e-5), "nearest: {x} {y} scale {scale}");
                assert!((x - z).abs() < scale * (1.0 + 1e-5), "stochastic: {x} {z} scale {scale}");
            }
        }
        // Stochastic rounding is unbiased: the mean error over many draws is far below a scale.
        let c = vec![0.3f32; CHUNK - 1].into_iter().chain([127.0]).collect::<Vec<_>>();
        let mut sum = 0.0f64;
        for s in 0..200 {
            encode_int8(&c, &mut bs, Some(&mut SplitMix::new(s)));
            let d = decoded(c.len(), |o| decode_int8_add(&bs, o));
            sum += d[..CHUNK - 1].iter().map(|x| f64::from(*x)).sum::<f64>();
        }
        let mean = sum / (200.0 * (CHUNK - 1) as f64);
        assert!((mean - 0.3).abs() < 0.02, "mean of stochastic codes {mean}, expected 0.3");
    }

    #[test]
    fn sign_keeps_each_chunks_mean_magnitude_and_every_sign() {
        let v = data(CHUNK * 2 + 9, 3);
        let mut b = Vec::new();
        encode_sign(&v, &mut b);
        assert_eq!(b.len(), sign_len(v.len()));
        let d = decoded(v.len(), |o| decode_sign_add(&b, o));
        for (c, dc) in v.chunks(CHUNK).zip(d.chunks(CHUNK)) {
            let l1: f32 = c.iter().map(|x| x.abs()).sum();
            let dl1: f32 = dc.iter().map(|x| x.abs()).sum();
            assert!((l1 - dl1).abs() <= l1 * 1e-5, "{l1} {dl1}");
            for (x, y) in c.iter().zip(dc) {
                assert_eq!(x.is_sign_negative(), y.is_sign_negative(), "{x} {y}");
            }
        }
    }

    #[test]
    fn top_k_finds_exactly_the_largest_magnitudes() {
        for (n, k) in [(10, 3), (5000, 50), (100_000, 1000), (100_000, 60_000), (9000, 9000)] {
            let v = data(n, n as u64);
            let mut idx = Vec::new();
            top_k(&v, k, &mut idx);
            assert_eq!(idx.len(), k);
            assert!(idx.windows(2).all(|w| w[0] < w[1]));
            let mut all: Vec<f32> = v.iter().map(|x| x.abs()).collect();
            all.sort_by(|a, b| b.total_cmp(a));
            let kth = all[k - 1];
            assert!(idx.iter().all(|i| v[*i as usize].abs() >= kth));
            let mut b = Vec::new();
            encode_sparse(&v, &idx, &mut b);
            assert_eq!(b.len(), sparse_len(k));
            let d = decoded(n, |o| decode_sparse_add(&b, o).expect("ok"));
            for (i, (x, y)) in v.iter().zip(&d).enumerate() {
                assert_eq!(*y, if idx.binary_search(&(i as u32)).is_ok() { *x } else { 0.0 });
            }
        }
    }

    #[test]
    fn random_k_draws_the_same_distinct_indices_from_the_same_seed() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        random_k(10_000, 100, &mut SplitMix::mixed(&[7, 3]), &mut a);
        random_k(10_000, 100, &mut SplitMix::mixed(&[7, 3]), &mut b);
        assert_eq!(a, b);
        assert_eq!(a.len(), 100);
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        random_k(10_000, 100, &mut SplitMix::mixed(&[7, 4]), &mut b);
        assert_ne!(a, b);
    }

    #[test]
    fn a_sparse_index_from_outside_the_buffer_is_an_error() {
        let mut b = Vec::new();
        encode_sparse(&[1.0, 2.0, 3.0], &[2], &mut b);
        assert!(decode_sparse_add(&b, &mut [0.0; 2]).expect_err("an error").contains("index 2"));
    }
}
