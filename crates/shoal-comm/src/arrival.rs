//! Arrival skew: which peer a rank waits for inside collectives, measured on every message, with no synchronised
//! clocks.
//!
//! Every message carries two words from its sender (in the slot header in shared memory, ahead of the payload
//! over TCP), its [`Timing`]:
//! - `stamp`: the sender's clock when it became ready to send the message (the start of its exchange);
//! - `held`: how long the sender itself had been held up so far in this operation, and by which rank at the root
//!   (packed: see [`pack`]).
//!
//! The receiver notes, in its own clock, when it posted the receive (`posted`) and when it saw the first bytes
//! (`seen`). Two processes' clocks differ by an unknown offset, so per peer it keeps the least `seen - stamp` over
//! the last [`BASE_WINDOW`] or two: the *base*, the offset plus the link's quickest delivery. `stamp + base` is
//! then, in the receiver's clock, the earliest the message could have been seen. Of the time from `posted` to
//! `seen`, what lies before that moment the sender **held** this rank up (it was late: it arrived late at the
//! operation, or was stopped, descheduled or slow inside it; the link's quickest delivery, microseconds on one
//! host, counts with it, for every sender alike); what lies after it this rank **lagged**: the data was there and
//! it did not take it (it was stopped or descheduled itself while it waited), or the link was slower than its
//! best. (A base learnt only from messages that were already waiting is too large by how late this rank always
//! is; that only shrinks what it charges others, and its peers, which do wait for it, learn theirs right.)
//!
//! The hold is charged to the rank at its root: when the sender had been held up by rank `c` for `x` before it
//! could send, up to `x` goes to `c` and the rest to the sender. So in a ring, where a late rank delays its
//! neighbour, which delays the next, every rank charges the late one. A rank that arrives last waits for no one
//! and the others wait for it; a slow network delays everyone's messages alike (lag and transfer after the first
//! bytes, and the same quickest delivery for every sender), so no rank stands out. Cost per exchange: one clock
//! read (a second where the receiver waited more than a few polls), two words written and read, a few atomic
//! loads, stores and adds on this rank's own record per receipt; no lock (see `PERFORMANCE_CRITICAL_PATH.md`).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// How long a base (least `seen - stamp`) is trusted before a fresher one replaces it: the base is the least over
/// the current window and the one before, so it follows drift between two hosts' clocks.
pub const BASE_WINDOW: Duration = Duration::from_secs(5);

/// Largest hold a message carries, in microseconds (40 bits).
const HELD_MASK: u64 = (1 << 40) - 1;

/// This process's clock in nanoseconds (monotonic, from an arbitrary origin: only differences and per-peer
/// bases are used).
pub fn now_ns() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// What a message carries for its receiver's record (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Timing {
    pub stamp: u64,
    pub held: u64,
}

impl Timing {
    /// Bytes on the wire.
    pub const LEN: usize = 16;

    pub fn encode(&self) -> [u8; Timing::LEN] {
        let mut b = [0u8; Timing::LEN];
        b[..8].copy_from_slice(&self.stamp.to_le_bytes());
        b[8..].copy_from_slice(&self.held.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; Timing::LEN]) -> Timing {
        let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        Timing { stamp: w(0), held: w(1) }
    }
}

/// Packs a hold of `total` held up by `root` (a rank of the communicator) into one word: rank + 1 in the top 24
/// bits (0: none), microseconds in the low 40.
pub fn pack(root: Option<usize>, total: Duration) -> u64 {
    match root {
        Some(r) if r < (1 << 24) - 1 => ((r as u64 + 1) << 40) | (total.as_micros() as u64).min(HELD_MASK),
        _ => 0,
    }
}

/// The inverse of [`pack`].
pub fn unpack(word: u64) -> Option<(usize, Duration)> {
    let r = word >> 40;
    (r > 0).then(|| ((r - 1) as usize, Duration::from_micros(word & HELD_MASK)))
}

/// What a rank's communicator measured so far ([`crate::Communicator::arrival_stats`]); cumulative, for a reader
/// that takes differences over a window of time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ArrivalStats {
    /// Per rank (of the communicator, or of the one it was split from): how long this rank was held up inside
    /// operations by that rank, as the root of the delay. Zero for itself.
    pub waited_for: Vec<Duration>,
    /// How long messages sat ready before this rank took them (it was stopped or descheduled while it waited), or
    /// arrived later than the link's best.
    pub lag: Duration,
}

impl ArrivalStats {
    /// How long this rank was held up by others in all.
    pub fn waited(&self) -> Duration {
        self.waited_for.iter().sum()
    }
}

