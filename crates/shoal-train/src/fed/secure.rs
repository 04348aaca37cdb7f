//! Secure aggregation between remote clients and the hub (`federated.secure_aggregation` with `federated.listen`):
//! Bonawitz et al.'s protocol over the hub's HTTPS, in four steps after a sampled client fetched the model.
//!
//! 1. **Keys**: each client draws a mask key pair, a cipher key pair and a self-mask seed, and posts the two public
//!    keys. The hub freezes the *roster* (the clients whose keys came, in client order; a client's place in it is
//!    its share coordinate and orders its pairwise masks) and publishes it with the keys.
//! 2. **Shares**: each client cuts its mask key and its seed into Shamir shares, one per roster member, each sealed
//!    for its holder (`secagg::seal`), and posts them. The hub freezes who sent shares (`u2`) and hands each member
//!    the sealed shares addressed to it — it cannot open them.
//! 3. **Masked input**: each member of `u2` posts its vector (update × samples ÷ [`WEIGHT_UNIT`], then the weight,
//!    the loss and 1) in fixed point, plus its pairwise masks with every other member of `u2`, plus its self-mask.
//!    The hub freezes who did (`u3`, the survivors).
//! 4. **Unmasking**: each survivor opens the shares it holds and reveals, for every member of `u2`, its share of
//!    the seed if that member survived, else of the mask key — never both. From a threshold of them the hub removes
//!    the dropped members' pairwise masks and the survivors' self-masks, and holds only the sum.
//!
//! Each step waits at most `round_timeout` for the clients it expects.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::board::{Open, SecureRound, Shared, refuse};
use crate::Real;
use crate::error::{Error, Result};
use crate::secagg::{self, Keys};

/// Samples per unit of a client's weight in the fixed-point sum: keeps a round's weighted sum inside its range.
pub const WEIGHT_UNIT: f64 = 1024.0;

/// What a secure round gave the hub.
#[derive(Debug)]
pub struct Outcome {
    /// The survivors' summed vector, unmasked: `[update × weight…, weight, loss, clients]`.
    pub sum: Vec<Real>,
    /// Clients that posted keys but whose masked vector never came.
    pub missing: usize,
}

fn hex32(v: &Value) -> Option<[u8; 32]> {
    hex::decode(v.as_str()?).ok()?.try_into().ok()
}

#[derive(serde::Deserialize)]
pub(super) struct RoundWait {
    round: usize,
    wait: Option<f64>,
}

/// The open round's protocol, if round `round` is the open one and secure.
fn with_round<T>(
    s: &Shared,
    round: usize,
    f: impl FnOnce(&mut SecureRound, usize) -> std::result::Result<T, Response>,
    client: usize,
) -> std::result::Result<T, Response> {
    let mut st = s.lock();
    let open = st.open.as_mut().filter(|o| o.round == round);
    let Some(sec) = open.and_then(|o| o.secure.as_mut()) else {
        return Err(refuse(StatusCode::CONFLICT, &format!("round {round} is not open for secure aggregation")));
    };
    f(sec, client)
}

/// Holds a request until `ready` gives an answer ([`Shared::long_poll`]).
async fn hold(
    s: Arc<Shared>,
    headers: HeaderMap,
    q: RoundWait,
    ready: impl Fn(&SecureRound, usize) -> Option<std::result::Result<Value, Response>>,
) -> Response {
    let client = match s.caller(&headers) {
        Ok(c) => c,
        Err(r) => return r,
    };
    s.long_poll(q.wait, || match with_round(&s, q.round, |sec, c| Ok(ready(sec, c)), client) {
        Err(r) => Some(r),
        Ok(Some(Ok(v))) => {
            let body = v.to_string();
            s.lock().bytes += body.len() as u64;
            Some((StatusCode::OK, [("content-type", "application/json")], body).into_response())
        }
        Ok(Some(Err(r))) => Some(r),
        Ok(None) => None,
    })
    .await
}

fn not_in(list: &str, round: usize) -> Response {
    refuse(StatusCode::CONFLICT, &format!("not in round {round}'s {list}"))
}

