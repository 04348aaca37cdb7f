//! `[federated]`: federated learning (`train.strategy = "federated"`). Clients each hold a part of the data that
//! never leaves them; every round the server samples some, sends them the global model, each trains
//! `local_steps` (or `local_epochs`) on its own part with the job's optimizer, learning rate and `global_batch` as
//! its local batch, and the server combines their updates weighted by their samples.

use serde::{Deserialize, Serialize};

/// `[federated]`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FederatedSpec {
    /// Clients, each with its own part of the training data.
    pub clients: usize,
    /// Rounds of training.
    pub rounds: usize,
    /// Clients sampled each round (default all); under `[federated.dp]` the expected number (each client is
    /// sampled with probability `clients_per_round / clients`, as the accountant assumes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clients_per_round: Option<usize>,
    /// Local optimizer steps a client takes each round (default 10; not with `local_epochs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_steps: Option<usize>,
    /// Or: passes over its own data a client makes each round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_epochs: Option<usize>,
    /// How the server combines the clients' updates (default `fedavg`).
    #[serde(default)]
    pub algorithm: FedAlgorithm,
    /// FedProx's proximal weight (default 0.01; `fedprox` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mu: Option<f64>,
    /// The server's step on the combined update (default 1.0 for FedAvg and FedProx: the weighted mean of the
    /// clients' models; 0.01 for FedAdam, whose step Adam sizes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_lr: Option<f64>,
    /// How the data is cut among the clients (default `iid`).
    #[serde(default)]
    pub partition: FedPartition,
    /// Dirichlet concentration over the labels (default 0.5; `dirichlet` only): smaller is less alike.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alpha: Option<f64>,
    /// Label-sorted shards per client (default 2; `shards` only), as McMahan et al.'s pathological non-IID cut.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards_per_client: Option<usize>,
    /// The server learns only the sum of each round's updates (pairwise masks agreed by Diffie–Hellman, the
    /// dropped clients' masks removed from the survivors' shares of their keys).
    #[serde(default)]
    pub secure_aggregation: bool,
    /// Experiments: the fraction of each round's sampled clients that drop out after the round began (their
    /// updates never arrive), drawn from the round's seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropout: Option<f64>,
    /// `[federated.dp]`: differential privacy of the clients' updates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dp: Option<DpSpec>,
    /// Seconds a round waits for its sampled clients' updates: those that have not arrived by then are dropped
    /// from the round (counted as late) and the rest are combined. Default 600 with remote clients; in simulation
    /// a client whose local training takes longer is dropped the same way (default: no deadline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round_timeout: Option<f64>,
    /// Serve remote clients at this address (`host:port`) instead of simulating them: each runs
    /// `shoal fed client --server URL --data PATH` on its own data. Needs `tokens`, and `tls_cert` and `tls_key`
    /// unless the address is loopback.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// The remote clients: a file of lines `NAME TOKEN` (blank lines and `#` comments skipped), one a client; a
    /// client authenticates with its token, and `clients` must equal the lines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<String>,
    /// The server's certificate chain (PEM) for HTTPS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<String>,
    /// Its private key (PEM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<String>,
    /// Require every client to present a certificate signed by this CA (PEM) as well as its token (mutual TLS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<String>,
    /// Seconds the server waits for enough clients to be connected before a round (default 300): at least
    /// `clients_per_round` of them, or all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_timeout: Option<f64>,
}

/// `federated.algorithm`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FedAlgorithm {
    /// The weighted mean of the clients' models (McMahan et al., 2017).
    #[default]
    Fedavg,
    /// FedAvg with a proximal term `mu/2 · ||w − w_global||²` in each client's loss (Li et al., 2020).
    Fedprox,
    /// The weighted mean update taken as a pseudo-gradient by a server-side Adam (Reddi et al., 2021).
    Fedadam,
}

/// `federated.partition`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FedPartition {
    /// A seeded shuffle cut into near-equal parts.
    #[default]
    Iid,
    /// Each class's samples spread over the clients by proportions drawn from Dirichlet(`alpha`).
    Dirichlet,
    /// The samples sorted by label, cut into `clients × shards_per_client` shards, each client given that many.
    Shards,
}

/// `[federated.dp]`: each client's update clipped to L2 norm `clip`, the sum of a round's updates given Gaussian
/// noise of standard deviation `noise_multiplier × clip` by the server (or each client's, with `local = true`),
/// and the privacy spent accounted by Rényi DP.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DpSpec {
    pub clip: f64,
    /// σ; or give `epsilon` and the smallest σ that stays within it over the job's rounds is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise_multiplier: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epsilon: Option<f64>,
    /// δ (default 1e-5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delta: Option<f64>,
    /// Each client noises its own clipped update (local DP) instead of the server the sum.
    #[serde(default)]
    pub local: bool,
}

impl FedAlgorithm {
    pub fn as_str(self) -> &'static str {
        match self {
            FedAlgorithm::Fedavg => "fedavg",
            FedAlgorithm::Fedprox => "fedprox",
            FedAlgorithm::Fedadam => "fedadam",
        }
    }
}

impl FederatedSpec {
    /// Clients sampled a round (expected, under DP).
    pub fn per_round(&self) -> usize {
        self.clients_per_round.unwrap_or(self.clients)
    }

    pub fn mu(&self) -> f64 {
        self.mu.unwrap_or(0.01)
    }

    pub fn server_lr(&self) -> f64 {
        self.server_lr.unwrap_or(if self.algorithm == FedAlgorithm::Fedadam { 0.01 } else { 1.0 })
    }

    pub fn alpha(&self) -> f64 {
        self.alpha.unwrap_or(0.5)
    }

    pub fn shards_per_client(&self) -> usize {
        self.shards_per_client.unwrap_or(2)
    }

