//! A remote federated client (`shoal fed client --server URL --data PATH`): joins the server with its token,
//! builds the job's model from the spec the server sends, reads its own data from a local file, and until the job
//! ends trains each round it is sampled for ([`super::Local`]) and sends back its update — clipped and, under
//! local DP, noised before it leaves ([`super::privatize`]). Its data never leaves it.
//!
//! A cut connection or a restarted server is waited out: every request is retried with a growing pause (0.25 s
//! to 5 s) for up to `retry_for` after the last answer, and the client rejoins the next round it is sampled for.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shoal_data::Dataset;

use super::board::{MAX_WAIT, decode, encode};
use crate::error::{Error, Result};
use crate::params::SeededRng;
use crate::spec::JobSpec;

/// How a client reaches its server, and what it trains on.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// The server: `https://host:port` (or `http://` on loopback).
    pub server: String,
    /// Its own data: a Parquet, CSV or JSONL file (or a directory or glob of them).
    pub data: PathBuf,
    pub token: String,
    /// The CA that signed the server's certificate (default: the public roots).
    pub ca: Option<PathBuf>,
    /// Its own certificate and key, for a server that requires them (`federated.client_ca`).
    pub identity: Option<shoal_http::tls::TlsFiles>,
    /// How long the server may be out of reach before the client gives up.
    pub retry_for: Duration,
}

/// What a client did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ClientReport {
    pub client: String,
    pub samples: usize,
    /// The rounds whose update the server accepted.
    pub rounds: Vec<usize>,
    /// Rounds whose update the server no longer took (the round had closed: late).
    pub late: Vec<usize>,
    /// Times the server was out of reach and then answered again.
    pub reconnects: usize,
}

/// The samples of a client's own file, read with the job's columns: a lake dataset's `feature_columns` and
/// `label_column`; for a built-in dataset, the columns `x0`…`x{n-1}` and `label` that `shoal fed partition`
/// writes.
pub fn client_data(spec: &JobSpec, path: &std::path::Path) -> Result<Arc<dyn Dataset>> {
    let t = &spec.train;
    let o = t.data_options();
    let (features, label, classes) = if crate::spec::data::is_lake(&t.dataset) {
        (
            o.feature_columns.clone().unwrap_or_default(),
            o.label_column.clone().unwrap_or_default(),
            o.classes.unwrap_or(0),
        )
    } else {
        let shape = t.data_shape().map_err(|e| Error::Spec(e.to_string()))?;
        ((0..shape.features).map(|i| format!("x{i}")).collect(), "label".to_owned(), shape.classes)
    };
    let location = std::path::absolute(path)
        .map_err(|e| Error::io(format!("--data {}", path.display()), e))?
        .display()
        .to_string();
    let table = shoal_data::lake::LakeTable::open(shoal_data::lake::TableSpec {
        location,
        format: o.format.as_deref().and_then(shoal_data::lake::Format::parse),
        features,
        label,
        classes,
        text: None,
        context: crate::spec::data::DEFAULT_CONTEXT,
        cache_bytes: shoal_data::lake::table::DEFAULT_CACHE_BYTES,
    })?;
    Ok(Arc::new(table))
}

struct Link {
    agent: ureq::Agent,
    server: String,
    auth: String,
    retry_for: Duration,
    reconnects: usize,
}

/// An answer: its status and body.
struct Answer {
    status: u16,
    body: Vec<u8>,
}

impl Link {
    /// `method` on `path`, retried while the server is out of reach.
    fn call(&mut self, post: bool, path: &str, body: &[u8]) -> Result<Answer> {
        let url = format!("{}{path}", self.server);
        let began = Instant::now();
        let mut pause = Duration::from_millis(250);
        let mut lost = false;
        loop {
            let sent = match post {
                true => self.agent.post(&url).header("authorization", &self.auth).send(body),
                false => self.agent.get(&url).header("authorization", &self.auth).call(),
            };
            let failure = match sent {
                Ok(mut r) => match r.body_mut().with_config().limit(1 << 34).read_to_vec() {
                    Ok(bytes) => {
                        if lost {
                            self.reconnects += 1;
                            eprintln!(
                                "federated client: the server answers again after {:.1} s",
                                began.elapsed().as_secs_f64()
                            );
                        }
                        return Ok(Answer { status: r.status().as_u16(), body: bytes });
                    }
                    Err(e) => e,
                },
                Err(e) => e,
            };
            // A certificate refused, either way, is not waited out; a connection cut mid-stream is.
            let said = failure.to_string().to_lowercase();
            if matches!(failure, ureq::Error::Tls(_)) || said.contains("certificate") || said.contains("alert") {
                return Err(Error::InvalidArgument(format!("{url}: TLS refused: {failure}")));
            }
            if began.elapsed() + pause > self.retry_for {
                return Err(Error::InvalidArgument(format!(
                    "{url}: no answer for {:.0} s (--retry-for): {failure}",
                    began.elapsed().as_secs_f64()
                )));
            }
            if !lost {
                eprintln!("federated client: the server is out of reach ({failure}); retrying");
                lost = true;
            }
            tracing::debug!(url, error = %failure, "retrying");
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    }
}

fn refused(what: &str, a: &Answer) -> Error {
    let text = String::from_utf8_lossy(&a.body);
    let msg = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_owned))
        .unwrap_or_else(|| text.chars().take(200).collect());
    Error::InvalidArgument(format!("the federated server refused {what} ({}): {msg}", a.status))
}

