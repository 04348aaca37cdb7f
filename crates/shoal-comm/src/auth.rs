//! Mutual job-secret authentication for freshly opened Shoal TCP connections.
//!
//! Both ends hold the job secret; neither ever sends it. The handshake is a
//! challenge-response over [`crate::frame`] frames, all with sequence number 0:
//!
//! ```text
//! server -> client  Challenge  nonce_s (32 random bytes)
//! client -> server  Response   nonce_c (32) || mac_c (32) || hello (<= 4 KiB)
//!                              mac_c = HMAC-SHA256(secret, "shoal-auth-v1/client" || nonce_s || nonce_c || hello)
//! server -> client  Accept     mac_s = HMAC-SHA256(secret, "shoal-auth-v1/server" || nonce_c || nonce_s)
//!               or  Reject     reason (UTF-8, <= 1 KiB)
//! ```
//!
//! Invariants:
//! - Every frame read here has a tight length bound (the exact size where the size
//!   is fixed), so an unauthenticated peer can make us allocate at most
//!   `64 + 4096` bytes. Malformed input yields [`Error::Protocol`], never a panic.
//! - MACs are compared in constant time (`hmac`'s `verify_slice`).
//! - The two MACs use different labels and nonce orders, so neither side's proof
//!   can be reflected back as the other's; each side's fresh nonce makes replays
//!   of an old handshake fail.
//! - A side that does not hold the secret gets [`Error::Auth`] on both ends (the
//!   server after sending `Reject`, the client on `Reject` or a bad `Accept`).
//! - This module sets no timeouts: the caller configures the stream's read and
//!   write timeouts. An I/O failure (a timeout included) becomes [`Error::Io`]
//!   whose context names the handshake step that was under way.

use std::io::{self, Read, Write};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};
use crate::frame::{self, Kind};

type HmacSha256 = Hmac<Sha256>;

/// Length of each side's random nonce.
pub const NONCE_LEN: usize = 32;
/// Length of an HMAC-SHA256 tag.
pub const MAC_LEN: usize = 32;
/// Largest `hello` a client may send.
pub const MAX_HELLO_LEN: usize = 4096;
/// Largest `Reject` reason either side sends or accepts.
const MAX_REASON_LEN: usize = 1024;
/// Largest `Response` payload.
const MAX_RESPONSE_LEN: usize = NONCE_LEN + MAC_LEN + MAX_HELLO_LEN;

const CLIENT_LABEL: &[u8] = b"shoal-auth-v1/client";
const MESSAGE_LABEL: &[u8] = b"shoal-auth-v1/message";
const SERVER_LABEL: &[u8] = b"shoal-auth-v1/server";

/// Server side of the handshake on a freshly accepted stream. Returns the client's
/// `hello` bytes (e.g. its rank) once it proved it holds `secret`.
///
/// `peer` only labels errors. On a wrong proof the client is sent a `Reject` (best
/// effort) and this returns [`Error::Auth`].
pub fn accept(stream: &mut (impl Read + Write), secret: &[u8], peer: &str) -> Result<Vec<u8>> {
    check_secret(secret)?;
    let nonce_s = fresh_nonce();
    frame::write_frame(stream, Kind::Challenge, 0, &nonce_s, peer).map_err(during("sending the challenge"))?;

    let (_, response) = read_bounded(stream, Kind::Response, MAX_RESPONSE_LEN, peer)
        .map_err(during("waiting for the client's response"))?;
    let Some((nonce_c, mac_c, hello)) = split_response(&response) else {
        let detail = format!("handshake response of {} bytes is shorter than {}", response.len(), NONCE_LEN + MAC_LEN);
        reject(stream, &detail, peer);
        return Err(Error::Protocol { peer: peer.to_string(), detail });
    };

    let proof =
        keyed(secret)?.chain_update(CLIENT_LABEL).chain_update(nonce_s).chain_update(nonce_c).chain_update(hello);
    if proof.verify_slice(mac_c).is_err() {
        let detail = "client's proof does not match the job secret";
        reject(stream, detail, peer);
        return Err(Error::Auth { peer: peer.to_string(), detail: detail.to_string() });
    }

    let mac_s = keyed(secret)?.chain_update(SERVER_LABEL).chain_update(nonce_c).chain_update(nonce_s).finalize();
    frame::write_frame(stream, Kind::Accept, 0, &mac_s.into_bytes(), peer).map_err(during("sending the acceptance"))?;
    Ok(hello.to_vec())
}

