//! The collectives, written once over [`Communicator::xchg`] and so run unchanged
//! on every transport. Byte-level implementations (`*_bytes`) do the work; the
//! typed public methods cast and delegate.
//!
//! - all-reduce: ring (reduce-scatter then all-gather, `2(n-1)/n` of the buffer on
//!   the wire per rank), recursive doubling (`log2 n` rounds, for small messages;
//!   non-powers of two fold the extra ranks in first), Rabenseifner halving-doubling
//!   (`rhd`: reduce-scatter by recursive halving, all-gather by recursive doubling;
//!   `2(n-1)/n` of the buffer like the ring but `2 log2 n` steps instead of
//!   `2(n-1)`), hierarchical (reduce inside each host, ring among one leader per
//!   host, broadcast inside each host).
//! - broadcast: binomial tree (small), pipelined chain in chunks (large).
//! - reduce: binomial tree (small), ring reduce-scatter + gather at the root (large).
//! - all-gather, reduce-scatter: ring. barrier: dissemination (`ceil(log2 n)` rounds
//!   of empty messages).
//!
//! Every rank ends an all-reduce with identical bits: in the ring each segment is
//! reduced on one rank and then copied, and recursive doubling combines the same
//! pair of partial results on both sides with a commutative operator; in
//! halving-doubling, as in the ring, each block is reduced on one rank and copied.
//!
//! `Algo::Auto` for all-reduce: up to `small_bytes` recursive doubling; ranks on
//! several hosts (but not one per host) hierarchical; otherwise halving-doubling
//! when every link is shared memory (`Shm`/`InProc`), there are at least 3 ranks
//! and the buffer is at most [`RHD_MAX_BYTES`] (1 MiB); the ring for the rest.
//! Measured on a 2-core machine, 3 alternating A/B rounds of `shoal bench allreduce
//! --algo ring|rhd`, medians in microseconds ring/rhd: shm 4 ranks 64 KiB 100/48,
//! 256 KiB 151/129, 1 MiB 434/394, 4 MiB 2670/3063; shm 3 ranks 256 KiB 109/72,
//! 1 MiB 321/285; fewer synchronisation steps pay off while a step costs more
//! than its bytes, and the ring's smaller, better-pipelined messages win beyond.
//! Over TCP rhd won no size consistently (4 ranks: 256 KiB 600/605, 1 MiB
//! 2100/3024, 16 MiB 34730/47318; its first and last steps move half the buffer
//! in one message, which goes to the sender thread above 256 KiB while the ring's
//! quarter-buffer steps are written inline), and with 2 ranks the two are the same
//! exchange; so those keep the ring.

use std::ops::Range;

use crate::chunk::{bytes, chunk_count, chunk_range, segment, split_pair};
use crate::comm::{Algo, Communicator, Hier, Pending};
use crate::dtype::{DType, Element, ReduceOp, finish_avg, reduce_bytes};
use crate::error::{Error, Result};
use crate::transport::{OpCtx, TransportKind};

/// Above this many bytes the hierarchical all-reduce pipelines its phases segment by segment.
pub const HIER_SEGMENT: usize = 2 << 20;

/// Largest all-reduce for which `Algo::Auto` picks halving-doubling (shared memory,
/// 3 or more ranks); see the module docs for the measurements.
pub const RHD_MAX_BYTES: usize = 1 << 20;

/// Chunk of the pipelined broadcast chain.
const BCAST_CHUNK: usize = 512 << 10;

/// Byte ranges of the ring's per-rank segments, computed on demand (no allocation).
enum Segs {
    /// `partition(count, n)` scaled by the element size.
    Partition { count: usize, n: usize, esize: usize },
    /// Segment `i` is `i*len..(i+1)*len`.
    Equal { len: usize },
}

impl Segs {
    fn get(&self, i: usize) -> Range<usize> {
        match *self {
            Segs::Partition { count, n, esize } => bytes(&segment(count, n, i), esize),
            Segs::Equal { len } => i * len..(i + 1) * len,
        }
    }
}

fn as_bytes<T: Element>(b: &[T]) -> &[u8] {
    bytemuck::cast_slice(b)
}
fn as_bytes_mut<T: Element>(b: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(b)
}

fn check_root(root: usize, size: usize) -> Result<()> {
    if root >= size {
        return Err(Error::InvalidArgument(format!("root {root} is not a rank of a communicator of size {size}")));
    }
    Ok(())
}

