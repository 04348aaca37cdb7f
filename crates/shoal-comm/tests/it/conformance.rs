//! Every operation, every dtype, lengths 0, 1, odd and large, world sizes 1 to 8,
//! over the in-process, TCP and shared-memory transports, compared with a
//! sequential reference. Inputs are small integers (products: powers of two) so
//! every float result is exact and compared bit for bit (tolerance 0); one test
//! with random floats uses a relative tolerance of 1e-5.

use std::time::Duration;

use half::{bf16, f16};
use shoal_comm::chunk::segment;
use shoal_comm::dtype::{finish_avg, reduce_bytes};
use shoal_comm::{Algo, CommConfig, Communicator, DType, ReduceOp, TransportChoice};

const LENGTHS: [usize; 4] = [0, 1, 37, 20_011];

fn cfg(t: TransportChoice) -> CommConfig {
    CommConfig {
        transport: t,
        timeout: Duration::from_secs(60),
        secret: b"conformance".to_vec(),
        ..CommConfig::default()
    }
}

/// Runs `f(comm)` on every rank of a world, each on its own thread.
pub(crate) fn world<R: Send + 'static>(
    n: usize,
    t: TransportChoice,
    f: impl Fn(Communicator) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let comms = Communicator::local_world(n, cfg(t)).unwrap_or_else(|e| panic!("building a {n}-rank {t:?} world: {e}"));
    let f = std::sync::Arc::new(f);
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            let f = f.clone();
            std::thread::spawn(move || f(c))
        })
        .collect();
    hs.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
}

/// Deterministic input of `rank`, as bytes of `dtype`.
fn input(dtype: DType, op: ReduceOp, rank: usize, len: usize) -> Vec<u8> {
    let val = |i: usize| -> f64 {
        if op == ReduceOp::Prod { [1.0, -1.0, 2.0][(rank * 5 + i) % 3] } else { ((rank * 7 + i * 3) % 11) as f64 - 5.0 }
    };
    let mut out = Vec::with_capacity(len * dtype.size());
    for i in 0..len {
        let v = val(i);
        match dtype {
            DType::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&v.to_le_bytes()),
            DType::F16 => out.extend_from_slice(&f16::from_f64(v).to_le_bytes()),
            DType::BF16 => out.extend_from_slice(&bf16::from_f64(v).to_le_bytes()),
            DType::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
        }
    }
    out
}

fn reference(dtype: DType, op: ReduceOp, n: usize, len: usize) -> Vec<u8> {
    let mut acc = input(dtype, op, 0, len);
    for r in 1..n {
        reduce_bytes(dtype, op.combining(), &mut acc, &input(dtype, op, r, len));
    }
    if op == ReduceOp::Avg {
        finish_avg(dtype, &mut acc, n);
    }
    acc
}