/// Client side of the handshake. Sends `hello` (at most [`MAX_HELLO_LEN`] bytes) and
/// checks that the server also holds `secret`.
///
/// `peer` only labels errors. Returns [`Error::Auth`] when the server refuses us or
/// cannot prove it holds the secret.
pub fn connect(stream: &mut (impl Read + Write), secret: &[u8], hello: &[u8], peer: &str) -> Result<()> {
    check_secret(secret)?;
    if hello.len() > MAX_HELLO_LEN {
        return Err(Error::InvalidArgument(format!(
            "handshake hello of {} bytes exceeds {MAX_HELLO_LEN}",
            hello.len()
        )));
    }

    let (_, challenge) =
        read_bounded(stream, Kind::Challenge, NONCE_LEN, peer).map_err(during("waiting for the server's challenge"))?;
    let nonce_s: [u8; NONCE_LEN] = challenge.as_slice().try_into().map_err(|_| Error::Protocol {
        peer: peer.to_string(),
        detail: format!("handshake challenge of {} bytes, expected {NONCE_LEN}", challenge.len()),
    })?;

    let nonce_c = fresh_nonce();
    let mac_c = keyed(secret)?
        .chain_update(CLIENT_LABEL)
        .chain_update(nonce_s)
        .chain_update(nonce_c)
        .chain_update(hello)
        .finalize()
        .into_bytes();
    let mut response = Vec::with_capacity(NONCE_LEN + MAC_LEN + hello.len());
    response.extend_from_slice(&nonce_c);
    response.extend_from_slice(&mac_c);
    response.extend_from_slice(hello);
    frame::write_frame(stream, Kind::Response, 0, &response, peer).map_err(during("sending the response"))?;

    let (kind, verdict) = read_verdict(stream, peer).map_err(during("waiting for the server's verdict"))?;
    match kind {
        Kind::Accept => {
            let expected = keyed(secret)?.chain_update(SERVER_LABEL).chain_update(nonce_c).chain_update(nonce_s);
            expected.verify_slice(&verdict).map_err(|_| Error::Auth {
                peer: peer.to_string(),
                detail: "server's proof does not match the job secret".to_string(),
            })
        }
        _ => Err(Error::Auth {
            peer: peer.to_string(),
            detail: format!("server refused the handshake: {:?}", String::from_utf8_lossy(&verdict)),
        }),
    }
}

/// Splits a `Response` payload into `(nonce_c, mac_c, hello)`; `None` if too short.
fn split_response(response: &[u8]) -> Option<(&[u8; NONCE_LEN], &[u8; MAC_LEN], &[u8])> {
    let (nonce_c, rest) = response.split_first_chunk::<NONCE_LEN>()?;
    let (mac_c, hello) = rest.split_first_chunk::<MAC_LEN>()?;
    Some((nonce_c, mac_c, hello))
}

/// A message's tag under the job secret, in hex: what a task sends beside a report to the control plane (a
/// heartbeat over HTTP) so the server knows it comes from a holder of the secret, which never crosses the wire.
/// `HMAC-SHA256(secret, "shoal-auth-v1/message" || message)`, a label of its own so a tag cannot stand in for a
/// handshake's proof.
pub fn sign(secret: &[u8], message: &[u8]) -> Result<String> {
    check_secret(secret)?;
    let mut mac = keyed(secret)?;
    mac.update(MESSAGE_LABEL);
    mac.update(message);
    Ok(mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect())
}

