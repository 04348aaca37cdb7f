//! The platform commands: `shoal server`, and the client commands `submit`, `jobs`, `status`, `logs`, `cancel`,
//! `queues`, `nodes`, plus `shoal demo` (an embedded server running a built-in job).
//!
//! Where the client finds its server and token, first found wins:
//! 1. `--addr` / `--token`;
//! 2. `SHOAL_ADDR` / `SHOAL_TOKEN`;
//! 3. the config file (`--config`, `SHOAL_CONFIG`, or `~/.config/shoal/config.toml`) with `addr` and `token`;
//! 4. a local server: `http://127.0.0.1:7733` and the token in its data directory's `admin.token`
//!    (`SHOAL_DATA_DIR`, default `~/.local/share/shoal`).

use std::io::{IsTerminal, Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use shoal_wire::{
    CancelAccepted, CostReport, Diagnosis, ErrorBody, EventList, JobDetail, JobList, NodeList, QueueList, Submitted,
};

pub const DEFAULT_ADDR: &str = "127.0.0.1:7733";

/// Where the server is and who we are.
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// Server address (`host:port` or `http://host:port`); default SHOAL_ADDR, the config file, 127.0.0.1:7733.
    #[arg(long, global = true)]
    pub addr: Option<String>,
    /// Bearer token; default SHOAL_TOKEN, the config file, or a local server's admin.token.
    #[arg(long, global = true)]
    pub token: Option<String>,
    /// Config file with `addr` and `token`; default SHOAL_CONFIG or ~/.config/shoal/config.toml.
    #[arg(long, global = true)]
    pub config: Option<PathBuf>,
    /// PEM file of the CA that signed the server's certificate (a private CA), for an `https://` address;
    /// default SHOAL_CA, the config file's `ca`, else the public roots.
    #[arg(long, global = true, value_name = "FILE")]
    pub ca: Option<PathBuf>,
}

pub fn default_data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SHOAL_DATA_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".local/share/shoal")
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    addr: Option<String>,
    token: Option<String>,
    ca: Option<PathBuf>,
}

fn read_config(args: &ClientArgs) -> Result<ConfigFile> {
    let explicit = args.config.clone().or_else(|| std::env::var_os("SHOAL_CONFIG").map(PathBuf::from));
    let path = explicit
        .clone()
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config/shoal/config.toml")));
    let Some(path) = path else { return Ok(ConfigFile::default()) };
    match std::fs::read_to_string(&path) {
        Ok(text) => toml_config(&text).with_context(|| format!("config file {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && explicit.is_none() => Ok(ConfigFile::default()),
        Err(e) => Err(anyhow!("config file {}: {e}", path.display())),
    }
}

fn toml_config(text: &str) -> Result<ConfigFile> {
    // `addr = "..."` and `token = "..."` lines; a tiny subset of TOML, strictly checked.
    let mut c = ConfigFile::default();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (k, v) = line.split_once('=').ok_or_else(|| anyhow!("line {}: expected key = \"value\"", i + 1))?;
        let v = v.trim().trim_matches('"').to_owned();
        match k.trim() {
            "addr" => c.addr = Some(v),
            "token" => c.token = Some(v),
            "ca" => c.ca = Some(PathBuf::from(v)),
            other => bail!("line {}: unknown key {other:?} (known: addr, token, ca)", i + 1),
        }
    }
    Ok(c)
}

/// The HTTP agent of a client: server errors are answers (read as the API's error body), connections time out,
/// and `https://` addresses are verified against `roots` (default: the public roots).
fn agent(roots: Option<ureq::tls::RootCerts>) -> ureq::Agent {
    let mut tls = ureq::tls::TlsConfig::builder();
    if let Some(roots) = roots {
        tls = tls.root_certs(roots);
    }
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(Duration::from_secs(5)))
        .tls_config(tls.build())
        .build()
        .into()
}

/// A client of one server.
#[derive(Debug, Clone)]
pub struct Client {
    base: String,
    token: Option<String>,
    agent: ureq::Agent,
}

impl Client {
    pub fn new(addr: &str, token: Option<String>) -> Client {
        let base = if addr.starts_with("http://") || addr.starts_with("https://") {
            addr.trim_end_matches('/').to_owned()
        } else {
            format!("http://{addr}")
        };
        Client { base, token, agent: agent(None) }
    }