fn bad(message: &str) -> Response {
    refuse(StatusCode::BAD_REQUEST, message)
}

/// A POST of the protocol: `take` is given the open round's state, the caller, the round's sampled clients and the
/// body (counted in the round's bytes); `200` when it took it.
fn accept(
    s: &Shared,
    headers: &HeaderMap,
    round: usize,
    body: &[u8],
    take: impl FnOnce(&mut SecureRound, usize, &[usize], &[u8]) -> std::result::Result<(), Response>,
) -> Response {
    let client = match s.caller(headers) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let mut st = s.lock();
    st.bytes += body.len() as u64;
    let Some(Open { sampled, secure: Some(sec), .. }) = st.open.as_mut().filter(|o| o.round == round) else {
        return refuse(StatusCode::CONFLICT, &format!("round {round} is not open for secure aggregation"));
    };
    match take(sec, client, sampled, body) {
        Ok(()) => StatusCode::OK.into_response(),
        Err(r) => r,
    }
}

fn json(body: &[u8]) -> std::result::Result<Value, Response> {
    serde_json::from_slice(body).map_err(|e| bad(&format!("the body is not JSON: {e}")))
}

/// Step 1: a sampled client's two public keys, until the roster is fixed.
pub(super) async fn post_keys(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<RoundWait>,
    body: axum::body::Bytes,
) -> Response {
    accept(&s, &headers, q.round, &body, |sec, c, sampled, body| {
        let v = json(body)?;
        let (Some(mask), Some(cipher)) = (hex32(&v["mask"]), hex32(&v["cipher"])) else {
            return Err(bad("`mask` and `cipher` must be 32-byte public keys in hex"));
        };
        if !sampled.contains(&c) || sec.roster.is_some() {
            return Err(not_in("sample, or too late for keys", q.round));
        }
        sec.keys.insert(c, (mask, cipher));
        Ok(())
    })
}

/// Step 2: a roster member's sealed shares, one for every member, until `u2` is fixed.
pub(super) async fn post_shares(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<RoundWait>,
    body: axum::body::Bytes,
) -> Response {
    accept(&s, &headers, q.round, &body, |sec, c, _, body| {
        let v = json(body)?;
        let mut shares = Vec::new();
        for item in v["shares"].as_array().into_iter().flatten() {
            let sealed = item["sealed"].as_str().and_then(|h| hex::decode(h).ok());
            let (Some(to), Some(sealed)) = (item["to"].as_u64(), sealed) else {
                return Err(bad("each share is {to, sealed (hex)}"));
            };
            shares.push((to as usize, sealed));
        }
        let Some(roster) = sec.roster.as_ref().filter(|r| r.contains(&c)) else {
            return Err(not_in("roster", q.round));
        };
        if sec.u2.is_some() {
            return Err(not_in("senders of shares (too late)", q.round));
        }
        let mut to: Vec<usize> = shares.iter().map(|(t, _)| *t).collect();
        to.sort_unstable();
        if &to != roster {
            return Err(bad("one share for every member of the roster"));
        }
        sec.sealed.insert(c, shares);
        Ok(())
    })
}

/// Step 3: a member of `u2`'s masked vector (`parameters + 3` little-endian i32), until `u3` is fixed.
pub(super) async fn post_masked(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<RoundWait>,
    body: axum::body::Bytes,
) -> Response {
    let want = s.parameters + 3;
    accept(&s, &headers, q.round, &body, |sec, c, _, body| {
        if body.len() != want * 4 {
            return Err(bad(&format!("a masked vector is {want} i32 values")));
        }
        if !sec.u2.as_ref().is_some_and(|u| u.contains(&c)) || sec.u3.is_some() {
            return Err(not_in("senders of shares, or too late for its vector", q.round));
        }
        sec.masked.insert(c, body.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect());
        Ok(())
    })
}

