//! The rendezvous key-value store: how ranks find each other and agree on small
//! facts (addresses, generation numbers, barriers) before any data link exists.
//!
//! [`Store`] is the object-safe interface (`Arc<dyn Store>`). [`MemStore`] keeps
//! the map in process; [`StoreServer`] serves a `MemStore` over TCP and
//! [`TcpStore`] is its client.
//!
//! Invariants:
//! - Keys are UTF-8 and at most [`MAX_KEY_LEN`] bytes; values at most
//!   [`MAX_VALUE_LEN`] bytes. Both backends enforce this, so they behave alike.
//! - Every wait has a deadline: the caller's timeout, capped at [`MAX_WAIT`]. A
//!   timeout is [`Error::StoreTimeout`] naming the (first) missing key.
//! - `add`, `compare_set`, `set` and `delete` are atomic with respect to each
//!   other and to waiters (one mutex guards the map; a condvar wakes waiters).
//! - The server authenticates every connection with [`crate::auth`] before reading
//!   a request. Anything malformed (bad frame, bad request, wrong secret) closes
//!   that one connection with a warning; the server keeps serving the others.
//!   Nothing read from the network is unwrapped, and every length is bounded
//!   before anything is allocated for it.
//! - A server-side wait checks about every [`POLL_SLICE`] whether its client
//!   hung up or the server is shutting down, so an abandoned wait frees its thread
//!   promptly. Idle authenticated connections are not timed out (clients keep them
//!   for the life of the job); TCP keep-alive reaps those whose peer vanished, and
//!   [`StoreServer::shutdown`] closes the rest.
//! - The client never waits without a deadline either: a reply must arrive within
//!   the request's timeout plus [`REPLY_GRACE`] (or [`OP_TIMEOUT`] for requests
//!   that do not wait). A connection on which anything went wrong is discarded,
//!   never reused, so a late reply cannot be mistaken for the answer to a later
//!   request.
//!
//! # Wire format
//!
//! Each request is one [`Kind::StoreRequest`] frame and gets exactly one
//! [`Kind::StoreReply`] frame with the same sequence number. Integers are
//! little-endian; a "field" is a `u32` length followed by that many bytes.
//!
//! ```text
//! request  = op:u8 body
//!   set 1: key value | get 2: timeout_ms:u64 key | try_get 3: key | wait 4: timeout_ms:u64 count:u32 key*
//!   add 5: key delta:i64 | compare_set 6: key has_expected:u8 [expected] desired | delete 7: key | keys 8: prefix
//! reply    = tag:u8 body
//!   done 0 | value 1: value | maybe 2: present:u8 [value] | int 3: i64 | flag 4: u8 | keys 5: count:u32 key*
//!   timed_out 6: key waited_ms:u64 | failed 7: message
//! ```

use std::collections::BTreeMap;
use std::io::{self, Read};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use socket2::{SockRef, TcpKeepalive};
use tracing::{debug, warn};

use crate::auth;
use crate::error::{Error, Result};
use crate::frame::{self, Kind};

/// Longest key (and key prefix), in bytes.
pub const MAX_KEY_LEN: usize = 4 << 10;
/// Longest value, in bytes.
pub const MAX_VALUE_LEN: usize = 16 << 20;
/// Cap on every wait (`get`, `wait`, `TcpStore::connect`), whatever the caller asks.
pub const MAX_WAIT: Duration = Duration::from_secs(3600);
/// How long past a waiting request's timeout the client waits for the reply.
pub const REPLY_GRACE: Duration = Duration::from_secs(5);
/// Reply deadline for requests that do not wait, and the write timeout of every
/// store connection.
pub const OP_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a waiting server thread checks that its client is still there.
pub const POLL_SLICE: Duration = Duration::from_millis(200);

/// Deadline for an accepted connection to complete the auth handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request payload: a `compare_set` with two maximal values and a key,
/// or a `wait` on that many bytes of keys.
const MAX_REQUEST_LEN: usize = 2 * MAX_VALUE_LEN + MAX_KEY_LEN + 64;
/// Largest reply payload.
const MAX_REPLY_LEN: usize = frame::MAX_CONTROL_LEN as usize;
/// Longest error message a server sends.
const MAX_MESSAGE_LEN: usize = 4 << 10;
/// Idle connections a `TcpStore` keeps for reuse.
const MAX_IDLE_CONNECTIONS: usize = 8;
/// What `MemStore` errors name as the store's address.
const IN_PROCESS: &str = "in-process store";

/// A rendezvous key-value store shared by all ranks of a job.
pub trait Store: Send + Sync + std::fmt::Debug {
    /// Sets `key` to `value`, waking anyone waiting for it.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Waits until `key` exists (up to `timeout`), returns its value.
    /// [`Error::StoreTimeout`] names the key.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// The value of `key`, or `None` if it does not exist; never waits.
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>>;
    /// Waits until all keys exist. [`Error::StoreTimeout`] names the first missing key.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;
    /// Atomically adds `delta` to the i64 stored at key (missing = 0; stored as
    /// decimal ASCII), returns the new value. A value that is not a decimal i64, or
    /// an overflow, is [`Error::Store`].
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Sets key to `desired` iff its current value equals `expected` (`None` = key
    /// absent). Returns the value after the call; if the key is absent after the
    /// call (`expected` was `Some` but there was no key) that is an empty vector.
    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>>;
    /// Removes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool>;
    /// Keys with the given prefix (sorted).
    fn keys(&self, prefix: &str) -> Result<Vec<String>>;
}

// ---------------------------------------------------------------------------
// In-process store
// ---------------------------------------------------------------------------

type Map = BTreeMap<String, Vec<u8>>;

/// An in-process [`Store`]: a mutex-guarded map plus a condvar for waiters.
/// Clones share the same map.
#[derive(Clone, Default)]
pub struct MemStore {
    inner: Arc<MemInner>,
}

#[derive(Default)]
struct MemInner {
    map: Mutex<Map>,
    changed: Condvar,
}

/// Why [`MemStore::wait_keys`] returned without the keys.
enum WaitEnd {
    /// The deadline passed while `missing` was still absent.
    TimedOut { missing: String, waited: Duration },
    /// `keep_waiting` said to stop.
    Abandoned,
}

impl std::fmt::Debug for MemStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemStore").field("keys", &self.lock().len()).finish()
    }
}

impl MemStore {
    fn lock(&self) -> MutexGuard<'_, Map> {
        // Every mutation is a single map operation, so a panic elsewhere cannot
        // leave the map half-updated: a poisoned lock is safe to keep using.
        self.inner.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn insert(&self, key: &str, value: Vec<u8>) {
        self.lock().insert(key.to_string(), value);
        self.inner.changed.notify_all();
    }