fn check_all_ops(n: usize, t: TransportChoice) {
    let results = world(n, t, move |c| -> Result<(), String> {
        let r = c.rank();
        for dtype in DType::ALL {
            for op in ReduceOp::ALL {
                for len in LENGTHS {
                    for algo in [Algo::Ring, Algo::Tree, Algo::Hier, Algo::HalvingDoubling, Algo::Auto] {
                        let mut buf = input(dtype, op, r, len);
                        c.all_reduce_bytes(&mut buf, dtype, op, algo)
                            .map_err(|e| format!("all_reduce {dtype} {op:?} {len} {algo:?}: {e}"))?;
                        if buf != reference(dtype, op, n, len) {
                            return Err(format!(
                                "rank {r}: all_reduce {dtype} {op:?} len {len} {algo:?} differs from the reference"
                            ));
                        }
                    }
                }
            }
        }
        for dtype in DType::ALL {
            for len in LENGTHS {
                let es = dtype.size();
                // broadcast from every root
                for root in 0..n {
                    let mut buf = if r == root { input(dtype, ReduceOp::Sum, root, len) } else { vec![0u8; len * es] };
                    c.broadcast_bytes(&mut buf, root)
                        .map_err(|e| format!("broadcast {dtype} {len} root {root}: {e}"))?;
                    if buf != input(dtype, ReduceOp::Sum, root, len) {
                        return Err(format!("rank {r}: broadcast {dtype} len {len} root {root} wrong"));
                    }
                }
                // reduce to the last rank: root gets the result, others keep their input
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                    let root = n - 1;
                    let mut buf = input(dtype, op, r, len);
                    c.reduce_bytes(&mut buf, dtype, op, root).map_err(|e| format!("reduce {dtype} {len}: {e}"))?;
                    let want = if r == root { reference(dtype, op, n, len) } else { input(dtype, op, r, len) };
                    if buf != want {
                        return Err(format!("rank {r}: reduce {dtype} {op:?} len {len} wrong"));
                    }
                }
                // all-gather
                let mine = input(dtype, ReduceOp::Sum, r, len);
                let mut out = vec![0u8; n * mine.len()];
                c.all_gather_bytes(&mine, &mut out).map_err(|e| format!("all_gather {dtype} {len}: {e}"))?;
                let want: Vec<u8> = (0..n).flat_map(|q| input(dtype, ReduceOp::Sum, q, len)).collect();
                if out != want {
                    return Err(format!("rank {r}: all_gather {dtype} len {len} wrong"));
                }
                // reduce-scatter with uneven segments
                for op in [ReduceOp::Sum, ReduceOp::Min] {
                    let seg = segment(len, n, r);
                    let mut out = vec![0u8; seg.len() * es];
                    c.reduce_scatter_bytes(&input(dtype, op, r, len), &mut out, dtype, op)
                        .map_err(|e| format!("reduce_scatter {dtype} {len}: {e}"))?;
                    if out != reference(dtype, op, n, len)[seg.start * es..seg.end * es] {
                        return Err(format!("rank {r}: reduce_scatter {dtype} {op:?} len {len} wrong"));
                    }
                }
            }
        }
        c.barrier().map_err(|e| format!("barrier: {e}"))?;
        // send/recv around a ring, with odd lengths
        if n > 1 {
            let msg: Vec<i64> = (0..1001).map(|i| (r * 1000 + i) as i64).collect();
            let mut got = vec![0i64; 1001];
            let (to, from) = ((r + 1) % n, (r + n - 1) % n);
            if r % 2 == 0 {
                c.send(&msg, to).map_err(|e| format!("send: {e}"))?;
                c.recv(&mut got, from).map_err(|e| format!("recv: {e}"))?;
            } else {
                c.recv(&mut got, from).map_err(|e| format!("recv: {e}"))?;
                c.send(&msg, to).map_err(|e| format!("send: {e}"))?;
            }
            if got != (0..1001).map(|i| (from * 1000 + i) as i64).collect::<Vec<_>>() {
                return Err(format!("rank {r}: recv from {from} wrong"));
            }
        }
        Ok(())
    });
    for (r, res) in results.into_iter().enumerate() {
        if let Err(e) = res {
            panic!("{t:?} world of {n}, rank {r}: {e}");
        }
    }
}

macro_rules! conformance {
    ($($name:ident: $t:expr, $n:expr;)*) => { $( #[test] fn $name() { check_all_ops($n, $t) } )* };
}

conformance! {
    inproc_1: TransportChoice::InProc, 1;
    inproc_2: TransportChoice::InProc, 2;
    inproc_3: TransportChoice::InProc, 3;
    inproc_4: TransportChoice::InProc, 4;
    inproc_5: TransportChoice::InProc, 5;
    inproc_6: TransportChoice::InProc, 6;
    inproc_7: TransportChoice::InProc, 7;
    inproc_8: TransportChoice::InProc, 8;
    tcp_1: TransportChoice::Tcp, 1;
    tcp_2: TransportChoice::Tcp, 2;
    tcp_3: TransportChoice::Tcp, 3;
    tcp_4: TransportChoice::Tcp, 4;
    tcp_5: TransportChoice::Tcp, 5;
    tcp_8: TransportChoice::Tcp, 8;
    shm_1: TransportChoice::Shm, 1;
    shm_2: TransportChoice::Shm, 2;
    shm_3: TransportChoice::Shm, 3;
    shm_4: TransportChoice::Shm, 4;
    shm_6: TransportChoice::Shm, 6;
    shm_8: TransportChoice::Shm, 8;
}

#[test]
fn random_floats_match_within_tolerance_and_ranks_agree_bitwise() {
    let n = 4;
    let len = 100_003;
    let data = move |r: usize| -> Vec<f32> {
        let mut x = (r as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2_000_001) as f32 / 1e6 - 1.0
            })
            .collect()
    };
    let outs = world(n, TransportChoice::Shm, move |c| {
        let mut v = data(c.rank());
        c.all_reduce(&mut v, ReduceOp::Sum).expect("all_reduce");
        v
    });
    let inputs: Vec<Vec<f32>> = (0..n).map(data).collect();
    let want: Vec<f64> = (0..len).map(|i| inputs.iter().map(|d| d[i] as f64).sum()).collect();
    for o in &outs {
        assert_eq!(o, &outs[0], "ranks must end with identical bits");
    }
    let max_a = want.iter().fold(0f64, |m, v| m.max(v.abs()));
    let max_err = outs[0].iter().zip(&want).fold(0f64, |m, (a, b)| m.max((*a as f64 - b).abs()));
    assert!(max_err / max_a <= 1e-5, "relative error {} exceeds 1e-5", max_err / max_a);
}