/// Whether `tag` (hex, as [`sign`] writes it) is `message`'s tag under `secret`; compared in constant time. A
/// malformed tag is simply not valid.
pub fn verify(secret: &[u8], message: &[u8], tag: &str) -> bool {
    let bytes: Option<Vec<u8>> = (tag.len() == 2 * MAC_LEN && tag.is_ascii())
        .then(|| (0..MAC_LEN).map(|i| u8::from_str_radix(&tag[2 * i..2 * i + 2], 16).ok()).collect())
        .flatten();
    let (Some(bytes), Ok(()), Ok(mut mac)) = (bytes, check_secret(secret), keyed(secret)) else { return false };
    mac.update(MESSAGE_LABEL);
    mac.update(message);
    mac.verify_slice(&bytes).is_ok()
}

/// Rejects an empty secret: it would make every proof forgeable.
fn check_secret(secret: &[u8]) -> Result<()> {
    if secret.is_empty() {
        return Err(Error::InvalidArgument("the job secret is empty".to_string()));
    }
    Ok(())
}

fn fresh_nonce() -> [u8; NONCE_LEN] {
    let mut nonce = [0u8; NONCE_LEN];
    rand::fill(&mut nonce);
    nonce
}

fn keyed(secret: &[u8]) -> Result<HmacSha256> {
    // HMAC takes keys of any length, so this cannot fail; map it rather than unwrap.
    HmacSha256::new_from_slice(secret)
        .map_err(|e| Error::InvalidArgument(format!("job secret unusable as an HMAC key: {e}")))
}

/// Best-effort `Reject`: the connection is being dropped anyway, so a failure to
/// deliver the reason is not worth reporting over the real error.
fn reject(stream: &mut impl Write, reason: &str, peer: &str) {
    let mut end = reason.len().min(MAX_REASON_LEN);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let _ = frame::write_frame(stream, Kind::Reject, 0, &reason.as_bytes()[..end], peer);
}

/// Reads one handshake frame of kind `expect` whose payload is at most `max_len`.
fn read_bounded(stream: &mut impl Read, expect: Kind, max_len: usize, peer: &str) -> Result<(Kind, Vec<u8>)> {
    read_one_of(stream, &[expect], max_len, peer)
}

/// Reads the server's `Accept` (exactly [`MAC_LEN`] bytes) or `Reject`.
fn read_verdict(stream: &mut impl Read, peer: &str) -> Result<(Kind, Vec<u8>)> {
    let (kind, payload) = read_one_of(stream, &[Kind::Accept, Kind::Reject], MAX_REASON_LEN.max(MAC_LEN), peer)?;
    if kind == Kind::Accept && payload.len() != MAC_LEN {
        return Err(Error::Protocol {
            peer: peer.to_string(),
            detail: format!("handshake acceptance of {} bytes, expected {MAC_LEN}", payload.len()),
        });
    }
    Ok((kind, payload))
}

fn read_one_of(stream: &mut impl Read, expect: &[Kind], max_len: usize, peer: &str) -> Result<(Kind, Vec<u8>)> {
    let protocol = |detail: String| Error::Protocol { peer: peer.to_string(), detail };
    let header = frame::read_header(stream, max_len as u64, peer)?;
    if !expect.contains(&header.kind) {
        return Err(protocol(format!("expected a handshake frame of kind {expect:?}, got {:?}", header.kind)));
    }
    if header.seq != 0 {
        return Err(protocol(format!(
            "handshake frame {:?} has sequence number {}, expected 0",
            header.kind, header.seq
        )));
    }
    // `read_header` enforced `len <= max_len`, so this fits in memory and in usize.
    let len = usize::try_from(header.len).map_err(|_| protocol(format!("frame length {} overflows", header.len)))?;
    let mut payload = vec![0u8; len];
    stream
        .read_exact(&mut payload)
        .map_err(|e| Error::io(format!("reading a {:?} frame body from {peer}", header.kind), e))?;
    Ok((header.kind, payload))
}