/// Step 4: a survivor's revealed shares.
pub(super) async fn post_reveal(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<RoundWait>,
    body: axum::body::Bytes,
) -> Response {
    accept(&s, &headers, q.round, &body, |sec, c, _, body| {
        let v = json(body)?;
        let mut shares = Vec::new();
        for item in v["shares"].as_array().into_iter().flatten() {
            let share =
                item["share"].as_str().and_then(|h| hex::decode(h).ok()).and_then(|b| secagg::share_from_bytes(&b));
            let (Some(about), Some(share)) = (item["about"].as_u64(), share) else {
                return Err(bad("each revealed share is {about, share (hex of 40 bytes)}"));
            };
            shares.push((about as usize, share));
        }
        if !sec.u3.as_ref().is_some_and(|u| u.contains(&c)) {
            return Err(not_in("survivors", q.round));
        }
        sec.reveals.insert(c, shares);
        Ok(())
    })
}

pub(super) async fn roster(State(s): State<Arc<Shared>>, headers: HeaderMap, Query(q): Query<RoundWait>) -> Response {
    let round = q.round;
    hold(s, headers, q, move |sec, c| {
        let roster = sec.roster.as_ref()?;
        if !roster.contains(&c) {
            return Some(Err(not_in("roster", round)));
        }
        let keys: Vec<Value> = roster
            .iter()
            .map(|m| {
                let (mask, cipher) = sec.keys.get(m).copied().unwrap_or_default();
                json!([hex::encode(mask), hex::encode(cipher)])
            })
            .collect();
        Some(Ok(json!({ "roster": roster, "keys": keys })))
    })
    .await
}

pub(super) async fn inbox(State(s): State<Arc<Shared>>, headers: HeaderMap, Query(q): Query<RoundWait>) -> Response {
    let round = q.round;
    hold(s, headers, q, move |sec, c| {
        let u2 = sec.u2.as_ref()?;
        if !u2.contains(&c) {
            return Some(Err(not_in("senders of shares", round)));
        }
        let mine: Vec<Value> = u2
            .iter()
            .filter_map(|from| {
                let (_, sealed) = sec.sealed.get(from)?.iter().find(|(to, _)| *to == c)?;
                Some(json!({ "from": from, "sealed": hex::encode(sealed) }))
            })
            .collect();
        Some(Ok(json!({ "u2": u2, "shares": mine })))
    })
    .await
}

pub(super) async fn survivors(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<RoundWait>,
) -> Response {
    let round = q.round;
    hold(s, headers, q, move |sec, c| {
        let u3 = sec.u3.as_ref()?;
        if !u3.contains(&c) {
            return Some(Err(not_in("survivors", round)));
        }
        Some(Ok(json!({ "u3": u3 })))
    })
    .await
}

