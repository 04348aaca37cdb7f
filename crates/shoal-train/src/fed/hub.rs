//! The server of remote federated clients (`federated.listen`): HTTPS (`shoal-http`) with per-client tokens and
//! optionally client certificates, and the rounds run on the caller's thread.
//!
//! The protocol (every request carries `Authorization: Bearer TOKEN`; bodies of numbers are little-endian f32
//! after one line of JSON):
//! - `POST /fed/v1/join` → `{client, index, rounds, sigma, spec}`: who the token belongs to, and the job spec the
//!   client builds its model and reads its data by. Joining again (after a cut, a restart) is the same call.
//! - `GET /fed/v1/task?wait=S` → `200` `{round}` and the global model when the client is sampled for the open
//!   round and has not answered it; `204` when there is nothing for it within `S` seconds (at most 30); `410` once
//!   the job is over.
//! - `POST /fed/v1/update?round=R` with `{samples, loss}` and the update → `200`, or `409` when round `R` is not
//!   open, the client was not sampled for it, or it already answered.
//!
//! A client is connected while it has been heard from within [`super::board::LIVE`]. Each round samples among the connected
//! clients ([`super::sample`]), waits for their updates until `round_timeout`, and combines what arrived; a client
//! that fetched the model and did not answer in time is late, one that never fetched it dropped.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use shoal_data::Dataset;

use super::board::{Board, LIVE, Open, Shared, decode, encode, hash, refuse};
use super::{Combined, Global};
use crate::Real;
use crate::error::{Error, Result};
use crate::models::Model;
use crate::params::Params;
use crate::spec::{FederatedSpec, JobSpec};
use crate::worker::wire::{FederatedReport, RoundReport};

/// After the last round, how long the server answers `410` so that polling clients learn the job is over.
const FAREWELL: Duration = Duration::from_secs(3);

/// The clients of a tokens file: their names, and each one's number by the SHA-256 of its token.
struct Roster {
    names: Vec<String>,
    by_hash: HashMap<[u8; 32], usize>,
}

/// Reads `federated.tokens`: lines `NAME TOKEN`, as many as `federated.clients`.
fn read_tokens(path: &str, clients: usize) -> Result<Roster> {
    let text =
        std::fs::read_to_string(path).map_err(|e| Error::Spec(format!("federated.tokens: cannot read {path}: {e}")))?;
    let (mut names, mut by_hash) = (Vec::new(), HashMap::new());
    for (k, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let (Some(name), Some(token), None) = (words.next(), words.next(), words.next()) else {
            return Err(Error::Spec(format!("federated.tokens: {path} line {}: expected `NAME TOKEN`", k + 1)));
        };
        if token.len() < 16 {
            return Err(Error::Spec(format!(
                "federated.tokens: {path} line {}: the token of {name:?} is shorter than 16 characters",
                k + 1
            )));
        }
        if names.iter().any(|n| n == name) {
            return Err(Error::Spec(format!("federated.tokens: {path} line {}: client {name:?} again", k + 1)));
        }
        if by_hash.insert(hash(token), names.len()).is_some() {
            return Err(Error::Spec(format!("federated.tokens: {path} line {}: a token given twice", k + 1)));
        }
        names.push(name.to_owned());
    }
    if names.len() != clients {
        return Err(Error::Spec(format!(
            "federated.clients is {clients} but {path} (federated.tokens) names {} clients",
            names.len()
        )));
    }
    Ok(Roster { names, by_hash })
}

async fn join(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let client = match s.caller(&headers) {
        Ok(c) => c,
        Err(r) => return r,
    };
    tracing::info!(client = %s.names[client], "federated client joined");
    let body = serde_json::json!({
        "client": s.names[client], "index": client, "rounds": s.rounds, "sigma": s.sigma,
        "parameters": s.parameters, "spec": s.spec,
    });
    axum::Json(body).into_response()
}

#[derive(serde::Deserialize)]
struct Wait {
    wait: Option<f64>,
}

async fn task(State(s): State<Arc<Shared>>, headers: HeaderMap, Query(q): Query<Wait>) -> Response {
    let client = match s.caller(&headers) {
        Ok(c) => c,
        Err(r) => return r,
    };
    s.long_poll(q.wait, || {
        let mut st = s.lock();
        if st.done.is_some() {
            return Some(refuse(StatusCode::GONE, "the job is over"));
        }
        let open = st.open.as_mut()?;
        let k = open.sampled.iter().position(|&c| c == client)?;
        if open.updates.contains_key(&client) || !open.secure.as_ref().is_none_or(|s| s.open_to(client)) {
            return None;
        }
        open.fetched[k] = true;
        let (round, body) = (open.round, open.body.clone());
        st.bytes += body.len() as u64;
        tracing::debug!(client = %s.names[client], round, "model sent");
        Some((StatusCode::OK, [("content-type", "application/octet-stream")], body).into_response())
    })
    .await
}