/// The largest power of two `p <= n` (n > 0) and the `n - p` ranks beyond it.
fn pow2_split(n: usize) -> (usize, usize) {
    let p = 1usize << (usize::BITS - 1 - n.max(1).leading_zeros());
    (p, n - p)
}

/// Copies arriving bytes into `dst`.
fn copy_sink(dst: &mut [u8]) -> impl FnMut(usize, &[u8]) + Send + '_ {
    move |off, chunk| dst[off..off + chunk.len()].copy_from_slice(chunk)
}

/// Reduces arriving bytes into `dst`.
fn reduce_sink(dst: &mut [u8], dtype: DType, op: ReduceOp) -> impl FnMut(usize, &[u8]) + Send + '_ {
    move |off, chunk| reduce_bytes(dtype, op, &mut dst[off..off + chunk.len()], chunk)
}

impl Communicator {
    fn with_scratch<R>(&self, len: usize, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        let mut s = self.inner.scratch.lock().map_err(|_| Error::Closed("scratch lock poisoned".into()))?;
        if s.len() * 8 < len {
            s.resize(len.div_ceil(8), 0);
        }
        let buf: &mut [u8] = bytemuck::cast_slice_mut(s.as_mut_slice());
        Ok(f(&mut buf[..len]))
    }

    /// The algorithm an all-reduce of `len` bytes uses under `algo`.
    pub fn choose_all_reduce(&self, len: usize, algo: Algo) -> Algo {
        match algo {
            Algo::Auto => {
                let hosts = self.host_count();
                if len <= self.inner.cfg.small_bytes {
                    Algo::Tree
                } else if hosts > 1 && hosts < self.size() {
                    Algo::Hier
                } else if self.size() >= 3 && len <= RHD_MAX_BYTES && self.all_links_shared_memory() {
                    Algo::HalvingDoubling
                } else {
                    Algo::Ring
                }
            }
            a => a,
        }
    }

    /// True when no link of this rank goes over TCP.
    fn all_links_shared_memory(&self) -> bool {
        (0..self.size()).all(|q| !matches!(self.link_kind(q), Some(TransportKind::Tcp)))
    }

    fn host_count(&self) -> usize {
        let mut h: Vec<&String> = self.inner.hosts.iter().collect();
        h.sort();
        h.dedup();
        h.len()
    }

    // ---------------- all-reduce ----------------