    /// Trusts `ca` (PEM: one or more certificates) for the server's certificate instead of the public roots.
    pub fn with_ca(mut self, ca: &Path) -> Result<Client> {
        let pem = std::fs::read(ca).with_context(|| format!("--ca {}", ca.display()))?;
        let certs: Vec<ureq::tls::Certificate<'static>> = ureq::tls::parse_pem(&pem)
            .filter_map(|item| match item {
                Ok(ureq::tls::PemItem::Certificate(c)) => Some(Ok(c)),
                Ok(_) => None,
                Err(e) => Some(Err(e)),
            })
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| anyhow!("--ca {}: not a PEM certificate file: {e}", ca.display()))?;
        if certs.is_empty() {
            bail!("--ca {}: holds no CERTIFICATE block", ca.display());
        }
        self.agent = agent(Some(ureq::tls::RootCerts::new_with_certs(&certs)));
        Ok(self)
    }

    pub fn from_args(args: &ClientArgs) -> Result<Client> {
        let cfg = read_config(args)?;
        let addr = args
            .addr
            .clone()
            .or_else(|| std::env::var("SHOAL_ADDR").ok())
            .or(cfg.addr)
            .unwrap_or_else(|| DEFAULT_ADDR.to_owned());
        let token = args.token.clone().or_else(|| std::env::var("SHOAL_TOKEN").ok()).or(cfg.token).or_else(|| {
            std::fs::read_to_string(default_data_dir().join("admin.token")).ok().map(|t| t.trim().to_owned())
        });
        let client = Client::new(&addr, token);
        let ca = args.ca.clone().or_else(|| std::env::var_os("SHOAL_CA").map(PathBuf::from)).or(cfg.ca);
        match ca {
            Some(ca) => client.with_ca(&ca),
            None => Ok(client),
        }
    }

    fn auth(&self) -> Option<String> {
        self.token.as_ref().map(|t| format!("Bearer {t}"))
    }

    fn check(&self, resp: ureq::http::Response<ureq::Body>, what: &str) -> Result<ureq::http::Response<ureq::Body>> {
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let mut resp = resp;
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        let msg = serde_json::from_str::<ErrorBody>(&text).map_or(text, |e| e.error);
        bail!("{what}: {} {}", status.as_u16(), msg.trim())
    }

    fn unreachable(&self, e: ureq::Error) -> anyhow::Error {
        anyhow!(
            "cannot reach the shoal server at {}: {e} (start one with `shoal server`, or point --addr / SHOAL_ADDR at it)",
            self.base
        )
    }

    /// A request with a body that failed: a connection closed while the body was going out means the server
    /// refused it before reading it all (most often for its size), not that it cannot be reached.
    fn send_failed(&self, e: ureq::Error, body_len: usize) -> anyhow::Error {
        use std::io::ErrorKind::{BrokenPipe, ConnectionReset};
        match &e {
            ureq::Error::Io(io) if body_len > 0 && matches!(io.kind(), BrokenPipe | ConnectionReset) => anyhow!(
                "the shoal server at {} closed the connection while receiving the {body_len}-byte request body \
                 ({e}); it accepts at most {} bytes",
                self.base,
                shoal_control::http::MAX_BODY
            ),
            _ => self.unreachable(e),
        }
    }

    pub fn get(&self, path: &str) -> Result<Value> {
        let mut req = self
            .agent
            .get(format!("{}{path}", self.base))
            .config()
            .timeout_global(Some(Duration::from_secs(30)))
            .build();
        if let Some(a) = self.auth() {
            req = req.header("Authorization", a);
        }
        let resp = req.call().map_err(|e| self.unreachable(e))?;
        let mut resp = self.check(resp, &format!("GET {path}"))?;
        resp.body_mut().read_json().map_err(|e| anyhow!("GET {path}: bad JSON from the server: {e}"))
    }

    pub fn post(&self, path: &str, content_type: &str, body: &[u8]) -> Result<Value> {
        let mut req = self
            .agent
            .post(format!("{}{path}", self.base))
            .config()
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .header("Content-Type", content_type);
        if let Some(a) = self.auth() {
            req = req.header("Authorization", a);
        }
        let resp = req.send(body).map_err(|e| self.send_failed(e, body.len()))?;
        let mut resp = self.check(resp, &format!("POST {path}"))?;
        resp.body_mut().read_json().map_err(|e| anyhow!("POST {path}: bad JSON from the server: {e}"))
    }

    /// GET, read as one of the API's types.
    pub fn get_as<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        typed(self.get(path)?, &format!("GET {path}"))
    }

    /// POST, the answer read as one of the API's types.
    pub fn post_as<T: DeserializeOwned>(&self, path: &str, content_type: &str, body: &[u8]) -> Result<T> {
        typed(self.post(path, content_type, body)?, &format!("POST {path}"))
    }

    /// Streams a text body to `out` until the server ends it.
    pub fn stream(&self, path: &str, out: &mut dyn Write) -> Result<()> {
        let mut req = self.agent.get(format!("{}{path}", self.base));
        if let Some(a) = self.auth() {
            req = req.header("Authorization", a);
        }
        let resp = req.call().map_err(|e| self.unreachable(e))?;
        let resp = self.check(resp, &format!("GET {path}"))?;
        let mut reader = resp.into_body().into_reader();
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = reader.read(&mut buf).map_err(|e| anyhow!("reading {path}: {e}"))?;
            if n == 0 {
                return Ok(());
            }
            out.write_all(&buf[..n])?;
            out.flush()?;
        }
    }
}

