//! Shared-memory and in-process transports: per ordered pair of ranks, one
//! single-producer single-consumer ring of fixed-size slots.
//!
//! Layout. Every rank owns one *segment* (its inbox): a control block followed by
//! one channel per local sender. A channel is two counters (`head`, written only by
//! the producer; `tail`, written only by the consumer), each on its own cache line,
//! and `slots` slots of `slot_bytes` payload with a small header (operation
//! sequence number, length, last-chunk flag, the sender's [`Timing`] of
//! [`crate::arrival`]). The producer copies straight into
//! the receiver's slot; the receiver reduces or copies straight out of it: one copy
//! per hop and no kernel in the data path.
//!
//! Wake-ups. Each control block has a futex word, the *doorbell*. Whoever changes a
//! channel (publishes a slot, frees one) bumps the doorbell of the rank on the other
//! side and wakes it if it sleeps. A waiting rank spins briefly, yields, then sleeps
//! on its own doorbell in slices of at most 50 ms, checking its deadline and the
//! liveness of the peers it waits on between slices. So one rank never waits on two
//! futexes, and a dead peer is noticed within ~100 ms.
//!
//! The same code runs over `/dev/shm` mappings ([`TransportKind::Shm`], between
//! processes) and over heap memory ([`TransportKind::InProc`], between threads).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::arrival::{Timing, now_ns};
use crate::error::{Error, Result};
use crate::transport::{OpCtx, RecvReq, SendReq, Transport, TransportKind};

const CONTROL_BYTES: usize = 256;
const CHAN_HEADER_BYTES: usize = 128;
const SLOT_HEADER_BYTES: usize = 64;
const SEGMENT_MAGIC: u64 = 0x5348_4f41_4c52_4e47; // "SHOALRNG"
const FLAG_LAST: u32 = 1;
/// Polls of an exchange that find nothing before a wait counts for the arrival record (a few microseconds).
const QUICK_POLLS: u32 = 256;

/// Sizes of the slot rings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingConfig {
    /// Payload bytes per slot (multiple of 64).
    pub slot_bytes: usize,
    /// Slots per channel.
    pub slots: usize,
    /// Busy-wait iterations before yielding and sleeping.
    pub spin: u32,
}

impl Default for RingConfig {
    fn default() -> Self {
        RingConfig { slot_bytes: 64 << 10, slots: 16, spin: 20_000 }
    }
}

impl RingConfig {
    /// Bytes of one rank's segment for `local` ranks on the host.
    pub fn segment_bytes(&self, local: usize) -> usize {
        CONTROL_BYTES + local * self.channel_bytes()
    }

    fn channel_bytes(&self) -> usize {
        CHAN_HEADER_BYTES + self.slots * (SLOT_HEADER_BYTES + self.slot_bytes)
    }

    /// Checks the sizes; slot payloads stay 64-byte aligned so every element type
    /// can be read in place.
    pub fn validate(&self) -> Result<()> {
        if self.slot_bytes == 0 || !self.slot_bytes.is_multiple_of(64) || self.slots < 2 || self.slots > 1 << 20 {
            return Err(Error::InvalidArgument(format!(
                "ring slots must be a non-zero multiple of 64 bytes and at least 2 per channel (got {} x {})",
                self.slots, self.slot_bytes
            )));
        }
        Ok(())
    }
}

/// Memory that holds a segment: a `/dev/shm` mapping or a heap block.
pub trait Region: Send + Sync + std::fmt::Debug {
    fn base(&self) -> *mut u8;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A zeroed, page-aligned heap block shared by threads of one process.
#[derive(Debug)]
pub struct HeapRegion {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the block is only accessed through atomics and the slot protocol, which
// hands each slot to exactly one side at a time.
unsafe impl Send for HeapRegion {}
unsafe impl Sync for HeapRegion {}

impl HeapRegion {
    pub fn new(len: usize) -> Result<HeapRegion> {
        let layout = std::alloc::Layout::from_size_align(len.max(64), 4096)
            .map_err(|e| Error::InvalidArgument(format!("segment of {len} bytes: {e}")))?;
        // SAFETY: the layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::io(
                "allocating an in-process segment",
                std::io::Error::from(std::io::ErrorKind::OutOfMemory),
            ));
        }
        Ok(HeapRegion { ptr, len: len.max(64) })
    }
}

