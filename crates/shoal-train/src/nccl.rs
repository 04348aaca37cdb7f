//! The NCCL communicator (feature `nccl`): collectives on device buffers between GPU ranks, through candle's
//! `cudarc`, beside Shoal's own host collectives (`shoal_comm`). [`NcclAllReduce`] fills data parallelism's device
//! all-reduce seam (`crate::strategy::DeviceAllReduce`): where the worker chooses it (`train.collectives`), each
//! bucket of gradients is summed in place on the GPU; elsewhere they are staged through the host into `shoal_comm`.
//!
//! Invariants:
//! - Rank 0 makes NCCL's unique id and publishes it in the job's rendezvous store (`nccl/<name>/id`); the others
//!   read it from there, within the communicator's deadline.
//! - Nothing waits without a bound, as with `shoal_comm`: NCCL's initialisation runs on a thread that is waited
//!   for until the deadline, and every operation is enqueued on the communicator's stream, then waited for by
//!   polling an event recorded after it. Past the deadline the communicator is aborted (`ncclCommAbort`, by
//!   dropping cudarc's `Comm`) and the error is `shoal_comm`'s usual timeout report: the operation, its sequence
//!   number, this rank and which ranks had not reached it (each rank's progress read from the store, where a rank
//!   that times out publishes its own).
//! - An aborted communicator refuses every later operation with an error; it is never used again.
//! - Nothing calls into NCCL or the driver before the driver was found (`crate::device::probe`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::cuda::cudarc;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp};
use shoal_comm::Store;
use shoal_comm::error::Participation;

use crate::device::Probe;
use crate::error::{Error, Result};

/// One rank's NCCL communicator.
pub struct Nccl {
    /// `None` once aborted.
    comm: Option<Comm>,
    stream: Arc<CudaStream>,
    store: Arc<dyn Store>,
    name: String,
    rank: usize,
    world: usize,
    timeout: Duration,
    /// Operations started so far (the next one's sequence number).
    seq: u64,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("seq", &self.seq)
            .field("aborted", &self.comm.is_none())
            .finish_non_exhaustive()
    }
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time: `Nccl`'s operations take `&mut self`,
// and its stream and store are themselves safe to move.
unsafe impl Send for Nccl {}

/// A communicator made on the init thread and handed to the caller's.
struct Made(Comm);
// SAFETY: an NCCL communicator may be used from any thread, one at a time; the init thread hands it over and never
// touches it again.
unsafe impl Send for Made {}

fn driver(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::InvalidArgument(format!("nccl: {what}: {e:?}"))
}