/// A response body read as one of the API's types (`shoal_wire`); `what` names the request in the error.
fn typed<T: DeserializeOwned>(v: Value, what: &str) -> Result<T> {
    serde_json::from_value(v).map_err(|e| anyhow!("{what}: the server's answer is not what this client expects: {e}"))
}

// ------------------------------------------------------------------------------------------------------------
// server

#[derive(Debug, Clone, Args)]
pub struct ServerArgs {
    /// Where the state (SQLite), logs, checkpoints and the admin token live; default SHOAL_DATA_DIR or
    /// ~/.local/share/shoal.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Address to serve the API on.
    #[arg(long, default_value = DEFAULT_ADDR)]
    pub listen: SocketAddr,
    /// The scheduler's policy: an ordering (fifo, backfill, sjf, las, drf, elastic), a packing (bestfit, fgd) or
    /// ORDERING+PACKING.
    #[arg(long, default_value = "drf+bestfit")]
    pub policy: shoal_sched::Policy,
    /// PostgreSQL instead of SQLite: postgres://USER:PASSWORD@HOST:PORT/DB.
    #[arg(long)]
    pub database: Option<String>,
    /// CPUs this node offers to jobs (default: all this process may use), e.g. 2 or 1.5.
    #[arg(long)]
    pub cpus: Option<String>,
    /// Memory this node offers to jobs (default: all of it), e.g. 8GiB.
    #[arg(long)]
    pub memory: Option<String>,
    /// GPUs this node offers (default 0).
    #[arg(long, default_value_t = 0)]
    pub gpus: u32,
    /// Serve without tokens (only on a loopback address).
    #[arg(long)]
    pub no_auth: bool,
    /// Price table for cost reports (TOML: currency, cpu_hour, gib_hour, gpu_hour, kwh).
    #[arg(long)]
    pub prices: Option<PathBuf>,
    /// Start afresh when the database is damaged or missing (the damaged file is kept beside it).
    #[arg(long)]
    pub init: bool,
    /// Where teams may keep checkpoints outside their jobs' directories: DIR/TEAM/... (checkpoint.url).
    #[arg(long)]
    pub storage_root: Option<PathBuf>,
    /// Per-team object stores (TOML: [teams.NAME] urls = ["s3://bucket/prefix/"], env = { AWS_... }).
    #[arg(long)]
    pub storage_config: Option<PathBuf>,
    /// Accept dynamic-loader variables (LD_*) in jobs' [env].
    #[arg(long)]
    pub allow_loader_env: bool,
    /// The user tasks run as when the server runs as root (default: the system user `shoal`, created if
    /// missing); `root` runs them with the server's privileges.
    #[arg(long)]
    pub task_user: Option<String>,
    /// Serve HTTPS with this certificate chain (PEM, the server's certificate first); needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The URL workers reach this server at, for their heartbeats (e.g. http://shoal.shoal.svc:8080 on
    /// Kubernetes, http://HEAD-NODE:8080 on Slurm); default: the --listen address (loopback when unspecified).
    #[arg(long, value_name = "URL")]
    pub advertise_url: Option<String>,
    /// What runs the tasks: `local` (this machine's processes), `slurm` (each job one Slurm allocation on the
    /// cluster SLURM_CONF names, whose nodes the scheduler places on) or `kubernetes` (each attempt a headless
    /// Service and a Pod per rank, on the cluster's Nodes).
    #[arg(long, value_enum, default_value_t = ExecutorArg::Local)]
    pub executor: ExecutorArg,
    /// With --executor kubernetes: the kubeconfig (default: KUBECONFIG, ~/.kube/config, or the Pod's service
    /// account).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// With --executor kubernetes: the namespace of the jobs' objects (default: the kubeconfig's).
    #[arg(long, value_name = "NS")]
    pub namespace: Option<String>,
    /// With --executor kubernetes: the workers' image (default ghcr.io/shoal/shoal:<this version>).
    #[arg(long, value_name = "IMAGE")]
    pub image: Option<String>,
    /// With --executor kubernetes: the PersistentVolumeClaim that holds the data directory, mounted in every
    /// worker's Pod at the data directory's path (ReadWriteMany when workers run on several nodes).
    #[arg(long, value_name = "NAME", default_value = "shoal-data")]
    pub data_pvc: String,
    /// With --executor kubernetes: where this server has --data-pvc mounted, when above the data directory (the
    /// workers mount it at the same path).
    #[arg(long, value_name = "DIR")]
    pub data_pvc_mount: Option<PathBuf>,
    /// With --executor kubernetes: this server's name among others in the namespace (the label
    /// shoal.dev/instance of its Pods).
    #[arg(long, value_name = "NAME", default_value = "shoal")]
    pub instance: String,
}

