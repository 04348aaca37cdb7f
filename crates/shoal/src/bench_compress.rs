//! `shoal bench compress`: what each gradient codec of `shoal_comm::compress` costs and what it saves, on a buffer
//! of normally distributed `f32` values (`--sizes`, default 64 MiB) summed over `--ranks` rank processes.
//!
//! For every codec (none, fp16, bf16, int8, top-k and random-k at 1%, sign, PowerSGD at rank 4 with the buffer as
//! one square-ish `rows × cols` matrix) it reports:
//! 1. encode and decode speed on one core, in GB/s of `f32` input (the buffer's bytes over the median seconds),
//!    measured by this process once the ranks are done, so nothing else of the benchmark runs beside it, in the
//!    measuring thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), so that other processes sharing the machine do not
//!    count against a codec. Encode is the codec's `encode_*` (top-k: the selection and the code; random-k: the
//!    draw of the indices and the gather of their values); decode adds the code into an `f32` buffer (random-k:
//!    scatters the values). PowerSGD's encode is one step's local math on the matrix (`P = M Q`, `P`
//!    orthonormalised, `Q = Mᵀ P`) and its decode `P Qᵀ`. `enc+dec` is the bytes over the sum of the two medians.
//! 2. the bytes rank 0 really sent for one reduction ([`Communicator::bytes_sent`] around one
//!    [`Compressor::all_reduce`]) against a plain `f32` all-reduce of the same buffer, and their ratio.
//! 3. the time of the whole [`Compressor::all_reduce`] (error feedback, encode, exchange, decode) against the plain
//!    all-reduce, alternating the two each iteration; per iteration the slowest rank, then the median. `speedup`
//!    is plain over compressed: above 1, compression pays on this network.
//!
//! The ranks are separate processes started like the collective benchmark's (`bench.rs`), over `--transport`
//! (default tcp: the loopback network; shm to compare with shared memory), every collective bounded by
//! `--timeout`, and across hosts with `--nnodes/--node-rank/--rdzv`. Rank 0 prints one JSON line per size and
//! codec with the wire figures; the parent adds the codec speeds and prints the table, or with `--json` one object
//! a codec a size: `codec bytes ranks transport encode_gbps decode_gbps codec_gbps sent_bytes plain_bytes
//! reduction time_s plain_time_s speedup` (the three speeds `null` for `none`).
//!
//! `shoal bench compress` (release build) gives the README's figures on loopback; `COMPRESS=1
//! scripts/bench-hosts.sh` runs it across two network namespaces joined by a shaped link.
//!
//! [`Communicator::bytes_sent`]: shoal_comm::Communicator::bytes_sent

use std::hint::black_box;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use shoal_comm::compress::codec::{self, SplitMix};
use shoal_comm::compress::powersgd;
use shoal_comm::env::EnvContract;
use shoal_comm::{Codec, CompressConfig, Compressor, Matrix, ReduceOp};

use crate::bench::{BenchArgs, Ranks, default_iters, transport_arg};

/// The codecs measured, in the table's order.
const CODECS: [Codec; 8] = [
    Codec::None,
    Codec::Fp16,
    Codec::Bf16,
    Codec::Int8 { stochastic: false },
    Codec::TopK { ratio: 0.01 },
    Codec::RandK { ratio: 0.01 },
    Codec::Sign,
    Codec::PowerSgd { rank: 4 },
];

/// Size of an `f32`.
const F32: usize = 4;

/// Seeds the data, random-k's draws and PowerSGD's first `Q`.
const SEED: u64 = 0xC0DEC;

/// The sizes measured unless `--sizes` says otherwise.
const DEFAULT_SIZES: &str = "64MiB";

/// What rank 0 reports for one size and codec.
#[derive(Debug, Serialize, Deserialize)]
struct Wire {
    codec: String,
    bytes: usize,
    ranks: usize,
    iters: usize,
    sent_bytes: u64,
    plain_bytes: u64,
    time_s: f64,
    plain_time_s: f64,
}

/// One line of `--json`.
#[derive(Debug, Serialize)]
struct Row {
    codec: String,
    bytes: usize,
    ranks: usize,
    transport: String,
    encode_gbps: Option<f64>,
    decode_gbps: Option<f64>,
    codec_gbps: Option<f64>,
    sent_bytes: u64,
    plain_bytes: u64,
    reduction: f64,
    time_s: f64,
    plain_time_s: f64,
    speedup: f64,
}

/// The label of a codec in the table, with its setting.
fn label(c: Codec) -> String {
    match c {
        Codec::TopK { ratio } | Codec::RandK { ratio } => format!("{} {}%", c.name(), ratio * 100.0),
        Codec::PowerSgd { rank } => format!("{} r{rank}", c.name()),
        _ => c.name().to_string(),
    }
}