impl Drop for HeapRegion {
    fn drop(&mut self) {
        if let Ok(layout) = std::alloc::Layout::from_size_align(self.len, 4096) {
            // SAFETY: allocated in `new` with this layout.
            unsafe { std::alloc::dealloc(self.ptr, layout) }
        }
    }
}

impl Region for HeapRegion {
    fn base(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// A mapping of a segment file under `/dev/shm`.
#[derive(Debug)]
pub struct ShmRegion {
    map: memmap2::MmapRaw,
}

impl ShmRegion {
    /// Creates (exclusively) and maps a zero-filled file of `len` bytes.
    pub fn create(path: &std::path::Path, len: usize) -> Result<ShmRegion> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| Error::io(format!("creating shared-memory segment {}", path.display()), e))?;
        file.set_len(len as u64).map_err(|e| Error::io(format!("sizing {} to {len} bytes", path.display()), e))?;
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| Error::io(format!("mapping {}", path.display()), e))?;
        Ok(ShmRegion { map })
    }

    /// Maps an existing segment file, checking its size.
    pub fn open(path: &std::path::Path, len: usize) -> Result<ShmRegion> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| Error::io(format!("opening shared-memory segment {}", path.display()), e))?;
        let actual = file.metadata().map_err(|e| Error::io(format!("stat {}", path.display()), e))?.len();
        if actual != len as u64 {
            return Err(Error::InvalidArgument(format!(
                "shared-memory segment {} has {actual} bytes, expected {len} (ranks disagree on ring sizes?)",
                path.display()
            )));
        }
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| Error::io(format!("mapping {}", path.display()), e))?;
        Ok(ShmRegion { map })
    }
}

impl Region for ShmRegion {
    fn base(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
    fn len(&self) -> usize {
        self.map.len()
    }
}

/// Views into one rank's segment.
#[derive(Debug, Clone)]
struct Segment {
    region: Arc<dyn Region>,
}

impl Segment {
    fn at<T>(&self, off: usize) -> &T {
        debug_assert!(off + std::mem::size_of::<T>() <= self.region.len());
        // SAFETY: offsets are computed from the validated layout and aligned (all
        // multiples of 64 from a page-aligned base); the fields are atomics.
        unsafe { &*(self.region.base().add(off) as *const T) }
    }
    fn magic(&self) -> &AtomicU64 {
        self.at(0)
    }
    fn doorbell(&self) -> &AtomicU32 {
        self.at(8)
    }
    fn sleeping(&self) -> &AtomicU32 {
        self.at(12)
    }
    fn pid(&self) -> &AtomicU32 {
        self.at(16)
    }
    fn alive(&self) -> &AtomicU32 {
        self.at(20)
    }
    fn progress(&self) -> &AtomicU64 {
        self.at(24)
    }