/// `shoal server --executor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExecutorArg {
    Local,
    Slurm,
    #[cfg(feature = "kubernetes")]
    Kubernetes,
}

pub fn server_options(args: &ServerArgs) -> Result<shoal_control::ServerOptions> {
    let data_dir = args.data_dir.clone().unwrap_or_else(default_data_dir);
    let exe = std::env::current_exe().context("locating the shoal executable")?;
    let mut o = shoal_control::ServerOptions::new(&data_dir, args.listen, &exe);
    o.database = args.database.clone();
    o.sched_policy = args.policy;
    if let Some(c) = &args.cpus {
        o.cpus_milli = Some(shoal_spec::parse_milli(c).map_err(|e| anyhow!("--cpus: {e}"))?);
    }
    if let Some(m) = &args.memory {
        o.memory_bytes = Some(shoal_spec::parse_bytes(m).map_err(|e| anyhow!("--memory: {e}"))?);
    }
    o.gpus = args.gpus;
    o.no_auth = args.no_auth;
    o.init = args.init;
    o.task_user = args.task_user.clone();
    o.executor_kind = match args.executor {
        ExecutorArg::Local => shoal_control::ExecutorKind::Local,
        ExecutorArg::Slurm => shoal_control::ExecutorKind::Slurm,
        #[cfg(feature = "kubernetes")]
        ExecutorArg::Kubernetes => {
            let default_image = format!("ghcr.io/shoal/shoal:{}", env!("CARGO_PKG_VERSION"));
            let mut k = shoal_exec::KubeOptions::new(args.image.as_deref().unwrap_or(&default_image));
            k.kubeconfig = args.kubeconfig.clone();
            k.namespace = args.namespace.clone();
            k.data_pvc = args.data_pvc.clone();
            k.data_mount = args.data_pvc_mount.clone();
            k.instance = args.instance.clone();
            shoal_control::ExecutorKind::Kubernetes(k)
        }
    };

    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        o.tls = Some(shoal_http::tls::TlsFiles { cert: cert.clone(), key: key.clone() });
    }
    if let Some(u) = &args.advertise_url {
        if !(u.starts_with("http://") || u.starts_with("https://")) {
            bail!("--advertise-url {u:?}: give an http:// or https:// URL");
        }
        o.advertise = Some(u.trim_end_matches('/').to_owned());
    }
    o.policy.allow_loader_env = args.allow_loader_env;
    o.policy.storage_root = match &args.storage_root {
        Some(r) => Some(std::path::absolute(r).with_context(|| format!("--storage-root {}", r.display()))?),
        None => None,
    };
    if let Some(p) = &args.storage_config {
        let text = std::fs::read_to_string(p).with_context(|| format!("--storage-config {}", p.display()))?;
        o.policy.storage = shoal_control::policy::StorageConfig::parse(&text)
            .map_err(|e| anyhow!("--storage-config {}: {e}", p.display()))?;
    }
    if let Some(p) = &args.prices {
        let text = std::fs::read_to_string(p).with_context(|| format!("--prices {}", p.display()))?;
        o.prices = shoal_control::cost::parse_prices(&text).map_err(|e| anyhow!("--prices {}: {e}", p.display()))?;
    }
    Ok(o)
}

pub fn server(args: &ServerArgs) -> Result<bool> {
    let opts = server_options(args)?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let s = shoal_control::start(opts.clone()).await?;
        eprintln!(
            "shoal server on http://{} (data {}; admin token in {})",
            s.addr,
            opts.data_dir.display(),
            opts.data_dir.join("admin.token").display()
        );
        s.wait_for_signal().await?;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(true)
}

// ------------------------------------------------------------------------------------------------------------
// client commands

