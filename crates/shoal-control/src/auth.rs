//! Bearer tokens: random, shown once, stored only as their SHA-256. A token maps to a user, a team and whether it
//! is an admin; a user sees and acts on its own team's jobs only, an admin on all.

use rand::RngCore;
use sha2::{Digest, Sha256};

/// A new token: `shoal_` and 32 random bytes in hex.
pub fn new_token() -> String {
    let mut b = [0u8; 32];
    rand::rng().fill_bytes(&mut b);
    format!("shoal_{}", hex(&b))
}

/// A job's secret: HMAC-SHA256 of its id under the server's key, in hex. Nothing secret about a job is stored; a
/// server with the same key derives the same secret after a restart (adopted workers keep authenticating).
pub fn derive_secret(key: &[u8], job_id: &str) -> String {
    use hmac::Mac;
    let Ok(mut mac) = hmac::Hmac::<Sha256>::new_from_slice(key) else {
        unreachable!("HMAC accepts keys of any length")
    };
    mac.update(b"shoal job secret\0");
    mac.update(job_id.as_bytes());
    hex(&mac.finalize().into_bytes())
}

pub fn hash_token(token: &str) -> String {
    hex(&Sha256::digest(token.as_bytes()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