/// Per peer: the base and what was charged to it. Atomics, written with plain loads and stores where one thread
/// at a time receives from a peer (operations on a communicator run one at a time, and the communicators split from
/// one reach disjoint peers), added to where any may charge it.
#[derive(Debug)]
struct Peer {
    base: AtomicI64,
    base_before: AtomicI64,
    /// When the current base window began (receiver's clock).
    since: AtomicU64,
    waited_ns: AtomicU64,
}

/// The record of one rank: shared by a communicator and those split from it. No lock: the data path only loads,
/// stores and adds.
#[derive(Debug)]
pub struct Record {
    peers: Vec<Peer>,
    lag_ns: AtomicU64,
}

impl Record {
    fn new(size: usize) -> Record {
        let peer = || Peer {
            base: AtomicI64::new(i64::MAX),
            base_before: AtomicI64::new(i64::MAX),
            since: AtomicU64::new(0),
            waited_ns: AtomicU64::new(0),
        };
        Record { peers: (0..size).map(|_| peer()).collect(), lag_ns: AtomicU64::new(0) }
    }

    fn stats(&self) -> ArrivalStats {
        ArrivalStats {
            waited_for: self.peers.iter().map(|p| Duration::from_nanos(p.waited_ns.load(Ordering::Relaxed))).collect(),
            lag: Duration::from_nanos(self.lag_ns.load(Ordering::Relaxed)),
        }
    }
}

/// One communicator's view of its rank's [`Record`], with the hold of the operation in progress.
#[derive(Debug)]
pub struct Arrivals {
    record: Arc<Record>,
    /// Rank of this communicator -> index in the record.
    index: Vec<usize>,
    rank: usize,
    /// What this rank's messages carry now ([`pack`]): its hold so far in the current operation.
    held: AtomicU64,
    /// The largest single charge of the current operation, in nanoseconds (its root is the one `held` names).
    largest: AtomicU64,
}

impl Arrivals {
    /// A fresh record for rank `rank` of a communicator of `size`.
    pub fn new(rank: usize, size: usize) -> Arrivals {
        Arrivals::view(Arc::new(Record::new(size)), (0..size).collect(), rank)
    }

    /// A view of `parent`'s record for a communicator split from it: `members[r]` is the parent's rank of rank `r`.
    pub fn split(parent: &Arrivals, members: &[usize], rank: usize) -> Arrivals {
        let index = members.iter().map(|&m| parent.index.get(m).copied().unwrap_or(usize::MAX)).collect();
        Arrivals::view(parent.record.clone(), index, rank)
    }

    fn view(record: Arc<Record>, index: Vec<usize>, rank: usize) -> Arrivals {
        Arrivals { record, index, rank, held: AtomicU64::new(0), largest: AtomicU64::new(0) }
    }

    /// An operation begins: nothing has held this rank up in it yet.
    pub fn begin_op(&self) {
        self.held.store(0, Ordering::Relaxed);
        self.largest.store(0, Ordering::Relaxed);
    }

    /// What a message sent now, `stamp` ([`now_ns`]), carries.
    pub fn outgoing(&self, stamp: u64) -> Timing {
        Timing { stamp, held: self.held.load(Ordering::Relaxed) }
    }

    /// Records a message from `peer`: posted and seen in this rank's clock ([`now_ns`]), its timing as the sender
    /// wrote it.
    pub fn incoming(&self, peer: usize, posted: u64, seen: u64, t: Timing) {
        let r = &*self.record;
        let Some(p) = self.index.get(peer).and_then(|&i| r.peers.get(i)) else { return };
        let (mut base, mut before) = (p.base.load(Ordering::Relaxed), p.base_before.load(Ordering::Relaxed));
        if seen.saturating_sub(p.since.load(Ordering::Relaxed)) >= BASE_WINDOW.as_nanos() as u64 {
            (base, before) = (i64::MAX, base);
            p.base.store(base, Ordering::Relaxed);
            p.base_before.store(before, Ordering::Relaxed);
            p.since.store(seen, Ordering::Relaxed);
        }
        let delivery = seen.wrapping_sub(t.stamp) as i64;
        if delivery < base {
            base = delivery;
            p.base.store(base, Ordering::Relaxed);
        }
        let base = base.min(before);
        // When the message could first have been seen, relative to when it was asked for.
        let could = (t.stamp as i64).wrapping_add(base).wrapping_sub(posted as i64);
        let waited = seen.saturating_sub(posted);
        let hold = (could.max(0) as u64).min(waited);
        if waited > hold {
            r.lag_ns.fetch_add(waited - hold, Ordering::Relaxed);
        }
        if hold == 0 {
            return;
        }
        // Charge the root: the rank that held the sender up, for as long as it did; the sender for the rest.
        let inherited = unpack(t.held)
            .filter(|&(root, _)| root != self.rank && root != peer)
            .and_then(|(root, x)| Some((root, r.peers.get(*self.index.get(root)?)?, x.as_nanos() as u64)));
        let (root, to_root) = match inherited {
            Some((root, rp, x)) => {
                let part = hold.min(x);
                rp.waited_ns.fetch_add(part, Ordering::Relaxed);
                (root, part)
            }
            None => (peer, 0),
        };
        p.waited_ns.fetch_add(hold - to_root, Ordering::Relaxed);
        // What this rank's own messages carry from now on in this operation.
        let (main, main_ns) = if to_root >= hold - to_root { (root, to_root) } else { (peer, hold - to_root) };
        let before = unpack(self.held.load(Ordering::Relaxed));
        let total = before.map_or(Duration::ZERO, |b| b.1) + Duration::from_nanos(hold);
        let largest = self.largest.load(Ordering::Relaxed);
        let root = match before {
            Some((r, _)) if largest >= main_ns => r,
            _ => {
                self.largest.store(main_ns, Ordering::Relaxed);
                main
            }
        };
        self.held.store(pack(Some(root), total), Ordering::Relaxed);
    }

