//! Compressed reductions over real worlds of ranks (TCP between threads): every rank ends with the same bits,
//! error feedback loses nothing over many steps, the bytes really sent shrink as each codec promises, PowerSGD is
//! exact on low-rank input, and the state survives a round trip.

use shoal_comm::compress::codec::{self, SplitMix};
use shoal_comm::{Codec, CompressConfig, Compressor, Matrix, ReduceOp, TransportChoice};

use super::conformance::world;

const CODECS: [Codec; 8] = [
    Codec::Fp16,
    Codec::Bf16,
    Codec::Int8 { stochastic: false },
    Codec::Int8 { stochastic: true },
    Codec::TopK { ratio: 0.01 },
    Codec::RandK { ratio: 0.01 },
    Codec::Sign,
    Codec::PowerSgd { rank: 4 },
];

/// A 96 × 64 matrix and a bias of 64 (the shape of a layer's gradients), per rank and step.
const ROWS: usize = 96;
const COLS: usize = 64;
const LEN: usize = ROWS * COLS + COLS;
const MATRICES: [Matrix; 1] = [Matrix { offset: 0, rows: ROWS, cols: COLS }];

fn grads(rank: usize, step: u64) -> Vec<f32> {
    let mut g = SplitMix::mixed(&[rank as u64, step, 17]);
    (0..LEN).map(|i| g.normal() * 0.01 + ((i % 7) as f32 - 3.0) * 1e-3).collect()
}

fn compressor(c: Codec, ef: bool) -> Compressor {
    Compressor::new(CompressConfig { codec: c, error_feedback: ef, seed: 42, ..CompressConfig::default() })
}

#[test]
fn every_rank_ends_each_step_with_the_same_bits_under_every_codec() {
    for n in [2, 3, 4] {
        for c in CODECS {
            let outs = world(n, TransportChoice::Tcp, move |comm| {
                let mut z = compressor(c, true);
                let mut steps = Vec::new();
                for step in 0..3 {
                    z.set_step(step);
                    let mut v = grads(comm.rank(), step);
                    z.all_reduce(&comm, 0, &mut v, &MATRICES).expect("compressed all-reduce");
                    steps.push(v);
                }
                steps
            });
            for (r, o) in outs.iter().enumerate().skip(1) {
                let same =
                    o.iter().zip(&outs[0]).all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
                assert!(same, "{} at {n} ranks: rank {r} differs from rank 0", c.name());
            }
        }
    }
}

/// Over many steps, what the reductions gave plus what every rank still holds back equals everything the ranks
/// put in: error feedback loses nothing — also across the end of a warm-up coded by int8, whose residual the codec
/// takes on.
#[test]
fn error_feedback_conserves_the_sum_over_steps() {
    let warm_ups = [(0, Codec::None), (4, Codec::Int8 { stochastic: false })];
    for n in [2, 3] {
        for (c, (warmup_steps, warmup_codec)) in CODECS.into_iter().flat_map(|c| warm_ups.map(|w| (c, w))) {
            let steps = 12u64;
            let outs = world(n, TransportChoice::Tcp, move |comm| {
                let mut z = Compressor::new(CompressConfig {
                    codec: c,
                    warmup_steps,
                    warmup_codec,
                    seed: 42,
                    ..CompressConfig::default()
                });
                let mut total = vec![0f64; LEN];
                for step in 0..steps {
                    z.set_step(step);
                    let mut v = grads(comm.rank(), step);
                    z.all_reduce(&comm, 3, &mut v, &MATRICES).expect("compressed all-reduce");
                    total.iter_mut().zip(&v).for_each(|(t, x)| *t += f64::from(*x));
                }
                (comm.rank(), total, z.state())
            });
            let mut want = vec![0f64; LEN];
            for r in 0..n {
                for step in 0..steps {
                    want.iter_mut().zip(grads(r, step)).for_each(|(w, x)| *w += f64::from(x));
                }
            }
            // Reduced so far, plus every rank's residual, plus (two-stage codecs) the residual of the segment each
            // rank sums.
            let mut got = outs[0].1.clone();
            for (rank, _, state) in &outs {
                for (name, v) in state {
                    let at = if name.starts_with("server.") { rank * LEN.div_ceil(n) } else { 0 };
                    if name.starts_with("residual.") || name.starts_with("server.") {
                        for (i, x) in v.iter().enumerate() {
                            if let Some(g) = got.get_mut(at + i) {
                                *g += f64::from(*x);
                            }
                        }
                    }
                }
            }
            let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
            assert!(
                worst <= scale * 1e-4,
                "{} (warm-up {warmup_steps} steps of {}) at {n} ranks: lost {worst:e} of a largest sum {scale:e}",
                c.name(),
                warmup_codec.name()
            );
        }
    }
}