/// The buffer of `count` values as one matrix, as square as it goes: `⌊√count⌋` rows (what is left over after the
/// last whole row rides along uncompressed).
fn square(count: usize) -> Matrix {
    let rows = count.isqrt().max(1);
    Matrix { offset: 0, rows, cols: count / rows }
}

/// `count` standard normal values from the seed's parts.
fn normals(count: usize, seed: &[u64]) -> Vec<f32> {
    let mut g = SplitMix::mixed(seed);
    (0..count).map(|_| g.normal()).collect()
}

/// This thread's CPU time in seconds (NaN if the clock cannot be read): what a codec costs on one core, whatever
/// else the machine runs meanwhile. On a shared machine wall-clock time also counts the other processes' turns on
/// the core, and its median can swing twofold from run to run.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime only writes the timespec it is given.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc == 0 { ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9 } else { f64::NAN }
}

/// Median CPU seconds of encoding and of decoding `input` with `c` on this thread (`None` for no codec), after
/// `warm` untimed rounds.
fn codec_speed(c: Codec, input: &[f32], warm: usize, iters: usize) -> Option<(f64, f64)> {
    if c == Codec::None {
        return None;
    }
    let n = input.len();
    let mut enc = Vec::new();
    let mut out = vec![0f32; n];
    let mut idx = Vec::new();
    let mut vals: Vec<f32> = Vec::new();
    let m = square(n);
    let r = match c {
        Codec::PowerSgd { rank } => rank.min(m.rows).min(m.cols).max(1),
        _ => 0,
    };
    let mat = &input[..m.rows * m.cols];
    let q0 = normals(m.cols * r, &[SEED, 0x9051]);
    let (mut p, mut q) = (vec![0f32; m.rows * r], vec![0f32; m.cols * r]);
    let (mut encode, mut decode) = (Vec::new(), Vec::new());
    for it in 0..warm + iters {
        let t0 = thread_cpu_s();
        match c {
            Codec::None => {}
            Codec::Fp16 => codec::encode_f16(input, &mut enc),
            Codec::Bf16 => codec::encode_bf16(input, &mut enc),
            Codec::Int8 { stochastic } => {
                let mut g = SplitMix::new(it as u64);
                codec::encode_int8(input, &mut enc, stochastic.then_some(&mut g));
            }
            Codec::Sign => codec::encode_sign(input, &mut enc),
            Codec::TopK { ratio } => {
                codec::top_k(input, codec::sparse_k(n, ratio), &mut idx);
                codec::encode_sparse(input, &idx, &mut enc);
            }
            Codec::RandK { ratio } => {
                codec::random_k(n, codec::sparse_k(n, ratio), &mut SplitMix::mixed(&[SEED, it as u64]), &mut idx);
                vals.clear();
                vals.extend(idx.iter().map(|i| input[*i as usize]));
            }
            Codec::PowerSgd { .. } => {
                powersgd::m_times_q(mat, m.rows, m.cols, &q0, r, &mut p);
                powersgd::orthonormalise(&mut p, m.rows, r);
                powersgd::mt_times_p(mat, m.rows, m.cols, &p, r, &mut q);
            }
        }
        black_box((&enc, &vals, &q));
        let t1 = thread_cpu_s();
        match c {
            Codec::None => {}
            Codec::Fp16 => codec::decode_f16_add(&enc, &mut out),
            Codec::Bf16 => codec::decode_bf16_add(&enc, &mut out),
            Codec::Int8 { .. } => codec::decode_int8_add(&enc, &mut out),
            Codec::Sign => codec::decode_sign_add(&enc, &mut out),
            Codec::TopK { .. } => {
                // Our own code: an index outside the buffer cannot happen.
                let _ = codec::decode_sparse_add(&enc, &mut out);
            }
            Codec::RandK { .. } => idx.iter().zip(&vals).for_each(|(i, v)| out[*i as usize] += v),
            Codec::PowerSgd { .. } => powersgd::add_p_qt(&mut out[..m.rows * m.cols], m.rows, m.cols, &p, &q, r, 1.0),
        }
        black_box(&out);
        let t2 = thread_cpu_s();
        if it >= warm {
            encode.push(t1 - t0);
            decode.push(t2 - t1);
        }
    }
    Some((shoal_spec::median(encode)?, shoal_spec::median(decode)?))
}

/// `bytes` over `seconds`, in GB/s.
fn gbps(bytes: usize, seconds: f64) -> f64 {
    if seconds > 0.0 { bytes as f64 / seconds / 1e9 } else { f64::INFINITY }
}