/// Runs the client until the job ends.
pub fn run(opts: &ClientOptions) -> Result<ClientReport> {
    let agent = shoal_http::tls::client(opts.ca.as_deref(), opts.identity.as_ref(), MAX_WAIT + Duration::from_secs(30))
        .map_err(|e| Error::InvalidArgument(e.0))?;
    let mut link = Link {
        agent,
        server: opts.server.trim_end_matches('/').to_owned(),
        auth: format!("Bearer {}", opts.token.trim()),
        retry_for: opts.retry_for,
        reconnects: 0,
    };
    let joined = link.call(true, "/fed/v1/join", b"")?;
    if joined.status != 200 {
        return Err(refused("the join", &joined));
    }
    let info: serde_json::Value = serde_json::from_slice(&joined.body)
        .map_err(|e| Error::InvalidArgument(format!("the server's join answer is not JSON: {e}")))?;
    let spec: JobSpec = serde_json::from_value(info["spec"].clone())
        .map_err(|e| Error::InvalidArgument(format!("the server's job spec: {e}")))?;
    let name = info["client"].as_str().unwrap_or("?").to_owned();
    let index = info["index"].as_u64().unwrap_or(0) as usize;
    let sigma = info["sigma"].as_f64();
    let f =
        spec.federated.clone().ok_or_else(|| Error::InvalidArgument("the server's spec has no [federated]".into()))?;
    let data = client_data(&spec, &opts.data)?;
    let (params, model) = crate::worker::setup::build_model(&spec, &mut SeededRng::new(spec.train.seed))?;
    let mine: Vec<usize> = (0..data.len()).collect();
    eprintln!("federated client {name}: joined {} with {} samples", opts.server, mine.len());
    let local = super::Local { spec: &spec, model: model.as_ref(), params: &params, data: data.as_ref() };
    let mut report =
        ClientReport { client: name.clone(), samples: mine.len(), rounds: Vec::new(), late: Vec::new(), reconnects: 0 };
    let wait = format!("/fed/v1/task?wait={}", MAX_WAIT.as_secs());
    loop {
        let task = link.call(false, &wait, b"")?;
        match task.status {
            200 => {}
            204 => continue,
            410 => break,
            _ => return Err(refused("a task request", &task)),
        }
        let (head, w) = decode(&task.body)
            .ok_or_else(|| Error::InvalidArgument("the server's model is not a JSON line and f32 values".into()))?;
        let round = head["round"].as_u64().unwrap_or(0) as usize;
        if head["secure"].as_bool() == Some(true) {
            let taken = secure_round(&mut link, &local, &mine, &w, round, index, (f.dp, sigma, spec.train.seed))?;
            match taken {
                true => report.rounds.push(round + 1),
                false => {
                    eprintln!("federated client {name}: round {} went on without it", round + 1);
                    report.late.push(round + 1);
                }
            }
            continue;
        }
        let (mut update, loss) = local.train(&mine, &w, round, index)?;
        super::privatize(&mut update, f.dp, sigma, spec.train.seed, round, index);
        let body = encode(&serde_json::json!({ "samples": mine.len(), "loss": loss }), &update);
        let sent = link.call(true, &format!("/fed/v1/update?round={round}"), &body)?;
        match sent.status {
            200 => {
                tracing::info!(client = %name, round = round + 1, loss, "update accepted");
                report.rounds.push(round + 1);
            }
            // A retried post whose first try arrived (its answer lost on the way back) is told it already answered.
            409 if String::from_utf8_lossy(&sent.body).contains("already answered") => report.rounds.push(round + 1),
            409 => {
                eprintln!("federated client {name}: round {} closed before its update arrived", round + 1);
                report.late.push(round + 1);
            }
            _ => return Err(refused("an update", &sent)),
        }
    }
    report.reconnects = link.reconnects;
    eprintln!(
        "federated client {name}: the job is over; {} rounds trained, {} reconnects",
        report.rounds.len(),
        report.reconnects
    );
    Ok(report)
}