#[test]
fn sent_plus_residual_is_exactly_the_input_for_sparse_codes_and_casts() {
    let v = grads(0, 0);
    let mut idx = Vec::new();
    let mut b = Vec::new();
    codec::top_k(&v, 61, &mut idx);
    codec::encode_sparse(&v, &idx, &mut b);
    let mut sent = vec![0f32; v.len()];
    codec::decode_sparse_add(&b, &mut sent).expect("ok");
    let mut residual = v.clone();
    idx.iter().for_each(|i| residual[*i as usize] = 0.0);
    let check = |sent: &[f32], what: &str| {
        for (i, x) in v.iter().enumerate() {
            let r = x - sent[i];
            assert_eq!((sent[i] + r).to_bits(), x.to_bits(), "{what}: value {i}");
        }
    };
    assert!(sent.iter().zip(&residual).zip(&v).all(|((s, r), x)| (s + r).to_bits() == x.to_bits()));
    for (what, enc, dec) in [
        ("fp16", codec::encode_f16 as fn(&[f32], &mut Vec<u8>), codec::decode_f16_add as fn(&[u8], &mut [f32])),
        ("bf16", codec::encode_bf16, codec::decode_bf16_add),
    ] {
        enc(&v, &mut b);
        let mut sent = vec![0f32; v.len()];
        dec(&b, &mut sent);
        check(&sent, what);
    }
    codec::encode_int8(&v, &mut b, None);
    let mut sent = vec![0f32; v.len()];
    codec::decode_int8_add(&b, &mut sent);
    check(&sent, "int8");
}

#[test]
fn power_sgd_reduces_a_sum_of_rank_r_exactly() {
    let outs = world(2, TransportChoice::Tcp, |comm| {
        // Every rank's input is a multiple of the same rank-3 matrix: so is the sum.
        let (r, mut g) = (3, SplitMix::new(11));
        let a: Vec<f32> = (0..ROWS * r).map(|_| g.normal()).collect();
        let b: Vec<f32> = (0..COLS * r).map(|_| g.normal()).collect();
        let mut m = vec![0f32; ROWS * COLS];
        shoal_comm::compress::powersgd::add_p_qt(&mut m, ROWS, COLS, &a, &b, r, comm.rank() as f32 + 1.0);
        let mut v = m.clone();
        let mut z = compressor(Codec::PowerSgd { rank: 4 }, true);
        z.all_reduce(&comm, 0, &mut v, &MATRICES[..]).expect("ok");
        (m, v)
    });
    let want: Vec<f32> = outs[0].0.iter().zip(&outs[1].0).map(|(a, b)| a + b).collect();
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (x, y) in outs[0].1.iter().zip(&want) {
        assert!((x - y).abs() <= scale * 1e-4, "{x} {y}");
    }
}

/// Bytes rank 0 really sent for one reduction of a 1 Mi-value buffer (a 1024 × 1024 matrix) against a plain f32
/// all-reduce of it.
fn bytes(n: usize, c: Codec) -> (u64, u64) {
    let outs = world(n, TransportChoice::Tcp, move |comm| {
        let len = 1 << 20;
        let mut g = SplitMix::new(comm.rank() as u64);
        let v: Vec<f32> = (0..len).map(|_| g.normal()).collect();
        let mut plain = v.clone();
        let b0 = comm.bytes_sent();
        comm.all_reduce(&mut plain, ReduceOp::Sum).expect("ok");
        let b1 = comm.bytes_sent();
        let mut z = compressor(c, true);
        let mut w = v.clone();
        z.all_reduce(&comm, 0, &mut w, &[Matrix { offset: 0, rows: 1024, cols: 1024 }]).expect("ok");
        (b1 - b0, comm.bytes_sent() - b1)
    });
    outs[0]
}

#[test]
fn each_codec_sends_the_fraction_of_the_bytes_it_promises() {
    // (codec, least reduction factor) at 2 and 4 ranks.
    let promised = [
        (Codec::Fp16, 2.0),
        (Codec::Bf16, 2.0),
        (Codec::Int8 { stochastic: false }, 3.9),
        (Codec::Sign, 25.0),
        (Codec::TopK { ratio: 0.01 }, 20.0),
        (Codec::RandK { ratio: 0.01 }, 50.0),
        (Codec::PowerSgd { rank: 4 }, 50.0),
    ];
    for n in [2, 4] {
        for (c, factor) in promised {
            let (plain, compressed) = bytes(n, c);
            let got = plain as f64 / compressed as f64;
            assert!(
                got >= factor * 0.99,
                "{} at {n} ranks: {plain} B plain, {compressed} B compressed ({got:.1}x)",
                c.name()
            );
        }
    }
}

