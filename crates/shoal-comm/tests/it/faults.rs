//! Fault tests inside one process: wrong secrets, garbage on a rank's port, a
//! rank that leaves or never arrives. (Killing a rank *process* in the middle
//! of an all-reduce is tested through `shoal bench` in the `shoal` crate.)

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shoal_comm::{CommConfig, Communicator, Error, MemStore, ReduceOp, Store, TransportChoice};

fn cfg(t: TransportChoice, secret: &[u8], timeout: Duration) -> CommConfig {
    CommConfig { transport: t, timeout, secret: secret.to_vec(), ..CommConfig::default() }
}

#[test]
fn a_rank_with_the_wrong_secret_cannot_join() {
    let store: Arc<dyn Store> = Arc::new(MemStore::default());
    let s0 = store.clone();
    let r0 = std::thread::spawn(move || {
        Communicator::init(s0, 0, 2, cfg(TransportChoice::Tcp, b"right", Duration::from_secs(3)))
    });
    let r1 = Communicator::init(store, 1, 2, cfg(TransportChoice::Tcp, b"wrong", Duration::from_secs(3)));
    match r1 {
        Err(Error::Auth { .. }) => {}
        other => panic!("the impostor should fail authentication, got {other:?}"),
    }
    match r0.join().expect("rank 0 thread") {
        Err(Error::Timeout { waiting_for, .. }) => assert!(waiting_for.contains("[1]"), "{waiting_for}"),
        other => panic!("rank 0 should time out waiting for rank 1, got {other:?}"),
    }
}

#[test]
fn garbage_on_a_ranks_port_is_refused_and_the_world_still_forms() {
    let store: Arc<dyn Store> = Arc::new(MemStore::default());
    let s0 = store.clone();
    let r0 = std::thread::spawn(move || {
        let c = Communicator::init(s0, 0, 2, cfg(TransportChoice::Tcp, b"s3cret", Duration::from_secs(20)))?;
        let mut v = vec![1.0f32; 1000];
        c.all_reduce(&mut v, ReduceOp::Sum)?;
        Ok::<_, Error>(v)
    });
    // Find rank 0's listening address and throw junk at it before rank 1 exists.
    let peer = store.get("shoal/world/peer/0", Duration::from_secs(10)).expect("rank 0 published its address");
    let peer = String::from_utf8_lossy(&peer).to_string();
    let addr = peer.rsplit('\t').next().expect("address field").to_string();
    let mut x: u64 = 0x1234_5678_9abc_def0;
    for attempt in 0..5 {
        let mut s = TcpStream::connect(&addr).expect("connect to rank 0");
        let junk: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        if attempt == 0 {
            // A well-formed header that announces an absurd length.
            let mut h = b"SHOL\x01\x02\0\0".to_vec();
            h.extend_from_slice(&0u64.to_le_bytes());
            h.extend_from_slice(&u64::MAX.to_le_bytes());
            let _ = s.write_all(&h);
        }
        let _ = s.write_all(&junk);
    }
    let c1 = Communicator::init(store, 1, 2, cfg(TransportChoice::Tcp, b"s3cret", Duration::from_secs(20)))
        .expect("rank 1 joins");
    let mut v = vec![2.0f32; 1000];
    c1.all_reduce(&mut v, ReduceOp::Sum).expect("all_reduce after the junk");
    assert_eq!(v, vec![3.0; 1000]);
    assert_eq!(r0.join().expect("rank 0").expect("rank 0 result"), vec![3.0; 1000]);
}

/// Rank 2 leaves after one all-reduce; the others, in their second one, must fail
/// naming rank 2 and the operation, well before their 20 s timeout.
fn departed_rank_is_named(t: TransportChoice) {
    let comms = Communicator::local_world(3, cfg(t, b"k", Duration::from_secs(20))).expect("world");
    let started = Instant::now();
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let mut v = vec![1.0f32; 1 << 20];
                c.all_reduce(&mut v, ReduceOp::Sum)?;
                if c.rank() == 2 {
                    drop(c);
                    return Ok(None);
                }
                c.all_reduce(&mut v, ReduceOp::Sum).map(|_| Some(()))?;
                Ok::<_, Error>(Some(()))
            })
        })
        .collect();
    let results: Vec<_> = hs.into_iter().map(|h| h.join().expect("rank thread")).collect();
    assert!(matches!(results[2], Ok(None)));
    let mut named = 0;
    for (r, res) in results.iter().enumerate().take(2) {
        match res {
            Err(e @ Error::PeerLost { op, participation, .. }) => {
                assert_eq!(*op, "all_reduce", "rank {r}: {e}");
                assert!(participation.missing.contains(&2), "rank {r}: {e}");
                named += 1;
            }
            Err(e @ Error::Timeout { op, participation, .. }) => {
                assert_eq!(*op, "all_reduce", "rank {r}: {e}");
                assert!(!participation.missing.is_empty(), "rank {r}: {e}");
            }
            other => panic!("rank {r} should fail, got {other:?}"),
        }
    }
    assert!(named >= 1, "at least the neighbour of rank 2 must name it as lost");
    assert!(started.elapsed() < Duration::from_secs(20), "a departed peer must be noticed before the timeout");
}

