//! Secure aggregation of federated updates (Bonawitz et al., 2017): the server learns only the sum of a round's
//! updates.
//!
//! - Each client of a round draws an X25519 key pair and publishes the public key; every pair of clients `i < j`
//!   agrees a secret by Diffie–Hellman, expanded by ChaCha20 into a mask over the update's length.
//! - A client's update is quantized to fixed point ([`SCALE`] fractional bits, `i32` wrapping arithmetic), and
//!   client `i` adds the masks it shares with every later client and subtracts those it shares with every earlier
//!   one: each masked vector alone is uniform noise, and in the sum every mask cancels.
//! - Each client also cuts its secret key into Shamir shares (threshold [`threshold`], over GF(2^61 − 1)), one
//!   for every other client. When clients drop out after the keys were published, the survivors' shares rebuild
//!   each dropped client's key, and its masks with the survivors are taken off the sum.
//! - Each client also adds a self-mask from a seed of its own, shared the same way: for a client whose masked
//!   vector arrived, the survivors reveal shares of its seed; for one that dropped, shares of its key — never both,
//!   so a vector that arrives late cannot be unmasked alone by a server that called its client dropped.
//! - Over the network the shares travel sealed for their holder ([`seal`], ChaCha20-Poly1305 under a key agreed
//!   by X25519 between a second pair of keys), so the server that relays them cannot read them.

use rand::RngCore;
use rand_chacha::ChaCha20Rng;
use rand_chacha::rand_core::SeedableRng;
use x25519_dalek::{PublicKey, StaticSecret};

use crate::error::{Error, Result};

/// Fractional bits of the fixed point the updates are summed in: `±2^(31 − SCALE)` holds a round's sum.
pub const SCALE: u32 = 22;

/// The field of the key shares: GF(2^61 − 1).
const P: u64 = (1 << 61) - 1;

/// Shares that rebuild a key among `n` clients: two thirds of them (at least 2).
pub fn threshold(n: usize) -> usize {
    (2 * n).div_ceil(3).max(2).min(n.max(1))
}

/// A client's key pair for one round.
pub struct Keys {
    secret: StaticSecret,
    pub public: [u8; 32],
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keys").field("public", &self.public).finish_non_exhaustive()
    }
}

impl Keys {
    /// A fresh pair from the operating system's randomness.
    pub fn generate() -> Keys {
        let mut bytes = [0u8; 32];
        rand::rng().fill_bytes(&mut bytes);
        Keys::from_secret(bytes)
    }

    /// The pair of a secret key's bytes (as rebuilt from shares).
    pub fn from_secret(bytes: [u8; 32]) -> Keys {
        let secret = StaticSecret::from(bytes);
        let public = PublicKey::from(&secret).to_bytes();
        Keys { secret, public }
    }

    /// The secret's bytes (for its shares).
    pub fn secret_bytes(&self) -> [u8; 32] {
        self.secret.to_bytes()
    }
}

/// The mask two clients agree on, `len` values long.
fn mask(secret: &StaticSecret, peer: &[u8; 32], len: usize) -> Vec<i32> {
    let shared = secret.diffie_hellman(&PublicKey::from(*peer));
    let mut prg = ChaCha20Rng::from_seed(*shared.as_bytes());
    (0..len).map(|_| prg.next_u32() as i32).collect()
}

/// `x` in fixed point.
pub fn quantize(x: &[f32]) -> Vec<i32> {
    let s = f64::from(1u32 << SCALE);
    x.iter().map(|v| (f64::from(*v) * s).round() as i64 as i32).collect()
}

/// A fixed-point sum back to reals.
pub fn dequantize(x: &[i32]) -> Vec<f32> {
    let s = f64::from(1u32 << SCALE);
    x.iter().map(|v| (f64::from(*v) / s) as f32).collect()
}