    /// Sums (or min/max/prod/avg) `buf` element-wise across all ranks, in place.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_bytes(as_bytes_mut(buf), T::DTYPE, op, self.inner.cfg.algo)
    }

    /// [`Self::all_reduce`] with an explicit algorithm.
    pub fn all_reduce_with<T: Element>(&self, buf: &mut [T], op: ReduceOp, algo: Algo) -> Result<()> {
        self.all_reduce_bytes(as_bytes_mut(buf), T::DTYPE, op, algo)
    }

    /// Out-of-place all-reduce: `output = reduce(input)`; `input` is left unchanged.
    pub fn all_reduce_into<T: Element>(&self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<()> {
        if input.len() != output.len() {
            return Err(Error::InvalidArgument(format!(
                "all_reduce_into: input has {} elements, output {}",
                input.len(),
                output.len()
            )));
        }
        output.copy_from_slice(input);
        self.all_reduce(output, op)
    }

    /// Non-blocking all-reduce of an owned buffer; the handle gives it back reduced.
    pub fn all_reduce_async<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Pending<Vec<T>> {
        let (ticket, seq) = (self.ticket(), self.next_coll_seq());
        let algo = self.inner.cfg.algo;
        self.spawn("all_reduce", move |c| {
            c.all_reduce_ticketed(ticket, seq, as_bytes_mut(&mut buf), T::DTYPE, op, algo)?;
            Ok(buf)
        })
    }

    /// Non-blocking all-reduce of owned raw bytes of `dtype`; the handle gives them back reduced.
    pub fn all_reduce_bytes_async(&self, mut buf: Vec<u8>, dtype: DType, op: ReduceOp, algo: Algo) -> Pending<Vec<u8>> {
        let (ticket, seq) = (self.ticket(), self.next_coll_seq());
        self.spawn("all_reduce", move |c| {
            c.all_reduce_ticketed(ticket, seq, &mut buf, dtype, op, algo)?;
            Ok(buf)
        })
    }

    /// All-reduce over raw little-endian bytes of `dtype`.
    pub fn all_reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp, algo: Algo) -> Result<()> {
        let (ticket, seq) = (self.ticket(), self.next_coll_seq());
        self.all_reduce_ticketed(ticket, seq, buf, dtype, op, algo)
    }

    fn all_reduce_ticketed(
        &self,
        ticket: u64,
        seq: u64,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        algo: Algo,
    ) -> Result<()> {
        self.run(ticket, "all_reduce", seq, |ctx| {
            if !buf.len().is_multiple_of(dtype.size()) {
                return Err(Error::InvalidArgument(format!(
                    "buffer of {} bytes is not a whole number of {dtype}",
                    buf.len()
                )));
            }
            let n = self.size();
            if n == 1 {
                return Ok(());
            }
            let comb = op.combining();
            match self.choose_all_reduce(buf.len(), algo) {
                Algo::Tree => self.rd_all_reduce(ctx, buf, dtype, comb)?,
                Algo::Hier => self.hier_all_reduce(buf, dtype, comb)?,
                Algo::HalvingDoubling => self.rhd_all_reduce(ctx, buf, dtype, comb)?,
                _ => self.ring_all_reduce(ctx, buf, dtype, comb)?,
            }
            if op == ReduceOp::Avg {
                finish_avg(dtype, buf, n);
            }
            Ok(())
        })
    }

    /// Ring reduce-scatter: afterwards rank r holds the reduced segment r.
    fn ring_reduce_scatter(&self, ctx: &OpCtx, buf: &mut [u8], dtype: DType, op: ReduceOp, segs: &Segs) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        for s in 0..n - 1 {
            let si = (r + 2 * n - s - 1) % n;
            let ri = (r + 2 * n - s - 2) % n;
            let (sb, rb) = split_pair(buf, segs.get(si), segs.get(ri));
            let len = rb.len();
            let mut sink = reduce_sink(rb, dtype, op);
            self.xchg(ctx, Some((right, sb)), Some((left, len, &mut sink)))?;
        }
        Ok(())
    }

    /// Ring all-gather: rank r starts holding segment r, ends holding all.
    fn ring_all_gather(&self, ctx: &OpCtx, buf: &mut [u8], segs: &Segs) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        for s in 0..n - 1 {
            let si = (r + n - s) % n;
            let ri = (r + 2 * n - s - 1) % n;
            let (sb, rb) = split_pair(buf, segs.get(si), segs.get(ri));
            let len = rb.len();
            let mut sink = copy_sink(rb);
            self.xchg(ctx, Some((right, sb)), Some((left, len, &mut sink)))?;
        }
        Ok(())
    }

    fn byte_segments(&self, len: usize, dtype: DType) -> Segs {
        Segs::Partition { count: len / dtype.size(), n: self.size(), esize: dtype.size() }
    }

    fn ring_all_reduce(&self, ctx: &OpCtx, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let segs = self.byte_segments(buf.len(), dtype);
        self.ring_reduce_scatter(ctx, buf, dtype, op, &segs)?;
        self.ring_all_gather(ctx, buf, &segs)
    }

    /// Recursive doubling; ranks beyond the largest power of two first hand their
    /// data to a partner and get the result back at the end.
    fn rd_all_reduce(&self, ctx: &OpCtx, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let (p, extra) = pow2_split(self.size());
        let len = buf.len();
        if let Some(v) = self.fold_extra(ctx, buf, dtype, op, extra)? {
            let real = |v: usize| if v < extra { v * 2 } else { v + extra };
            self.with_scratch(len, |tmp| -> Result<()> {
                let mut mask = 1;
                while mask < p {
                    let partner = real(v ^ mask);
                    {
                        let mut sink = copy_sink(tmp);
                        self.xchg(ctx, Some((partner, buf)), Some((partner, len, &mut sink)))?;
                    }
                    reduce_bytes(dtype, op, buf, tmp);
                    mask <<= 1;
                }
                Ok(())
            })??;
        }
        self.unfold_extra(ctx, buf, extra)
    }

    /// Folds the ranks beyond the largest power of two in: among the first
    /// `2*extra` ranks, odd ones give their data to the even one below, which
    /// reduces it in as it arrives. Returns this rank's virtual rank among the
    /// power of two, or `None` for a rank that folded out.
    fn fold_extra(
        &self,
        ctx: &OpCtx,
        buf: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        extra: usize,
    ) -> Result<Option<usize>> {
        let r = self.rank();
        if r >= 2 * extra {
            return Ok(Some(r - extra));
        }
        if r % 2 == 1 {
            self.xchg(ctx, Some((r - 1, buf)), None)?;
            return Ok(None);
        }
        let len = buf.len();
        let mut sink = reduce_sink(buf, dtype, op);
        self.xchg(ctx, None, Some((r + 1, len, &mut sink)))?;
        Ok(Some(r / 2))
    }

    /// Hands the result back to the ranks that [`Self::fold_extra`] folded out.
    fn unfold_extra(&self, ctx: &OpCtx, buf: &mut [u8], extra: usize) -> Result<()> {
        let r = self.rank();
        if r < 2 * extra {
            if r % 2 == 1 {
                let len = buf.len();
                let mut sink = copy_sink(buf);
                self.xchg(ctx, None, Some((r - 1, len, &mut sink)))?;
            } else {
                self.xchg(ctx, Some((r + 1, buf)), None)?;
            }
        }
        Ok(())
    }

    /// Rabenseifner: reduce-scatter by recursive halving, then all-gather by
    /// recursive doubling, over the largest power of two `p <= n` ranks (the extra
    /// ranks fold in first and get the result back at the end, as in
    /// [`Self::rd_all_reduce`]). The elements are split into `p` blocks
    /// ([`segment`] of the element count); at halving step `m = p/2, ..., 1` a
    /// virtual rank `v` keeps the half of its current window of blocks on its side
    /// of bit `m`, sends the other half to `v ^ m` and reduces the partner's copy of
    /// the kept half straight into `buf` as it arrives. Afterwards `v` holds block
    /// `v` fully reduced; each block is reduced on exactly one rank and then only
    /// copied, so every rank ends with identical bits. The doubling steps run in
    /// reverse, each exchanging the whole current window. No scratch is needed:
    /// the half sent and the half received never overlap.
    fn rhd_all_reduce(&self, ctx: &OpCtx, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let (p, extra) = pow2_split(self.size());
        let len = buf.len();
        let (es, count) = (dtype.size(), len / dtype.size());
        let vrank = self.fold_extra(ctx, buf, dtype, op, extra)?;
        if let Some(v) = vrank {
            let real = |v: usize| if v < extra { v * 2 } else { v + extra };
            // Byte range of blocks `a..b` (the start of block i is `segment(count, p, i).start`).
            let (base, rem) = (count / p, count % p);
            let start = |i: usize| (i * base + i.min(rem)) * es;
            let blocks = |a: usize, b: usize| start(a)..start(b);
            // Reduce-scatter: the window [lo, lo + 2m) halves at every step.
            let mut lo = 0;
            let mut m = p / 2;
            while m > 0 {
                let partner = real(v ^ m);
                let (keep, give) = if v & m == 0 {
                    (blocks(lo, lo + m), blocks(lo + m, lo + 2 * m))
                } else {
                    (blocks(lo + m, lo + 2 * m), blocks(lo, lo + m))
                };
                if v & m != 0 {
                    lo += m;
                }
                if !(keep.is_empty() && give.is_empty()) {
                    let (sb, rb) = split_pair(buf, give, keep);
                    let rlen = rb.len();
                    let mut sink = reduce_sink(rb, dtype, op);
                    self.xchg(ctx, Some((partner, sb)), Some((partner, rlen, &mut sink)))?;
                }
                m >>= 1;
            }
            // All-gather: the window [lo, lo + m) doubles at every step.
            let mut m = 1;
            while m < p {
                let partner = real(v ^ m);
                let theirs = lo ^ m;
                let (mine, other) = (blocks(lo, lo + m), blocks(theirs, theirs + m));
                if !(mine.is_empty() && other.is_empty()) {
                    let (sb, rb) = split_pair(buf, mine, other);
                    let rlen = rb.len();
                    let mut sink = copy_sink(rb);
                    self.xchg(ctx, Some((partner, sb)), Some((partner, rlen, &mut sink)))?;
                }
                lo &= !m;
                m <<= 1;
            }
        }
        self.unfold_extra(ctx, buf, extra)
    }

    fn hier(&self) -> Result<&Hier> {
        let h = self.inner.hier.get_or_init(|| {
            (|| -> Result<Hier> {
                let mut hosts: Vec<&String> = self.inner.hosts.iter().collect();
                hosts.sort();
                hosts.dedup();
                let mine = &self.inner.hosts[self.rank()];
                let colour = hosts.iter().position(|h| *h == mine).unwrap_or(0) as u32;
                let local = self
                    .split(Some(colour), self.rank() as i64)?
                    .ok_or_else(|| Error::Closed("no local group".into()))?;
                let leader = local.rank() == 0;
                let leaders = self.split(leader.then_some(0), self.rank() as i64)?;
                Ok(Hier { local, leaders })
            })()
            .map_err(|e| e.to_string())
        });
        h.as_ref().map_err(|e| Error::Closed(format!("building the hierarchical sub-communicators failed: {e}")))
    }

    /// Reduce inside each host, all-reduce among the hosts' leaders, broadcast inside each host. A buffer of more
    /// than one [`HIER_SEGMENT`] goes through the three phases segment by segment, so that one segment crosses
    /// between hosts (on the leaders' communicator, in the background) while the next is reduced and the one before
    /// is broadcast inside the host: the slow link never waits for the host's own work. Every rank of a host runs
    /// the same sequence on the host's communicator — reduce 0, reduce 1, broadcast 0, reduce 2, broadcast 1, … —
    /// so the order of its operations is the same everywhere.
    fn hier_all_reduce(&self, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let h = self.hier()?;
        let seg = (HIER_SEGMENT / dtype.size()).max(1) * dtype.size();
        if buf.len() <= seg || h.local.size() == 1 {
            h.local.reduce_bytes(buf, dtype, op, 0)?;
            if let Some(leaders) = &h.leaders {
                leaders.all_reduce_bytes(buf, dtype, op, Algo::Auto)?;
            }
            return h.local.broadcast_bytes(buf, 0);
        }
        let len = buf.len();
        let range = |i: usize| i * seg..((i + 1) * seg).min(len);
        let segments = len.div_ceil(seg);
        let mut crossing: std::collections::VecDeque<Pending<Vec<u8>>> = std::collections::VecDeque::new();
        let finish = |buf: &mut [u8], i: usize, crossing: &mut std::collections::VecDeque<Pending<Vec<u8>>>| {
            if let Some(p) = crossing.pop_front() {
                buf[range(i)].copy_from_slice(&p.wait()?);
            }
            h.local.broadcast_bytes(&mut buf[range(i)], 0)
        };
        for i in 0..segments {
            h.local.reduce_bytes(&mut buf[range(i)], dtype, op, 0)?;
            if let Some(leaders) = &h.leaders {
                crossing.push_back(leaders.all_reduce_bytes_async(buf[range(i)].to_vec(), dtype, op, Algo::Auto));
            }
            if i > 0 {
                finish(buf, i - 1, &mut crossing)?;
            }
        }
        finish(buf, segments - 1, &mut crossing)
    }

    // ---------------- broadcast ----------------

    /// Copies `root`'s buffer to every rank.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast_bytes(as_bytes_mut(buf), root)
    }

    /// Non-blocking broadcast of an owned buffer.
    pub fn broadcast_async<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Pending<Vec<T>> {
        let (ticket, seq) = (self.ticket(), self.next_coll_seq());
        self.spawn("broadcast", move |c| {
            c.broadcast_ticketed(ticket, seq, as_bytes_mut(&mut buf), root)?;
            Ok(buf)
        })
    }

    /// Broadcast of raw bytes.
    pub fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<()> {
        let (ticket, seq) = (self.ticket(), self.next_coll_seq());
        self.broadcast_ticketed(ticket, seq, buf, root)
    }

    fn broadcast_ticketed(&self, ticket: u64, seq: u64, buf: &mut [u8], root: usize) -> Result<()> {
        self.run(ticket, "broadcast", seq, |ctx| {
            check_root(root, self.size())?;
            if self.size() == 1 {
                return Ok(());
            }
            let algo = match self.inner.cfg.algo {
                Algo::Auto | Algo::Hier | Algo::HalvingDoubling if buf.len() <= self.inner.cfg.small_bytes => {
                    Algo::Tree
                }
                Algo::Auto | Algo::Hier | Algo::HalvingDoubling => Algo::Ring,
                a => a,
            };
            if algo == Algo::Tree { self.tree_broadcast(ctx, buf, root) } else { self.chain_broadcast(ctx, buf, root) }
        })
    }

    fn tree_broadcast(&self, ctx: &OpCtx, buf: &mut [u8], root: usize) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let v = (r + n - root) % n;
        let real = |v: usize| (v + root) % n;
        let len = buf.len();
        let mut mask = 1;
        while mask < n {
            if v & mask != 0 {
                let mut sink = copy_sink(buf);
                self.xchg(ctx, None, Some((real(v - mask), len, &mut sink)))?;
                break;
            }
            mask <<= 1;
        }
        mask >>= 1;
        while mask > 0 {
            if v + mask < n {
                self.xchg(ctx, Some((real(v + mask), buf)), None)?;
            }
            mask >>= 1;
        }
        Ok(())
    }

    /// Pipelined chain root -> root+1 -> ...: while forwarding chunk i to the next
    /// rank, receive chunk i+1 from the previous one.
    fn chain_broadcast(&self, ctx: &OpCtx, buf: &mut [u8], root: usize) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let v = (r + n - root) % n;
        let (prev, next) = ((r + n - 1) % n, (r + 1) % n);
        let has_next = v + 1 < n;
        let k = chunk_count(buf.len(), BCAST_CHUNK);
        let len = buf.len();
        let cs = |i: usize| chunk_range(len, BCAST_CHUNK, i);
        for i in 0..=k {
            // The root sends chunk i; every other rank receives chunk i and forwards
            // chunk i-1, so each rank runs one chunk behind the previous one.
            let send = if v == 0 { (i < k).then(|| cs(i)) } else { (has_next && i > 0).then(|| cs(i - 1)) };
            let recv = (v > 0 && i < k).then(|| cs(i));
            match (send, recv) {
                (Some(s), Some(rr)) => {
                    let (sb, rb) = split_pair(buf, s, rr);
                    let len = rb.len();
                    let mut sink = copy_sink(rb);
                    self.xchg(ctx, Some((next, sb)), Some((prev, len, &mut sink)))?;
                }
                (Some(s), None) => self.xchg(ctx, Some((next, &buf[s])), None)?,
                (None, Some(rr)) => {
                    let len = rr.len();
                    let mut sink = copy_sink(&mut buf[rr]);
                    self.xchg(ctx, None, Some((prev, len, &mut sink)))?;
                }
                (None, None) => {}
            }
        }
        Ok(())
    }

    // ---------------- reduce ----------------

    /// Reduces every rank's `buf` into `root`'s `buf`; other ranks' buffers are unchanged.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.reduce_bytes(as_bytes_mut(buf), T::DTYPE, op, root)
    }

    /// Reduce of raw bytes.
    pub fn reduce_bytes(&self, buf: &mut [u8], dtype: DType, op: ReduceOp, root: usize) -> Result<()> {
        let (ticket, seq) = (self.ticket(), self.next_coll_seq());
        self.run(ticket, "reduce", seq, |ctx| {
            check_root(root, self.size())?;
            if !buf.len().is_multiple_of(dtype.size()) {
                return Err(Error::InvalidArgument(format!(
                    "buffer of {} bytes is not a whole number of {dtype}",
                    buf.len()
                )));
            }
            let n = self.size();
            if n == 1 {
                return Ok(());
            }
            let comb = op.combining();
            let small = matches!(self.inner.cfg.algo, Algo::Tree)
                || (!matches!(self.inner.cfg.algo, Algo::Ring) && buf.len() <= self.inner.cfg.small_bytes);
            if self.rank() == root {
                if small {
                    self.tree_reduce(ctx, buf, dtype, comb, root)?
                } else {
                    self.ring_reduce(ctx, buf, dtype, comb, root)?
                }
                if op == ReduceOp::Avg {
                    finish_avg(dtype, buf, n);
                }
                Ok(())
            } else {
                // Work on a copy so the caller's buffer stays as it was.
                self.with_work_copy(buf, |w| {
                    if small {
                        self.tree_reduce(ctx, w, dtype, comb, root)
                    } else {
                        self.ring_reduce(ctx, w, dtype, comb, root)
                    }
                })?
            }
        })
    }

    fn with_work_copy<R>(&self, src: &[u8], f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        // The scratch buffer is free here: tree_reduce needs its own temporary, so
        // the work copy is a separate, reused allocation.
        thread_local! {
            static WORK: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        WORK.with(|w| {
            let mut w = w.borrow_mut();
            if w.len() * 8 < src.len() {
                w.resize(src.len().div_ceil(8), 0);
            }
            let b: &mut [u8] = bytemuck::cast_slice_mut(w.as_mut_slice());
            let b = &mut b[..src.len()];
            b.copy_from_slice(src);
            Ok(f(b))
        })
    }

    fn tree_reduce(&self, ctx: &OpCtx, buf: &mut [u8], dtype: DType, op: ReduceOp, root: usize) -> Result<()> {
        let (n, r) = (self.size(), self.rank());
        let v = (r + n - root) % n;
        let real = |v: usize| (v + root) % n;
        let len = buf.len();
        self.with_scratch(len, |tmp| -> Result<()> {
            let mut mask = 1;
            while mask < n {
                if v & mask == 0 {
                    let src = v | mask;
                    if src < n {
                        {
                            let mut sink = copy_sink(tmp);
                            self.xchg(ctx, None, Some((real(src), len, &mut sink)))?;
                        }
                        reduce_bytes(dtype, op, buf, tmp);
                    }
                } else {
                    self.xchg(ctx, Some((real(v & !mask), buf)), None)?;
                    break;
                }
                mask <<= 1;
            }
            Ok(())
        })?
    }

    fn ring_reduce(&self, ctx: &OpCtx, buf: &mut [u8], dtype: DType, op: ReduceOp, root: usize) -> Result<()> {
        let segs = self.byte_segments(buf.len(), dtype);
        self.ring_reduce_scatter(ctx, buf, dtype, op, &segs)?;
        let r = self.rank();
        if r == root {
            for q in (0..self.size()).filter(|&q| q != root) {
                let seg = segs.get(q);
                let len = seg.len();
                let mut sink = copy_sink(&mut buf[seg]);
                self.xchg(ctx, None, Some((q, len, &mut sink)))?;
            }
        } else {
            self.xchg(ctx, Some((root, &buf[segs.get(r)])), None)?;
        }
        Ok(())
    }

    // ---------------- all-gather / reduce-scatter ----------------

    /// Gathers every rank's `input` into `output` (`size * input.len()` elements, rank order).
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.all_gather_bytes(as_bytes(input), as_bytes_mut(output))
    }

    /// Non-blocking all-gather; the handle gives back the gathered buffer.
    pub fn all_gather_async<T: Element>(&self, input: Vec<T>) -> Pending<Vec<T>> {
        let (ticket, seq) = (self.ticket(), self.next_coll_seq());
        let n = self.size();
        self.spawn("all_gather", move |c| {
            let mut out = vec![T::zeroed(); input.len() * n];
            c.all_gather_ticketed(ticket, seq, as_bytes(&input), as_bytes_mut(&mut out))?;
            Ok(out)
        })
    }

    /// All-gather of raw bytes.
    pub fn all_gather_bytes(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        let (ticket, seq) = (self.ticket(), self.next_coll_seq());
        self.all_gather_ticketed(ticket, seq, input, output)
    }

    fn all_gather_ticketed(&self, ticket: u64, seq: u64, input: &[u8], output: &mut [u8]) -> Result<()> {
        self.run(ticket, "all_gather", seq, |ctx| {
            let (n, m) = (self.size(), input.len());
            if output.len() != n * m {
                return Err(Error::InvalidArgument(format!(
                    "all_gather: output has {} bytes, expected {n} ranks x {m}",
                    output.len()
                )));
            }
            let r = self.rank();
            output[r * m..(r + 1) * m].copy_from_slice(input);
            let segs = Segs::Equal { len: m };
            if n > 1 { self.ring_all_gather(ctx, output, &segs) } else { Ok(()) }
        })
    }

    /// Sends segment `j` of `input` (`size` equal segments, rank order) to rank `j` and puts what rank `i` sent to
    /// this rank in segment `i` of `output` (as long as `input`): a personalised exchange, `size - 1` rounds of
    /// one send and one receive each, in which every rank sends to the rank `d` after it and hears from the rank
    /// `d` before it.
    pub fn all_to_all_bytes(&self, input: &[u8], output: &mut [u8]) -> Result<()> {
        let (ticket, seq) = (self.ticket(), self.next_coll_seq());
        self.run(ticket, "all_to_all", seq, |ctx| {
            let (n, r) = (self.size(), self.rank());
            if !input.len().is_multiple_of(n) || output.len() != input.len() {
                return Err(Error::InvalidArgument(format!(
                    "all_to_all: input of {} bytes is not {n} equal segments, or output ({} bytes) differs",
                    input.len(),
                    output.len()
                )));
            }
            let m = input.len() / n;
            output[r * m..(r + 1) * m].copy_from_slice(&input[r * m..(r + 1) * m]);
            for d in 1..n {
                let (to, from) = ((r + d) % n, (r + n - d) % n);
                let mut sink = copy_sink(&mut output[from * m..(from + 1) * m]);
                self.xchg(ctx, Some((to, &input[to * m..(to + 1) * m])), Some((from, m, &mut sink)))?;
            }
            Ok(())
        })
    }

    /// Reduces `input` across ranks and leaves rank r's segment of the result in
    /// `output`; segments follow [`crate::chunk::partition`] of `input.len()`, so
    /// any length works (`output.len()` must equal `segment(len, size, rank).len()`).
    pub fn reduce_scatter<T: Element>(&self, input: &[T], output: &mut [T], op: ReduceOp) -> Result<()> {
        self.reduce_scatter_bytes(as_bytes(input), as_bytes_mut(output), T::DTYPE, op)
    }

    /// Non-blocking reduce-scatter; the handle gives back this rank's segment.
    pub fn reduce_scatter_async<T: Element>(&self, input: Vec<T>, op: ReduceOp) -> Pending<Vec<T>> {
        let (ticket, seq) = (self.ticket(), self.next_coll_seq());
        let seg = segment(input.len(), self.size(), self.rank());
        self.spawn("reduce_scatter", move |c| {
            let mut out = vec![T::zeroed(); seg.len()];
            c.reduce_scatter_ticketed(ticket, seq, as_bytes(&input), as_bytes_mut(&mut out), T::DTYPE, op)?;
            Ok(out)
        })
    }

    /// Reduce-scatter of raw bytes.
    pub fn reduce_scatter_bytes(&self, input: &[u8], output: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let (ticket, seq) = (self.ticket(), self.next_coll_seq());
        self.reduce_scatter_ticketed(ticket, seq, input, output, dtype, op)
    }

    fn reduce_scatter_ticketed(
        &self,
        ticket: u64,
        seq: u64,
        input: &[u8],
        output: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.run(ticket, "reduce_scatter", seq, |ctx| {
            let es = dtype.size();
            if !input.len().is_multiple_of(es) {
                return Err(Error::InvalidArgument(format!(
                    "input of {} bytes is not a whole number of {dtype}",
                    input.len()
                )));
            }
            let segs = self.byte_segments(input.len(), dtype);
            let mine = segs.get(self.rank());
            if output.len() != mine.len() {
                return Err(Error::InvalidArgument(format!(
                    "reduce_scatter: output has {} bytes, rank {}'s segment of {} input bytes has {}",
                    output.len(),
                    self.rank(),
                    input.len(),
                    mine.len()
                )));
            }
            if self.size() == 1 {
                output.copy_from_slice(input);
                return Ok(());
            }
            self.with_work_copy(input, |w| -> Result<()> {
                self.ring_reduce_scatter(ctx, w, dtype, op.combining(), &segs)?;
                output.copy_from_slice(&w[mine.clone()]);
                Ok(())
            })??;
            if op == ReduceOp::Avg {
                finish_avg(dtype, output, self.size());
            }
            Ok(())
        })
    }

    // ---------------- barrier, send, recv ----------------

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        let (ticket, seq) = (self.ticket(), self.next_coll_seq());
        self.run(ticket, "barrier", seq, |ctx| {
            let (n, r) = (self.size(), self.rank());
            let mut dist = 1;
            while dist < n {
                let mut sink = |_: usize, _: &[u8]| {};
                self.xchg(ctx, Some(((r + dist) % n, &[])), Some(((r + n - dist) % n, 0, &mut sink)))?;
                dist <<= 1;
            }
            Ok(())
        })
    }

    /// Sends `buf` to `peer`, which must call [`Self::recv`] with the same length.
    pub fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        self.check_peer(peer)?;
        let (ticket, seq) = (self.ticket(), self.next_p2p_seq(peer, true));
        self.run(ticket, "send", seq, |ctx| self.xchg(ctx, Some((peer, as_bytes(buf))), None))
    }

    /// Receives `buf.len()` elements from `peer`.
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        self.check_peer(peer)?;
        let (ticket, seq) = (self.ticket(), self.next_p2p_seq(peer, false));
        self.run(ticket, "recv", seq, |ctx| {
            let b = as_bytes_mut(buf);
            let len = b.len();
            let mut sink = copy_sink(b);
            self.xchg(ctx, None, Some((peer, len, &mut sink)))
        })
    }

    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.size() || peer == self.rank() {
            return Err(Error::InvalidArgument(format!(
                "rank {} cannot exchange messages with rank {peer} (size {})",
                self.rank(),
                self.size()
            )));
        }
        Ok(())
    }
}