    fn ring(&self) {
        self.doorbell().fetch_add(1, Ordering::SeqCst);
        if self.sleeping().load(Ordering::SeqCst) != 0 {
            let _ = rustix::thread::futex::wake(self.doorbell(), rustix::thread::futex::Flags::empty(), 1);
        }
    }
}

/// A channel (sender `from` into the owner's segment).
#[derive(Clone, Copy)]
struct Chan {
    base: *mut u8,
    cfg: RingConfig,
}

impl Chan {
    fn head(&self) -> &AtomicU32 {
        // SAFETY: inside the channel header, 64-byte aligned.
        unsafe { &*(self.base as *const AtomicU32) }
    }
    fn tail(&self) -> &AtomicU32 {
        // SAFETY: second cache line of the channel header.
        unsafe { &*(self.base.add(64) as *const AtomicU32) }
    }
    fn slot(&self, i: u32) -> *mut u8 {
        let idx = i as usize % self.cfg.slots;
        // SAFETY: idx < slots, so the slot lies inside the channel.
        unsafe { self.base.add(CHAN_HEADER_BYTES + idx * (SLOT_HEADER_BYTES + self.cfg.slot_bytes)) }
    }
}

/// The shared-memory / in-process transport of one communicator.
#[derive(Debug)]
pub struct RingTransport {
    kind: TransportKind,
    cfg: RingConfig,
    /// Communicator rank -> index among the ranks that share memory with us.
    local_of: Vec<Option<usize>>,
    /// Local index -> communicator rank.
    ranks: Vec<usize>,
    me: usize,
    segs: Vec<Segment>,
    /// Local index -> process id (0 for threads).
    pids: Vec<u32>,
}

impl Drop for RingTransport {
    fn drop(&mut self) {
        self.leave();
    }
}

impl RingTransport {
    /// Marks this rank's segment closed and wakes every peer, which then sees it gone.
    fn leave(&self) {
        self.segs[self.me].alive().store(0, Ordering::SeqCst);
        for (i, s) in self.segs.iter().enumerate() {
            if i != self.me {
                s.ring();
            }
        }
    }
}

impl RingTransport {
    /// Initialises this rank's own segment (before publishing it to peers).
    pub fn init_own_segment(region: &dyn Region, cfg: &RingConfig, local: usize) -> Result<()> {
        if region.len() < cfg.segment_bytes(local) {
            return Err(Error::InvalidArgument("segment smaller than its layout".into()));
        }
        let seg = Segment { region: Arc::new(RegionRef(region.base(), region.len())) };
        seg.pid().store(std::process::id(), Ordering::SeqCst);
        seg.alive().store(1, Ordering::SeqCst);
        seg.progress().store(0, Ordering::SeqCst);
        seg.magic().store(SEGMENT_MAGIC, Ordering::SeqCst);
        Ok(())
    }

    /// Builds the transport from every local rank's segment (index = local index).
    /// `ranks[i]` is the communicator rank of local index `i`; `me` is ours.
    pub fn new(
        kind: TransportKind,
        cfg: RingConfig,
        size: usize,
        ranks: Vec<usize>,
        me: usize,
        regions: Vec<Arc<dyn Region>>,
    ) -> Result<RingTransport> {
        cfg.validate()?;
        let mut cfg = cfg;
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        if ranks.len() > cpus {
            // More ranks than cores: spinning would steal the core a peer needs.
            cfg.spin = cfg.spin.min(64);
        }
        let local = ranks.len();
        if regions.len() != local || me >= local {
            return Err(Error::InvalidArgument("one segment per local rank is required".into()));
        }
        let mut local_of = vec![None; size];
        for (i, &r) in ranks.iter().enumerate() {
            if r >= size {
                return Err(Error::InvalidArgument(format!("rank {r} out of range for size {size}")));
            }
            local_of[r] = Some(i);
        }
        let mut segs = Vec::with_capacity(local);
        let mut pids = Vec::with_capacity(local);
        for (i, region) in regions.into_iter().enumerate() {
            if region.len() < cfg.segment_bytes(local) {
                return Err(Error::InvalidArgument(format!("segment of local rank {i} is too small")));
            }
            let seg = Segment { region };
            if seg.magic().load(Ordering::SeqCst) != SEGMENT_MAGIC {
                return Err(Error::Protocol {
                    peer: format!("rank {}", ranks[i]),
                    detail: "shared-memory segment is not initialised".into(),
                });
            }
            pids.push(if kind == TransportKind::Shm { seg.pid().load(Ordering::SeqCst) } else { 0 });
            segs.push(seg);
        }
        Ok(RingTransport { kind, cfg, local_of, ranks, me, segs, pids })
    }

    fn chan(&self, from: usize, to: usize) -> Chan {
        let seg = &self.segs[to];
        // SAFETY: the segment holds `local` channels (checked in `new`).
        let base = unsafe { seg.region.base().add(CONTROL_BYTES + from * self.cfg.channel_bytes()) };
        Chan { base, cfg: self.cfg }
    }