/// Client `me`'s masked update among the round's clients `publics` (every client's public key, in order; its own
/// included): `quantize(update)` plus the masks with later clients, less those with earlier ones.
pub fn masked(keys: &Keys, me: usize, publics: &[[u8; 32]], update: &[f32]) -> Vec<i32> {
    let mut y = quantize(update);
    for (j, peer) in publics.iter().enumerate() {
        if j == me {
            continue;
        }
        let m = mask(&keys.secret, peer, y.len());
        for (yi, mi) in y.iter_mut().zip(m) {
            *yi = if me < j { yi.wrapping_add(mi) } else { yi.wrapping_sub(mi) };
        }
    }
    y
}

fn mul(a: u64, b: u64) -> u64 {
    ((u128::from(a) * u128::from(b)) % u128::from(P)) as u64
}

fn pow(mut a: u64, mut e: u64) -> u64 {
    let mut r = 1;
    while e > 0 {
        if e & 1 == 1 {
            r = mul(r, a);
        }
        a = mul(a, a);
        e >>= 1;
    }
    r
}

/// The secret key's 32 bytes as 5 field elements of 7 bytes (the last of 4).
fn chunks(secret: &[u8; 32]) -> [u64; 5] {
    let mut out = [0u64; 5];
    for (k, c) in secret.chunks(7).enumerate() {
        out[k] = c.iter().rev().fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
    }
    out
}

fn unchunk(values: &[u64; 5]) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (k, v) in values.iter().enumerate() {
        for b in 0..7 {
            if k * 7 + b < 32 {
                out[k * 7 + b] = (v >> (8 * b)) as u8;
            }
        }
    }
    out
}

/// Shares of client keys: `shares[j]` is for client `j` (the polynomial at `x = j + 1`).
pub fn share(keys: &Keys, n: usize) -> Vec<[u64; 5]> {
    share_bytes(&keys.secret_bytes(), n)
}

/// Shares of any 32 secret bytes (a key, a self-mask seed) among `n` clients, [`threshold`] of which rebuild them.
pub fn share_bytes(secret: &[u8; 32], n: usize) -> Vec<[u64; 5]> {
    let t = threshold(n);
    let secret = chunks(secret);
    let mut rng = rand::rng();
    // One polynomial of degree t − 1 a chunk, its constant the chunk.
    let coeffs: Vec<Vec<u64>> =
        secret.iter().map(|&s| std::iter::once(s).chain((1..t).map(|_| rng.next_u64() % P)).collect()).collect();
    (0..n)
        .map(|j| {
            let x = j as u64 + 1;
            let mut out = [0u64; 5];
            for (k, c) in coeffs.iter().enumerate() {
                out[k] = c.iter().rev().fold(0u64, |acc, &a| (mul(acc, x) + a) % P);
            }
            out
        })
        .collect()
}

/// The secret rebuilt from shares `(holder, share)` (at least [`threshold`] of them) by Lagrange at 0.
pub fn rebuild(shares: &[(usize, [u64; 5])]) -> [u8; 32] {
    let mut out = [0u64; 5];
    for (i, (xi, si)) in shares.iter().enumerate() {
        let xi = *xi as u64 + 1;
        let mut l = 1u64;
        for (j, (xj, _)) in shares.iter().enumerate() {
            if i != j {
                let xj = *xj as u64 + 1;
                // xj / (xj − xi)
                l = mul(l, mul(xj, pow((xj + P - xi) % P, P - 2)));
            }
        }
        for k in 0..5 {
            out[k] = (out[k] + mul(si[k], l)) % P;
        }
    }
    unchunk(&out)
}

/// A fresh self-mask seed.
pub fn new_seed() -> [u8; 32] {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    bytes
}

/// The self-mask a seed expands to, `len` values long.
pub fn self_mask(seed: &[u8; 32], len: usize) -> Vec<i32> {
    let mut prg = ChaCha20Rng::from_seed(*seed);
    (0..len).map(|_| prg.next_u32() as i32).collect()
}