/// A byte count for the table: B, KiB, MiB, GiB.
fn fmt_bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{b} B") } else { format!("{v:.2} {}", units[u]) }
}

fn fmt_speed(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.2}"))
}

/// The parent: checks the flags, runs the ranks, measures the codecs and prints the results.
pub fn run(args: &BenchArgs) -> Result<bool> {
    let mut args = args.clone();
    let args = &mut args;
    // The ranks get the defaults filled in.
    args.sizes.get_or_insert_with(|| DEFAULT_SIZES.into());
    let sizes = args.sizes()?;
    if let Some(b) = sizes.iter().find(|b| **b < F32) {
        bail!("--sizes: {b} B holds no f32 value (4 bytes each)");
    }
    if args.dtype != "f32" {
        bail!("--dtype {}: shoal bench compress codes f32 gradients only", args.dtype);
    }
    if args.op != "sum" {
        bail!("--op {}: a compressed reduction sums (use sum)", args.op);
    }
    if args.check {
        bail!("--check: compressed sums are approximate by design; shoal bench compress has nothing exact to check");
    }
    if args.dir.is_some() {
        bail!("--dir applies to shoal bench checkpoint only");
    }
    let transport = transport_arg(args, "tcp")?;
    args.transport = Some(transport.clone());
    let ranks = Ranks::new(args, &transport, vec!["bench-compress-rank".into(), serde_json::to_string(&*args)?])?;
    if ranks.world() < 2 {
        bail!("--ranks: compression needs at least 2 ranks to sum over (got {})", ranks.world());
    }
    let mut wires: Vec<Wire> = Vec::new();
    let first_rank = ranks.run(|text| match serde_json::from_str::<Wire>(text) {
        Ok(w) => {
            wires.push(w);
            true
        }
        Err(_) => false,
    })?;
    let Some(first_rank) = first_rank else { return Ok(false) };
    if first_rank != 0 {
        // Node 0 prints the results.
        return Ok(true);
    }
    if !args.json {
        println!(
            "# shoal bench compress: {} ranks{}, transport {transport}, algo {}; f32 values, normally distributed; \
             codec speed on one core (CPU time)",
            ranks.world(),
            if ranks.hosts == 1 { String::new() } else { format!(" on {} hosts", ranks.hosts) },
            args.algo,
        );
    }
    for bytes in sizes {
        let count = bytes / F32;
        let bytes = count * F32;
        let (dw, di) = default_iters(bytes);
        let (warm, iters) = (args.warmup.unwrap_or(dw), args.iters.unwrap_or(di).max(1));
        if !args.json {
            let m = square(count);
            println!(
                "# {} ({count} values), medians of {iters} iterations after {warm} warm-up; powersgd on a {} × {} \
                 matrix",
                fmt_bytes(bytes as u64),
                m.rows,
                m.cols
            );
            println!(
                "# {:<12} {:>9} {:>9} {:>12} {:>12} {:>12} {:>8} {:>10} {:>10} {:>8}",
                "codec",
                "enc GB/s",
                "dec GB/s",
                "enc+dec GB/s",
                "bytes sent",
                "plain bytes",
                "× fewer",
                "time ms",
                "plain ms",
                "speedup"
            );
        }
        let input = normals(count, &[SEED, u64::MAX, count as u64]);
        for c in CODECS {
            let Some(w) = wires.iter().find(|w| w.codec == c.name() && w.bytes == bytes) else {
                bail!("rank 0 reported nothing for {} at {bytes} bytes", c.name());
            };
            let speed = codec_speed(c, &input, warm, iters);
            let row = Row {
                codec: c.name().into(),
                bytes,
                ranks: w.ranks,
                transport: transport.clone(),
                encode_gbps: speed.map(|(e, _)| gbps(bytes, e)),
                decode_gbps: speed.map(|(_, d)| gbps(bytes, d)),
                codec_gbps: speed.map(|(e, d)| gbps(bytes, e + d)),
                sent_bytes: w.sent_bytes,
                plain_bytes: w.plain_bytes,
                reduction: w.plain_bytes as f64 / w.sent_bytes.max(1) as f64,
                time_s: w.time_s,
                plain_time_s: w.plain_time_s,
                speedup: if w.time_s > 0.0 { w.plain_time_s / w.time_s } else { f64::INFINITY },
            };
            if args.json {
                println!("{}", serde_json::to_string(&row)?);
            } else {
                println!(
                    "  {:<12} {:>9} {:>9} {:>12} {:>12} {:>12} {:>8.2} {:>10.2} {:>10.2} {:>8.2}",
                    label(c),
                    fmt_speed(row.encode_gbps),
                    fmt_speed(row.decode_gbps),
                    fmt_speed(row.codec_gbps),
                    fmt_bytes(row.sent_bytes),
                    fmt_bytes(row.plain_bytes),
                    row.reduction,
                    row.time_s * 1e3,
                    row.plain_time_s * 1e3,
                    row.speedup
                );
            }
        }
    }
    Ok(true)
}