#[derive(serde::Deserialize)]
struct RoundQuery {
    round: usize,
}

async fn update(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<RoundQuery>,
    body: axum::body::Bytes,
) -> Response {
    let client = match s.caller(&headers) {
        Ok(c) => c,
        Err(r) => return r,
    };
    let Some((head, values)) = decode(&body) else {
        return refuse(StatusCode::BAD_REQUEST, "the body is not a JSON line followed by f32 values");
    };
    if values.len() != s.parameters {
        return refuse(
            StatusCode::BAD_REQUEST,
            &format!("an update of {} values for a model of {}", values.len(), s.parameters),
        );
    }
    let samples = head.get("samples").and_then(serde_json::Value::as_f64).filter(|x| x.is_finite() && *x > 0.0);
    let loss = head.get("loss").and_then(serde_json::Value::as_f64).unwrap_or(f64::NAN);
    let Some(samples) = samples else {
        return refuse(StatusCode::BAD_REQUEST, "the update's `samples` must be a number > 0");
    };
    if values.iter().any(|v| !v.is_finite()) {
        return refuse(StatusCode::BAD_REQUEST, "the update holds values that are not finite");
    }
    let mut st = s.lock();
    st.bytes += body.len() as u64;
    let Some(open) = st.open.as_mut().filter(|o| o.round == q.round) else {
        return refuse(StatusCode::CONFLICT, &format!("round {} is not open", q.round));
    };
    if !open.sampled.contains(&client) {
        return refuse(StatusCode::CONFLICT, &format!("{} was not sampled for round {}", s.names[client], q.round));
    }
    if open.updates.contains_key(&client) {
        return refuse(StatusCode::CONFLICT, &format!("{} already answered round {}", s.names[client], q.round));
    }
    open.updates.insert(client, (samples, loss, values));
    StatusCode::OK.into_response()
}

/// The server of a federated job's remote clients.
pub struct Hub<'a> {
    spec: &'a JobSpec,
    f: &'a FederatedSpec,
    model: &'a dyn Model,
    params: &'a Params,
    eval: &'a dyn Dataset,
    output: &'a Path,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Hub<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Hub").field("job", &self.spec.name).field("clients", &self.shared.names).finish_non_exhaustive()
    }
}