#[test]
fn non_blocking_operations_complete_in_issue_order() {
    let outs = world(3, TransportChoice::InProc, |c| {
        let r = c.rank() as f32;
        let a = c.all_reduce_async(vec![r; 1000], ReduceOp::Sum);
        let b = c.all_gather_async(vec![r as i32; 3]);
        let mut blocking = vec![1.0f64; 10];
        c.all_reduce(&mut blocking, ReduceOp::Sum).expect("blocking all_reduce");
        let d = c.reduce_scatter_async(vec![1i64; 10], ReduceOp::Sum);
        let e = c.broadcast_async(vec![r; 7], 2);
        (a.wait().expect("a"), b.wait().expect("b"), blocking, d.wait().expect("d"), e.wait().expect("e"))
    });
    for (r, (a, b, blocking, d, e)) in outs.into_iter().enumerate() {
        assert_eq!(a, vec![3.0; 1000]);
        assert_eq!(b, vec![0, 0, 0, 1, 1, 1, 2, 2, 2]);
        assert_eq!(blocking, vec![3.0; 10]);
        assert_eq!(d, vec![3; segment(10, 3, r).len()]);
        assert_eq!(e, vec![2.0; 7]);
    }
}

#[test]
fn split_by_colour_builds_independent_groups() {
    let outs = world(6, TransportChoice::InProc, |c| {
        let r = c.rank();
        let sub = c.split(Some((r % 2) as u32), -(r as i64)).expect("split").expect("member");
        let mut v = vec![r as i32];
        sub.all_reduce(&mut v, ReduceOp::Sum).expect("sub all_reduce");
        let none = c.split(if r == 0 { None } else { Some(0) }, 0).expect("second split");
        (sub.rank(), sub.size(), v[0], none.map(|s| s.size()))
    });
    for (r, (sr, ss, sum, other)) in outs.into_iter().enumerate() {
        assert_eq!(ss, 3);
        // keys are -rank: the highest rank of each colour comes first
        let members: Vec<usize> = (0..6).filter(|q| q % 2 == r % 2).rev().collect();
        assert_eq!(sr, members.iter().position(|&q| q == r).unwrap_or(99));
        assert_eq!(sum, members.iter().sum::<usize>() as i32);
        assert_eq!(other, if r == 0 { None } else { Some(5) });
    }
}

#[test]
fn a_host_with_one_rank_joins_hosts_with_several() {
    // Three ranks on "host0", one alone on "host1" (an uneven layout, as a cluster's placement may give): the ranks
    // that share memory link among themselves without waiting for the one that has nobody to share it with.
    let n = 4;
    let host = |r: usize| if r < 3 { "host0" } else { "host1" };
    let store: std::sync::Arc<dyn shoal_comm::Store> = std::sync::Arc::new(shoal_comm::MemStore::default());
    let t0 = std::time::Instant::now();
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                let c = CommConfig { host_id: Some(host(r).into()), ..cfg(TransportChoice::Auto) };
                let c = Communicator::init(store, r, n, c).map_err(|e| format!("rank {r} init: {e}"))?;
                let mut v = vec![r as i32 + 1; 1000];
                c.all_reduce(&mut v, ReduceOp::Sum).map_err(|e| format!("rank {r} all_reduce: {e}"))?;
                Ok::<_, String>(v)
            })
        })
        .collect();
    for h in hs {
        let v = h.join().expect("rank panicked").unwrap_or_else(|e| panic!("{e}"));
        assert!(v.iter().all(|x| *x == 10), "sum of 1..=4 everywhere");
    }
    assert!(t0.elapsed() < Duration::from_secs(8), "linking took {:?}: someone waited for a timeout", t0.elapsed());
}