#[test]
fn a_compressed_reduce_scatter_sums_each_slice_onto_its_rank() {
    // The last: a warm-up step of sign coded by int8.
    let warm = Compressor::new(CompressConfig {
        codec: Codec::Sign,
        warmup_steps: 1,
        warmup_codec: Codec::Int8 { stochastic: false },
        ..CompressConfig::default()
    });
    for c in [Codec::Fp16, Codec::Int8 { stochastic: false }, Codec::Sign, Codec::TopK { ratio: 0.5 }, Codec::None] {
        let n = 3;
        let s = 1000;
        let cfg = *warm.config();
        let outs = world(n, TransportChoice::Tcp, move |comm| {
            let mut z = if c == Codec::None { Compressor::new(cfg) } else { compressor(c, true) };
            let mut g = SplitMix::new(comm.rank() as u64 + 1);
            let v: Vec<f32> = (0..s * n).map(|_| g.normal()).collect();
            let mut out = vec![0f32; s];
            z.reduce_scatter(&comm, 0, &v, &mut out).expect("ok");
            let residual = z.state().into_iter().find(|(k, _)| k == "residual.0").map(|(_, v)| v).expect("ok");
            (v, out, residual)
        });
        // Each rank's slice is the sum of what every rank sent of it: the inputs less their residuals.
        for (r, (_, out, _)) in outs.iter().enumerate() {
            for (i, x) in out.iter().enumerate() {
                let want: f32 = outs.iter().map(|(v, _, res)| v[r * s + i] - res[r * s + i]).sum();
                assert!((x - want).abs() <= 1e-4 * want.abs().max(1.0), "{}: rank {r} value {i}: {x} {want}", c.name());
            }
        }
    }
    let err = world(2, TransportChoice::Tcp, |comm| {
        let mut z = compressor(Codec::PowerSgd { rank: 2 }, true);
        z.reduce_scatter(&comm, 0, &[0.0; 4], &mut [0.0; 2]).expect_err("an error").to_string()
    });
    assert!(err[0].contains("PowerSGD"), "{}", err[0]);
}

#[test]
fn warm_up_steps_are_plain_and_the_state_round_trips() {
    let outs = world(2, TransportChoice::Tcp, |comm| {
        let mut z = Compressor::new(CompressConfig {
            codec: Codec::TopK { ratio: 0.01 },
            warmup_steps: 2,
            seed: 1,
            ..CompressConfig::default()
        });
        let mut exact = grads(comm.rank(), 0);
        let mut plain = exact.clone();
        z.all_reduce(&comm, 0, &mut exact, &[]).expect("ok");
        comm.all_reduce(&mut plain, ReduceOp::Sum).expect("ok");
        assert_eq!(exact, plain, "a warm-up step is a plain all-reduce");
        assert!(z.state().is_empty());
        z.set_step(2);
        let mut v = grads(comm.rank(), 2);
        z.all_reduce(&comm, 0, &mut v, &[]).expect("ok");
        let state = z.state();
        let mut again = Compressor::new(*z.config());
        again.load_state(state.clone()).expect("ok");
        assert_eq!(again.state(), state);
        assert!(again.load_state(vec![("velocity.0".into(), vec![])]).is_err());
        state.len()
    });
    assert_eq!(outs, vec![1, 1]);
}

/// A warm-up coded by int8 sends int8's bytes, sums to within int8's rounding of the plain sum, and keeps what it
/// rounded away.
#[test]
fn a_warm_up_coded_by_int8_sends_its_bytes_and_keeps_its_residual() {
    let outs = world(2, TransportChoice::Tcp, |comm| {
        let mut z = Compressor::new(CompressConfig {
            codec: Codec::Sign,
            warmup_steps: 2,
            warmup_codec: Codec::Int8 { stochastic: false },
            seed: 1,
            ..CompressConfig::default()
        });
        assert!(!z.active());
        let mut coded = grads(comm.rank(), 0);
        let mut plain = coded.clone();
        let before = comm.bytes_sent();
        z.all_reduce(&comm, 0, &mut coded, &[]).expect("coded all-reduce");
        let sent = comm.bytes_sent() - before;
        let before = comm.bytes_sent();
        comm.all_reduce(&mut plain, ReduceOp::Sum).expect("plain all-reduce");
        let plain_sent = comm.bytes_sent() - before;
        let largest = plain.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = coded.iter().zip(&plain).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let residual: usize = z.state().iter().filter(|(n, _)| n.starts_with("residual.")).map(|(_, v)| v.len()).sum();
        (sent, plain_sent, worst / largest, coded != plain, residual)
    });
    for (sent, plain_sent, err, differs, residual) in outs {
        assert!(
            sent >= codec::int8_len(LEN) as u64 && sent * 39 <= plain_sent * 10,
            "{sent} bytes, plain {plain_sent}"
        );
        assert!(differs && err < 0.02, "relative error {err}");
        assert_eq!(residual, LEN);
    }
}
