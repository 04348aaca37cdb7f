//! The arrival skew on real communicators: a rank that comes late to every collective is the one every other rank
//! waits for — directly, or through a neighbour it held up — over every transport and algorithm, and it waits for
//! no one itself.

use std::time::Duration;

use shoal_comm::{Algo, CommConfig, Communicator, ReduceOp, TransportChoice};

const LATE: usize = 1;
const SLEEP: Duration = Duration::from_millis(20);
const OPS: usize = 10;

fn run(n: usize, t: TransportChoice, algo: Algo) -> Vec<shoal_comm::ArrivalStats> {
    let cfg = CommConfig {
        transport: t,
        algo,
        timeout: Duration::from_secs(60),
        secret: b"arrival".to_vec(),
        ..CommConfig::default()
    };
    let comms = Communicator::local_world(n, cfg).unwrap_or_else(|e| panic!("building a {n}-rank {t:?} world: {e}"));
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                let mut v = vec![1.0f32; 16 << 10];
                // A first collective to learn every link's quickest delivery.
                c.all_reduce(&mut v, ReduceOp::Sum).expect("all_reduce");
                for _ in 0..OPS {
                    if c.rank() == LATE {
                        std::thread::sleep(SLEEP);
                    }
                    c.all_reduce(&mut v, ReduceOp::Sum).expect("all_reduce");
                }
                c.barrier().expect("barrier");
                c.arrival_stats()
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
}

#[test]
fn a_late_rank_is_the_one_the_others_wait_for() {
    let late_total = SLEEP * OPS as u32;
    for t in [TransportChoice::InProc, TransportChoice::Shm, TransportChoice::Tcp] {
        for algo in [Algo::Ring, Algo::Tree] {
            let stats = run(3, t, algo);
            for (rank, s) in stats.iter().enumerate() {
                let what = format!("{t:?} {algo:?}, rank {rank}: {s:?}");
                assert_eq!(s.waited_for.len(), 3, "{what}");
                assert_eq!(s.waited_for[rank], Duration::ZERO, "{what}");
                if rank == LATE {
                    assert!(s.waited() < late_total / 3, "the late rank waits for no one: {what}");
                } else {
                    assert!(s.waited_for[LATE] >= late_total * 7 / 10, "charged to the late rank: {what}");
                    let other = 3 - rank - LATE;
                    assert!(s.waited_for[other] < late_total / 3, "not charged to rank {other}: {what}");
                }
            }
        }
    }
}

#[test]
fn a_split_communicator_adds_to_its_parent_record() {
    let cfg = CommConfig { transport: TransportChoice::InProc, ..CommConfig::default() };
    let comms = Communicator::local_world(4, cfg).expect("world");
    let hs: Vec<_> = comms
        .into_iter()
        .map(|c| {
            std::thread::spawn(move || {
                // Odd world ranks form a communicator in which world rank 3 is late.
                let sub = c.split(Some((c.rank() % 2) as u32), c.rank() as i64).expect("split").expect("member");
                let mut v = vec![1.0f32; 1024];
                for _ in 0..5 {
                    if c.rank() == 3 {
                        std::thread::sleep(SLEEP);
                    }
                    sub.all_reduce(&mut v, ReduceOp::Sum).expect("all_reduce");
                }
                (c.rank(), c.arrival_stats(), sub.arrival_stats())
            })
        })
        .collect();
    for h in hs {
        let (rank, world, sub) = h.join().expect("rank thread panicked");
        assert_eq!(world, sub, "one record");
        assert_eq!(world.waited_for.len(), 4);
        if rank == 1 {
            assert!(world.waited_for[3] >= SLEEP * 5 * 7 / 10, "world rank 3 charged: {world:?}");
        }
    }
}