impl<'a> Hub<'a> {
    pub fn new(
        spec: &'a JobSpec,
        model: &'a dyn Model,
        params: &'a Params,
        eval: &'a dyn Dataset,
        output: &'a Path,
    ) -> Result<Hub<'a>> {
        let f = spec.federated.as_ref().ok_or_else(|| Error::Spec("no [federated] table".into()))?;
        let path = f.tokens.as_deref().ok_or_else(|| Error::Spec("federated.tokens: needed with listen".into()))?;
        let Roster { names, by_hash: tokens } = read_tokens(path, f.clients)?;
        let sigma = super::sigma(f)?;
        let spec_json = serde_json::to_value(spec).map_err(|e| Error::Spec(format!("the job spec as JSON: {e}")))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(Board { seen: vec![None; names.len()], ..Board::default() }),
            names,
            tokens,
            changed: tokio::sync::watch::channel(0).0,
            spec: spec_json,
            rounds: f.rounds,
            sigma,
            parameters: params.full_count(),
        });
        Ok(Hub { spec, f, model, params, eval, output, shared })
    }

    /// Serves the clients and runs every round; returns what the rounds did.
    pub fn run(self, mut on_round: impl FnMut(usize)) -> Result<FederatedReport> {
        let f = self.f;
        let listen = f.listen.as_deref().unwrap_or_default();
        let addr: std::net::SocketAddr =
            listen.parse().map_err(|_| Error::Spec(format!("federated.listen: {listen:?} is not an address")))?;
        let tls = match (&f.tls_cert, &f.tls_key) {
            (Some(cert), Some(key)) => {
                let files = shoal_http::tls::TlsFiles { cert: cert.into(), key: key.into() };
                let config = shoal_http::tls::server_config(&files, f.client_ca.as_deref().map(Path::new))
                    .map_err(|e| Error::Spec(format!("federated: {e}")))?;
                Some(tokio_rustls::TlsAcceptor::from(config))
            }
            _ => None,
        };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| Error::io("starting the federated server's runtime", e))?;
        let listener = rt
            .block_on(tokio::net::TcpListener::bind(addr))
            .map_err(|e| Error::io(format!("federated.listen: cannot listen on {addr}"), e))?;
        let bound = listener.local_addr().map_err(|e| Error::io("federated.listen", e))?;
        let app = axum::Router::new()
            .route("/fed/v1/join", axum::routing::post(join))
            .route("/fed/v1/task", axum::routing::get(task))
            .route("/fed/v1/update", axum::routing::post(update))
            .route("/fed/v1/secure/keys", axum::routing::post(super::secure::post_keys))
            .route("/fed/v1/secure/roster", axum::routing::get(super::secure::roster))
            .route("/fed/v1/secure/shares", axum::routing::post(super::secure::post_shares))
            .route("/fed/v1/secure/inbox", axum::routing::get(super::secure::inbox))
            .route("/fed/v1/secure/masked", axum::routing::post(super::secure::post_masked))
            .route("/fed/v1/secure/survivors", axum::routing::get(super::secure::survivors))
            .route("/fed/v1/secure/reveal", axum::routing::post(super::secure::post_reveal))
            .layer(axum::extract::DefaultBodyLimit::max(self.shared.parameters * 4 + (1 << 16)))
            .with_state(self.shared.clone());
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let serving = rt.spawn(shoal_http::serve(listener, app, tls.clone(), stopped));
        let scheme = if tls.is_some() { "https" } else { "http" };
        eprintln!(
            "federated: serving {} clients at {scheme}://{bound} ({} rounds, {} a round{})",
            f.clients,
            f.rounds,
            f.per_round(),
            if f.client_ca.is_some() { ", client certificates required" } else { "" }
        );
        let result = self.rounds(&mut on_round);
        // Polling clients learn the job is over, then the server stops.
        self.shared.lock().done = Some(Instant::now());
        self.shared.changed.send_modify(|v| *v += 1);
        std::thread::sleep(FAREWELL);
        let _ = stop.send(true);
        let _ = rt.block_on(serving);
        rt.shutdown_timeout(Duration::from_secs(2));
        result
    }

    /// The clients heard from within [`LIVE`].
    fn connected(&self) -> Vec<usize> {
        let st = self.shared.lock();
        st.seen.iter().enumerate().filter(|(_, s)| s.is_some_and(|t| t.elapsed() < LIVE)).map(|(i, _)| i).collect()
    }

    /// Waits until a round's worth of clients is connected (`clients_per_round`, or all), for at most
    /// `join_timeout`.
    fn await_clients(&self, round: usize) -> Result<Vec<usize>> {
        let want = self.f.per_round().min(self.f.clients);
        let limit = self.f.join_deadline();
        let began = Instant::now();
        let mut said = false;
        loop {
            let pool = self.connected();
            if pool.len() >= want {
                return Ok(pool);
            }
            if began.elapsed() > limit {
                let names: Vec<&str> = pool.iter().map(|&i| self.shared.names[i].as_str()).collect();
                return Err(Error::InvalidArgument(format!(
                    "federated round {}: waited {:.0} s (federated.join_timeout) for {want} connected clients; {} \
                     connected: {names:?}",
                    round + 1,
                    limit.as_secs_f64(),
                    pool.len()
                )));
            }
            if !said && began.elapsed() > Duration::from_secs(2) {
                eprintln!("federated round {}: waiting for {want} clients ({} connected)", round + 1, pool.len());
                said = true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn rounds(&self, on_round: &mut impl FnMut(usize)) -> Result<FederatedReport> {
        let (f, t) = (self.f, &self.spec.train);
        let sigma = self.shared.sigma;
        let (rule, tolerated) = self.spec.robust.map_or((shoal_ps::Rule::Mean, 0), |r| (r.rule.rule(), r.f));
        let mut global = Global::new(super::flat(self.params)?, f, sigma, t.seed);
        let mut recorder = super::Recorder::create(self.output, f, t.log_every)?;
        let deadline = f.deadline().unwrap_or(Duration::from_secs(600));
        for round in 0..f.rounds {
            let pool = self.await_clients(round)?;
            let started = Instant::now();
            let sampled = super::sample(f, round, t.seed, &pool);
            let secure = f.secure_aggregation;
            let body =
                axum::body::Bytes::from(encode(&serde_json::json!({ "round": round, "secure": secure }), &global.w));
            let bytes_before = {
                let mut st = self.shared.lock();
                st.open = Some(Open {
                    round,
                    body,
                    fetched: vec![false; sampled.len()],
                    sampled: sampled.clone(),
                    updates: BTreeMap::new(),
                    secure: secure.then(super::board::SecureRound::default),
                });
                st.bytes
            };
            self.shared.changed.send_modify(|v| *v += 1);
            let outcome = match secure {
                true => super::secure::run(&self.shared, round, deadline, &sampled)?,
                false => None,
            };
            // Until every sampled client answered, or the deadline (under secure aggregation: the protocol's end).
            let open = loop {
                {
                    let mut st = self.shared.lock();
                    let all = st.open.as_ref().is_some_and(|o| o.updates.len() == o.sampled.len());
                    if all || secure || started.elapsed() >= deadline {
                        break st.open.take();
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let open = open.ok_or_else(|| Error::InvalidArgument("the open round vanished".into()))?;
            let dropped = (0..sampled.len()).filter(|&k| !open.fetched[k]).count();
            let Tally { arrived, late, total, loss } = match secure {
                true => combine_secure(outcome, sampled.len(), dropped, &mut global, round)?,
                false => combine(&open, &sampled, (rule, tolerated), self.spec.robust.is_some(), &mut global, round)?,
            };
            super::load(self.params, &global.w)?;
            on_round(round + 1);
            let (eval_loss, eval_accuracy) = super::evaluate(self.model, self.eval, 256)?;
            let bytes = self.shared.lock().bytes - bytes_before;
            let r = RoundReport {
                round: round + 1,
                clients: arrived,
                sampled: sampled.len(),
                dropped,
                late,
                loss,
                eval_loss,
                eval_accuracy,
                bytes,
                epsilon: sigma.and_then(|s| super::epsilon_after(f, s, round + 1)),
            };
            let names: Vec<&str> = open.updates.keys().map(|&c| self.shared.names[c].as_str()).collect();
            tracing::info!(round = round + 1, clients = ?names, late, dropped, "federated round combined");
            recorder.round(r, started.elapsed(), total)?;
            let path = self.output.join("rounds.jsonl");
            let line = serde_json::json!({ "round": round + 1, "clients": names });
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .and_then(|mut file| writeln!(file, "{line}"))
                .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
        }
        let rounds = recorder.rounds();
        Ok(FederatedReport {
            algorithm: f.algorithm.as_str().into(),
            clients: f.clients,
            clients_per_round: f.per_round(),
            partition: "the clients' own".into(),
            epsilon: rounds.last().and_then(|r| r.epsilon),
            rounds,
            noise_multiplier: sigma,
            delta: f.dp.map(|d| d.delta()),
            histogram: Vec::new(),
            rule: rule.name().into(),
            remote: true,
        })
    }
}

/// What a round combined: the clients, those late, their samples and mean loss.
struct Tally {
    arrived: usize,
    late: usize,
    total: f64,
    loss: f64,
}

/// A round's updates as they arrived: by `[robust]`'s rule, or weighted by samples (under DP each clipped update
/// counts once, as the accountant assumes).
fn combine(
    open: &Open,
    sampled: &[usize],
    (rule, tolerated): (shoal_ps::Rule, usize),
    robust: bool,
    global: &mut Global,
    round: usize,
) -> Result<Tally> {
    let late = (0..sampled.len()).filter(|&k| open.fetched[k] && !open.updates.contains_key(&sampled[k])).count();
    let arrived = open.updates.len();
    let total: f64 = open.updates.values().map(|(s, _, _)| s).sum();
    let loss = open.updates.values().map(|(_, l, _)| l).sum::<f64>() / arrived.max(1) as f64;
    if robust {
        let updates: Vec<&[Real]> = open.updates.values().map(|(_, _, u)| u.as_slice()).collect();
        global.step(Combined::Each { updates, rule, f: tolerated }, round)?;
    } else {
        let n = global.w.len();
        let mean = (total / arrived.max(1) as f64).max(1e-12);
        let (mut sum, mut weight) = (vec![0.0 as Real; n], 0.0 as Real);
        for (samples, _, u) in open.updates.values() {
            let w = if global.private() { 1.0 } else { (samples / mean) as Real };
            sum.iter_mut().zip(u).for_each(|(a, b)| *a += w * b);
            weight += w;
        }
        global.step(Combined::Sum { sum, weight }, round)?;
    }
    Ok(Tally { arrived, late, total, loss })
}

/// A secure round's unmasked sum, `[update × weight…, weight, loss, clients]` (none when too few took part).
fn combine_secure(
    outcome: Option<super::secure::Outcome>,
    sampled: usize,
    dropped: usize,
    global: &mut Global,
    round: usize,
) -> Result<Tally> {
    let n = global.w.len();
    let (mut sum, missing) = match outcome {
        Some(o) => (o.sum, o.missing),
        None => (vec![0.0 as Real; n + 3], sampled),
    };
    let arrived = f64::from(sum[n + 2]).round().max(0.0) as usize;
    let tally = Tally {
        arrived,
        late: missing.saturating_sub(dropped),
        total: f64::from(sum[n]) * super::secure::WEIGHT_UNIT,
        loss: f64::from(sum[n + 1]) / arrived.max(1) as f64,
    };
    let weight = sum[n];
    sum.truncate(n);
    if arrived > 0 {
        global.step(Combined::Sum { sum, weight }, round)?;
    }
    Ok(tally)
}