impl Nccl {
    /// Joins communicator `name` as `rank` of `world` on CUDA device `ordinal`, the unique id exchanged through
    /// `store`; every wait bounded by `timeout`.
    pub fn connect(
        store: Arc<dyn Store>,
        name: &str,
        rank: usize,
        world: usize,
        ordinal: usize,
        timeout: Duration,
    ) -> Result<Nccl> {
        match crate::device::probe() {
            Probe::Devices(n) if ordinal < n => {}
            found => return Err(Error::InvalidArgument(format!("nccl: no CUDA device {ordinal} here: {found:?}"))),
        }
        let key = format!("nccl/{name}/id");
        let id = if rank == 0 {
            let id = Id::new().map_err(|e| driver("unique id", e))?;
            let bytes: Vec<u8> = id.internal().iter().map(|c| *c as u8).collect();
            store.set(&key, &bytes)?;
            id
        } else {
            let bytes = store.get(&key, timeout)?;
            let mut internal = [0 as std::ffi::c_char; 128];
            if bytes.len() != internal.len() {
                return Err(Error::InvalidArgument(format!("nccl: {key} holds {} bytes, not 128", bytes.len())));
            }
            for (d, s) in internal.iter_mut().zip(&bytes) {
                *d = *s as std::ffi::c_char;
            }
            Id::uninit(internal)
        };
        let ctx = CudaContext::new(ordinal).map_err(|e| driver("context", e))?;
        let stream = ctx.new_stream().map_err(|e| driver("stream", e))?;
        store.set(&format!("nccl/{name}/at/{rank}"), b"0")?;
        // ncclCommInitRank waits for every rank: on a thread of its own, waited for until the deadline.
        let (tx, rx) = std::sync::mpsc::channel();
        let s = stream.clone();
        std::thread::Builder::new()
            .name(format!("nccl-init-{rank}"))
            .spawn(move || {
                let _ = tx.send(Comm::from_rank(s, rank, world, id).map(Made));
            })
            .map_err(|e| Error::InvalidArgument(format!("nccl: init thread: {e}")))?;
        let mut me = Nccl { comm: None, stream, store, name: name.to_owned(), rank, world, timeout, seq: 0 };
        match rx.recv_timeout(timeout) {
            Ok(Ok(Made(comm))) => {
                me.comm = Some(comm);
                Ok(me)
            }
            Ok(Err(e)) => Err(driver("init", e)),
            // The init thread stays blocked in NCCL: nothing more can be done for it than leaving it.
            Err(_) => Err(me.report("nccl init", timeout)),
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.world
    }

    /// The stream the operations run on: buffers given to them belong to its context.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Runs `enqueue` (one NCCL call on the stream) as operation `op`, then waits for the stream until the deadline.
    fn run(
        &mut self,
        op: &'static str,
        enqueue: impl FnOnce(&Comm) -> std::result::Result<(), cudarc::nccl::result::NcclError>,
    ) -> Result<()> {
        let started = Instant::now();
        let Some(comm) = &self.comm else {
            return Err(Error::InvalidArgument(format!("nccl {op}: the communicator was aborted")));
        };
        self.seq += 1;
        enqueue(comm).map_err(|e| driver(op, e))?;
        let event = self.stream.record_event(None).map_err(|e| driver(op, e))?;
        let mut pause = Duration::from_micros(20);
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    self.abort();
                    return Err(driver(op, e));
                }
            }
            if started.elapsed() >= self.timeout {
                self.abort();
                return Err(self.report(op, started.elapsed()));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(5));
        }
    }

    /// `ncclCommAbort`: cudarc's `Comm` aborts when dropped.
    fn abort(&mut self) {
        drop(self.comm.take());
    }

    /// The timeout report of operation `op` (the current sequence number): this rank's progress published, the
    /// others' read back (a rank behind this one, or never heard of, is missing).
    fn report(&self, op: &'static str, waited: Duration) -> Error {
        let _ = self.store.set(&format!("nccl/{}/at/{}", self.name, self.rank), self.seq.to_string().as_bytes());
        // Give the ranks that timed out alike a moment to publish theirs.
        std::thread::sleep(Duration::from_millis(200));
        let mut p = Participation::default();
        for r in 0..self.world {
            let at = self
                .store
                .try_get(&format!("nccl/{}/at/{r}", self.name))
                .ok()
                .flatten()
                .and_then(|b| String::from_utf8(b).ok())
                .and_then(|s| s.parse::<u64>().ok());
            match at {
                Some(s) if r == self.rank || s >= self.seq => p.arrived.push(r),
                _ => p.missing.push(r),
            }
        }
        Error::Comm(shoal_comm::Error::Timeout {
            op,
            seq: self.seq,
            rank: self.rank,
            waited,
            waiting_for: format!("ranks {:?} over NCCL", p.missing),
            participation: p,
            bytes_moved: 0,
        })
    }

    /// Sums `buf` over the ranks, in place.
    pub fn all_reduce(&mut self, buf: &mut CudaSlice<f32>) -> Result<()> {
        self.run("nccl all_reduce", |c| c.all_reduce_in_place(buf, &ReduceOp::Sum).map(drop))
    }

    /// `root`'s `buf` to every rank.
    pub fn broadcast(&mut self, buf: &mut CudaSlice<f32>, root: usize) -> Result<()> {
        let root = i32::try_from(root).map_err(|_| Error::InvalidArgument(format!("nccl broadcast: root {root}")))?;
        self.run("nccl broadcast", |c| c.broadcast_in_place(buf, root).map(drop))
    }

    /// Every rank's `send` (all the same length), in rank order, into `recv` (world × as long).
    pub fn all_gather(&mut self, send: &CudaSlice<f32>, recv: &mut CudaSlice<f32>) -> Result<()> {
        if recv.len() != send.len() * self.world {
            return Err(Error::InvalidArgument(format!(
                "nccl all_gather: {} values received for {} sent by {} ranks",
                recv.len(),
                send.len(),
                self.world
            )));
        }
        self.run("nccl all_gather", |c| c.all_gather(send, recv).map(drop))
    }

    /// The sum over ranks of `send`, of which this rank keeps its part (`send.len() / world` values) in `recv`.
    pub fn reduce_scatter(&mut self, send: &CudaSlice<f32>, recv: &mut CudaSlice<f32>) -> Result<()> {
        if send.len() != recv.len() * self.world {
            return Err(Error::InvalidArgument(format!(
                "nccl reduce_scatter: {} values sent for parts of {} over {} ranks",
                send.len(),
                recv.len(),
                self.world
            )));
        }
        self.run("nccl reduce_scatter", |c| c.reduce_scatter(send, recv, &ReduceOp::Sum).map(drop))
    }

    /// `buf` to rank `peer`.
    pub fn send(&mut self, buf: &CudaSlice<f32>, peer: usize) -> Result<()> {
        let peer = i32::try_from(peer).map_err(|_| Error::InvalidArgument(format!("nccl send: peer {peer}")))?;
        self.run("nccl send", |c| c.send(buf, peer))
    }

    /// Rank `peer`'s message into `buf`.
    pub fn recv(&mut self, buf: &mut CudaSlice<f32>, peer: usize) -> Result<()> {
        let peer = i32::try_from(peer).map_err(|_| Error::InvalidArgument(format!("nccl recv: peer {peer}")))?;
        self.run("nccl recv", |c| c.recv(buf, peer).map(drop))
    }
}