/// Adds the handshake step to the context of I/O errors, flagging timeouts
/// explicitly (a socket read timeout surfaces as `WouldBlock` on Unix, whose
/// message says nothing about time).
fn during(step: &'static str) -> impl FnOnce(Error) -> Error {
    move |e| match e {
        Error::Io { context, source } => {
            let context = if matches!(source.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
                format!("auth handshake timed out {step} ({context})")
            } else {
                format!("auth handshake failed {step} ({context})")
            };
            Error::Io { context, source }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;
    use std::os::unix::net::UnixStream;
    use std::thread;
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_message_tag_proves_the_secret_and_the_message() {
        let tag = sign(b"job secret", b"{\"beat\":1}").expect("sign");
        assert_eq!(tag.len(), 64);
        assert!(verify(b"job secret", b"{\"beat\":1}", &tag));
        assert!(!verify(b"another secret", b"{\"beat\":1}", &tag), "wrong secret");
        assert!(!verify(b"job secret", b"{\"beat\":2}", &tag), "altered message");
        for bad in ["", "zz", &tag[..62], &format!("{}é", &tag[..62])] {
            assert!(!verify(b"job secret", b"{\"beat\":1}", bad), "malformed tag {bad:?}");
        }
        assert!(sign(b"", b"x").is_err(), "an empty secret signs nothing");
        assert!(!verify(b"", b"x", &tag));
    }

    /// A connected pair of sockets that cannot hang a test.
    fn pair() -> (UnixStream, UnixStream) {
        let (a, b) = UnixStream::pair().expect("socketpair");
        for s in [&a, &b] {
            s.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
            s.set_write_timeout(Some(Duration::from_secs(5))).expect("timeout");
        }
        (a, b)
    }

    /// Runs `accept` with `server_secret` against `connect` with `client_secret`.
    fn handshake(server_secret: &[u8], client_secret: &[u8], hello: &[u8]) -> (Result<Vec<u8>>, Result<()>) {
        let (mut s, mut c) = pair();
        let server_secret = server_secret.to_vec();
        let server = thread::spawn(move || accept(&mut s, &server_secret, "client"));
        let client = connect(&mut c, client_secret, hello, "server");
        (server.join().expect("server thread"), client)
    }

    /// A stream that reads from a fixed script and swallows writes.
    struct Scripted {
        input: Cursor<Vec<u8>>,
    }

    impl Read for Scripted {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.input.read(buf)
        }
    }

    impl Write for Scripted {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn scripted(input: Vec<u8>) -> Scripted {
        Scripted { input: Cursor::new(input) }
    }

    fn frame_bytes(kind: Kind, seq: u64, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        frame::write_frame(&mut out, kind, seq, payload, "t").expect("write to a Vec");
        out
    }

    #[test]
    fn good_secret_passes_both_ways() {
        let (server, client) = handshake(b"job-secret", b"job-secret", b"rank 3");
        assert_eq!(server.expect("server accepts"), b"rank 3");
        client.expect("client accepts");

        let (server, client) = handshake(b"k", b"k", &[7u8; MAX_HELLO_LEN]);
        assert_eq!(server.expect("server accepts").len(), MAX_HELLO_LEN);
        client.expect("client accepts");
    }

    #[test]
    fn wrong_secret_is_refused_on_both_sides() {
        let (server, client) = handshake(b"right", b"wrong", b"");
        assert!(matches!(server, Err(Error::Auth { .. })), "{server:?}");
        match client {
            Err(Error::Auth { detail, .. }) => assert!(detail.contains("refused"), "{detail}"),
            other => panic!("client should be refused, got {other:?}"),
        }
    }

    #[test]
    fn impostor_server_is_detected_by_the_client() {
        // A server that does not know the secret but answers Accept anyway.
        let (mut s, mut c) = pair();
        let server = thread::spawn(move || -> Result<()> {
            frame::write_frame(&mut s, Kind::Challenge, 0, &[1u8; NONCE_LEN], "c")?;
            read_bounded(&mut s, Kind::Response, MAX_RESPONSE_LEN, "c")?;
            frame::write_frame(&mut s, Kind::Accept, 0, &[0u8; MAC_LEN], "c")
        });
        let client = connect(&mut c, b"secret", b"", "server");
        assert!(matches!(client, Err(Error::Auth { .. })), "{client:?}");
        server.join().expect("server thread").expect("fake server ran");
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5_0a1);
        for len in [0usize, 1, 23, 24, 25, 100, 5000] {
            for _ in 0..20 {
                let junk: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                assert!(accept(&mut scripted(junk.clone()), b"s", "junk").is_err());
                assert!(connect(&mut scripted(junk), b"s", b"hi", "junk").is_err());
            }
        }
        // Well-formed headers with hostile contents.
        let huge = frame_bytes(Kind::Response, 0, &vec![0u8; MAX_RESPONSE_LEN + 1]);
        assert!(matches!(accept(&mut scripted(huge), b"s", "t"), Err(Error::Protocol { .. })));
        let short = frame_bytes(Kind::Response, 0, &[0u8; NONCE_LEN + MAC_LEN - 1]);
        assert!(matches!(accept(&mut scripted(short), b"s", "t"), Err(Error::Protocol { .. })));
        let wrong_kind = frame_bytes(Kind::Data, 0, &[0u8; NONCE_LEN + MAC_LEN]);
        assert!(matches!(accept(&mut scripted(wrong_kind), b"s", "t"), Err(Error::Protocol { .. })));
        let wrong_seq = frame_bytes(Kind::Challenge, 9, &[0u8; NONCE_LEN]);
        assert!(matches!(connect(&mut scripted(wrong_seq), b"s", b"", "t"), Err(Error::Protocol { .. })));
        let short_challenge = frame_bytes(Kind::Challenge, 0, &[0u8; NONCE_LEN - 1]);
        assert!(matches!(connect(&mut scripted(short_challenge), b"s", b"", "t"), Err(Error::Protocol { .. })));
        let mut bad_accept = frame_bytes(Kind::Challenge, 0, &[0u8; NONCE_LEN]);
        bad_accept.extend(frame_bytes(Kind::Accept, 0, &[0u8; MAC_LEN + 1]));
        assert!(matches!(connect(&mut scripted(bad_accept), b"s", b"", "t"), Err(Error::Protocol { .. })));
    }

    #[test]
    fn truncated_stream_is_an_io_error_naming_the_step() {
        let mut half_header = frame_bytes(Kind::Challenge, 0, &[0u8; NONCE_LEN]);
        half_header.truncate(10);
        match connect(&mut scripted(half_header), b"s", b"", "srv") {
            Err(Error::Io { context, .. }) => assert!(context.contains("server's challenge"), "{context}"),
            other => panic!("expected an I/O error, got {other:?}"),
        }
        let mut half_body = frame_bytes(Kind::Response, 0, &[0u8; NONCE_LEN + MAC_LEN]);
        half_body.truncate(frame::HEADER_LEN + 5);
        match accept(&mut scripted(half_body), b"s", "cli") {
            Err(Error::Io { context, .. }) => assert!(context.contains("client's response"), "{context}"),
            other => panic!("expected an I/O error, got {other:?}"),
        }
        // Nothing after the challenge: the client waits for a verdict that never comes.
        let only_challenge = frame_bytes(Kind::Challenge, 0, &[0u8; NONCE_LEN]);
        match connect(&mut scripted(only_challenge), b"s", b"", "srv") {
            Err(Error::Io { context, .. }) => assert!(context.contains("verdict"), "{context}"),
            other => panic!("expected an I/O error, got {other:?}"),
        }
    }

    #[test]
    fn silent_peer_times_out_with_the_step_named() {
        let (mut s, _c) = pair();
        s.set_read_timeout(Some(Duration::from_millis(50))).expect("timeout");
        match accept(&mut s, b"s", "cli") {
            Err(Error::Io { context, .. }) => {
                assert!(context.contains("timed out waiting for the client's response"), "{context}");
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    #[test]
    fn bad_arguments_are_refused_before_any_io() {
        assert!(matches!(accept(&mut scripted(Vec::new()), b"", "t"), Err(Error::InvalidArgument(_))));
        let long_hello = vec![0u8; MAX_HELLO_LEN + 1];
        assert!(matches!(connect(&mut scripted(Vec::new()), b"s", &long_hello, "t"), Err(Error::InvalidArgument(_))));
    }
}