pub fn submit(client: &Client, job: &Path, json_out: bool) -> Result<bool> {
    let text = std::fs::read_to_string(job).with_context(|| format!("reading {}", job.display()))?;
    within_body_limit(job, text.len())?;
    // Check locally first: errors then name the file and line.
    let spec = shoal_spec::parse_job(&text, &job.display().to_string()).map_err(|e| anyhow!("{e}"))?;
    let v: Submitted = client.post_as("/api/v1/jobs", "application/toml", text.as_bytes())?;
    let id = v.id.as_str();
    if json_out {
        println!("{}", json!({ "id": id }));
    } else {
        println!("{id}");
        eprintln!("submitted {} as {id}; follow it with `shoal status {id}` or `shoal logs {id} --follow`", spec.name);
    }
    Ok(true)
}

/// Refuses a spec the server would refuse for its size ([`shoal_control::http::MAX_BODY`]) before sending it.
fn within_body_limit(job: &Path, len: usize) -> Result<()> {
    let max = shoal_control::http::MAX_BODY;
    if len > max {
        bail!(
            "{}: {len} bytes; the server accepts job specs of at most {max} bytes ({} MiB)",
            job.display(),
            max >> 20
        );
    }
    Ok(())
}

fn age(ms: Option<i64>) -> String {
    let Some(ms) = ms else { return "-".into() };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    let s = ((now - ms) / 1000).max(0);
    if s < 120 {
        format!("{s}s")
    } else if s < 7200 {
        format!("{}m", s / 60)
    } else {
        format!("{}h", s / 3600)
    }
}

pub fn jobs(client: &Client, state: Option<&str>, json_out: bool) -> Result<bool> {
    let q = state.map(|s| format!("?state={s}")).unwrap_or_default();
    let path = format!("/api/v1/jobs{q}");
    let v = client.get(&path)?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(true);
    }
    let list: JobList = typed(v, &format!("GET {path}"))?;
    println!(
        "{:<11} {:<24} {:<10} {:<10} {:<9} {:>7} {:>8} {:>6}",
        "ID", "NAME", "STATE", "TEAM", "QUEUE", "WORKERS", "RESTARTS", "AGE"
    );
    for j in &list.jobs {
        println!(
            "{:<11} {:<24} {:<10} {:<10} {:<9} {:>7} {:>8} {:>6}",
            j.id,
            j.name,
            j.state.as_str(),
            j.team,
            j.queue,
            j.worker_count,
            j.restarts,
            age(Some(j.created_ms))
        );
    }
    Ok(true)
}

pub fn status(client: &Client, id: &str, json_out: bool) -> Result<bool> {
    let path = format!("/api/v1/jobs/{id}");
    let v = client.get(&path)?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(true);
    }
    let d: JobDetail = typed(v, &format!("GET {path}"))?;
    let j = &d.job;
    println!("{} {} — {}", j.id, j.name, j.state.as_str());
    println!("  team {} (user {}), queue {}, priority {}", j.team, j.user, j.queue, j.priority);
    println!("  attempt {}, restarts {}; {}", j.attempt, j.restarts, j.reason);
    if let Some(m) = &d.last_metrics {
        let steps = d.spec.as_ref().map_or(0, |s| s.train.steps);
        println!(
            "  step {}/{steps}, loss {:.4}",
            m.get("step").and_then(Value::as_i64).unwrap_or(0),
            m.get("loss").and_then(Value::as_f64).unwrap_or(f64::NAN)
        );
    }
    println!("  {:<5} {:<8} {:<16} {:<8} {:>5} {:<8}", "RANK", "PID", "HOST", "STATE", "EXIT", "CPUS");
    for w in &d.workers {
        println!(
            "  {:<5} {:<8} {:<16} {:<8} {:>5} {:<8}",
            w.rank,
            w.pid.map_or("-".into(), |p| p.to_string()),
            w.host,
            w.state.as_str(),
            w.exit_code.map_or("-".into(), |c| c.to_string()),
            w.cpus
        );
    }
    if let Some(sum) = &d.summary {
        print_summary(sum);
    }
    if let Some(h) = &d.hang_dump {
        println!("  last hang (attempt {}, step {}): {}", h.attempt, h.step, h.summary);
    }
    println!("  events:");
    for e in &d.events {
        println!("    {:>6} {:<10} {}", age(Some(e.time_ms)), e.kind, e.message);
    }
    Ok(true)
}

