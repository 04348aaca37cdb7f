//! The wire header shared by every Shoal TCP connection (data links and the
//! rendezvous store): `magic(4) version(1) kind(1) reserved(2) seq(8) len(8)`, all
//! little-endian, followed by `len` payload bytes; a `Data` frame has [`DATA_TIMING_LEN`] bytes between the two
//! (the sender's [`crate::arrival::Timing`]), not counted in `len`. A reader always knows the largest
//! length it will accept; anything else closes the connection with
//! [`Error::Protocol`], never a panic.

use std::io::{Read, Write};

use crate::error::{Error, Result};

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"SHOL";
/// Wire protocol version; bumped on any incompatible change.
pub const VERSION: u8 = 2;
/// Size of [`Header`] on the wire.
pub const HEADER_LEN: usize = 24;
/// Bytes of timing between a `Data` frame's header and its payload.
pub const DATA_TIMING_LEN: usize = crate::arrival::Timing::LEN;
/// Largest control frame (store requests, handshakes) a reader accepts.
pub const MAX_CONTROL_LEN: u64 = 64 << 20;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Handshake: server's challenge.
    Challenge = 1,
    /// Handshake: client's answer.
    Response = 2,
    /// Handshake: server's verdict and proof.
    Accept = 3,
    /// Handshake refused (payload: reason, UTF-8).
    Reject = 4,
    /// Collective payload bytes.
    Data = 10,
    /// Rendezvous store request.
    StoreRequest = 20,
    /// Rendezvous store reply.
    StoreReply = 21,
    /// A parameter server's request (`shoal-ps`: a push, a pull, …).
    PsRequest = 30,
    /// A parameter server's reply.
    PsReply = 31,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Challenge,
            2 => Kind::Response,
            3 => Kind::Accept,
            4 => Kind::Reject,
            10 => Kind::Data,
            20 => Kind::StoreRequest,
            21 => Kind::StoreReply,
            30 => Kind::PsRequest,
            31 => Kind::PsReply,
            _ => return None,
        })
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub seq: u64,
    pub len: u64,
}

impl Header {
    /// Encodes the header into its 24 wire bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and validates 24 wire bytes; `max_len` bounds the payload length.
    pub fn decode(b: &[u8; HEADER_LEN], max_len: u64, peer: &str) -> Result<Header> {
        let bad = |detail: String| Error::Protocol { peer: peer.to_string(), detail };
        if b[0..4] != MAGIC {
            return Err(bad(format!("bad magic {:02x?}", &b[0..4])));
        }
        if b[4] != VERSION {
            return Err(bad(format!("wire version {} (this build speaks {VERSION})", b[4])));
        }
        let kind = Kind::from_u8(b[5]).ok_or_else(|| bad(format!("unknown frame kind {}", b[5])))?;
        let seq = u64::from_le_bytes(b[8..16].try_into().unwrap_or_default());
        let len = u64::from_le_bytes(b[16..24].try_into().unwrap_or_default());
        if len > max_len {
            return Err(bad(format!("frame of {len} bytes exceeds the limit of {max_len}")));
        }
        Ok(Header { kind, seq, len })
    }
}

/// Writes one frame (header then payload).
pub fn write_frame(w: &mut impl Write, kind: Kind, seq: u64, payload: &[u8], peer: &str) -> Result<()> {
    let h = Header { kind, seq, len: payload.len() as u64 };
    w.write_all(&h.encode())
        .and_then(|()| w.write_all(payload))
        .and_then(|()| w.flush())
        .map_err(|e| Error::io(format!("writing a {kind:?} frame to {peer}"), e))
}

/// Reads one frame header.
pub fn read_header(r: &mut impl Read, max_len: u64, peer: &str) -> Result<Header> {
    let mut b = [0u8; HEADER_LEN];
    r.read_exact(&mut b).map_err(|e| Error::io(format!("reading a frame header from {peer}"), e))?;
    Header::decode(&b, max_len, peer)
}

/// Reads one whole control frame (bounded by [`MAX_CONTROL_LEN`]) and checks its kind.
pub fn read_frame(r: &mut impl Read, expect: &[Kind], peer: &str) -> Result<(Header, Vec<u8>)> {
    let h = read_header(r, MAX_CONTROL_LEN, peer)?;
    if !expect.contains(&h.kind) {
        return Err(Error::Protocol {
            peer: peer.to_string(),
            detail: format!("expected a frame of kind {expect:?}, got {:?}", h.kind),
        });
    }
    let mut payload = vec![0u8; h.len as usize];
    r.read_exact(&mut payload).map_err(|e| Error::io(format!("reading a {:?} frame body from {peer}", h.kind), e))?;
    Ok((h, payload))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_garbage() {
        let h = Header { kind: Kind::Data, seq: 7, len: 1234 };
        assert_eq!(Header::decode(&h.encode(), 1 << 20, "t").ok(), Some(h));
        let mut b = h.encode();
        b[0] = b'X';
        assert!(matches!(Header::decode(&b, 1 << 20, "t"), Err(Error::Protocol { .. })));
        assert!(matches!(Header::decode(&h.encode(), 100, "t"), Err(Error::Protocol { .. })));
        let mut b = h.encode();
        b[5] = 99;
        assert!(matches!(Header::decode(&b, 1 << 20, "t"), Err(Error::Protocol { .. })));
    }
}
