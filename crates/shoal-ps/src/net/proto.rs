//! The parameter server's messages on the wire. Every message is one frame of `shoal_comm::frame` (kind
//! `PsRequest` or `PsReply`) whose payload is `head_len: u32, head, values: f32…`: a small head (the operation and
//! its fields, little-endian) and then the values, read straight into `f32` buffers — pushes and pulls move
//! megabytes, heads a few bytes. Anything malformed is a protocol error naming the peer, never a panic.

use std::io::{Read, Write};

use shoal_comm::frame::{self, Kind};

use crate::error::{PsError, Result};
pub use crate::shard::Span;

/// Largest payload either side accepts: 4 GiB of values (a billion parameters on one server).
pub const MAX_PAYLOAD: u64 = 4 << 30;
/// Largest head (the spans of a sparse push of a million rows, and more).
const MAX_HEAD: usize = 64 << 20;

/// What a worker asks of a server.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    /// The shard's starting values and optimizer state (`m`, `v`: empty when there is none yet) at `version`.
    /// Taken when the server holds nothing yet, or always when `force` (a job resumed from its workers'
    /// checkpoint).
    Init { force: bool, version: u64, values: Vec<f32>, m: Vec<f32>, v: Vec<f32> },
    /// A gradient computed on `version`, for the spans named (every value of the shard when `spans` is empty),
    /// to be applied with learning rate `lr`.
    Push { version: u64, lr: f64, spans: Vec<Span>, grad: Vec<f32> },
    /// The values of `spans` (every value when empty), once the shard is at `min_version` or later (and, under
    /// bounded staleness, once this worker may start its next step).
    Pull { min_version: u64, spans: Vec<Span> },
    /// The shard's values and optimizer state.
    State,
    /// Save the shard now, as of the workers' `step`.
    Checkpoint { step: u64 },
    /// This worker has finished.
    Done,
    /// A shared-memory segment for this connection, when the worker runs on the server's host ([`super::shm`]).
    Share,
    /// [`Request::Push`] of the whole shard's gradient, written into the shared segment.
    PushShared { version: u64, lr: f64 },
    /// [`Request::Pull`] of every value, into the shared segment.
    PullShared { min_version: u64 },
}

/// What a server answers.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// The request failed; why.
    Error(String),
    /// The shard's version after the request, and the slowest worker's clock.
    Version { version: u64, slowest: u64 },
    /// Values pulled, as of `version`.
    Values { version: u64, slowest: u64, values: Vec<f32> },
    /// The shard's values and optimizer state.
    State { version: u64, values: Vec<f32>, m: Vec<f32>, v: Vec<f32> },
    /// The shared segment made for the connection: its file and how many values each half holds.
    Shared { path: String, len: u64 },
}

/// A head being written.
#[derive(Default)]
struct Head(Vec<u8>);

impl Head {
    fn u8(mut self, x: u8) -> Head {
        self.0.push(x);
        self
    }
    fn u64(mut self, x: u64) -> Head {
        self.0.extend_from_slice(&x.to_le_bytes());
        self
    }
    fn f64(self, x: f64) -> Head {
        self.u64(x.to_bits())
    }
    fn spans(mut self, spans: &[Span]) -> Head {
        self.0.extend_from_slice(&(spans.len() as u64).to_le_bytes());
        for s in spans {
            self.0.extend_from_slice(&s.start.to_le_bytes());
            self.0.extend_from_slice(&s.len.to_le_bytes());
        }
        self
    }
    fn str(mut self, s: &str) -> Head {
        self.0.extend_from_slice(s.as_bytes());
        self
    }
}