fn print_summary(sum: &Value) {
    let f = |k: &str| sum.get(k).and_then(Value::as_f64);
    println!(
        "  result: {} steps, final loss {:.4}, eval loss {:.4}{}{}, {:.0} samples/s",
        sum.get("steps").and_then(Value::as_u64).unwrap_or(0),
        f("final_loss").unwrap_or(f64::NAN),
        f("eval_loss").unwrap_or(f64::NAN),
        f("eval_accuracy").map_or(String::new(), |a| format!(", eval accuracy {:.2}%", a * 100.0)),
        f("eval_perplexity").map_or(String::new(), |p| format!(", eval perplexity {p:.2}")),
        f("samples_per_s").unwrap_or(0.0)
    );
    if let Some(b) = f("baseline_loss") {
        println!("  a unigram model of the same text: loss {b:.4}, perplexity {:.2}", b.exp());
    }
}

pub fn logs(client: &Client, id: &str, rank: u32, follow: bool) -> Result<bool> {
    let mut out = Counting { inner: std::io::stdout().lock(), n: 0 };
    if follow {
        client.stream(&format!("/api/v1/jobs/{id}/logs?rank={rank}&follow=true"), &mut out)?;
        return Ok(true);
    }
    // The server answers a bounded chunk per request: ask from where the last one ended until nothing is left.
    loop {
        let before = out.n;
        client.stream(&format!("/api/v1/jobs/{id}/logs?rank={rank}&offset={before}"), &mut out)?;
        if out.n == before {
            return Ok(true);
        }
    }
}

/// A writer that counts what passed through it.
struct Counting<W> {
    inner: W,
    n: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(b)?;
        self.n += k as u64;
        Ok(k)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

pub fn cancel(client: &Client, id: &str, json_out: bool) -> Result<bool> {
    let path = format!("/api/v1/jobs/{id}/cancel");
    let v = client.post(&path, "application/json", b"{}")?;
    if json_out {
        println!("{v}");
    } else {
        let c: CancelAccepted = typed(v, &format!("POST {path}"))?;
        println!("cancelling {}", c.id);
    }
    Ok(true)
}

pub fn queues(client: &Client, json_out: bool) -> Result<bool> {
    let v = client.get("/api/v1/queues")?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(true);
    }
    let list: QueueList = typed(v, "GET /api/v1/queues")?;
    println!(
        "{:<12} {:>8} {:>12} {:>6} {:>7} {:>8} {:>8} {:>9}",
        "QUEUE", "CPUS", "MEMORY", "GPUS", "BORROW", "PENDING", "RUNNING", "PREEMPTED"
    );
    for q in &list.queues {
        let g = &q.guaranteed;
        println!(
            "{:<12} {:>8} {:>12} {:>6} {:>7} {:>8} {:>8} {:>9}",
            q.name,
            g.cpus,
            bytes(g.memory_bytes),
            g.gpus,
            q.can_borrow,
            q.pending,
            q.running,
            q.preempted
        );
    }
    Ok(true)
}

fn bytes(b: u64) -> String {
    format!("{:.1}GiB", b as f64 / (1u64 << 30) as f64)
}

pub fn nodes(client: &Client, json_out: bool) -> Result<bool> {
    let v = client.get("/api/v1/nodes")?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(true);
    }
    let list: NodeList = typed(v, "GET /api/v1/nodes")?;
    println!("{:<8} {:<16} {:>11} {:>23} {:>9}", "NODE", "HOST", "CPUS", "MEMORY", "GPUS");
    for n in &list.nodes {
        let a = &n.allocated;
        println!(
            "{:<8} {:<16} {:>11} {:>23} {:>9}",
            n.id,
            n.host,
            format!("{}/{}", a.cpus, n.cpus),
            format!("{}/{}", bytes(a.memory_bytes), bytes(n.memory_bytes)),
            format!("{}/{}", a.gpus, n.gpus.len())
        );
    }
    Ok(true)
}

pub fn diagnose(client: &Client, id: &str, json_out: bool) -> Result<bool> {
    let path = format!("/api/v1/jobs/{id}/diagnosis");
    let v = client.get(&path)?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&json!({ "findings": v["findings"] }))?);
        return Ok(true);
    }
    let d: Diagnosis = typed(v, &format!("GET {path}"))?;
    println!("{id} ({}):", d.state.as_str());
    for f in &d.findings {
        let rank = f.rank.map_or(String::new(), |r| format!(" (rank {r})"));
        println!("  {}{rank}", f.kind);
        println!("    evidence: {}", f.evidence);
        println!("    action:   {}", f.action);
    }
    Ok(true)
}