/// A GET held by the hub until it has an answer: `Some` of it (200), `None` when the round went on without this
/// client (409).
fn poll(link: &mut Link, path: &str) -> Result<Option<serde_json::Value>> {
    let path = format!("{path}&wait={}", MAX_WAIT.as_secs());
    loop {
        let a = link.call(false, &path, b"")?;
        match a.status {
            200 => {
                return serde_json::from_slice(&a.body)
                    .map(Some)
                    .map_err(|e| Error::InvalidArgument(format!("{path}: the answer is not JSON: {e}")));
            }
            204 => continue,
            409 | 410 => return Ok(None),
            _ => return Err(refused(&path, &a)),
        }
    }
}

/// A POST of the protocol: `true` when taken, `false` when the round went on without this client (409).
fn post(link: &mut Link, path: &str, body: &[u8]) -> Result<bool> {
    let a = link.call(true, path, body)?;
    match a.status {
        200 => Ok(true),
        409 | 410 => Ok(false),
        _ => Err(refused(path, &a)),
    }
}

/// One round of secure aggregation (`super::secure`) as a client: keys, training, sealed shares, the masked
/// vector, the revealed shares. `true` when the client's vector was in the round's sum.
fn secure_round(
    link: &mut Link,
    local: &super::Local<'_>,
    mine: &[usize],
    w: &[crate::Real],
    round: usize,
    me: usize,
    (dp, sigma, seed): (Option<crate::spec::DpSpec>, Option<f64>, u64),
) -> Result<bool> {
    use super::secure;
    let q = format!("round={round}");
    let secrets = secure::Secrets::new();
    exit_before(round, "keys");
    if !post(link, &format!("/fed/v1/secure/keys?{q}"), secrets.publics().to_string().as_bytes())? {
        return Ok(false);
    }
    let (mut update, loss) = local.train(mine, w, round, me)?;
    super::privatize(&mut update, dp, sigma, seed, round, me);
    let Some(roster) = poll(link, &format!("/fed/v1/secure/roster?{q}"))? else { return Ok(false) };
    let (roster, shares) = secure::shares_for(&secrets, round, me, &roster)?;
    exit_before(round, "shares");
    if !post(link, &format!("/fed/v1/secure/shares?{q}"), shares.to_string().as_bytes())? {
        return Ok(false);
    }
    let Some(inbox) = poll(link, &format!("/fed/v1/secure/inbox?{q}"))? else { return Ok(false) };
    let u2: Vec<usize> =
        inbox["u2"].as_array().into_iter().flatten().filter_map(|v| v.as_u64()).map(|v| v as usize).collect();
    // Under DP each clipped update counts once; else by its samples, in units the fixed point holds.
    let weight = if dp.is_some() { 1.0 } else { mine.len() as f64 / secure::WEIGHT_UNIT };
    #[allow(clippy::unnecessary_cast)]
    let mut plain: Vec<f32> = update.iter().map(|u| (f64::from(*u) * weight) as f32).collect();
    plain.extend([weight as f32, loss as f32, 1.0]);
    let y = secure::masked(&secrets, me, &roster, &u2, &plain);
    let bytes: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
    exit_before(round, "masked");
    if !post(link, &format!("/fed/v1/secure/masked?{q}"), &bytes)? {
        return Ok(false);
    }
    let Some(survivors) = poll(link, &format!("/fed/v1/secure/survivors?{q}"))? else { return Ok(false) };
    let u3: Vec<usize> =
        survivors["u3"].as_array().into_iter().flatten().filter_map(|v| v.as_u64()).map(|v| v as usize).collect();
    let reveal = secure::reveal(&secrets, round, me, &roster, &inbox, &u3)?;
    exit_before(round, "reveal");
    post(link, &format!("/fed/v1/secure/reveal?{q}"), reveal.to_string().as_bytes())
}

/// Fault injection (feature `failpoints`): the client exits before `step` of round `round` when
/// `SHOAL_FAULT_FED_CLIENT_EXIT` is `ROUND:STEP` (rounds counted from 1).
#[cfg(feature = "failpoints")]
fn exit_before(round: usize, step: &str) {
    if std::env::var(shoal_comm::env::var::FAULT_FED_CLIENT_EXIT).is_ok_and(|v| v == format!("{}:{step}", round + 1)) {
        eprintln!("federated client: exiting before {step} of round {} (fault injection)", round + 1);
        std::process::exit(3);
    }
}

#[cfg(not(feature = "failpoints"))]
fn exit_before(_round: usize, _step: &str) {}