    /// The table alone. Errors are `(key path, message)`.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let at = |k: &str, m: String| Err((format!("federated.{k}"), m));
        if self.clients == 0 || self.clients > 1_000_000 {
            return at("clients", format!("{} is not in 1..=1000000", self.clients));
        }
        if self.rounds == 0 {
            return at("rounds", "must be at least 1".into());
        }
        if let Some(k) = self.clients_per_round.filter(|&k| k == 0 || k > self.clients) {
            return at("clients_per_round", format!("{k} is not in 1..={} (the clients)", self.clients));
        }
        match (self.local_steps, self.local_epochs) {
            (Some(_), Some(_)) => return at("local_epochs", "give local_steps or local_epochs, not both".into()),
            (Some(0), _) => return at("local_steps", "must be at least 1".into()),
            (_, Some(0)) => return at("local_epochs", "must be at least 1".into()),
            _ => {}
        }
        let only = |key: &str, set: bool, when: bool, what: &str| match set && !when {
            true => at(key, format!("applies to {what} only")),
            false => Ok(()),
        };
        only("mu", self.mu.is_some(), self.algorithm == FedAlgorithm::Fedprox, "algorithm = \"fedprox\"")?;
        only("alpha", self.alpha.is_some(), self.partition == FedPartition::Dirichlet, "partition = \"dirichlet\"")?;
        only(
            "shards_per_client",
            self.shards_per_client.is_some(),
            self.partition == FedPartition::Shards,
            "partition = \"shards\"",
        )?;
        let positive = |key: &str, v: Option<f64>| match v {
            Some(x) if !(x.is_finite() && x > 0.0) => at(key, format!("{x} is not > 0 and finite")),
            _ => Ok(()),
        };
        positive("mu", self.mu)?;
        positive("alpha", self.alpha)?;
        positive("server_lr", self.server_lr)?;
        if let Some(d) = self.dropout.filter(|d| !(*d >= 0.0 && *d < 1.0)) {
            return at("dropout", format!("{d} is not in [0, 1)"));
        }
        positive("round_timeout", self.round_timeout)?;
        positive("join_timeout", self.join_timeout)?;
        match &self.listen {
            Some(addr) => {
                let Ok(sock) = addr.parse::<std::net::SocketAddr>() else {
                    return at("listen", format!("{addr:?} is not an address and port like \"0.0.0.0:7443\""));
                };
                if self.tokens.is_none() {
                    return at(
                        "tokens",
                        "remote clients authenticate by token: give the file of `NAME TOKEN` lines".into(),
                    );
                }
                if self.tls_cert.is_some() != self.tls_key.is_some() {
                    let missing = if self.tls_cert.is_none() { "tls_cert" } else { "tls_key" };
                    return at(missing, "give tls_cert and tls_key together".into());
                }
                if self.tls_cert.is_none() && !sock.ip().is_loopback() {
                    return at(
                        "tls_cert",
                        format!("{addr} is not loopback: updates and tokens would cross the network unencrypted"),
                    );
                }
                if self.client_ca.is_some() && self.tls_cert.is_none() {
                    return at("client_ca", "client certificates need HTTPS: give tls_cert and tls_key".into());
                }
                if self.dropout.is_some() {
                    return at("dropout", "is for simulations: remote clients drop out for real".into());
                }
            }
            None => {
                let remote = [
                    ("tokens", self.tokens.is_some()),
                    ("tls_cert", self.tls_cert.is_some()),
                    ("tls_key", self.tls_key.is_some()),
                    ("client_ca", self.client_ca.is_some()),
                    ("join_timeout", self.join_timeout.is_some()),
                ];
                if let Some((key, _)) = remote.iter().find(|(_, on)| *on) {
                    return at(key, "applies to remote clients only (give `listen`)".into());
                }
            }
        }
        if self.shards_per_client == Some(0) {
            return at("shards_per_client", "must be at least 1".into());
        }
        if let Some(dp) = &self.dp {
            let at = |k: &str, m: String| Err((format!("federated.dp.{k}"), m));
            if !(dp.clip.is_finite() && dp.clip > 0.0) {
                return at("clip", format!("{} is not > 0 and finite", dp.clip));
            }
            match (dp.noise_multiplier, dp.epsilon) {
                (Some(_), Some(_)) => return at("epsilon", "give noise_multiplier or epsilon, not both".into()),
                (None, None) => return at("noise_multiplier", "give noise_multiplier, or a target epsilon".into()),
                (Some(s), None) if !(s.is_finite() && s > 0.0) => {
                    return at("noise_multiplier", format!("{s} is not > 0 and finite"));
                }
                (None, Some(e)) if !(e.is_finite() && e > 0.0) => {
                    return at("epsilon", format!("{e} is not > 0 and finite"));
                }
                _ => {}
            }
            if let Some(d) = dp.delta.filter(|d| !(*d > 0.0 && *d < 1.0)) {
                return at("delta", format!("{d} is not in (0, 1)"));
            }
        }
        Ok(())
    }
}

impl FederatedSpec {
    /// Whether the clients are remote (`listen`), not simulated.
    pub fn remote(&self) -> bool {
        self.listen.is_some()
    }

    /// `round_timeout` in effect: remote clients default to 600 s; simulated ones have none unless given.
    pub fn deadline(&self) -> Option<std::time::Duration> {
        let secs = self.round_timeout.or(self.remote().then_some(600.0))?;
        Some(std::time::Duration::from_secs_f64(secs))
    }

    /// `join_timeout` in effect.
    pub fn join_deadline(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.join_timeout.unwrap_or(300.0))
    }
}

impl DpSpec {
    pub fn delta(&self) -> f64 {
        self.delta.unwrap_or(1e-5)
    }
}