    /// Waits until every key in `keys` exists, up to `timeout` (capped at
    /// [`MAX_WAIT`]), and returns the locked map. About every [`POLL_SLICE`] it
    /// calls `keep_waiting` (without the lock held) and gives up if that says no.
    fn wait_keys(
        &self,
        keys: &[&str],
        timeout: Duration,
        mut keep_waiting: impl FnMut() -> bool,
    ) -> std::result::Result<MutexGuard<'_, Map>, WaitEnd> {
        let waited = timeout.min(MAX_WAIT);
        let start = Instant::now();
        let deadline = start + waited;
        let mut last_check = start;
        let mut map = self.lock();
        loop {
            let Some(missing) = keys.iter().find(|k| !map.contains_key(**k)) else {
                return Ok(map);
            };
            let now = Instant::now();
            if now >= deadline {
                return Err(WaitEnd::TimedOut { missing: (*missing).to_string(), waited });
            }
            if now.duration_since(last_check) >= POLL_SLICE {
                drop(map);
                if !keep_waiting() {
                    return Err(WaitEnd::Abandoned);
                }
                last_check = Instant::now();
                map = self.lock();
                continue;
            }
            let slice = (deadline - now).min(POLL_SLICE);
            map = self.inner.changed.wait_timeout(map, slice).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// `wait_keys` as a public-facing result.
    fn wait_or_timeout(&self, keys: &[&str], timeout: Duration) -> Result<MutexGuard<'_, Map>> {
        self.wait_keys(keys, timeout, || true).map_err(|end| match end {
            WaitEnd::TimedOut { missing, waited } => Error::StoreTimeout { key: missing, waited },
            // `keep_waiting` above never says stop.
            WaitEnd::Abandoned => Error::Closed("in-process store wait abandoned".to_string()),
        })
    }
}

impl Store for MemStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(value)?;
        self.insert(key, value.to_vec());
        Ok(())
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        check_key(key)?;
        let map = self.wait_or_timeout(&[key], timeout)?;
        Ok(map.get(key).cloned().unwrap_or_default())
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        check_key(key)?;
        Ok(self.lock().get(key).cloned())
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        keys.iter().try_for_each(|k| check_key(k))?;
        self.wait_or_timeout(keys, timeout).map(drop)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key(key)?;
        let failed = |detail: String| Error::Store { addr: IN_PROCESS.to_string(), detail };
        let mut map = self.lock();
        let current = match map.get(key) {
            None => 0,
            Some(v) => parse_i64(v)
                .ok_or_else(|| failed(format!("add to key {key:?}: its value {} is not a decimal i64", preview(v))))?,
        };
        let new = current
            .checked_add(delta)
            .ok_or_else(|| failed(format!("add {delta} to key {key:?} holding {current} overflows i64")))?;
        map.insert(key.to_string(), new.to_string().into_bytes());
        drop(map);
        self.inner.changed.notify_all();
        Ok(new)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        check_key(key)?;
        if let Some(e) = expected {
            check_value(e)?;
        }
        check_value(desired)?;
        let mut map = self.lock();
        let current = map.get(key).map(Vec::as_slice);
        if current != expected {
            return Ok(current.map(<[u8]>::to_vec).unwrap_or_default());
        }
        map.insert(key.to_string(), desired.to_vec());
        drop(map);
        self.inner.changed.notify_all();
        Ok(desired.to_vec())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        Ok(self.lock().remove(key).is_some())
    }

    fn keys(&self, prefix: &str) -> Result<Vec<String>> {
        check_key(prefix)?;
        let map = self.lock();
        let from = (Bound::Included(prefix), Bound::Unbounded);
        Ok(map.range::<str, _>(from).take_while(|(k, _)| k.starts_with(prefix)).map(|(k, _)| k.clone()).collect())
    }
}

fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::InvalidArgument(format!("store key of {} bytes exceeds {MAX_KEY_LEN}", key.len())));
    }
    Ok(())
}

fn check_value(value: &[u8]) -> Result<()> {
    if value.len() > MAX_VALUE_LEN {
        return Err(Error::InvalidArgument(format!("store value of {} bytes exceeds {MAX_VALUE_LEN}", value.len())));
    }
    Ok(())
}

fn parse_i64(v: &[u8]) -> Option<i64> {
    std::str::from_utf8(v).ok()?.parse().ok()
}

/// A short, printable rendering of a value for error messages.
fn preview(v: &[u8]) -> String {
    const SHOWN: usize = 32;
    let shown = String::from_utf8_lossy(&v[..v.len().min(SHOWN)]).into_owned();
    if v.len() > SHOWN { format!("{shown:?}... ({} bytes)", v.len()) } else { format!("{shown:?}") }
}

// ---------------------------------------------------------------------------
// Wire codec
// ---------------------------------------------------------------------------

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_TRY_GET: u8 = 3;
const OP_WAIT: u8 = 4;
const OP_ADD: u8 = 5;
const OP_COMPARE_SET: u8 = 6;
const OP_DELETE: u8 = 7;
const OP_KEYS: u8 = 8;

const TAG_DONE: u8 = 0;
const TAG_VALUE: u8 = 1;
const TAG_MAYBE: u8 = 2;
const TAG_INT: u8 = 3;
const TAG_FLAG: u8 = 4;
const TAG_KEYS: u8 = 5;
const TAG_TIMED_OUT: u8 = 6;
const TAG_FAILED: u8 = 7;

