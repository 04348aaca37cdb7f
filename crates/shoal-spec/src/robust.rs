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
        if strategy != Strategy::Ddp {
            return Err((
                "robust.rule".into(),
                format!(
                    "\"{}\" combines every rank's whole gradient, which train.strategy = \"ddp\" gathers; \
                     \"{strategy}\" does not",
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