/// NCCL as data parallelism's device all-reduce (`crate::strategy::DeviceAllReduce`): each bucket of gradients is
/// summed in place on the GPU, once the work candle's stream queued for it is done (the NCCL stream joins it).
#[derive(Debug)]
pub struct NcclAllReduce(Nccl);

impl NcclAllReduce {
    pub fn new(nccl: Nccl) -> NcclAllReduce {
        NcclAllReduce(nccl)
    }
}

/// The in-place sum, as a candle operation on the bucket's own storage.
struct SumInPlace<'a> {
    nccl: std::cell::RefCell<&'a mut Nccl>,
    /// The error behind a failed sum (a timeout's report), given back whole rather than as candle's message.
    failed: std::cell::RefCell<Option<Error>>,
}

impl candle_core::InplaceOp1 for SumInPlace<'_> {
    fn name(&self) -> &'static str {
        "shoal-nccl-all-reduce"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &candle_core::Layout) -> candle_core::Result<()> {
        candle_core::bail!("nccl all_reduce: the bucket is on the host, not on a CUDA device")
    }

    fn cuda_fwd(
        &self,
        storage: &mut candle_core::CudaStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<()> {
        let n = layout.shape().elem_count();
        if layout.start_offset() != 0 || !layout.is_contiguous() {
            candle_core::bail!("nccl all_reduce: the bucket is not a whole contiguous tensor");
        }
        let producer = storage.device.cuda_stream();
        let slice = storage.as_cuda_slice_mut::<f32>()?;
        if slice.len() != n {
            candle_core::bail!("nccl all_reduce: the bucket's storage holds {} values for {n}", slice.len());
        }
        let mut nccl = self.nccl.borrow_mut();
        let joined = nccl.stream().join(&producer).map_err(|e| driver("join the compute stream", e));
        if let Err(e) = joined.and_then(|()| nccl.all_reduce(slice)) {
            let shown = e.to_string();
            *self.failed.borrow_mut() = Some(e);
            candle_core::bail!("{shown}");
        }
        Ok(())
    }
}

impl crate::strategy::DeviceAllReduce for NcclAllReduce {
    fn all_reduce(&mut self, flat: candle_core::Tensor) -> Result<candle_core::Tensor> {
        let op = SumInPlace { nccl: std::cell::RefCell::new(&mut self.0), failed: std::cell::RefCell::new(None) };
        match flat.inplace_op1(&op) {
            Ok(()) => Ok(flat),
            Err(e) => Err(op.failed.into_inner().unwrap_or_else(|| e.into())),
        }
    }

    fn name(&self) -> &'static str {
        "nccl"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NCCL at world size 1 on the first device: every operation runs and gives what one rank should get; skipped
    /// with a message where no device is found.
    #[test]
    fn gpu_nccl_at_world_size_one() -> std::result::Result<(), Box<dyn std::error::Error>> {
        let found = crate::device::probe();
        if !matches!(found, Probe::Devices(1..)) {
            eprintln!("skipped: no CUDA device here ({found:?})");
            return Ok(());
        }
        let store: Arc<dyn Store> = Arc::new(shoal_comm::MemStore::default());
        let mut c = Nccl::connect(store, "check", 0, 1, 0, Duration::from_secs(60))?;
        let s = c.stream().clone();
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
        let mut buf = s.clone_htod(&values)?;
        c.all_reduce(&mut buf)?;
        assert_eq!(s.clone_dtoh(&buf)?, values);
        c.broadcast(&mut buf, 0)?;
        assert_eq!(s.clone_dtoh(&buf)?, values);
        let mut gathered = s.alloc_zeros::<f32>(1000)?;
        c.all_gather(&buf, &mut gathered)?;
        assert_eq!(s.clone_dtoh(&gathered)?, values);
        let mut part = s.alloc_zeros::<f32>(1000)?;
        c.reduce_scatter(&buf, &mut part)?;
        assert_eq!(s.clone_dtoh(&part)?, values);
        // A mismatched size is an error, not a call into NCCL.
        let mut short = s.alloc_zeros::<f32>(10)?;
        assert!(c.all_gather(&buf, &mut short).is_err());
        assert_eq!(c.seq, 4);
        // The device all-reduce seam: a bucket made by candle on the device, summed in place.
        let mut sum = NcclAllReduce::new(c);
        let device = crate::device::open(&crate::device::Placement::Cuda { ordinal: 0 })?;
        let bucket = candle_core::Tensor::from_slice(&values, values.len(), &device)?;
        let bucket = (bucket * 2.0)?;
        let summed = crate::strategy::DeviceAllReduce::all_reduce(&mut sum, bucket)?;
        let doubled: Vec<f32> = values.iter().map(|v| v * 2.0).collect();
        assert_eq!(summed.to_vec1::<f32>()?, doubled);
        assert_eq!(sum.0.seq, 5);
        eprintln!(
            "nccl world 1: all_reduce, broadcast, all_gather, reduce_scatter of 1000 f32, and a candle bucket checked"
        );
        Ok(())
    }
}
