//! `[robust]`: how the ranks' gradients are combined when some of them may lie (`shoal_ps::robust`).

use serde::{Deserialize, Serialize};

use crate::Strategy;

/// `[robust]`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RobustSpec {
    /// The rule (default `mean`, what data parallelism computes).
    #[serde(default)]
    pub rule: RuleName,
    /// How many attackers the rule must bear (default 0).
    #[serde(default)]
    pub f: usize,
}

/// `robust.rule`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RuleName {
    /// The plain mean: no attacker borne.
    #[default]
    Mean,
    /// Coordinate-wise median.
    Median,
    /// Coordinate-wise mean of what is left once the `f` largest and smallest are dropped.
    TrimmedMean,
    /// The one gradient nearest its `n - f - 2` nearest others (Krum).
    Krum,
    /// The mean of the `n - f` gradients of least Krum score.
    MultiKrum,
    /// The geometric median (Weiszfeld).
    Geomed,
}

impl RuleName {
    /// The rule itself.
    pub fn rule(self) -> shoal_ps::Rule {
        match self {
            RuleName::Mean => shoal_ps::Rule::Mean,
            RuleName::Median => shoal_ps::Rule::Median,
            RuleName::TrimmedMean => shoal_ps::Rule::TrimmedMean,
            RuleName::Krum => shoal_ps::Rule::Krum,
            RuleName::MultiKrum => shoal_ps::Rule::MultiKrum,
            RuleName::Geomed => shoal_ps::Rule::GeoMed,
        }
    }
}

impl RobustSpec {
    /// The table against the strategy and the compression: a robust rule needs every rank's whole gradient, which
    /// data parallelism (`ddp`) all-gathers; compressed gradients are combined by their codec's own sum. Errors are
    /// `(key path, message)`.
    pub fn validate(&self, strategy: Strategy, compressed: bool) -> Result<(), (String, String)> {
        let rule = self.rule.rule();
        if !matches!(strategy, Strategy::Ddp | Strategy::Ps) {
            return Err((
                "robust.rule".into(),
                format!(
                    "\"{}\" combines every rank's whole gradient, which train.strategy = \"ddp\" gathers (and \
                     \"ps\"'s servers hold); \"{strategy}\" does not",
                    rule.name()
                ),
            ));
        }
        if compressed {
            return Err((
                "robust.rule".into(),
                "a robust rule combines whole gradients; [compression] sends codes that only their codec sums".into(),
            ));
        }
        if rule == shoal_ps::Rule::Mean && self.f > 0 {
            return Err((
                "robust.f".into(),
                format!("the mean bears no attacker (f = {}): choose a robust rule", self.f),
            ));
        }
        Ok(())
    }

    /// The rule against the number of ranks: refused naming `robust.f` when it cannot bear `f` attackers among
    /// `world` ranks.
    pub fn validate_world(&self, world: usize) -> Result<(), (String, String)> {
        self.rule.rule().check(world, self.f).map_err(|e| ("robust.f".into(), e.to_string()))
    }
}

/// `[chaos]`: attackers, for experiments with `[robust]` — the ranks that send a forged gradient
/// (`shoal_ps::attack`). Marked as an experiment in the job's events.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChaosSpec {
    /// The ranks that lie.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub byzantine_ranks: Vec<usize>,
    /// Under `train.strategy = "federated"`: the clients that lie (their update replaced by the attack's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub byzantine_clients: Vec<usize>,
    /// What they send.
    pub attack: AttackName,
    /// The attack's strength (default: 10 for `signflip`, 1 for `noise` and `alie`, 0.5 for `ipm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<f64>,
}

/// `chaos.attack`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttackName {
    /// The attacker's own gradient reversed and scaled.
    Signflip,
    /// Its own gradient plus Gaussian noise.
    Noise,
    /// The honest mean less `scale` standard deviations ("a little is enough").
    Alie,
    /// `-scale` times the honest mean (inner-product manipulation).
    Ipm,
}

impl ChaosSpec {
    /// The attack, at its scale.
    pub fn attack(&self) -> Option<shoal_ps::Attack> {
        let name = match self.attack {
            AttackName::Signflip => "signflip",
            AttackName::Noise => "noise",
            AttackName::Alie => "alie",
            AttackName::Ipm => "ipm",
        };
        shoal_ps::Attack::parse(name, self.scale)
    }

    /// The table on its own and beside `[robust]`, which it needs: the attack is simulated where a robust rule
    /// gathers the gradients (`rule = "mean"` for an undefended run). Errors are `(key path, message)`.
    pub fn validate(&self, robust: Option<&RobustSpec>) -> Result<(), (String, String)> {
        if robust.is_none() {
            return Err((
                "chaos.attack".into(),
                "attacks are simulated where [robust] gathers the gradients: add [robust] (rule = \"mean\" for no \
                 defence)"
                    .into(),
            ));
        }
        if !self.byzantine_clients.is_empty() {
            return Err((
                "chaos.byzantine_clients".into(),
                "applies to train.strategy = \"federated\" only: name ranks with byzantine_ranks".into(),
            ));
        }
        if self.byzantine_ranks.is_empty() {
            return Err(("chaos.byzantine_ranks".into(), "names no rank".into()));
        }
        let mut sorted = self.byzantine_ranks.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(("chaos.byzantine_ranks".into(), format!("names a rank twice: {:?}", self.byzantine_ranks)));
        }
        if let Some(s) = self.scale
            && !(s.is_finite() && s >= 0.0)
        {
            return Err(("chaos.scale".into(), format!("must be a finite number of at least 0, got {s}")));
        }
        Ok(())
    }

    /// The table under `train.strategy = "federated"`: the lying clients are named by `byzantine_clients`, each
    /// one of the `clients`.
    pub fn validate_federated(&self, clients: usize) -> Result<(), (String, String)> {
        if !self.byzantine_ranks.is_empty() {
            return Err((
                "chaos.byzantine_ranks".into(),
                "a federated job's attackers are clients: name them with byzantine_clients".into(),
            ));
        }
        if self.byzantine_clients.is_empty() {
            return Err(("chaos.byzantine_clients".into(), "names no client".into()));
        }
        if let Some(c) = self.byzantine_clients.iter().find(|&&c| c >= clients) {
            return Err(("chaos.byzantine_clients".into(), format!("client {c} is not one of the {clients} clients")));
        }
        let mut sorted = self.byzantine_clients.clone();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(("chaos.byzantine_clients".into(), "names a client twice".into()));
        }
        if let Some(s) = self.scale
            && !(s.is_finite() && s >= 0.0)
        {
            return Err(("chaos.scale".into(), format!("must be a finite number of at least 0, got {s}")));
        }
        Ok(())
    }

    /// The ranks against the world: each one of its ranks, and at least one honest rank.
    pub fn validate_world(&self, world: usize) -> Result<(), (String, String)> {
        if let Some(r) = self.byzantine_ranks.iter().find(|&&r| r >= world) {
            return Err(("chaos.byzantine_ranks".into(), format!("rank {r} is not one of the {world} workers")));
        }
        if self.byzantine_ranks.len() >= world {
            return Err(("chaos.byzantine_ranks".into(), format!("every one of the {world} workers lies")));
        }
        Ok(())
    }
}