/// `y` plus the self-mask of `seed` (or minus it, `sign` −1).
pub fn apply_self_mask(y: &mut [i32], seed: &[u8; 32], sign: i32) {
    let m = self_mask(seed, y.len());
    for (yi, mi) in y.iter_mut().zip(m) {
        *yi = if sign >= 0 { yi.wrapping_add(mi) } else { yi.wrapping_sub(mi) };
    }
}

/// Takes off `sum` the masks that dropped client `d` (whose key `key` was rebuilt) shared with each survivor
/// `(index, public key)`: survivor `s` added `+m` if `s < d`, `−m` if `s > d`.
pub fn remove_pairwise(sum: &mut [i32], key: &Keys, d: usize, survivors: &[(usize, [u8; 32])]) {
    for (s, public) in survivors {
        let m = mask(&key.secret, public, sum.len());
        for (x, mi) in sum.iter_mut().zip(m) {
            *x = if *s < d { x.wrapping_sub(mi) } else { x.wrapping_add(mi) };
        }
    }
}

/// Rebuilds the secret of client `of` from the survivors' shares (`shares[of][holder]`), at least [`threshold`]
/// of `n`; an error names the client and how many shares there were.
fn rebuild_from(shares: &[Vec<[u64; 5]>], of: usize, holders: &[usize], n: usize) -> Result<[u8; 32]> {
    let t = threshold(n);
    if holders.len() < t {
        return Err(Error::InvalidArgument(format!(
            "secure aggregation: {} of {n} clients remain, fewer than the {t} that rebuild client {of}'s secret",
            holders.len()
        )));
    }
    let held: Vec<(usize, [u64; 5])> = holders.iter().take(t).map(|&h| (h, shares[of][h])).collect();
    Ok(rebuild(&held))
}

/// Unmasks the survivors' summed vectors: the `dropped` clients' masks with the survivors come off by their keys
/// rebuilt from the survivors' shares (`key_shares[i][j]`: client `i`'s key's share for client `j`), and each
/// survivor's self-mask by its seed rebuilt the same way (`seed_shares`). Errors when fewer survivors than the
/// threshold remain, or a key does not rebuild to its public key.
pub fn unmask(
    sum: &mut [i32],
    publics: &[[u8; 32]],
    dropped: &[usize],
    key_shares: &[Vec<[u64; 5]>],
    seed_shares: &[Vec<[u64; 5]>],
) -> Result<()> {
    let n = publics.len();
    let survivors: Vec<usize> = (0..n).filter(|i| !dropped.contains(i)).collect();
    let with_keys: Vec<(usize, [u8; 32])> = survivors.iter().map(|&s| (s, publics[s])).collect();
    for &d in dropped {
        let keys = Keys::from_secret(rebuild_from(key_shares, d, &survivors, n)?);
        if keys.public != publics[d] {
            return Err(Error::InvalidArgument(format!("secure aggregation: client {d}'s key did not rebuild")));
        }
        remove_pairwise(sum, &keys, d, &with_keys);
    }
    for &s in &survivors {
        apply_self_mask(sum, &rebuild_from(seed_shares, s, &survivors, n)?, -1);
    }
    Ok(())
}