/// A head being read; every read is bounds-checked.
struct Cursor<'a> {
    b: &'a [u8],
    peer: &'a str,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.b.len() < n {
            return Err(protocol(self.peer, format!("a message head ends {} bytes early", n - self.b.len())));
        }
        let (a, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes(b.try_into().unwrap_or_default()))
    }
    fn f64(&mut self) -> Result<f64> {
        self.u64().map(f64::from_bits)
    }
    fn spans(&mut self) -> Result<Vec<Span>> {
        let n = self.u64()?;
        if n.saturating_mul(12) > self.b.len() as u64 {
            return Err(protocol(self.peer, format!("{n} spans do not fit the message head")));
        }
        (0..n).map(|_| Ok(Span { start: self.u64()?, len: self.u32()? })).collect()
    }
    fn rest_str(&mut self) -> String {
        let s = String::from_utf8_lossy(self.b).into_owned();
        self.b = &[];
        s
    }
    fn end(&self) -> Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(protocol(self.peer, format!("{} bytes left over after a message head", self.b.len())))
        }
    }
}

fn protocol(peer: &str, detail: String) -> PsError {
    PsError::Comm(shoal_comm::Error::Protocol { peer: peer.to_string(), detail })
}

/// Writes one message: the frame header, the head, then `values` as raw little-endian `f32`s.
fn write_message(w: &mut impl Write, kind: Kind, head: &[u8], values: &[&[f32]], peer: &str) -> Result<()> {
    let bytes: u64 = values.iter().map(|v| v.len() as u64 * 4).sum();
    let len = 4 + head.len() as u64 + bytes;
    let mut first = Vec::with_capacity(frame::HEADER_LEN + 4 + head.len());
    first.extend_from_slice(&frame::Header { kind, seq: 0, len }.encode());
    first.extend_from_slice(&(head.len() as u32).to_le_bytes());
    first.extend_from_slice(head);
    let io = |e| PsError::Comm(shoal_comm::Error::io(format!("writing a {kind:?} to {peer}"), e));
    w.write_all(&first).map_err(io)?;
    for v in values {
        w.write_all(bytemuck::cast_slice(v)).map_err(io)?;
    }
    w.flush().map_err(io)
}

/// Reads one message of `kind`: its head, and its values into `values` (resized to fit).
fn read_message(r: &mut impl Read, kind: Kind, values: &mut Vec<f32>, peer: &str) -> Result<Vec<u8>> {
    let (head, count) = read_head(r, kind, peer)?;
    values.clear();
    values.resize(count, 0.0);
    read_values(r, values, kind, peer)?;
    Ok(head)
}

fn read_values(r: &mut impl Read, values: &mut [f32], kind: Kind, peer: &str) -> Result<()> {
    r.read_exact(bytemuck::cast_slice_mut(values))
        .map_err(|e| PsError::Comm(shoal_comm::Error::io(format!("reading a {kind:?}'s values from {peer}"), e)))
}

/// Reads a [`Reply::Values`] straight into `out`, which must be as long as the values sent: no buffer between the
/// socket and the worker's parameters. Returns the version and the slowest worker's clock; a server's error is
/// [`PsError::Server`].
pub fn read_values_into(r: &mut impl Read, out: &mut [f32], peer: &str) -> Result<(u64, u64)> {
    let (head, count) = read_head(r, Kind::PsReply, peer)?;
    let mut c = Cursor { b: &head, peer };
    match c.u8()? {
        R_VALUES if count == out.len() => {
            let (version, slowest) = (c.u64()?, c.u64()?);
            c.end()?;
            read_values(r, out, Kind::PsReply, peer)?;
            Ok((version, slowest))
        }
        R_VALUES => {
            Err(PsError::InvalidArgument(format!("{peer} sent {count} values where this worker holds {}", out.len())))
        }
        R_ERROR if count == 0 => Err(PsError::Server(c.rest_str())),
        op => Err(protocol(peer, format!("reply {op} with {count} values where values were asked for"))),
    }
}