    fn local(&self, peer: usize, op: &OpCtx) -> Result<usize> {
        self.local_of.get(peer).copied().flatten().filter(|&l| l != self.me).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{} #{}: rank {peer} is not reachable over {}",
                op.name,
                op.seq,
                self.kind.name()
            ))
        })
    }

    /// Why a local peer is gone, if it is.
    fn dead(&self, l: usize) -> Option<String> {
        if self.segs[l].alive().load(Ordering::SeqCst) == 0 {
            return Some("it closed its communicator".into());
        }
        let pid = self.pids[l];
        if pid != 0 && pid != std::process::id() {
            match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                Err(_) => return Some(format!("process {pid} has exited")),
                Ok(stat) => {
                    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
                    if matches!(state, Some('Z') | Some('X')) {
                        return Some(format!("process {pid} has exited"));
                    }
                }
            }
        }
        None
    }
}

/// A non-owning view of a region (used only while initialising our own segment).
#[derive(Debug)]
struct RegionRef(*mut u8, usize);
// SAFETY: used transiently on the creating thread only.
unsafe impl Send for RegionRef {}
unsafe impl Sync for RegionRef {}
impl Region for RegionRef {
    fn base(&self) -> *mut u8 {
        self.0
    }
    fn len(&self) -> usize {
        self.1
    }
}

struct Pusher<'a> {
    chan: Chan,
    to: &'a Segment,
    data: &'a [u8],
    sent: usize,
    started: bool,
    /// What every slot of the message carries for the receiver's arrival record.
    timing: Timing,
}

impl Pusher<'_> {
    fn done(&self) -> bool {
        self.started && self.sent == self.data.len()
    }

    /// Fills as many free slots as there are; returns whether it did anything.
    fn push(&mut self, seq: u64) -> bool {
        let slots = self.chan.cfg.slots as u32;
        let mut head = self.chan.head().load(Ordering::Relaxed);
        let mut progress = false;
        while !self.done() {
            let tail = self.chan.tail().load(Ordering::Acquire);
            if head.wrapping_sub(tail) >= slots {
                break;
            }
            let n = (self.data.len() - self.sent).min(self.chan.cfg.slot_bytes);
            let slot = self.chan.slot(head);
            let last = self.sent + n == self.data.len();
            // SAFETY: the slot is free (head - tail < slots), so only we touch it
            // until we publish it; the payload area holds `slot_bytes` >= n bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(self.data.as_ptr().add(self.sent), slot.add(SLOT_HEADER_BYTES), n);
                (slot as *mut u64).write_volatile(seq);
                (slot.add(8) as *mut u32).write_volatile(n as u32);
                (slot.add(12) as *mut u32).write_volatile(if last { FLAG_LAST } else { 0 });
                (slot.add(16) as *mut u64).write_volatile(self.timing.stamp);
                (slot.add(24) as *mut u64).write_volatile(self.timing.held);
            }
            self.sent += n;
            self.started = true;
            head = head.wrapping_add(1);
            self.chan.head().store(head, Ordering::Release);
            self.to.ring();
            progress = true;
        }
        progress
    }
}

struct Popper<'a, 'b> {
    chan: Chan,
    from: &'a Segment,
    len: usize,
    received: usize,
    finished: bool,
    req: RecvReq<'b>,
    /// When the receive was asked for ([`now_ns`]).
    posted: u64,
    /// Whether it has waited for the message beyond [`QUICK_POLLS`] polls: until then it counts as there when
    /// asked for, and its arrival costs no clock read.
    looked: bool,
}