/// Parses `--since`: a duration back from now (`90m`, `24h`, `7d`) or milliseconds since the epoch.
fn since_ms(since: &str) -> Result<i64> {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    let t = since.trim();
    let (num, unit) = t.split_at(t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len()));
    let n: i64 =
        num.parse().map_err(|_| anyhow!("--since {since:?}: expected e.g. 90m, 24h, 7d or epoch milliseconds"))?;
    let ms = match unit {
        "" => return Ok(n),
        "s" => n * 1000,
        "m" => n * 60_000,
        "h" => n * 3_600_000,
        "d" => n * 86_400_000,
        u => bail!("--since {since:?}: unknown unit {u:?} (s, m, h, d)"),
    };
    Ok(now - ms)
}

pub fn cost(client: &Client, team: Option<&str>, since: Option<&str>, json_out: bool) -> Result<bool> {
    let mut q = Vec::new();
    if let Some(t) = team {
        q.push(format!("team={t}"));
    }
    if let Some(s) = since {
        q.push(format!("since={}", since_ms(s)?));
    }
    let path = if q.is_empty() { "/api/v1/cost".to_owned() } else { format!("/api/v1/cost?{}", q.join("&")) };
    let v = client.get(&path)?;
    if json_out {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(true);
    }
    let r: CostReport = typed(v, &format!("GET {path}"))?;
    let cur = &r.currency;
    println!(
        "{:<11} {:<20} {:<8} {:<10} {:>8} {:>9} {:>9} {:>8} {:>9} {:>10}",
        "JOB", "NAME", "TEAM", "STATE", "QUEUED", "CPU-H", "USED", "GIB-H", "GPU-H", "COST"
    );
    for j in &r.jobs {
        println!(
            "{:<11} {:<20} {:<8} {:<10} {:>7.0}s {:>9.4} {:>9.4} {:>8.4} {:>9.4} {:>10}",
            j.id,
            j.name,
            j.team,
            j.state,
            j.queue_s,
            j.allocated.cpu_hours,
            j.used.cpu_hours,
            j.allocated.gib_hours,
            j.allocated.gpu_hours,
            format!("{:.4} {cur}", j.cost)
        );
    }
    println!();
    for t in &r.teams {
        println!(
            "team {:<12} {:>4} jobs  {:.4} CPU-h  {:.4} GPU-h  {:.4} {cur}",
            t.team, t.jobs, t.allocated.cpu_hours, t.allocated.gpu_hours, t.cost
        );
    }
    println!("total {:.4} {cur}", r.total_cost);
    Ok(true)
}

// ------------------------------------------------------------------------------------------------------------
// demo

/// The demo's job: a small GPT on Cicero's Latin, two workers (`examples/demo_gpt_cicero.toml`).
const DEMO_JOB: &str = include_str!("../../../examples/demo_gpt_cicero.toml");

/// `shoal demo`: an embedded server on a free loopback port with a temporary data directory, the built-in job
/// submitted through the API like any client would, progress until it ends, the result, and where to look.
/// The built-in demo job as JSON, shortened to `steps` when asked (warm-up and
/// evaluation interval shrink with it so the spec stays valid).
fn demo_job(steps: Option<usize>) -> Result<String> {
    let mut spec = shoal_spec::parse_job(DEMO_JOB, "examples/demo_gpt_cicero.toml").map_err(|e| anyhow!("{e}"))?;
    if let Some(n) = steps {
        let t = &mut spec.train;
        t.steps = n;
        t.warmup_steps = t.warmup_steps.min(n / 4);
        if t.eval_every >= n {
            t.eval_every = 0;
        }
        if t.log_every > n {
            t.log_every = n;
        }
        spec.validate().map_err(|e| anyhow!("demo job with --steps {n}: {e}"))?;
    }
    Ok(serde_json::to_string(&spec)?)
}