#[test]
fn departed_rank_is_named_over_tcp() {
    departed_rank_is_named(TransportChoice::Tcp);
}

#[test]
fn departed_rank_is_named_over_shm() {
    departed_rank_is_named(TransportChoice::Shm);
}

#[test]
fn departed_rank_is_named_in_process() {
    departed_rank_is_named(TransportChoice::InProc);
}

#[test]
fn a_rank_that_never_arrives_times_out_with_a_report() {
    let comms = Communicator::local_world(3, cfg(TransportChoice::Shm, b"k", Duration::from_secs(2))).expect("world");
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                if c.rank() == 1 {
                    // Busy elsewhere: never enters the all-reduce, but stays alive.
                    std::thread::sleep(Duration::from_secs(4));
                    return (c, Ok(()));
                }
                let mut v = vec![1i64; 10];
                let r = c.all_reduce(&mut v, ReduceOp::Sum);
                // Keep the communicator open until every rank is done, so that
                // one rank's exit is not reported as a lost peer to another.
                (c, r)
            })
        })
        .collect();
    let (_comms, results): (Vec<_>, Vec<_>) = hs.into_iter().map(|h| h.join().expect("rank thread")).unzip();
    for r in [0, 2] {
        match &results[r] {
            Err(e @ Error::Timeout { op, seq, participation, .. }) => {
                assert_eq!(*op, "all_reduce");
                assert_eq!(*seq, 1);
                assert_eq!(participation.missing, vec![1], "rank {r}: {e}");
                assert!(participation.arrived.contains(&r), "rank {r}: {e}");
                let text = e.to_string();
                assert!(text.contains("all_reduce #1") && text.contains("missing [1]"), "{text}");
            }
            other => panic!("rank {r} should time out, got {other:?}"),
        }
    }
}

#[test]
fn a_failed_communicator_refuses_further_operations() {
    let comms =
        Communicator::local_world(2, cfg(TransportChoice::InProc, b"k", Duration::from_millis(300))).expect("world");
    let mut it = comms.into_iter();
    let c0 = it.next().expect("rank 0");
    let _c1 = it.next().expect("rank 1");
    let mut v = vec![1.0f64; 4];
    assert!(matches!(c0.all_reduce(&mut v, ReduceOp::Sum), Err(Error::Timeout { .. })));
    match c0.barrier() {
        Err(Error::Closed(why)) => assert!(why.contains("all_reduce #1"), "{why}"),
        other => panic!("expected Closed, got {other:?}"),
    }
}

/// A rank's activity names the collective it waits in, its sequence number and for how long, so that a hang can be
/// dumped; a rank that has not arrived shows the last one it finished.
#[test]
fn activity_names_the_collective_a_rank_waits_in_and_who_has_not_arrived() {
    let mut comms = Communicator::local_world(2, cfg(TransportChoice::InProc, b"s", Duration::from_secs(20)))
        .expect("a world of 2");
    let late = comms.pop().expect("rank 1");
    let early = comms.pop().expect("rank 0");
    let before = early.activity();
    assert_eq!((before.op, before.seq, before.in_op, before.done), ("", 0, false, 0));
    let waiting = early.clone();
    let t = std::thread::spawn(move || {
        let mut v = vec![1.0f32; 64];
        waiting.all_reduce(&mut v, ReduceOp::Sum).map(|_| v)
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while !early.activity().in_op {
        assert!(Instant::now() < deadline, "rank 0 never entered its all-reduce: {:?}", early.activity());
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    let a = early.activity();
    assert_eq!((a.op, a.seq, a.in_op, a.done), ("all_reduce", 1, true, 0), "{a:?}");
    assert!(a.for_ >= Duration::from_millis(200), "{a:?}");
    let b = late.activity();
    assert_eq!((b.seq, b.in_op), (0, false), "rank 1 has not arrived: {b:?}");
    let mut v = vec![2.0f32; 64];
    late.all_reduce(&mut v, ReduceOp::Sum).expect("rank 1's all-reduce");
    assert_eq!(t.join().expect("rank 0's thread").expect("rank 0's all-reduce"), vec![3.0f32; 64]);
    for c in [&early, &late] {
        let a = c.activity();
        assert_eq!((a.op, a.seq, a.in_op, a.done, a.closed.clone()), ("all_reduce", 1, false, 1, None), "{a:?}");
    }
}