#[test]
fn hierarchical_all_reduce_across_simulated_hosts() {
    // Two "hosts" of three ranks each: shared memory inside, TCP across.
    let n = 6;
    let store: std::sync::Arc<dyn shoal_comm::Store> = std::sync::Arc::new(shoal_comm::MemStore::default());
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                let c = CommConfig {
                    host_id: Some(format!("host{}", r / 3)),
                    transport: TransportChoice::Auto,
                    ..cfg(TransportChoice::Auto)
                };
                let c = Communicator::init(store, r, n, c).expect("init");
                let kinds: Vec<_> = (0..n).map(|q| c.link_kind(q)).collect();
                let mut v: Vec<f32> = (0..100_000).map(|i| (i % 13) as f32 + r as f32).collect();
                assert_eq!(c.choose_all_reduce(v.len() * 4, Algo::Auto), Algo::Hier);
                c.all_reduce(&mut v, ReduceOp::Sum).expect("hier all_reduce");
                (kinds, v)
            })
        })
        .collect();
    for (r, h) in hs.into_iter().enumerate() {
        let (kinds, v) = h.join().expect("rank panicked");
        for (q, k) in kinds.iter().enumerate() {
            let want = if q == r {
                None
            } else if q / 3 == r / 3 {
                // same host but same process: the heap rings
                Some(shoal_comm::TransportKind::InProc)
            } else {
                Some(shoal_comm::TransportKind::Tcp)
            };
            assert_eq!(*k, want, "rank {r} link to {q}");
        }
        assert!(v.iter().enumerate().all(|(i, x)| *x == 6.0 * (i % 13) as f32 + 15.0), "rank {r} wrong hier result");
    }
}

#[test]
fn hierarchical_all_reduce_pipelines_large_buffers_segment_by_segment() {
    // Three "hosts" of two ranks; a buffer of several segments with a short last one, twice in a row (the host
    // communicators' order of operations must hold across calls), then an average.
    let (n, per_host) = (6, 2);
    let len = 2 * shoal_comm::algo::HIER_SEGMENT / 4 + 300_001;
    let store: std::sync::Arc<dyn shoal_comm::Store> = std::sync::Arc::new(shoal_comm::MemStore::default());
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let store = store.clone();
            std::thread::spawn(move || {
                let c = CommConfig {
                    host_id: Some(format!("host{}", r / per_host)),
                    algo: Algo::Hier,
                    ..cfg(TransportChoice::Auto)
                };
                let c = Communicator::init(store, r, n, c).expect("init");
                let mut v: Vec<f32> = (0..len).map(|i| (i % 7) as f32 + r as f32).collect();
                c.all_reduce(&mut v, ReduceOp::Sum).expect("first");
                let mut w: Vec<f32> = (0..len).map(|i| (i % 5) as f32 * (r + 1) as f32).collect();
                c.all_reduce(&mut w, ReduceOp::Avg).expect("second");
                (v, w)
            })
        })
        .collect();
    for (r, h) in hs.into_iter().enumerate() {
        let (v, w) = h.join().expect("rank panicked");
        assert_eq!(v.len(), len);
        let bad = v.iter().enumerate().find(|(i, x)| **x != 6.0 * (i % 7) as f32 + 15.0);
        assert!(bad.is_none(), "rank {r}: sum wrong at {bad:?}");
        // Sum over ranks of (i % 5)(r + 1) = 21 (i % 5); the average divides by 6.
        let bad = w.iter().enumerate().find(|(i, x)| (**x - 21.0 * (i % 5) as f32 / 6.0).abs() > 1e-5);
        assert!(bad.is_none(), "rank {r}: average wrong at {bad:?}");
    }
}