/// One store request; borrows its strings and bytes from the caller or from the
/// received frame.
enum Request<'a> {
    Set { key: &'a str, value: &'a [u8] },
    Get { key: &'a str, timeout: Duration },
    TryGet { key: &'a str },
    Wait { keys: Vec<&'a str>, timeout: Duration },
    Add { key: &'a str, delta: i64 },
    CompareSet { key: &'a str, expected: Option<&'a [u8]>, desired: &'a [u8] },
    Delete { key: &'a str },
    Keys { prefix: &'a str },
}

/// One store reply. `TimedOut` and `Failed` may answer any request.
enum Reply {
    Done,
    Value(Vec<u8>),
    Maybe(Option<Vec<u8>>),
    Int(i64),
    Flag(bool),
    Keys(Vec<String>),
    TimedOut { key: String, waited: Duration },
    Failed(String),
}

#[derive(Default)]
struct Encoder(Vec<u8>);

impl Encoder {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    /// A count or length; callers have bounded it far below `u32::MAX`, and a
    /// saturated length would be refused by the decoder rather than misread.
    fn len(&mut self, n: usize) {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
    fn field(&mut self, b: &[u8]) {
        self.len(b.len());
        self.0.extend_from_slice(b);
    }
    fn millis(&mut self, d: Duration) {
        let ms = d.min(MAX_WAIT).as_nanos().div_ceil(1_000_000);
        self.u64(u64::try_from(ms).unwrap_or(u64::MAX));
    }
}

/// Reads fields off a received payload; every error is a protocol-violation detail.
struct Decoder<'a> {
    rest: &'a [u8],
}

impl<'a> Decoder<'a> {
    fn array<const N: usize>(&mut self, what: &str) -> std::result::Result<[u8; N], String> {
        let (head, tail) = self
            .rest
            .split_first_chunk::<N>()
            .ok_or_else(|| format!("truncated {what}: need {N} bytes, {} left", self.rest.len()))?;
        self.rest = tail;
        Ok(*head)
    }
    fn u8(&mut self, what: &str) -> std::result::Result<u8, String> {
        self.array::<1>(what).map(|[b]| b)
    }
    fn flag(&mut self, what: &str) -> std::result::Result<bool, String> {
        match self.u8(what)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(format!("{what} is {other}, expected 0 or 1")),
        }
    }
    fn u32(&mut self, what: &str) -> std::result::Result<u32, String> {
        self.array(what).map(u32::from_le_bytes)
    }
    fn u64(&mut self, what: &str) -> std::result::Result<u64, String> {
        self.array(what).map(u64::from_le_bytes)
    }
    fn i64(&mut self, what: &str) -> std::result::Result<i64, String> {
        self.array(what).map(i64::from_le_bytes)
    }
    fn millis(&mut self, what: &str) -> std::result::Result<Duration, String> {
        self.u64(what).map(|ms| Duration::from_millis(ms).min(MAX_WAIT))
    }
    /// A count of at-least-4-byte items: bounded by what is left, so it cannot
    /// drive a huge allocation.
    fn count(&mut self, what: &str) -> std::result::Result<usize, String> {
        let n = self.u32(what)? as usize;
        if n > self.rest.len() / 4 {
            return Err(format!("{what} of {n} cannot fit in the {} bytes left", self.rest.len()));
        }
        Ok(n)
    }
    fn field(&mut self, max: usize, what: &str) -> std::result::Result<&'a [u8], String> {
        let len = self.u32(what)? as usize;
        if len > max {
            return Err(format!("{what} of {len} bytes exceeds {max}"));
        }
        if len > self.rest.len() {
            return Err(format!("truncated {what}: need {len} bytes, {} left", self.rest.len()));
        }
        let (head, tail) = self.rest.split_at(len);
        self.rest = tail;
        Ok(head)
    }
    fn str(&mut self, max: usize, what: &str) -> std::result::Result<&'a str, String> {
        std::str::from_utf8(self.field(max, what)?).map_err(|e| format!("{what} is not UTF-8: {e}"))
    }
    fn key(&mut self) -> std::result::Result<&'a str, String> {
        self.str(MAX_KEY_LEN, "key")
    }
    fn value(&mut self, what: &str) -> std::result::Result<&'a [u8], String> {
        self.field(MAX_VALUE_LEN, what)
    }
    fn finish(self) -> std::result::Result<(), String> {
        if self.rest.is_empty() { Ok(()) } else { Err(format!("{} trailing bytes", self.rest.len())) }
    }
}

impl<'a> Request<'a> {
    /// Checks the limits a well-behaved client enforces before sending.
    fn validate(&self) -> Result<()> {
        match self {
            Request::Set { key, value } => {
                check_key(key)?;
                check_value(value)
            }
            Request::Get { key, .. } | Request::TryGet { key } | Request::Add { key, .. } | Request::Delete { key } => {
                check_key(key)
            }
            Request::Wait { keys, .. } => keys.iter().try_for_each(|k| check_key(k)),
            Request::CompareSet { key, expected, desired } => {
                check_key(key)?;
                expected.map_or(Ok(()), check_value)?;
                check_value(desired)
            }
            Request::Keys { prefix } => check_key(prefix),
        }
    }

    /// What the request is, for error messages.
    fn describe(&self) -> String {
        match self {
            Request::Set { key, .. } => format!("set({key:?})"),
            Request::Get { key, .. } => format!("get({key:?})"),
            Request::TryGet { key } => format!("try_get({key:?})"),
            Request::Wait { keys, .. } => match keys.as_slice() {
                [] => "wait([])".to_string(),
                [one] => format!("wait([{one:?}])"),
                [first, rest @ ..] => format!("wait([{first:?}, and {} more])", rest.len()),
            },
            Request::Add { key, .. } => format!("add({key:?})"),
            Request::CompareSet { key, .. } => format!("compare_set({key:?})"),
            Request::Delete { key } => format!("delete({key:?})"),
            Request::Keys { prefix } => format!("keys({prefix:?})"),
        }
    }

    /// How long the server may legitimately take before replying.
    fn wait_time(&self) -> Option<Duration> {
        match self {
            Request::Get { timeout, .. } | Request::Wait { timeout, .. } => Some((*timeout).min(MAX_WAIT)),
            _ => None,
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        match self {
            Request::Set { key, value } => {
                e.u8(OP_SET);
                e.field(key.as_bytes());
                e.field(value);
            }
            Request::Get { key, timeout } => {
                e.u8(OP_GET);
                e.millis(*timeout);
                e.field(key.as_bytes());
            }
            Request::TryGet { key } => {
                e.u8(OP_TRY_GET);
                e.field(key.as_bytes());
            }
            Request::Wait { keys, timeout } => {
                e.u8(OP_WAIT);
                e.millis(*timeout);
                e.len(keys.len());
                keys.iter().for_each(|k| e.field(k.as_bytes()));
            }
            Request::Add { key, delta } => {
                e.u8(OP_ADD);
                e.field(key.as_bytes());
                e.i64(*delta);
            }
            Request::CompareSet { key, expected, desired } => {
                e.u8(OP_COMPARE_SET);
                e.field(key.as_bytes());
                match expected {
                    None => e.u8(0),
                    Some(v) => {
                        e.u8(1);
                        e.field(v);
                    }
                }
                e.field(desired);
            }
            Request::Delete { key } => {
                e.u8(OP_DELETE);
                e.field(key.as_bytes());
            }
            Request::Keys { prefix } => {
                e.u8(OP_KEYS);
                e.field(prefix.as_bytes());
            }
        }
        e.0
    }

    fn decode(payload: &'a [u8]) -> std::result::Result<Request<'a>, String> {
        let mut d = Decoder { rest: payload };
        let request = match d.u8("opcode")? {
            OP_SET => Request::Set { key: d.key()?, value: d.value("value")? },
            OP_GET => {
                let timeout = d.millis("timeout")?;
                Request::Get { key: d.key()?, timeout }
            }
            OP_TRY_GET => Request::TryGet { key: d.key()? },
            OP_WAIT => {
                let timeout = d.millis("timeout")?;
                let n = d.count("key count")?;
                let keys = (0..n).map(|_| d.key()).collect::<std::result::Result<_, _>>()?;
                Request::Wait { keys, timeout }
            }
            OP_ADD => Request::Add { key: d.key()?, delta: d.i64("delta")? },
            OP_COMPARE_SET => {
                let key = d.key()?;
                let expected = if d.flag("has_expected")? { Some(d.value("expected value")?) } else { None };
                Request::CompareSet { key, expected, desired: d.value("desired value")? }
            }
            OP_DELETE => Request::Delete { key: d.key()? },
            OP_KEYS => Request::Keys { prefix: d.key()? },
            other => return Err(format!("unknown store opcode {other}")),
        };
        d.finish()?;
        Ok(request)
    }
}

impl Reply {
    fn name(&self) -> &'static str {
        match self {
            Reply::Done => "done",
            Reply::Value(_) => "value",
            Reply::Maybe(_) => "maybe",
            Reply::Int(_) => "int",
            Reply::Flag(_) => "flag",
            Reply::Keys(_) => "keys",
            Reply::TimedOut { .. } => "timed_out",
            Reply::Failed(_) => "failed",
        }
    }

    fn failed(message: &str) -> Reply {
        let mut end = message.len().min(MAX_MESSAGE_LEN);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        Reply::Failed(message[..end].to_string())
    }

    /// Encodes the reply; one too large for a frame becomes a `Failed` saying so.
    fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::default();
        match self {
            Reply::Done => e.u8(TAG_DONE),
            Reply::Value(v) => {
                e.u8(TAG_VALUE);
                e.field(v);
            }
            Reply::Maybe(v) => {
                e.u8(TAG_MAYBE);
                match v {
                    None => e.u8(0),
                    Some(v) => {
                        e.u8(1);
                        e.field(v);
                    }
                }
            }
            Reply::Int(v) => {
                e.u8(TAG_INT);
                e.i64(*v);
            }
            Reply::Flag(v) => {
                e.u8(TAG_FLAG);
                e.u8(u8::from(*v));
            }
            Reply::Keys(keys) => {
                e.u8(TAG_KEYS);
                e.len(keys.len());
                keys.iter().for_each(|k| e.field(k.as_bytes()));
            }
            Reply::TimedOut { key, waited } => {
                e.u8(TAG_TIMED_OUT);
                e.field(key.as_bytes());
                e.millis(*waited);
            }
            Reply::Failed(message) => {
                e.u8(TAG_FAILED);
                e.field(message.as_bytes());
            }
        }
        if e.0.len() > MAX_REPLY_LEN {
            return Reply::failed(&format!("reply of {} bytes exceeds the limit of {MAX_REPLY_LEN}", e.0.len()))
                .encode();
        }
        e.0
    }

    fn decode(payload: &[u8]) -> std::result::Result<Reply, String> {
        let mut d = Decoder { rest: payload };
        let reply = match d.u8("reply tag")? {
            TAG_DONE => Reply::Done,
            TAG_VALUE => Reply::Value(d.value("value")?.to_vec()),
            TAG_MAYBE => Reply::Maybe(if d.flag("present")? { Some(d.value("value")?.to_vec()) } else { None }),
            TAG_INT => Reply::Int(d.i64("integer")?),
            TAG_FLAG => Reply::Flag(d.flag("flag")?),
            TAG_KEYS => {
                let n = d.count("key count")?;
                let keys = (0..n).map(|_| d.key().map(str::to_string)).collect::<std::result::Result<_, _>>()?;
                Reply::Keys(keys)
            }
            TAG_TIMED_OUT => {
                let key = d.key()?.to_string();
                Reply::TimedOut { key, waited: d.millis("waited")? }
            }
            TAG_FAILED => Reply::Failed(d.str(MAX_MESSAGE_LEN, "error message")?.to_string()),
            other => return Err(format!("unknown store reply tag {other}")),
        };
        d.finish()?;
        Ok(reply)
    }
}

// ---------------------------------------------------------------------------
// Socket helpers
// ---------------------------------------------------------------------------

/// What an idle connection looks like without reading from it.
#[derive(Debug, PartialEq, Eq)]
enum Idle {
    /// Nothing to read; the peer is presumably there.
    Quiet,
    /// Bytes are waiting.
    Readable,
    /// The peer closed the connection or it failed.
    Closed,
}

fn idle_state(stream: &TcpStream) -> Idle {
    if stream.set_nonblocking(true).is_err() {
        return Idle::Quiet;
    }
    let peeked = stream.peek(&mut [0u8; 1]);
    let restored = stream.set_nonblocking(false);
    match peeked {
        // A socket we cannot put back into blocking mode is of no further use.
        _ if restored.is_err() => Idle::Closed,
        Ok(0) => Idle::Closed,
        Ok(_) => Idle::Readable,
        Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => Idle::Quiet,
        Err(_) => Idle::Closed,
    }
}

/// Low latency for small requests, keep-alive so that a vanished peer is noticed
/// on a connection nobody is writing to.
fn tune(stream: &TcpStream, peer: &str) -> Result<()> {
    stream.set_nodelay(true).map_err(|e| Error::io(format!("setting TCP_NODELAY on the connection to {peer}"), e))?;
    let keepalive =
        TcpKeepalive::new().with_time(Duration::from_secs(60)).with_interval(Duration::from_secs(10)).with_retries(6);
    SockRef::from(stream)
        .set_tcp_keepalive(&keepalive)
        .map_err(|e| Error::io(format!("enabling TCP keep-alive on the connection to {peer}"), e))?;
    stream
        .set_write_timeout(Some(OP_TIMEOUT))
        .map_err(|e| Error::io(format!("setting the write timeout on the connection to {peer}"), e))
}

fn set_read_timeout(stream: &TcpStream, timeout: Option<Duration>, peer: &str) -> Result<()> {
    stream
        .set_read_timeout(timeout)
        .map_err(|e| Error::io(format!("setting the read timeout on the connection to {peer}"), e))
}

/// Adds `doing` to the context of an I/O error, flagging timeouts explicitly (a
/// socket read timeout surfaces as `WouldBlock`, whose message says nothing of time).
fn io_context(doing: &str) -> impl FnOnce(Error) -> Error + '_ {
    move |e| match e {
        Error::Io { context, source } => {
            let context = if matches!(source.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
                format!("timed out {doing} ({context})")
            } else {
                format!("failed {doing} ({context})")
            };
            Error::Io { context, source }
        }
        other => other,
    }
}