/// The hub's side of a round: drives the four steps (each waiting at most `limit`) and unmasks the sum.
/// `Ok(None)`: too few clients took part to unmask anything this round.
pub(super) fn run(s: &Shared, round: usize, limit: Duration, sampled: &[usize]) -> Result<Option<Outcome>> {
    let step = |done: &dyn Fn(&SecureRound) -> bool, freeze: &dyn Fn(&mut SecureRound)| {
        let began = Instant::now();
        loop {
            {
                let mut st = s.lock();
                let sec = st.open.as_mut().and_then(|o| o.secure.as_mut());
                if let Some(sec) = sec
                    && (done(sec) || began.elapsed() >= limit)
                {
                    freeze(sec);
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        s.changed.send_modify(|v| *v += 1);
    };
    let read = |f: &dyn Fn(&SecureRound) -> Option<Vec<usize>>| -> Vec<usize> {
        s.lock().open.as_ref().and_then(|o| o.secure.as_ref()).and_then(f).unwrap_or_default()
    };
    let n_sampled = sampled.len();
    step(&|sec| sec.keys.len() == n_sampled, &|sec| sec.roster = Some(sec.keys.keys().copied().collect()));
    let roster = read(&|sec| sec.roster.clone());
    let n = roster.len();
    if n < 2 {
        tracing::warn!(round = round + 1, keys = n, "secure round: fewer than 2 clients posted keys");
        return Ok(None);
    }
    step(&|sec| sec.sealed.len() == n, &|sec| sec.u2 = Some(sec.sealed.keys().copied().collect()));
    let u2 = read(&|sec| sec.u2.clone());
    let threshold = secagg::threshold(n);
    step(&|sec| sec.masked.len() == u2.len(), &|sec| sec.u3 = Some(sec.masked.keys().copied().collect()));
    let u3 = read(&|sec| sec.u3.clone());
    if u3.len() < threshold {
        tracing::warn!(round = round + 1, survivors = u3.len(), threshold, "secure round: too few survivors to unmask");
        return Ok(None);
    }
    step(&|sec| sec.reveals.len() == u3.len(), &|_| {});
    let st = s.lock();
    let sec = st
        .open
        .as_ref()
        .and_then(|o| o.secure.as_ref())
        .ok_or_else(|| Error::InvalidArgument("no secure round".into()))?;
    let pos = |c: usize| roster.iter().position(|&m| m == c).unwrap_or(usize::MAX);
    // Every survivor's vector summed.
    let mut sum = vec![0i32; s.parameters + 3];
    for c in &u3 {
        if let Some(y) = sec.masked.get(c) {
            sum.iter_mut().zip(y).for_each(|(a, b)| *a = a.wrapping_add(*b));
        }
    }
    // The shares revealed about client `about`, as (holder's coordinate, share).
    let revealed = |about: usize| -> Vec<(usize, [u64; 5])> {
        sec.reveals
            .iter()
            .filter_map(|(holder, list)| list.iter().find(|(a, _)| *a == about).map(|(_, sh)| (pos(*holder), *sh)))
            .take(threshold)
            .collect()
    };
    let survivors: Vec<(usize, [u8; 32])> =
        u3.iter().map(|&c| (pos(c), sec.keys.get(&c).map(|k| k.0).unwrap_or_default())).collect();
    for &d in u2.iter().filter(|d| !u3.contains(d)) {
        let held = revealed(d);
        if held.len() < threshold {
            return Err(Error::InvalidArgument(format!(
                "secure round {}: {} shares of a dropped client's key revealed, {threshold} needed",
                round + 1,
                held.len()
            )));
        }
        let key = Keys::from_secret(secagg::rebuild(&held));
        if Some(key.public) != sec.keys.get(&d).map(|k| k.0) {
            return Err(Error::InvalidArgument(format!(
                "secure round {}: a dropped client's key did not rebuild",
                round + 1
            )));
        }
        secagg::remove_pairwise(&mut sum, &key, pos(d), &survivors);
    }
    for &c in &u3 {
        let held = revealed(c);
        if held.len() < threshold {
            return Err(Error::InvalidArgument(format!(
                "secure round {}: {} shares of a survivor's seed revealed, {threshold} needed",
                round + 1,
                held.len()
            )));
        }
        secagg::apply_self_mask(&mut sum, &secagg::rebuild(&held), -1);
    }
    #[allow(clippy::unnecessary_cast)]
    let sum: Vec<Real> = secagg::dequantize(&sum).into_iter().map(|v| v as Real).collect();
    Ok(Some(Outcome { sum, missing: n_sampled.saturating_sub(u3.len()) }))
}

/// A client's secrets for one round.
pub(super) struct Secrets {
    mask: Keys,
    cipher: Keys,
    seed: [u8; 32],
}

impl Secrets {
    pub(super) fn new() -> Secrets {
        Secrets { mask: Keys::generate(), cipher: Keys::generate(), seed: secagg::new_seed() }
    }

    pub(super) fn publics(&self) -> Value {
        json!({ "mask": hex::encode(self.mask.public), "cipher": hex::encode(self.cipher.public) })
    }
}

fn context(round: usize, from: usize, to: usize) -> String {
    format!("round {round}: {from} to {to}")
}

/// The round's roster as a client holds it: the members in order, and each one's mask and cipher public keys.
pub(super) struct Roster {
    members: Vec<usize>,
    keys: Vec<[[u8; 32]; 2]>,
}

/// Step 2 for a client: its sealed shares for every roster member, from the roster's answer.
pub(super) fn shares_for(secrets: &Secrets, round: usize, me: usize, roster: &Value) -> Result<(Roster, Value)> {
    let members: Vec<usize> =
        roster["roster"].as_array().into_iter().flatten().filter_map(|v| v.as_u64()).map(|v| v as usize).collect();
    let keys: Vec<[[u8; 32]; 2]> = roster["keys"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|k| Some([hex32(&k[0])?, hex32(&k[1])?]))
        .collect::<Option<_>>()
        .ok_or_else(|| Error::InvalidArgument("the roster's keys are not hex".into()))?;
    if keys.len() != members.len() || !members.contains(&me) {
        return Err(Error::InvalidArgument("the roster does not hold this client".into()));
    }
    let n = members.len();
    let (key_shares, seed_shares) =
        (secagg::share_bytes(&secrets.mask.secret_bytes(), n), secagg::share_bytes(&secrets.seed, n));
    let sealed: Vec<Value> = (0..n)
        .map(|j| {
            let mut plain = secagg::share_to_bytes(&key_shares[j]);
            plain.extend(secagg::share_to_bytes(&seed_shares[j]));
            let bytes = secagg::seal(&secrets.cipher, &keys[j][1], &context(round, me, members[j]), &plain);
            json!({ "to": members[j], "sealed": hex::encode(bytes) })
        })
        .collect();
    Ok((Roster { members, keys }, json!({ "shares": sealed })))
}

/// Step 3 for a client: its masked vector, given the roster and the members that sent shares (`u2`).
pub(super) fn masked(secrets: &Secrets, me: usize, roster: &Roster, u2: &[usize], plain: &[f32]) -> Vec<i32> {
    let (members, keys) = (&roster.members, &roster.keys);
    // The members of u2 in roster order: a member adds the masks it shares with later ones and subtracts those
    // with earlier ones, as the hub's unmasking assumes of the roster's coordinates.
    let list: Vec<usize> = (0..members.len()).filter(|&j| u2.contains(&members[j])).collect();
    let publics: Vec<[u8; 32]> = list.iter().map(|&j| keys[j][0]).collect();
    let at = list.iter().position(|&j| members[j] == me).unwrap_or(0);
    let mut y = secagg::masked(&secrets.mask, at, &publics, plain);
    secagg::apply_self_mask(&mut y, &secrets.seed, 1);
    y
}

/// Step 4 for a client: its revealed shares — of the seed of each survivor, of the mask key of each member of `u2`
/// that did not survive — opened from its inbox.
pub(super) fn reveal(
    secrets: &Secrets,
    round: usize,
    me: usize,
    roster: &Roster,
    inbox: &Value,
    u3: &[usize],
) -> Result<Value> {
    let (members, keys) = (&roster.members, &roster.keys);
    let mut out = Vec::new();
    for item in inbox["shares"].as_array().into_iter().flatten() {
        let from = item["from"]
            .as_u64()
            .ok_or_else(|| Error::InvalidArgument("an inbox share without `from`".into()))? as usize;
        let j = members
            .iter()
            .position(|&m| m == from)
            .ok_or_else(|| Error::InvalidArgument("a share from outside the roster".into()))?;
        let sealed = item["sealed"].as_str().and_then(|h| hex::decode(h).ok()).unwrap_or_default();
        let plain = secagg::open(&secrets.cipher, &keys[j][1], &context(round, from, me), &sealed)?;
        if plain.len() != 80 {
            return Err(Error::InvalidArgument(format!("a share from client {from} is {} bytes, not 80", plain.len())));
        }
        // Never both: the seed's share for a survivor, the key's for one that dropped.
        let part = if u3.contains(&from) { &plain[40..] } else { &plain[..40] };
        out.push(json!({ "about": from, "share": hex::encode(part) }));
    }
    Ok(json!({ "shares": out }))
}