/// Reads a message's frame header and head; returns the head and how many values follow.
fn read_head(r: &mut impl Read, kind: Kind, peer: &str) -> Result<(Vec<u8>, usize)> {
    let h = frame::read_header(r, MAX_PAYLOAD, peer)?;
    if h.kind != kind {
        return Err(protocol(peer, format!("expected a {kind:?}, got a {:?}", h.kind)));
    }
    let io = |e| PsError::Comm(shoal_comm::Error::io(format!("reading a {kind:?} from {peer}"), e));
    let mut n = [0u8; 4];
    r.read_exact(&mut n).map_err(io)?;
    let head_len = u32::from_le_bytes(n) as u64;
    if head_len > MAX_HEAD as u64 || 4 + head_len > h.len {
        return Err(protocol(peer, format!("a head of {head_len} bytes in a message of {}", h.len)));
    }
    let mut head = vec![0u8; head_len as usize];
    r.read_exact(&mut head).map_err(io)?;
    let bytes = h.len - 4 - head_len;
    if !bytes.is_multiple_of(4) {
        return Err(protocol(peer, format!("{bytes} bytes of values are not whole f32s")));
    }
    Ok((head, (bytes / 4) as usize))
}

/// Splits `values` into parts of the given lengths, refusing a total that disagrees.
fn split3(mut values: Vec<f32>, a: u64, b: u64, c: u64, peer: &str) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    if a.checked_add(b).and_then(|ab| ab.checked_add(c)) != Some(values.len() as u64) {
        return Err(protocol(peer, format!("{} values where the head says {a} + {b} + {c}", values.len())));
    }
    let v = values.split_off((a + b) as usize);
    let m = values.split_off(a as usize);
    Ok((values, m, v))
}

const INIT: u8 = 1;
const PUSH: u8 = 2;
const PULL: u8 = 3;
const STATE: u8 = 4;
const CHECKPOINT: u8 = 5;
const DONE: u8 = 6;
const SHARE: u8 = 7;
const PUSH_SHARED: u8 = 8;
const PULL_SHARED: u8 = 9;

const R_ERROR: u8 = 0;
const R_VERSION: u8 = 1;
const R_VALUES: u8 = 2;
const R_STATE: u8 = 3;
const R_SHARED: u8 = 4;

/// Writes a [`Request::Push`] from borrowed values (a worker's part of its flat gradient).
pub fn write_push(w: &mut impl Write, version: u64, lr: f64, spans: &[Span], grad: &[f32], peer: &str) -> Result<()> {
    let head = Head::default().u8(PUSH).u64(version).f64(lr).spans(spans);
    write_message(w, Kind::PsRequest, &head.0, &[grad], peer)
}

/// Writes a [`Request::Pull`] of borrowed spans (a worker's rows for its next step).
pub fn write_pull(w: &mut impl Write, min_version: u64, spans: &[Span], peer: &str) -> Result<()> {
    let head = Head::default().u8(PULL).u64(min_version).spans(spans);
    write_message(w, Kind::PsRequest, &head.0, &[], peer)
}

/// Writes a [`Reply::Values`] from borrowed values (a server's shard, sent while it holds it).
pub fn write_values(w: &mut impl Write, version: u64, slowest: u64, values: &[&[f32]], peer: &str) -> Result<()> {
    let head = Head::default().u8(R_VALUES).u64(version).u64(slowest);
    write_message(w, Kind::PsReply, &head.0, values, peer)
}

/// Writes a [`Request::Init`] from borrowed values.
pub fn write_init(w: &mut impl Write, force: bool, version: u64, parts: [&[f32]; 3], peer: &str) -> Result<()> {
    let head = Head::default()
        .u8(INIT)
        .u8(u8::from(force))
        .u64(version)
        .u64(parts[0].len() as u64)
        .u64(parts[1].len() as u64)
        .u64(parts[2].len() as u64);
    write_message(w, Kind::PsRequest, &head.0, &parts, peer)
}