/// A share's 5 field elements as 40 bytes, and back.
pub fn share_to_bytes(share: &[u64; 5]) -> Vec<u8> {
    share.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn share_from_bytes(bytes: &[u8]) -> Option<[u64; 5]> {
    if bytes.len() != 40 {
        return None;
    }
    let mut out = [0u64; 5];
    for (k, c) in bytes.chunks_exact(8).enumerate() {
        out[k] = u64::from_le_bytes(c.try_into().ok()?);
    }
    Some(out)
}

fn cipher(me: &Keys, peer: &[u8; 32], context: &str) -> (chacha20poly1305::ChaCha20Poly1305, chacha20poly1305::Nonce) {
    use chacha20poly1305::KeyInit;
    use sha2::Digest;
    let shared = me.secret.diffie_hellman(&PublicKey::from(*peer));
    let key = sha2::Sha256::new().chain_update(b"shoal secagg share key").chain_update(shared.as_bytes()).finalize();
    let nonce = sha2::Sha256::new().chain_update(b"shoal secagg nonce").chain_update(context.as_bytes()).finalize();
    let aead = chacha20poly1305::ChaCha20Poly1305::new(chacha20poly1305::Key::from_slice(&key));
    (aead, *chacha20poly1305::Nonce::from_slice(&nonce[..12]))
}

/// `plain` sealed for the holder of `peer` (its public key): ChaCha20-Poly1305 under the X25519 secret of `me` and
/// `peer`, the nonce from `context` (which names the round, the sender and the receiver, so no key meets a nonce
/// twice).
pub fn seal(me: &Keys, peer: &[u8; 32], context: &str, plain: &[u8]) -> Vec<u8> {
    use chacha20poly1305::aead::Aead;
    let (aead, nonce) = cipher(me, peer, context);
    aead.encrypt(&nonce, plain).unwrap_or_default()
}

/// What [`seal`] sealed, opened by its receiver; an error when it was not sealed for `me` by `peer` in `context`.
pub fn open(me: &Keys, peer: &[u8; 32], context: &str, sealed: &[u8]) -> Result<Vec<u8>> {
    use chacha20poly1305::aead::Aead;
    let (aead, nonce) = cipher(me, peer, context);
    aead.decrypt(&nonce, sealed)
        .map_err(|_| Error::InvalidArgument(format!("secure aggregation: a sealed share ({context}) does not open")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn updates(n: usize, len: usize) -> Vec<Vec<f32>> {
        (0..n).map(|i| (0..len).map(|k| ((i * 31 + k * 7) % 17) as f32 / 17.0 - 0.5).collect()).collect()
    }

    fn plain_sum(u: &[Vec<f32>], keep: impl Fn(usize) -> bool) -> Vec<f32> {
        let mut s = vec![0f32; u[0].len()];
        for (i, x) in u.iter().enumerate().filter(|(i, _)| keep(*i)) {
            let _ = i;
            s.iter_mut().zip(x).for_each(|(a, b)| *a += b);
        }
        s
    }

    #[test]
    fn the_masks_cancel_and_dropped_clients_are_unmasked_from_the_survivors_shares() -> Result<()> {
        let (n, len) = (10, 257);
        let u = updates(n, len);
        let keys: Vec<Keys> = (0..n).map(|_| Keys::generate()).collect();
        let publics: Vec<[u8; 32]> = keys.iter().map(|k| k.public).collect();
        let shares: Vec<Vec<[u64; 5]>> = keys.iter().map(|k| share(k, n)).collect();
        let seeds: Vec<[u8; 32]> = (0..n).map(|_| new_seed()).collect();
        let seed_shares: Vec<Vec<[u64; 5]>> = seeds.iter().map(|s| share_bytes(s, n)).collect();
        // Clients 2, 5 and 7 drop after the keys were published.
        let dropped = [2usize, 5, 7];
        let mut sum = vec![0i32; len];
        for i in (0..n).filter(|i| !dropped.contains(i)) {
            let mut y = masked(&keys[i], i, &publics, &u[i]);
            apply_self_mask(&mut y, &seeds[i], 1);
            for (s, y) in sum.iter_mut().zip(y) {
                *s = s.wrapping_add(y);
            }
        }
        let mut without_seeds = sum.clone();
        unmask(&mut sum, &publics, &dropped, &shares, &seed_shares)?;
        let got = dequantize(&sum);
        let want = plain_sum(&u, |i| !dropped.contains(&i));
        let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-5, "the unmasked sum is the survivors' sum: max error {err}");
        // The self-masks stay on without the seeds' shares (here: shares of other seeds).
        let wrong: Vec<Vec<[u64; 5]>> = (0..n).map(|_| share_bytes(&new_seed(), n)).collect();
        unmask(&mut without_seeds, &publics, &dropped, &shares, &wrong)?;
        let off = dequantize(&without_seeds).iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(off > 1.0, "the sum came out without the self-masks removed: max error {off}");
        // Too many dropped: refused.
        let many: Vec<usize> = (0..6).collect();
        assert!(unmask(&mut sum.clone(), &publics, &many, &shares, &seed_shares).is_err());
        Ok(())
    }

    #[test]
    fn a_sealed_share_opens_only_for_its_receiver_in_its_context() -> Result<()> {
        let (a, b, c) = (Keys::generate(), Keys::generate(), Keys::generate());
        let share = share_to_bytes(&[1, 2, 3, 4, (1 << 61) - 2]);
        let sealed = seal(&a, &b.public, "round 3: 0 to 1", &share);
        assert_ne!(&sealed[..40], &share[..], "the share is not readable in the sealed bytes");
        assert_eq!(open(&b, &a.public, "round 3: 0 to 1", &sealed)?, share);
        assert_eq!(share_from_bytes(&share), Some([1, 2, 3, 4, (1 << 61) - 2]));
        assert!(open(&c, &a.public, "round 3: 0 to 1", &sealed).is_err(), "a third party opened it");
        assert!(open(&b, &a.public, "round 4: 0 to 1", &sealed).is_err(), "it opened in another round");
        let mut tampered = sealed.clone();
        tampered[0] ^= 1;
        assert!(open(&b, &a.public, "round 3: 0 to 1", &tampered).is_err(), "a changed share opened");
        Ok(())
    }

    #[test]
    fn a_single_masked_update_looks_like_uniform_noise() {
        let (n, len) = (5, 40_000);
        let keys: Vec<Keys> = (0..n).map(|_| Keys::generate()).collect();
        let publics: Vec<[u8; 32]> = keys.iter().map(|k| k.public).collect();
        // An update that is all zeros: anything but noise would show.
        let y = masked(&keys[0], 0, &publics, &vec![0f32; len]);
        // Chi-square of the top byte over 256 bins, and the mean of the bits.
        let mut bins = [0f64; 256];
        let mut ones = 0u64;
        for v in &y {
            bins[(*v as u32 >> 24) as usize] += 1.0;
            ones += u64::from((*v as u32).count_ones());
        }
        let expected = len as f64 / 256.0;
        let chi: f64 = bins.iter().map(|b| (b - expected).powi(2) / expected).sum();
        // 255 degrees of freedom: the 99.9th percentile is about 330.
        assert!(chi < 330.0, "chi-square {chi}");
        let bit_mean = ones as f64 / (len as f64 * 32.0);
        assert!((bit_mean - 0.5).abs() < 0.002, "mean bit {bit_mean}");
    }

    #[test]
    fn keys_rebuild_from_any_threshold_of_shares_and_the_fixed_point_round_trips() {
        let k = Keys::generate();
        let s = share(&k, 9);
        let t = threshold(9);
        assert_eq!(t, 6);
        for start in [0, 3] {
            let held: Vec<(usize, [u64; 5])> = (start..start + t).map(|j| (j, s[j])).collect();
            assert_eq!(rebuild(&held), k.secret_bytes());
        }
        let held: Vec<(usize, [u64; 5])> = (0..t - 1).map(|j| (j, s[j])).collect();
        assert_ne!(rebuild(&held), k.secret_bytes(), "fewer than the threshold give another key");
        let x = [0.5f32, -1.25, 3.0e-6, 100.0];
        let back = dequantize(&quantize(&x));
        assert!(x.iter().zip(&back).all(|(a, b)| (a - b).abs() <= 1.0 / (1u32 << SCALE) as f32));
    }
}