pub fn demo(keep: bool, steps: Option<usize>, json_out: bool) -> Result<bool> {
    // With --json, stdout carries only the final object; the running commentary goes to stderr.
    let say = |line: String| {
        if json_out {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    let job = demo_job(steps)?;
    let dir = std::env::temp_dir().join(format!("shoal-demo-{}", std::process::id()));
    let exe = std::env::current_exe().context("locating the shoal executable")?;
    let listen: SocketAddr = "127.0.0.1:0".parse()?;
    let mut opts = shoal_control::ServerOptions::new(&dir, listen, &exe);
    opts.tick = Duration::from_millis(200);
    let rt = tokio::runtime::Runtime::new()?;
    let server = rt.block_on(shoal_control::start(opts))?;
    let addr = server.addr;
    say(format!("shoal demo: server on http://{addr} (data in {})", dir.display()));
    let client = Client::new(&addr.to_string(), Some(server.admin_token.clone()));
    let id = client.post_as::<Submitted>("/api/v1/jobs", "application/json", job.as_bytes())?.id;
    say(format!("submitted the built-in job (a small GPT learning Cicero's Latin, 2 workers, data parallel) as {id}"));
    let ok = follow_job(&client, &id, Duration::from_secs(600), json_out)?;
    let v: JobDetail = client.get_as(&format!("/api/v1/jobs/{id}"))?;
    let summary = v.summary.as_ref();
    let findings =
        client.get_as::<Diagnosis>(&format!("/api/v1/jobs/{id}/diagnosis")).map(|d| d.findings).unwrap_or_default();
    let dashboard = format!("http://{addr}/#token={}&/jobs/{id}", server.admin_token);
    if json_out {
        println!(
            "{}",
            json!({
                "id": id,
                "state": v.job.state,
                "succeeded": ok,
                "summary": summary,
                "events": v.events,
                "diagnosis": findings,
                "dashboard": if keep { Some(&dashboard) } else { None },
                "data_dir": dir,
            })
        );
    } else {
        if let Some(sum) = summary {
            print_summary(sum);
            if let Some(st) = sum.get("step_time") {
                let f = |k: &str| st.get(k).and_then(Value::as_f64).unwrap_or(0.0) * 1e3;
                println!(
                    "  step medians: data {:.2} ms, compute {:.2} ms, comm {:.2} ms, optimizer {:.2} ms",
                    f("data_s"),
                    f("compute_s"),
                    f("comm_s"),
                    f("optimizer_s")
                );
            }
        }
        println!("  events:");
        for e in &v.events {
            println!("    {:<10} {}", e.kind, e.message);
        }
        for f in &findings {
            println!("  diagnosis: {} — {}", f.kind, f.evidence);
        }
    }
    say(format!("dashboard: {dashboard}"));
    say(format!("  (or: shoal status {id} --addr {addr} --token $(cat {}/admin.token))", dir.display()));
    if keep {
        say("--keep: the server keeps running; Ctrl-C stops it".to_owned());
        rt.block_on(server.wait_for_signal())?;
    } else {
        rt.block_on(server.shutdown());
    }
    Ok(ok)
}

/// Shows a job's progress until it ends (a bar on a terminal, lines otherwise); true when it succeeded.
/// With `to_stderr`, the plain lines go to stderr (stdout is kept for JSON).
pub fn follow_job(client: &Client, id: &str, limit: Duration, to_stderr: bool) -> Result<bool> {
    let say = |line: String| {
        if to_stderr {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    let t0 = Instant::now();
    let tty = std::io::stderr().is_terminal();
    let bar = indicatif::ProgressBar::new(0);
    if tty {
        bar.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {prefix} [{bar:30}] {pos}/{len} {msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut last_state = String::new();
    let mut last_print = Instant::now() - Duration::from_secs(60);
    loop {
        let v: JobDetail = client.get_as(&format!("/api/v1/jobs/{id}"))?;
        let state = v.job.state.as_str();
        if state != last_state {
            bar.suspend(|| say(format!("  {id}: {state} — {}", v.job.reason)));
            state.clone_into(&mut last_state);
        }
        let steps = v.spec.as_ref().map_or(0, |s| s.train.steps as u64);
        if let Some(m) = &v.last_metrics {
            let step = m.get("step").and_then(Value::as_u64).unwrap_or(0);
            let loss = m.get("loss").and_then(Value::as_f64).unwrap_or(f64::NAN);
            bar.set_length(steps);
            bar.set_position(step);
            bar.set_prefix(id.to_owned());
            bar.set_message(format!("loss {loss:.4}"));
            if !tty && last_print.elapsed() >= Duration::from_secs(5) {
                say(format!("  step {step}/{steps} loss {loss:.4}"));
                last_print = Instant::now();
            }
        }
        match state {
            "succeeded" => {
                bar.finish_and_clear();
                return Ok(true);
            }
            "failed" | "cancelled" => {
                bar.finish_and_clear();
                let tail = client
                    .get_as::<EventList>(&format!("/api/v1/jobs/{id}/events"))
                    .ok()
                    .and_then(|e| e.events.into_iter().next_back());
                if let Some(e) = tail {
                    eprintln!("{id} {state}: {}", e.message);
                }
                return Ok(false);
            }
            _ => {}
        }
        if t0.elapsed() > limit {
            bar.finish_and_clear();
            bail!("{id} did not finish within {} s (state {state})", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}