impl Request {
    /// Writes the request.
    pub fn write(&self, w: &mut impl Write, peer: &str) -> Result<()> {
        let (head, values): (Head, Vec<&[f32]>) = match self {
            Request::Init { force, version, values, m, v } => (
                Head::default()
                    .u8(INIT)
                    .u8(u8::from(*force))
                    .u64(*version)
                    .u64(values.len() as u64)
                    .u64(m.len() as u64)
                    .u64(v.len() as u64),
                vec![values, m, v],
            ),
            Request::Push { version, lr, spans, grad } => return write_push(w, *version, *lr, spans, grad, peer),
            Request::Pull { min_version, spans } => return write_pull(w, *min_version, spans, peer),
            Request::State => (Head::default().u8(STATE), vec![]),
            Request::Checkpoint { step } => (Head::default().u8(CHECKPOINT).u64(*step), vec![]),
            Request::Done => (Head::default().u8(DONE), vec![]),
            Request::Share => (Head::default().u8(SHARE), vec![]),
            Request::PushShared { version, lr } => (Head::default().u8(PUSH_SHARED).u64(*version).f64(*lr), vec![]),
            Request::PullShared { min_version } => (Head::default().u8(PULL_SHARED).u64(*min_version), vec![]),
        };
        write_message(w, Kind::PsRequest, &head.0, &values, peer)
    }

    /// Reads a request; its values go into `buf`'s allocation when it has one (a push's gradient).
    pub fn read(r: &mut impl Read, buf: Vec<f32>, peer: &str) -> Result<Request> {
        let mut values = buf;
        let head = read_message(r, Kind::PsRequest, &mut values, peer)?;
        let mut c = Cursor { b: &head, peer };
        let req = match c.u8()? {
            INIT => {
                let force = c.u8()? != 0;
                let version = c.u64()?;
                let (a, b, cc) = (c.u64()?, c.u64()?, c.u64()?);
                let (values, m, v) = split3(values, a, b, cc, peer)?;
                Request::Init { force, version, values, m, v }
            }
            PUSH => Request::Push { version: c.u64()?, lr: c.f64()?, spans: c.spans()?, grad: values },
            PULL => Request::Pull { min_version: c.u64()?, spans: c.spans()? },
            STATE => Request::State,
            CHECKPOINT => Request::Checkpoint { step: c.u64()? },
            DONE => Request::Done,
            SHARE => Request::Share,
            PUSH_SHARED => Request::PushShared { version: c.u64()?, lr: c.f64()? },
            PULL_SHARED => Request::PullShared { min_version: c.u64()? },
            op => return Err(protocol(peer, format!("unknown request {op}"))),
        };
        c.end()?;
        Ok(req)
    }
}

impl Reply {
    /// Writes a reply; `values` are a [`Reply::Values`]'s (kept out of the enum so a server sends from its own
    /// buffer).
    pub fn write(&self, w: &mut impl Write, peer: &str) -> Result<()> {
        let (head, values): (Head, Vec<&[f32]>) = match self {
            Reply::Error(why) => (Head::default().u8(R_ERROR).str(why), vec![]),
            Reply::Version { version, slowest } => (Head::default().u8(R_VERSION).u64(*version).u64(*slowest), vec![]),
            Reply::Values { version, slowest, values } => {
                (Head::default().u8(R_VALUES).u64(*version).u64(*slowest), vec![values])
            }
            Reply::State { version, values, m, v } => (
                Head::default()
                    .u8(R_STATE)
                    .u64(*version)
                    .u64(values.len() as u64)
                    .u64(m.len() as u64)
                    .u64(v.len() as u64),
                vec![values, m, v],
            ),
            Reply::Shared { path, len } => (Head::default().u8(R_SHARED).u64(*len).str(path), vec![]),
        };
        write_message(w, Kind::PsReply, &head.0, &values, peer)
    }