impl Popper<'_, '_> {
    /// Consumes every published slot; returns whether it did anything.
    fn pop(&mut self, op: &OpCtx) -> Result<bool> {
        let slots = self.chan.cfg.slots as u32;
        let mut tail = self.chan.tail().load(Ordering::Relaxed);
        let mut progress = false;
        while !self.finished {
            let head = self.chan.head().load(Ordering::Acquire);
            if head == tail {
                break;
            }
            if head.wrapping_sub(tail) > slots {
                return Err(self.violation(format!("channel counters are corrupt (head {head}, tail {tail})")));
            }
            let slot = self.chan.slot(tail);
            // SAFETY: the slot was published (tail < head) and is ours until we
            // advance `tail`; the header fields are plain integers.
            let (seq, n, flags) = unsafe {
                (
                    (slot as *const u64).read_volatile(),
                    (slot.add(8) as *const u32).read_volatile() as usize,
                    (slot.add(12) as *const u32).read_volatile(),
                )
            };
            if seq != op.seq {
                return Err(self.violation(format!("chunk of operation #{seq} arrived during {} #{}", op.name, op.seq)));
            }
            let last = flags & FLAG_LAST != 0;
            if n > self.chan.cfg.slot_bytes || self.received + n > self.len || last != (self.received + n == self.len) {
                return Err(self.violation(format!(
                    "chunk of {n} bytes (last: {last}) does not fit a message of {} bytes with {} received",
                    self.len, self.received
                )));
            }
            if self.received == 0 {
                // SAFETY: as above; the timing follows the flags in the slot header.
                let timing = unsafe {
                    Timing {
                        stamp: (slot.add(16) as *const u64).read_volatile(),
                        held: (slot.add(24) as *const u64).read_volatile(),
                    }
                };
                // Found within a few polls: it counts as there when asked for (a clock read saved on the fast path;
                // waits of a few microseconds are not what the arrival record is for).
                let seen = if self.looked { now_ns() } else { self.posted };
                op.arrived(self.req.peer, self.posted, seen, timing);
            }
            // SAFETY: n <= slot_bytes, inside the slot's payload area.
            let chunk = unsafe { std::slice::from_raw_parts(slot.add(SLOT_HEADER_BYTES), n) };
            (self.req.sink)(self.received, chunk);
            self.received += n;
            self.finished = last;
            tail = tail.wrapping_add(1);
            self.chan.tail().store(tail, Ordering::Release);
            self.from.ring();
            progress = true;
        }
        Ok(progress)
    }

    fn violation(&self, detail: String) -> Error {
        Error::Protocol { peer: format!("rank {}", self.req.peer), detail }
    }
}

impl Transport for RingTransport {
    fn kind(&self) -> TransportKind {
        self.kind
    }

    fn close(&self) {
        self.leave();
    }

    fn reaches(&self, peer: usize) -> bool {
        matches!(self.local_of.get(peer), Some(Some(l)) if *l != self.me)
    }

    fn set_progress(&self, seq: u64) {
        self.segs[self.me].progress().store(seq, Ordering::Relaxed);
    }

    fn peer_progress(&self, peer: usize) -> Option<u64> {
        let l = self.local_of.get(peer).copied().flatten()?;
        Some(self.segs[l].progress().load(Ordering::Relaxed))
    }