// ---------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------

/// Serves a [`MemStore`] over TCP to authenticated [`TcpStore`] clients, one
/// thread per connection. Dropping it (or [`StoreServer::shutdown`]) stops it.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    /// A second handle on the listening socket, used to wake the accept thread.
    listener: Option<TcpListener>,
    accept_thread: Option<JoinHandle<()>>,
}

struct Shared {
    store: MemStore,
    secret: Vec<u8>,
    stop: AtomicBool,
    connections: Mutex<Vec<Connection>>,
}

/// A served connection: a handle to close it with, and the thread serving it.
struct Connection {
    stream: TcpStream,
    thread: JoinHandle<()>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .field("running", &self.accept_thread.is_some())
            .field("store", &self.shared.store)
            .finish_non_exhaustive()
    }
}

impl StoreServer {
    /// Binds `addr` (e.g. `"0.0.0.0:29500"`, or port 0 for any free port) and
    /// starts serving. Every client must prove it holds `secret`, which must not
    /// be empty.
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug, secret: Vec<u8>) -> Result<StoreServer> {
        if secret.is_empty() {
            return Err(Error::InvalidArgument("the job secret is empty".to_string()));
        }
        let listener =
            TcpListener::bind(&addr).map_err(|e| Error::io(format!("binding the rendezvous store to {addr:?}"), e))?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io(format!("reading the local address of the store bound to {addr:?}"), e))?;
        let waker =
            listener.try_clone().map_err(|e| Error::io(format!("duplicating the store listener on {local}"), e))?;
        let shared = Arc::new(Shared {
            store: MemStore::default(),
            secret,
            stop: AtomicBool::new(false),
            connections: Mutex::new(Vec::new()),
        });
        let accept_shared = Arc::clone(&shared);
        let accept_thread = thread::Builder::new()
            .name("shoal-store-accept".to_string())
            .spawn(move || accept_loop(&listener, &accept_shared))
            .map_err(|e| Error::io(format!("spawning the accept thread of the store on {local}"), e))?;
        debug!(addr = %local, "rendezvous store listening");
        Ok(StoreServer { addr: local, shared, listener: Some(waker), accept_thread: Some(accept_thread) })
    }

    /// The address the server listens on (with the real port if bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting, closes every connection and joins all server threads.
    /// Clients waiting on the server get an error. Idempotent; also run on drop.
    pub fn shutdown(&mut self) {
        let Some(accept_thread) = self.accept_thread.take() else {
            return;
        };
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the blocked accept(): a connection to ourselves works everywhere;
        // shutting the listening socket down also wakes it on Linux should the
        // connection fail (e.g. a firewall in the way).
        let _ = TcpStream::connect_timeout(&wake_addr(self.addr), Duration::from_secs(1));
        if let Some(listener) = self.listener.take() {
            let _ = SockRef::from(&listener).shutdown(Shutdown::Both);
        }
        if accept_thread.join().is_err() {
            warn!(addr = %self.addr, "rendezvous store accept thread panicked");
        }
        // The accept thread is gone, so no connection can be added any more.
        let connections = std::mem::take(&mut *self.shared.lock_connections());
        for c in &connections {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        for c in connections {
            if c.thread.join().is_err() {
                warn!(addr = %self.addr, "rendezvous store connection thread panicked");
            }
        }
        debug!(addr = %self.addr, "rendezvous store stopped");
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Where to connect to reach a listener bound to `addr`.
fn wake_addr(addr: SocketAddr) -> SocketAddr {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, addr.port())
}

impl Shared {
    fn lock_connections(&self) -> MutexGuard<'_, Vec<Connection>> {
        self.connections.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    for incoming in listener.incoming() {
        if shared.stopping() {
            break;
        }
        match incoming {
            Ok(stream) => spawn_connection(shared, stream),
            Err(e) => {
                warn!(error = %e, "rendezvous store failed to accept a connection");
                // E.g. out of file descriptors: do not spin while it lasts.
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn spawn_connection(shared: &Arc<Shared>, stream: TcpStream) {
    let peer = stream.peer_addr().map_or_else(|_| "unknown peer".to_string(), |a| a.to_string());
    let handle = match stream.try_clone() {
        Ok(h) => h,
        Err(e) => {
            warn!(peer, error = %e, "rendezvous store dropped a connection it could not track");
            return;
        }
    };
    let thread_shared = Arc::clone(shared);
    let spawned = thread::Builder::new()
        .name("shoal-store-conn".to_string())
        .spawn(move || serve_connection(&thread_shared, stream, &peer));
    match spawned {
        Ok(thread) => {
            let mut connections = shared.lock_connections();
            for done in connections.extract_if(.., |c| c.thread.is_finished()) {
                let _ = done.thread.join();
            }
            connections.push(Connection { stream: handle, thread });
        }
        Err(e) => warn!(error = %e, "rendezvous store could not spawn a connection thread"),
    }
}

fn serve_connection(shared: &Shared, mut stream: TcpStream, peer: &str) {
    match serve(shared, &mut stream, peer) {
        Ok(()) => debug!(peer, "rendezvous store client disconnected"),
        Err(e) if shared.stopping() => debug!(peer, error = %e, "rendezvous store connection closed by shutdown"),
        Err(e) => warn!(peer, error = %e, "rendezvous store closed a connection"),
    }
    // Close the connection itself, not just this handle: the server keeps another.
    let _ = stream.shutdown(Shutdown::Both);
}

/// Authenticates the client, then answers requests until it disconnects. An
/// error means the connection must be closed.
fn serve(shared: &Shared, stream: &mut TcpStream, peer: &str) -> Result<()> {
    tune(stream, peer)?;
    set_read_timeout(stream, Some(HANDSHAKE_TIMEOUT), peer)?;
    auth::accept(stream, &shared.secret, peer)?;
    loop {
        // Clients legitimately idle between requests; keep-alive and shutdown
        // bound this wait. Once a header is in, the body must follow promptly.
        set_read_timeout(stream, None, peer)?;
        let header = match frame::read_header(stream, MAX_REQUEST_LEN as u64, peer) {
            Ok(h) => h,
            Err(Error::Io { source, .. }) if source.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        if header.kind != Kind::StoreRequest {
            return Err(Error::Protocol {
                peer: peer.to_string(),
                detail: format!("expected a StoreRequest frame, got {:?}", header.kind),
            });
        }
        set_read_timeout(stream, Some(OP_TIMEOUT), peer)?;
        // `read_header` bounded the length by MAX_REQUEST_LEN.
        let mut body = vec![0u8; usize::try_from(header.len).unwrap_or(MAX_REQUEST_LEN)];
        stream
            .read_exact(&mut body)
            .map_err(|e| Error::io(format!("reading store request #{} from {peer}", header.seq), e))?;
        let request = Request::decode(&body).map_err(|detail| Error::Protocol { peer: peer.to_string(), detail })?;
        let Some(reply) = execute(shared, &request, stream) else {
            return Ok(());
        };
        frame::write_frame(stream, Kind::StoreReply, header.seq, &reply.encode(), peer)?;
    }
}

/// Runs one request against the shared map. `None` means the client left (or
/// the server is stopping) during a wait and nobody is left to answer.
fn execute(shared: &Shared, request: &Request<'_>, stream: &TcpStream) -> Option<Reply> {
    let store = &shared.store;
    let keep_waiting = || !shared.stopping() && idle_state(stream) != Idle::Closed;
    let reply = |result: Result<Reply>| match result {
        Ok(r) => r,
        Err(Error::Store { detail, .. }) => Reply::failed(&detail),
        Err(e) => Reply::failed(&e.to_string()),
    };
    Some(match request {
        Request::Set { key, value } => reply(store.set(key, value).map(|()| Reply::Done)),
        Request::TryGet { key } => reply(store.try_get(key).map(Reply::Maybe)),
        Request::Add { key, delta } => reply(store.add(key, *delta).map(Reply::Int)),
        Request::CompareSet { key, expected, desired } => {
            reply(store.compare_set(key, *expected, desired).map(Reply::Value))
        }
        Request::Delete { key } => reply(store.delete(key).map(Reply::Flag)),
        Request::Keys { prefix } => reply(store.keys(prefix).map(Reply::Keys)),
        Request::Get { key, timeout } => match store.wait_keys(&[key], *timeout, keep_waiting) {
            Ok(map) => Reply::Value(map.get(*key).cloned().unwrap_or_default()),
            Err(WaitEnd::TimedOut { missing, waited }) => Reply::TimedOut { key: missing, waited },
            Err(WaitEnd::Abandoned) => return None,
        },
        Request::Wait { keys, timeout } => match store.wait_keys(keys, *timeout, keep_waiting) {
            Ok(_) => Reply::Done,
            Err(WaitEnd::TimedOut { missing, waited }) => Reply::TimedOut { key: missing, waited },
            Err(WaitEnd::Abandoned) => return None,
        },
    })
}

// ---------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------

/// Client of a [`StoreServer`].
///
/// Requests from several threads run concurrently, each on its own connection
/// (a thread blocked in `get` does not hold up another thread's `set`): idle
/// connections are pooled, and a new one is opened, with the timeout given to
/// [`TcpStore::connect`], when none is free.
pub struct TcpStore {
    addr: String,
    secret: Vec<u8>,
    connect_timeout: Duration,
    idle: Mutex<Vec<TcpStream>>,
    next_seq: AtomicU64,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl TcpStore {
    /// Connects to the store at `addr` (`host:port`) and authenticates with
    /// `secret`. Until `timeout` (capped at [`MAX_WAIT`]) passes it retries while
    /// the server is unreachable, since the server may start after its clients.
    /// A refused handshake is [`Error::Auth`] and is not retried.
    pub fn connect(addr: &str, secret: &[u8], timeout: Duration) -> Result<TcpStore> {
        if secret.is_empty() {
            return Err(Error::InvalidArgument("the job secret is empty".to_string()));
        }
        let store = TcpStore {
            addr: addr.to_string(),
            secret: secret.to_vec(),
            connect_timeout: timeout.min(MAX_WAIT),
            idle: Mutex::new(Vec::new()),
            next_seq: AtomicU64::new(1),
        };
        let first = store.open()?;
        store.check_in(first);
        Ok(store)
    }

    fn lock_idle(&self) -> MutexGuard<'_, Vec<TcpStream>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens and authenticates a new connection, retrying unreachable servers
    /// until `connect_timeout` passes.
    fn open(&self) -> Result<TcpStream> {
        let start = Instant::now();
        let deadline = start + self.connect_timeout;
        let mut backoff = Duration::from_millis(10);
        let mut attempts = 0u32;
        let stream = loop {
            attempts += 1;
            let left = deadline.saturating_duration_since(Instant::now());
            match dial(&self.addr, left.max(Duration::from_millis(10))) {
                Ok(stream) => break stream,
                Err(e) if is_retryable(&e) && !left.is_zero() => {
                    debug!(addr = %self.addr, attempts, error = %e, "rendezvous store not reachable yet; retrying");
                    thread::sleep(backoff.min(left));
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(e) => {
                    return Err(Error::io(
                        format!(
                            "connecting to the rendezvous store at {} ({attempts} attempts over {:?})",
                            self.addr,
                            start.elapsed()
                        ),
                        e,
                    ));
                }
            }
        };
        tune(&stream, &self.addr)?;
        // The handshake gets what is left of the deadline, but at least a second.
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
        set_read_timeout(&stream, Some(left), &self.addr)?;
        let mut stream = stream;
        auth::connect(&mut stream, &self.secret, b"", &self.addr)?;
        Ok(stream)
    }

    /// An idle pooled connection that still looks healthy, or a new one.
    fn check_out(&self) -> Result<TcpStream> {
        loop {
            let Some(stream) = self.lock_idle().pop() else {
                return self.open();
            };
            // Anything but silence (the server closed it, or sent something
            // nobody asked for) makes the connection unusable.
            if idle_state(&stream) == Idle::Quiet {
                return Ok(stream);
            }
        }
    }

    fn check_in(&self, stream: TcpStream) {
        let mut idle = self.lock_idle();
        if idle.len() < MAX_IDLE_CONNECTIONS {
            idle.push(stream);
        }
    }

    /// Sends one request and returns its reply, with `TimedOut` and `Failed`
    /// already turned into errors.
    fn call(&self, request: &Request<'_>) -> Result<Reply> {
        request.validate()?;
        let payload = request.encode();
        if payload.len() > MAX_REQUEST_LEN {
            return Err(Error::InvalidArgument(format!(
                "store request {} of {} bytes exceeds {MAX_REQUEST_LEN}",
                request.describe(),
                payload.len()
            )));
        }
        let reply_timeout = request.wait_time().map_or(OP_TIMEOUT, |w| w + REPLY_GRACE);
        let mut stream = self.check_out()?;
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        // On any error the connection is dropped, not returned to the pool: its
        // state (a half-sent request, a reply still on its way) is unknown.
        let reply = self.exchange(&mut stream, seq, &payload, reply_timeout, request)?;
        self.check_in(stream);
        match reply {
            Reply::TimedOut { key, waited } => Err(Error::StoreTimeout { key, waited }),
            Reply::Failed(detail) => Err(Error::Store { addr: self.addr.clone(), detail }),
            other => Ok(other),
        }
    }

    fn exchange(
        &self,
        stream: &mut TcpStream,
        seq: u64,
        payload: &[u8],
        reply_timeout: Duration,
        request: &Request<'_>,
    ) -> Result<Reply> {
        let addr = self.addr.as_str();
        set_read_timeout(stream, Some(reply_timeout), addr)?;
        frame::write_frame(stream, Kind::StoreRequest, seq, payload, addr)
            .map_err(io_context(&format!("sending store request {}", request.describe())))?;
        let (header, body) = frame::read_frame(stream, &[Kind::StoreReply], addr)
            .map_err(io_context(&format!("waiting for the reply to store request {}", request.describe())))?;
        let protocol = |detail: String| Error::Protocol { peer: addr.to_string(), detail };
        if header.seq != seq {
            return Err(protocol(format!("store reply #{} answers no request (expected #{seq})", header.seq)));
        }
        Reply::decode(&body).map_err(protocol)
    }

    fn unexpected(&self, request: &Request<'_>, reply: &Reply) -> Error {
        Error::Protocol {
            peer: self.addr.clone(),
            detail: format!("a {} reply does not answer {}", reply.name(), request.describe()),
        }
    }
}

/// Connects to the first address of `addr` that accepts.
fn dial(addr: &str, timeout: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{addr} resolved to no address"));
    for candidate in addr.to_socket_addrs()? {
        match TcpStream::connect_timeout(&candidate, timeout) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// Whether a failure to connect may go away by itself (server not up yet, name
/// not yet resolvable, network hiccup) rather than being a mistake in `addr`.
fn is_retryable(e: &io::Error) -> bool {
    !matches!(e.kind(), io::ErrorKind::InvalidInput | io::ErrorKind::PermissionDenied | io::ErrorKind::Unsupported)
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let request = Request::Set { key, value };
        match self.call(&request)? {
            Reply::Done => Ok(()),
            other => Err(self.unexpected(&request, &other)),
        }
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let request = Request::Get { key, timeout };
        match self.call(&request)? {
            Reply::Value(v) => Ok(v),
            other => Err(self.unexpected(&request, &other)),
        }
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let request = Request::TryGet { key };
        match self.call(&request)? {
            Reply::Maybe(v) => Ok(v),
            other => Err(self.unexpected(&request, &other)),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let request = Request::Wait { keys: keys.to_vec(), timeout };
        match self.call(&request)? {
            Reply::Done => Ok(()),
            other => Err(self.unexpected(&request, &other)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let request = Request::Add { key, delta };
        match self.call(&request)? {
            Reply::Int(v) => Ok(v),
            other => Err(self.unexpected(&request, &other)),
        }
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        let request = Request::CompareSet { key, expected, desired };
        match self.call(&request)? {
            Reply::Value(v) => Ok(v),
            other => Err(self.unexpected(&request, &other)),
        }
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let request = Request::Delete { key };
        match self.call(&request)? {
            Reply::Flag(existed) => Ok(existed),
            other => Err(self.unexpected(&request, &other)),
        }
    }

    fn keys(&self, prefix: &str) -> Result<Vec<String>> {
        let request = Request::Keys { prefix };
        match self.call(&request)? {
            Reply::Keys(keys) => Ok(keys),
            other => Err(self.unexpected(&request, &other)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::Barrier;

    use rand::{Rng, SeedableRng};

    use super::*;

    const SECRET: &[u8] = b"test-job-secret";
    const LONG: Duration = Duration::from_secs(10);

    /// Hands out clients of one store, so the same behaviour suite runs on both
    /// backends.
    trait Backend {
        fn client(&self) -> Arc<dyn Store>;
    }

    struct Mem(MemStore);

    impl Backend for Mem {
        fn client(&self) -> Arc<dyn Store> {
            Arc::new(self.0.clone())
        }
    }

    struct Tcp(StoreServer);

    impl Tcp {
        fn new() -> Tcp {
            Tcp(StoreServer::bind("127.0.0.1:0", SECRET.to_vec()).expect("bind a store server"))
        }
        fn addr(&self) -> String {
            self.0.local_addr().to_string()
        }
        fn tcp_client(&self) -> TcpStore {
            TcpStore::connect(&self.addr(), SECRET, LONG).expect("connect to the store server")
        }
        /// Connection threads still running on the server.
        fn live_connections(&self) -> usize {
            self.0.shared.lock_connections().iter().filter(|c| !c.thread.is_finished()).count()
        }
        /// A raw connection that has passed the handshake.
        fn authenticated_raw(&self) -> TcpStream {
            let mut raw = TcpStream::connect(self.0.local_addr()).expect("connect");
            raw.set_read_timeout(Some(LONG)).expect("read timeout");
            auth::connect(&mut raw, SECRET, b"raw", "server").expect("authenticate");
            raw
        }
    }

    impl Backend for Tcp {
        fn client(&self) -> Arc<dyn Store> {
            Arc::new(self.tcp_client())
        }
    }

    macro_rules! on_both_backends {
        ($($name:ident),* $(,)?) => {
            mod mem {
                $( #[test] fn $name() { super::$name(&super::Mem(super::MemStore::default())); } )*
            }
            mod tcp {
                $( #[test] fn $name() { super::$name(&super::Tcp::new()); } )*
            }
        };
    }

    on_both_backends!(
        set_and_get,
        get_waits_for_a_later_set,
        get_times_out_naming_the_key,
        wait_names_the_first_missing_key,
        concurrent_adds_sum_exactly,
        add_refuses_non_integers_and_overflow,
        compare_set_semantics,
        delete_reports_whether_the_key_existed,
        keys_by_prefix_are_sorted,
        size_limits_are_enforced,
    );

    fn set_and_get(b: &dyn Backend) {
        let s = b.client();
        assert_eq!(s.try_get("a").expect("try_get"), None);
        s.set("a", b"1").expect("set");
        assert_eq!(s.get("a", LONG).expect("get"), b"1");
        s.set("a", b"").expect("overwrite with empty");
        assert_eq!(s.try_get("a").expect("try_get"), Some(Vec::new()));
        let binary: Vec<u8> = (0..=255).collect();
        s.set("bin/ü", &binary).expect("set binary");
        let other = b.client();
        assert_eq!(other.get("bin/ü", LONG).expect("get from another client"), binary);
        // A huge timeout is capped, not an overflow.
        assert_eq!(other.get("a", Duration::MAX).expect("get with Duration::MAX"), b"");
    }

    fn get_waits_for_a_later_set(b: &dyn Backend) {
        for shared in [false, true] {
            let waiter = b.client();
            // With a shared client the `set` must not queue behind the blocked `get`.
            let setter = if shared { Arc::clone(&waiter) } else { b.client() };
            let key = format!("late/{shared}");
            let setter_key = key.clone();
            let t = thread::spawn(move || {
                thread::sleep(Duration::from_millis(100));
                setter.set(&setter_key, b"here")
            });
            assert_eq!(waiter.get(&key, LONG).expect("get sees the later set"), b"here");
            t.join().expect("setter thread").expect("set");
        }
    }

    fn get_times_out_naming_the_key(b: &dyn Backend) {
        let s = b.client();
        let start = Instant::now();
        match s.get("never", Duration::from_millis(150)) {
            Err(Error::StoreTimeout { key, waited }) => {
                assert_eq!(key, "never");
                assert_eq!(waited, Duration::from_millis(150));
            }
            other => panic!("expected a store timeout, got {other:?}"),
        }
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(150) && took < Duration::from_secs(5), "{took:?}");
        // The store is still usable after a timeout.
        s.set("after", b"x").expect("set after a timeout");
        assert_eq!(s.try_get("after").expect("try_get"), Some(b"x".to_vec()));
    }

    fn wait_names_the_first_missing_key(b: &dyn Backend) {
        let s = b.client();
        s.wait(&[], Duration::ZERO).expect("waiting for nothing");
        s.set("w1", b"").expect("set");
        s.wait(&["w1"], LONG).expect("wait on a present key");
        match s.wait(&["w1", "w2", "w3"], Duration::from_millis(100)) {
            Err(Error::StoreTimeout { key, .. }) => assert_eq!(key, "w2"),
            other => panic!("expected a store timeout, got {other:?}"),
        }
        let setter = b.client();
        let t = thread::spawn(move || {
            thread::sleep(Duration::from_millis(50));
            setter.set("w3", b"")?;
            thread::sleep(Duration::from_millis(50));
            setter.set("w2", b"")
        });
        s.wait(&["w1", "w2", "w3"], LONG).expect("wait sees the later sets");
        t.join().expect("setter thread").expect("set");
    }

    fn concurrent_adds_sum_exactly(b: &dyn Backend) {
        const THREADS: usize = 8;
        const ADDS: usize = 50;
        let shared = b.client();
        // Half the threads share one client, the others have their own.
        let clients: Vec<Arc<dyn Store>> =
            (0..THREADS).map(|i| if i % 2 == 0 { Arc::clone(&shared) } else { b.client() }).collect();
        let barrier = Arc::new(Barrier::new(THREADS));
        let threads: Vec<_> = clients
            .into_iter()
            .map(|client| {
                let barrier = Arc::clone(&barrier);
                thread::spawn(move || {
                    barrier.wait();
                    (0..ADDS).map(|_| client.add("counter", 1)).collect::<Result<Vec<i64>>>()
                })
            })
            .collect();
        let mut seen: Vec<i64> =
            threads.into_iter().flat_map(|t| t.join().expect("adder thread").expect("add")).collect();
        seen.sort_unstable();
        // Every add saw a distinct intermediate value: no update was lost.
        let total = (THREADS * ADDS) as i64;
        assert_eq!(seen, (1..=total).collect::<Vec<_>>());
        assert_eq!(shared.add("counter", 0).expect("add 0"), total);
        assert_eq!(shared.try_get("counter").expect("try_get"), Some(total.to_string().into_bytes()));
        assert_eq!(shared.add("negative", -5).expect("add"), -5);
    }

    fn add_refuses_non_integers_and_overflow(b: &dyn Backend) {
        let s = b.client();
        s.set("text", b"abc").expect("set");
        assert!(matches!(s.add("text", 1), Err(Error::Store { .. })));
        s.set("big", i64::MAX.to_string().as_bytes()).expect("set");
        match s.add("big", 1) {
            Err(Error::Store { detail, .. }) => assert!(detail.contains("overflow"), "{detail}"),
            other => panic!("expected a store error, got {other:?}"),
        }
        assert_eq!(s.try_get("big").expect("try_get"), Some(i64::MAX.to_string().into_bytes()));
        // The connection survives a refused request.
        assert_eq!(s.add("fine", 2).expect("add"), 2);
    }

    fn compare_set_semantics(b: &dyn Backend) {
        let s = b.client();
        assert_eq!(s.compare_set("c", None, b"one").expect("cas on absent key"), b"one");
        assert_eq!(s.compare_set("c", None, b"two").expect("cas expecting absence"), b"one");
        assert_eq!(s.compare_set("c", Some(b"one"), b"two").expect("cas match"), b"two");
        assert_eq!(s.compare_set("c", Some(b"one"), b"three").expect("cas mismatch"), b"two");
        assert_eq!(s.try_get("c").expect("try_get"), Some(b"two".to_vec()));
        assert_eq!(s.compare_set("absent", Some(b"x"), b"y").expect("cas on absent key"), b"");
        assert_eq!(s.try_get("absent").expect("try_get"), None);
    }

    fn delete_reports_whether_the_key_existed(b: &dyn Backend) {
        let s = b.client();
        s.set("d", b"v").expect("set");
        assert!(s.delete("d").expect("delete"));
        assert!(!s.delete("d").expect("delete again"));
        assert_eq!(s.try_get("d").expect("try_get"), None);
        assert!(matches!(s.get("d", Duration::from_millis(20)), Err(Error::StoreTimeout { .. })));
    }

    fn keys_by_prefix_are_sorted(b: &dyn Backend) {
        let s = b.client();
        for k in ["job/b", "other", "job/ü", "jobs", "job/a", "job/c/x"] {
            s.set(k, k.as_bytes()).expect("set");
        }
        assert_eq!(s.keys("job/").expect("keys"), ["job/a", "job/b", "job/c/x", "job/ü"]);
        assert_eq!(s.keys("").expect("keys").len(), 6);
        assert_eq!(s.keys("job").expect("keys").last().map(String::as_str), Some("jobs"));
        assert!(s.keys("zzz").expect("keys").is_empty());
    }

    fn size_limits_are_enforced(b: &dyn Backend) {
        let s = b.client();
        let long_key = "k".repeat(MAX_KEY_LEN + 1);
        assert!(matches!(s.set(&long_key, b""), Err(Error::InvalidArgument(_))));
        assert!(matches!(s.get(&long_key, LONG), Err(Error::InvalidArgument(_))));
        assert!(matches!(s.set("k", &vec![0; MAX_VALUE_LEN + 1]), Err(Error::InvalidArgument(_))));
        let biggest = vec![7u8; MAX_VALUE_LEN];
        s.set(&"k".repeat(MAX_KEY_LEN), &biggest).expect("largest key and value");
        assert_eq!(s.get(&"k".repeat(MAX_KEY_LEN), LONG).expect("get"), biggest);
    }

    #[test]
    fn wrong_secret_is_refused_and_the_server_keeps_serving() {
        let server = Tcp::new();
        match TcpStore::connect(&server.addr(), b"not the secret", LONG) {
            Err(Error::Auth { .. }) => {}
            other => panic!("expected an auth failure, got {other:?}"),
        }
        assert!(matches!(TcpStore::connect(&server.addr(), b"", LONG), Err(Error::InvalidArgument(_))));
        let good = server.tcp_client();
        good.set("k", b"v").expect("set after a refused client");
        assert_eq!(good.get("k", LONG).expect("get"), b"v");
    }

    #[test]
    fn garbage_does_not_stop_the_server() {
        let server = Tcp::new();
        let good = server.tcp_client();
        good.set("before", b"1").expect("set");

        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for len in [1usize, 23, 24, 100, 10_000] {
            let junk: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            let mut raw = TcpStream::connect(server.0.local_addr()).expect("connect");
            let _ = raw.write_all(&junk);
        }
        // A plausible header announcing an enormous handshake.
        let huge = frame::Header { kind: Kind::Response, seq: 0, len: u64::MAX }.encode();
        let _ = TcpStream::connect(server.0.local_addr()).expect("connect").write_all(&huge);

        // Authenticated, then nonsense: each such connection is closed.
        let nonsense: [(Kind, Vec<u8>); 4] = [
            (Kind::StoreRequest, vec![99, 1, 2, 3]),
            (Kind::StoreRequest, vec![OP_SET, 0xff, 0xff, 0xff, 0xff]),
            (Kind::StoreRequest, Request::TryGet { key: "x" }.encode().into_iter().chain([0]).collect()),
            (Kind::Data, Vec::new()),
        ];
        for (kind, payload) in nonsense {
            let mut raw = server.authenticated_raw();
            frame::write_frame(&mut raw, kind, 1, &payload, "server").expect("send nonsense");
            let mut rest = Vec::new();
            let closed = matches!(raw.read_to_end(&mut rest), Ok(0) | Err(_));
            assert!(closed, "server answered nonsense with {} bytes", rest.len());
        }

        assert_eq!(good.get("before", LONG).expect("old client still served"), b"1");
        let late = server.tcp_client();
        assert_eq!(late.get("before", LONG).expect("new client served"), b"1");
    }

    #[test]
    fn client_may_start_before_the_server() {
        let port = TcpListener::bind("127.0.0.1:0").expect("probe").local_addr().expect("addr").port();
        let addr = format!("127.0.0.1:{port}");
        let client_addr = addr.clone();
        let client = thread::spawn(move || TcpStore::connect(&client_addr, SECRET, LONG));
        thread::sleep(Duration::from_millis(300));
        let _server = StoreServer::bind(addr.as_str(), SECRET.to_vec()).expect("bind the announced port");
        let client = client.join().expect("client thread").expect("connects once the server is up");
        client.set("k", b"v").expect("set");
    }

    #[test]
    fn connect_gives_up_at_its_timeout() {
        let port = TcpListener::bind("127.0.0.1:0").expect("probe").local_addr().expect("addr").port();
        let start = Instant::now();
        let result = TcpStore::connect(&format!("127.0.0.1:{port}"), SECRET, Duration::from_millis(200));
        match result {
            Err(Error::Io { context, .. }) => assert!(context.contains("rendezvous store"), "{context}"),
            other => panic!("expected an I/O error, got {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
        assert!(matches!(TcpStore::connect("no port here", SECRET, LONG), Err(Error::Io { .. })));
    }

    #[test]
    fn abandoned_wait_frees_its_thread() {
        let server = Tcp::new();
        let mut raw = server.authenticated_raw();
        let get = Request::Get { key: "never", timeout: Duration::from_secs(600) }.encode();
        frame::write_frame(&mut raw, Kind::StoreRequest, 1, &get, "server").expect("send get");
        let until = |want: usize| {
            let deadline = Instant::now() + Duration::from_secs(5);
            while server.live_connections() != want {
                assert!(Instant::now() < deadline, "{} live connections, want {want}", server.live_connections());
                thread::sleep(Duration::from_millis(20));
            }
        };
        until(1);
        drop(raw);
        until(0);
    }

    #[test]
    fn shutdown_releases_waiting_clients() {
        let mut server = Tcp::new();
        let client = server.tcp_client();
        let waiter = thread::spawn(move || client.get("never", Duration::from_secs(600)));
        thread::sleep(Duration::from_millis(200));
        let start = Instant::now();
        server.0.shutdown();
        server.0.shutdown();
        assert!(matches!(waiter.join().expect("waiter thread"), Err(Error::Io { .. })));
        assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
        assert!(TcpStore::connect(&server.addr(), SECRET, Duration::from_millis(100)).is_err());
    }

    #[test]
    fn codec_round_trips() {
        let requests = [
            Request::Set { key: "k", value: b"v" },
            Request::Get { key: "k", timeout: Duration::from_millis(1500) },
            Request::TryGet { key: "" },
            Request::Wait { keys: vec!["a", "b"], timeout: Duration::ZERO },
            Request::Add { key: "k", delta: -3 },
            Request::CompareSet { key: "k", expected: None, desired: b"d" },
            Request::CompareSet { key: "k", expected: Some(b""), desired: b"d" },
            Request::Delete { key: "k" },
            Request::Keys { prefix: "p/" },
        ];
        for r in &requests {
            let bytes = r.encode();
            let back = Request::decode(&bytes).expect("decode");
            assert_eq!(back.encode(), bytes, "{}", r.describe());
        }
        let replies = [
            Reply::Done,
            Reply::Value(b"v".to_vec()),
            Reply::Maybe(None),
            Reply::Maybe(Some(Vec::new())),
            Reply::Int(i64::MIN),
            Reply::Flag(true),
            Reply::Keys(vec!["a".to_string(), "b".to_string()]),
            Reply::TimedOut { key: "k".to_string(), waited: Duration::from_secs(2) },
            Reply::Failed("nope".to_string()),
        ];
        for r in &replies {
            let bytes = r.encode();
            let back = Reply::decode(&bytes).expect("decode");
            assert_eq!(back.encode(), bytes, "{}", r.name());
        }
    }

    #[test]
    fn codec_survives_garbage() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for _ in 0..20_000 {
            let len = rng.random_range(0..48);
            let mut junk: Vec<u8> = (0..len).map(|_| rng.random()).collect();
            if let Some(first) = junk.first_mut() {
                *first %= 10; // mostly valid opcodes and tags
            }
            let _ = Request::decode(&junk);
            let _ = Reply::decode(&junk);
        }
        // A count that promises more than the payload holds is refused up front.
        let mut e = Encoder::default();
        e.u8(TAG_KEYS);
        e.u32(u32::MAX);
        assert!(Reply::decode(&e.0).is_err());
    }
}
