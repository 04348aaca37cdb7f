//! `shoal fed`: federated learning's real clients. `client` joins a federated job's server (`federated.listen`)
//! and trains on a local file until the job ends; `partition` cuts a job's dataset the way its `[federated]` table
//! says, into one file per client (and their tokens), to try real clients on.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

#[derive(Debug, clap::Subcommand)]
pub enum FedCmd {
    /// Join a federated job's server and train each round this client is sampled for, on its own data, until the
    /// job ends. The data never leaves: only clipped updates do.
    Client {
        /// The server: https://HOST:PORT (http:// on loopback).
        #[arg(long)]
        server: String,
        /// This client's data: a Parquet, CSV or JSONL file (the job's columns; for a built-in dataset x0.. and
        /// label, as `shoal fed partition` writes).
        #[arg(long)]
        data: PathBuf,
        /// This client's token (or SHOAL_FED_TOKEN, or --token-file).
        #[arg(long)]
        token: Option<String>,
        /// A file holding this client's token.
        #[arg(long, conflicts_with = "token")]
        token_file: Option<PathBuf>,
        /// PEM of the CA that signed the server's certificate (default: the public roots).
        #[arg(long)]
        ca: Option<PathBuf>,
        /// This client's certificate chain (PEM), for a server that requires client certificates.
        #[arg(long, requires = "key")]
        cert: Option<PathBuf>,
        /// The key of --cert (PEM).
        #[arg(long, requires = "cert")]
        key: Option<PathBuf>,
        /// Seconds the server may be out of reach before the client gives up.
        #[arg(long, default_value_t = 300.0)]
        retry_for: f64,
        /// One JSON object at the end: client, samples, rounds, late, reconnects.
        #[arg(long)]
        json: bool,
    },
    /// Cut a federated job's training data among its clients as `[federated]` says (partition, alpha, seed):
    /// `client-NNNN.csv` each (columns x0.. and label), and with --tokens a `tokens` file for `federated.tokens`
    /// and each client's token in `client-NNNN.token`.
    Partition {
        job: PathBuf,
        #[arg(long)]
        out: PathBuf,
        #[arg(long)]
        tokens: bool,
    },
}

pub fn run(cmd: &FedCmd) -> Result<bool> {
    match cmd {
        FedCmd::Client { server, data, token, token_file, ca, cert, key, retry_for, json } => {
            let token = match (token, token_file) {
                (Some(t), _) => t.clone(),
                (None, Some(f)) => std::fs::read_to_string(f)
                    .with_context(|| format!("--token-file {}", f.display()))?
                    .trim()
                    .to_owned(),
                (None, None) => match std::env::var("SHOAL_FED_TOKEN") {
                    Ok(t) if !t.trim().is_empty() => t,
                    _ => bail!("give this client's token: --token, --token-file or SHOAL_FED_TOKEN"),
                },
            };
            if !(retry_for.is_finite() && *retry_for > 0.0) {
                bail!("--retry-for {retry_for}: must be a number of seconds > 0");
            }
            let identity = match (cert, key) {
                (Some(cert), Some(key)) => Some(shoal_http::tls::TlsFiles { cert: cert.clone(), key: key.clone() }),
                _ => None,
            };
            let opts = shoal_train::fed::client::ClientOptions {
                server: server.clone(),
                data: data.clone(),
                token,
                ca: ca.clone(),
                identity,
                retry_for: Duration::from_secs_f64(*retry_for),
            };
            let report = shoal_train::fed::client::run(&opts)?;
            if *json {
                println!("{}", serde_json::to_string(&report)?);
            }
            Ok(true)
        }
        FedCmd::Partition { job, out, tokens } => partition(job, out, *tokens),
    }
}

fn partition(job: &std::path::Path, out: &std::path::Path, tokens: bool) -> Result<bool> {
    let spec = shoal_train::spec::load_job(job).map_err(|e| anyhow::anyhow!("{e}"))?;
    let Some(f) = spec.federated.as_ref() else { bail!("{}: has no [federated] table", job.display()) };
    let (train, _, _) = shoal_train::worker::open_data(&spec.train)?;
    let labels = shoal_train::fed::labels(train.as_ref())?;
    let parts = shoal_train::fed::partition(f, &labels, train.info().classes, spec.train.seed)?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let features = train.info().features;
    let mut lines = String::from("# federated.tokens: NAME TOKEN\n");
    for (c, mine) in parts.iter().enumerate() {
        let name = format!("client-{c:04}");
        let path = out.join(format!("{name}.csv"));
        let mut w = std::io::BufWriter::new(std::fs::File::create(&path).with_context(|| path.display().to_string())?);
        let head: Vec<String> = (0..features).map(|i| format!("x{i}")).chain(["label".to_owned()]).collect();
        writeln!(w, "{}", head.join(","))?;
        for &i in mine {
            let s = train.get(i)?;
            let Some(dense) = s.features.as_dense() else {
                bail!("{}: a federated partition file holds dense features", spec.train.dataset)
            };
            // Always with a decimal point, so a column of whole numbers is still read as real.
            let x: Vec<String> = dense.iter().map(|v| format!("{v:?}")).collect();
            let label = match s.label {
                shoal_data::Label::Class(k) => k,
                _ => bail!("{}: a federated partition needs a class a sample", spec.train.dataset),
            };
            writeln!(w, "{},{label}", x.join(","))?;
        }
        w.flush()?;
        if tokens {
            let token: String = (0..32).map(|_| format!("{:x}", rand::random::<u8>() & 15)).collect();
            std::fs::write(out.join(format!("{name}.token")), &token)?;
            lines.push_str(&format!("{name} {token}\n"));
        }
    }
    if tokens {
        std::fs::write(out.join("tokens"), lines)?;
    }
    eprintln!("{} clients written to {}", parts.len(), out.display());
    Ok(true)
}