/// One rank (started by [`run`] through the launcher): for each size and codec, alternately a plain all-reduce and
/// a compressed one of this rank's data; rank 0 prints a [`Wire`] line.
pub fn run_rank(spec: &str) -> Result<()> {
    let args: BenchArgs = serde_json::from_str(spec).context("bench-compress-rank: bad arguments")?;
    let env = EnvContract::from_env()?;
    let comm = env.connect().context("joining the benchmark's communicator")?;
    let (n, rank) = (comm.size(), comm.rank());
    for bytes in args.sizes()? {
        let count = bytes / F32;
        let bytes = count * F32;
        let (dw, di) = default_iters(bytes);
        let (warm, iters) = (args.warmup.unwrap_or(dw), args.iters.unwrap_or(di).max(1));
        // Each rank its own gradient.
        let input = normals(count, &[SEED, rank as u64, count as u64]);
        let mut buf = vec![0f32; count];
        let matrices = [square(count)];
        for codec in CODECS {
            let cfg = CompressConfig { codec, seed: SEED, ..CompressConfig::default() };
            let mut compressor = Compressor::new(cfg);
            let (mut plain_t, mut codec_t) = (Vec::with_capacity(iters), Vec::with_capacity(iters));
            let (mut plain_bytes, mut sent_bytes) = (0, 0);
            for it in 0..warm + iters {
                buf.copy_from_slice(&input);
                comm.barrier()?;
                let (b0, t0) = (comm.bytes_sent(), Instant::now());
                comm.all_reduce(&mut buf, ReduceOp::Sum)?;
                let (plain_s, plain_b) = (t0.elapsed().as_secs_f64(), comm.bytes_sent() - b0);
                buf.copy_from_slice(&input);
                compressor.set_step(it as u64);
                comm.barrier()?;
                let (b0, t0) = (comm.bytes_sent(), Instant::now());
                compressor.all_reduce(&comm, 0, &mut buf, &matrices)?;
                let (codec_s, codec_b) = (t0.elapsed().as_secs_f64(), comm.bytes_sent() - b0);
                if it >= warm {
                    plain_t.push(plain_s);
                    codec_t.push(codec_s);
                    (plain_bytes, sent_bytes) = (plain_b, codec_b);
                }
            }
            // Every rank's times at rank 0: per iteration the slowest rank.
            let mine: Vec<f64> = plain_t.iter().chain(&codec_t).copied().collect();
            let mut all = vec![0f64; mine.len() * n];
            comm.all_gather(&mine, &mut all)?;
            if rank == 0 {
                let slowest = |k: usize| -> Vec<f64> {
                    (0..iters)
                        .map(|it| (0..n).map(|r| all[r * 2 * iters + k * iters + it]).fold(0.0, f64::max))
                        .collect()
                };
                let wire = Wire {
                    codec: codec.name().into(),
                    bytes,
                    ranks: n,
                    iters,
                    sent_bytes,
                    plain_bytes,
                    time_s: shoal_spec::median(slowest(1)).unwrap_or(0.0),
                    plain_time_s: shoal_spec::median(slowest(0)).unwrap_or(0.0),
                };
                println!("{}", serde_json::to_string(&wire)?);
            }
        }
    }
    comm.barrier()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_matrix_is_as_square_as_the_buffer_allows() {
        assert_eq!(square(16 << 20), Matrix { offset: 0, rows: 4096, cols: 4096 });
        assert_eq!(square(65536), Matrix { offset: 0, rows: 256, cols: 256 });
        let m = square(1000);
        assert_eq!((m.rows, m.cols), (31, 32));
        assert_eq!(square(1), Matrix { offset: 0, rows: 1, cols: 1 });
    }

    #[test]
    fn every_codec_has_a_speed_but_none() {
        let input = normals(4096, &[1]);
        for c in CODECS {
            let s = codec_speed(c, &input, 0, 2);
            assert_eq!(s.is_none(), c == Codec::None, "{}", c.name());
            assert!(s.is_none_or(|(e, d)| e >= 0.0 && d >= 0.0));
        }
    }

    #[test]
    fn bytes_read_as_binary_units() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(64 << 20), "64.00 MiB");
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
    }
}