    /// What was measured so far, per rank of the record (the root communicator's ranks).
    pub fn stats(&self) -> ArrivalStats {
        self.record.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn packing_round_trips() {
        assert_eq!(unpack(pack(Some(3), Duration::from_micros(1500))), Some((3, Duration::from_micros(1500))));
        assert_eq!(unpack(pack(None, Duration::from_secs(1))), None);
        assert_eq!(unpack(0), None);
    }

    fn timing(stamp: u64, held: u64) -> Timing {
        Timing { stamp, held }
    }

    #[test]
    fn timing_round_trips() {
        let t = timing(7, pack(Some(2), Duration::from_micros(9)));
        assert_eq!(Timing::decode(&t.encode()), t);
    }

    #[test]
    fn a_late_sender_is_charged_and_a_late_receiver_lags() {
        // Rank 0's clock; rank 1's clock reads 1000 ms more. Delivery takes 10 us at best.
        let a = Arrivals::new(0, 2);
        let off = 1000 * MS;
        // Both ready together: the quickest delivery is learnt, and is all that is charged.
        a.begin_op();
        a.incoming(1, 100 * MS, 100 * MS + 10_000, timing(100 * MS + off, 0));
        let s = a.stats();
        assert_eq!((s.waited(), s.lag), (Duration::from_micros(10), Duration::ZERO));
        // Rank 1 was ready 30 ms after rank 0 asked: 30 ms charged to rank 1.
        a.begin_op();
        a.incoming(1, 200 * MS, 230 * MS + 10_000, timing(230 * MS + off, 0));
        let held = Duration::from_micros(30_010);
        assert_eq!(a.stats().waited_for[1], held + Duration::from_micros(10));
        assert_eq!(unpack(a.outgoing(0).held), Some((1, held)));
        // Rank 1 sent long before; rank 0 asked at 300 ms but saw it only at 340 ms (stopped): lag, no charge.
        a.begin_op();
        a.incoming(1, 300 * MS, 340 * MS, timing(250 * MS + off, 0));
        assert_eq!(a.outgoing(0).held, 0);
        let s = a.stats();
        assert_eq!(s.waited_for[1], held + Duration::from_micros(10));
        assert_eq!(s.lag, Duration::from_millis(40));
    }

    #[test]
    fn a_hold_passes_on_to_its_root() {
        // Rank 2 waits 20 ms for rank 1, which had been held up 25 ms by rank 0: rank 0 is charged.
        let a = Arrivals::new(2, 3);
        a.incoming(1, 0, 10_000, timing(0, 0));
        let before = a.stats().waited_for[1];
        a.begin_op();
        a.incoming(1, 100 * MS, 120 * MS + 10_000, timing(120 * MS, pack(Some(0), Duration::from_millis(25))));
        let s = a.stats();
        assert_eq!(s.waited_for[0], Duration::from_micros(20_010));
        assert_eq!(s.waited_for[1], before);
        assert_eq!(unpack(a.outgoing(0).held).map(|h| h.0), Some(0));
    }

    #[test]
    fn a_split_view_charges_the_parent_ranks() {
        let world = Arrivals::new(3, 4);
        // A sub-communicator of world ranks 1 and 3: its rank 0 is world rank 1.
        let sub = Arrivals::split(&world, &[1, 3], 1);
        sub.incoming(0, 0, 10_000, timing(0, 0));
        sub.incoming(0, 100 * MS, 150 * MS + 10_000, timing(150 * MS, 0));
        let charged = Duration::from_micros(50_020);
        assert_eq!(world.stats().waited_for, vec![Duration::ZERO, charged, Duration::ZERO, Duration::ZERO]);
    }
}