    /// Reads a reply; its values go into `buf`'s allocation.
    pub fn read(r: &mut impl Read, buf: Vec<f32>, peer: &str) -> Result<Reply> {
        let mut values = buf;
        let head = read_message(r, Kind::PsReply, &mut values, peer)?;
        let mut c = Cursor { b: &head, peer };
        let reply = match c.u8()? {
            R_ERROR => Reply::Error(c.rest_str()),
            R_VERSION => Reply::Version { version: c.u64()?, slowest: c.u64()? },
            R_VALUES => Reply::Values { version: c.u64()?, slowest: c.u64()?, values },
            R_STATE => {
                let version = c.u64()?;
                let (a, b, cc) = (c.u64()?, c.u64()?, c.u64()?);
                let (values, m, v) = split3(values, a, b, cc, peer)?;
                Reply::State { version, values, m, v }
            }
            R_SHARED => Reply::Shared { len: c.u64()?, path: c.rest_str() },
            op => return Err(protocol(peer, format!("unknown reply {op}"))),
        };
        c.end()?;
        Ok(reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip_request(r: Request) -> Result<()> {
        let mut wire = Vec::new();
        r.write(&mut wire, "test")?;
        assert_eq!(Request::read(&mut wire.as_slice(), Vec::new(), "test")?, r);
        Ok(())
    }

    #[test]
    fn every_message_reads_back_as_written() -> Result<()> {
        let spans = vec![Span { start: 8, len: 4 }, Span { start: 40, len: 4 }];
        round_trip_request(Request::Init {
            force: true,
            version: 7,
            values: vec![1.0, 2.0],
            m: vec![0.5, 0.25],
            v: vec![],
        })?;
        round_trip_request(Request::Push { version: 3, lr: 0.01, spans: spans.clone(), grad: vec![-1.0; 8] })?;
        round_trip_request(Request::Pull { min_version: 4, spans })?;
        round_trip_request(Request::State)?;
        round_trip_request(Request::Checkpoint { step: 100 })?;
        round_trip_request(Request::Done)?;
        round_trip_request(Request::Share)?;
        round_trip_request(Request::PushShared { version: 2, lr: 0.5 })?;
        round_trip_request(Request::PullShared { min_version: 3 })?;
        for reply in [
            Reply::Error("the round waits for workers [2]".into()),
            Reply::Version { version: 9, slowest: 3 },
            Reply::Values { version: 9, slowest: 3, values: vec![3.5; 5] },
            Reply::State { version: 2, values: vec![1.0], m: vec![2.0], v: vec![3.0] },
            Reply::Shared { path: "/dev/shm/shoal-ps-1-2".into(), len: 9 },
        ] {
            let mut wire = Vec::new();
            reply.write(&mut wire, "test")?;
            assert_eq!(Reply::read(&mut wire.as_slice(), Vec::new(), "test")?, reply);
        }
        Ok(())
    }

    /// Truncated, overlong or mislabelled input is an error naming the peer, never a panic.
    #[test]
    fn malformed_messages_are_refused_naming_the_peer() -> Result<()> {
        let mut wire = Vec::new();
        Request::Push { version: 1, lr: 0.1, spans: vec![Span { start: 0, len: 2 }], grad: vec![1.0, 2.0] }
            .write(&mut wire, "w")?;
        for cut in [3, 24, 27, 30, wire.len() - 1] {
            let e = Request::read(&mut &wire[..cut], Vec::new(), "worker 3").err().map(|e| e.to_string());
            assert!(e.is_some_and(|e| e.contains("worker 3")), "cut at {cut}");
        }
        // A span count far beyond the head.
        let mut forged = wire.clone();
        let at = frame::HEADER_LEN + 4 + 1 + 16;
        forged[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
        let e = Request::read(&mut forged.as_slice(), Vec::new(), "w").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("spans do not fit"), "{e}");
        // A reply where a request belongs.
        let mut reply = Vec::new();
        Reply::Version { version: 1, slowest: 0 }.write(&mut reply, "s")?;
        assert!(Request::read(&mut reply.as_slice(), Vec::new(), "s").is_err());
        Ok(())
    }
}