    fn exchange(&self, op: &OpCtx, send: Option<SendReq<'_>>, recv: Option<RecvReq<'_>>) -> Result<()> {
        let me = &self.segs[self.me];
        let now = now_ns();
        let mut pusher = match send {
            Some(s) => {
                let l = self.local(s.peer, op)?;
                Some((
                    l,
                    Pusher {
                        chan: self.chan(self.me, l),
                        to: &self.segs[l],
                        data: s.data,
                        sent: 0,
                        started: false,
                        timing: op.timing(now),
                    },
                ))
            }
            None => None,
        };
        let mut popper = match recv {
            Some(r) => {
                let l = self.local(r.peer, op)?;
                Some((
                    l,
                    Popper {
                        chan: self.chan(l, self.me),
                        from: &self.segs[l],
                        len: r.len,
                        received: 0,
                        finished: false,
                        req: r,
                        posted: now,
                        looked: false,
                    },
                ))
            }
            None => None,
        };
        let mut idle: u32 = 0;
        let mut last_check = Instant::now();
        loop {
            let mut progress = false;
            if let Some((_, p)) = pusher.as_mut()
                && !p.done()
            {
                let before = p.sent;
                progress |= p.push(op.seq);
                op.add_sent(p.sent - before);
            }
            if let Some((_, p)) = popper.as_mut()
                && !p.finished
            {
                let before = p.received;
                progress |= p.pop(op)?;
                op.add_bytes(p.received - before);
            }
            let send_done = pusher.as_ref().is_none_or(|(_, p)| p.done());
            let recv_done = popper.as_ref().is_none_or(|(_, p)| p.finished);
            if send_done && recv_done {
                return Ok(());
            }
            if progress {
                idle = 0;
                continue;
            }
            idle = idle.saturating_add(1);
            if idle >= QUICK_POLLS.min(self.cfg.spin)
                && let Some((_, p)) = popper.as_mut()
            {
                p.looked = true;
            }
            if idle < self.cfg.spin {
                std::hint::spin_loop();
                continue;
            }
            if idle < self.cfg.spin.saturating_add(16) {
                std::thread::yield_now();
                continue;
            }
            // Sleep on our doorbell until a peer changes a channel we wait on.
            let bell = me.doorbell().load(Ordering::SeqCst);
            me.sleeping().store(1, Ordering::SeqCst);
            let ready = pusher.as_ref().is_some_and(|(_, p)| {
                !p.done()
                    && p.chan.head().load(Ordering::SeqCst).wrapping_sub(p.chan.tail().load(Ordering::SeqCst))
                        < self.cfg.slots as u32
            }) || popper.as_ref().is_some_and(|(_, p)| {
                !p.finished && p.chan.head().load(Ordering::SeqCst) != p.chan.tail().load(Ordering::SeqCst)
            });
            if !ready {
                let left = op.remaining();
                let slice = left.min(Duration::from_millis(50));
                if !slice.is_zero() {
                    let ts =
                        rustix::fs::Timespec { tv_sec: slice.as_secs() as i64, tv_nsec: slice.subsec_nanos() as i64 };
                    let _ = rustix::thread::futex::wait(
                        me.doorbell(),
                        rustix::thread::futex::Flags::empty(),
                        bell,
                        Some(&ts),
                    );
                }
            }
            me.sleeping().store(0, Ordering::SeqCst);
            idle = self.cfg.spin / 2;
            if last_check.elapsed() >= Duration::from_millis(100) || Instant::now() >= op.deadline {
                last_check = Instant::now();
                let waiting: Vec<usize> = pusher
                    .iter()
                    .filter(|(_, p)| !p.done())
                    .map(|(l, _)| *l)
                    .chain(popper.iter().filter(|(_, p)| !p.finished).map(|(l, _)| *l))
                    .collect();
                if waiting.iter().any(|&l| self.dead(l).is_some()) {
                    // Name a rank whose process died before one that merely closed
                    // its communicator (it may have closed because of that death).
                    let died = (0..self.ranks.len())
                        .filter(|&l| l != self.me && self.segs[l].alive().load(Ordering::SeqCst) != 0)
                        .find_map(|l| self.dead(l).map(|r| (l, r)));
                    let (l, reason) = died
                        .or_else(|| waiting.iter().find_map(|&l| self.dead(l).map(|r| (l, r))))
                        .unwrap_or((waiting[0], "it is gone".into()));
                    return Err(op.peer_lost(self.ranks[l], reason));
                }
                if Instant::now() >= op.deadline {
                    let mut what = Vec::new();
                    if let Some((l, p)) = pusher.as_ref().filter(|(_, p)| !p.done()) {
                        what.push(format!("rank {} to take {} more bytes", self.ranks[*l], p.data.len() - p.sent));
                    }
                    if let Some((l, p)) = popper.as_ref().filter(|(_, p)| !p.finished) {
                        what.push(format!("{} more bytes from rank {}", p.len - p.received, self.ranks[*l]));
                    }
                    return Err(op.timeout(what.join(" and ")));
                }
            }
        }
    }
}
