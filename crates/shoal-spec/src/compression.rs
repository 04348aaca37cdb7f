//! `[compression]`: what the ranks send in place of their gradients (`shoal_comm::compress`).

use serde::{Deserialize, Serialize};

use crate::{OptimizerKind, Strategy};

/// `[compression]`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompressionSpec {
    /// What each gradient bucket is sent as (default `none`).
    #[serde(default)]
    pub codec: CodecName,
    /// `topk`, `randk`: the fraction of values sent each step, in (0, 1] (default 0.01).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    /// `powersgd`: the rank of each matrix's approximation (default 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub rank: Option<usize>,
    /// Keep what a code leaves out and send it with the next step's gradients (default true).
    #[serde(default = "yes")]
    pub error_feedback: bool,
    /// Steps sent uncompressed first (default 0)...
    #[serde(default)]
    pub warmup_steps: u64,
    /// ...or coded by this quantiser (`none`, `fp16`, `bf16`, `int8`; default `none`), with the codec's error
    /// feedback.
    #[serde(default)]
    pub warmup_codec: CodecName,
    /// With AdamW under `ddp`: after the warm-up, send each rank's AdamW first moment (its momentum taken one step
    /// with its own gradients) in place of its gradients, the ranks' mean becoming everyone's moment, with the
    /// second moment frozen where the warm-up left it — 1-bit Adam's scheme, for any codec. With `topk` the values
    /// are chosen by the size of the update they make (the moment over the square root of the frozen second
    /// moment). Default false.
    #[serde(default)]
    pub momentum: bool,
    /// `int8`: round stochastically (unbiased) instead of to nearest (default false).
    #[serde(default)]
    pub stochastic: bool,
}

fn yes() -> bool {
    true
}

/// `compression.codec`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CodecName {
    /// Plain f32 all-reduce.
    #[default]
    None,
    /// IEEE half precision: 2 bytes a value.
    Fp16,
    /// bfloat16: 2 bytes a value, f32's range.
    Bf16,
    /// A byte a value and a scale per 512: about 3.97× fewer bytes.
    Int8,
    /// The `ratio` of values of largest magnitude, with their indices.
    Topk,
    /// A `ratio` of the values drawn at random, the same on every rank (no indices sent).
    Randk,
    /// A bit a value and a scale per 512 (1-bit, about 30× fewer bytes).
    Sign,
    /// PowerSGD: each gradient matrix as two rank-`rank` factors.
    Powersgd,
}

impl CodecName {
    pub fn as_str(self) -> &'static str {
        match self {
            CodecName::None => "none",
            CodecName::Fp16 => "fp16",
            CodecName::Bf16 => "bf16",
            CodecName::Int8 => "int8",
            CodecName::Topk => "topk",
            CodecName::Randk => "randk",
            CodecName::Sign => "sign",
            CodecName::Powersgd => "powersgd",
        }
    }
}

impl std::fmt::Display for CodecName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl CompressionSpec {
    /// `ratio`, resolved.
    pub fn ratio(&self) -> f64 {
        self.ratio.unwrap_or(0.01)
    }

    /// `rank`, resolved.
    pub fn rank(&self) -> usize {
        self.rank.unwrap_or(4)
    }

    /// Whether anything is compressed.
    pub fn is_on(&self) -> bool {
        self.codec != CodecName::None
    }

    /// The table's own values, and the codec against the strategy: compression sits between a data-parallel
    /// strategy's gradients and its all-reduce (DDP) or reduce-scatter (ZeRO); PowerSGD needs whole matrices, so
    /// only DDP. Errors are `(key path, message)`.
    pub fn validate(&self, strategy: Strategy, optimizer: OptimizerKind) -> Result<(), (String, String)> {
        let err = |p: &str, m: String| Err((format!("compression.{p}"), m));
        let c = self.codec;
        if let Some(r) = self.ratio {
            if !matches!(c, CodecName::Topk | CodecName::Randk) {
                return err("ratio", format!("applies to codec = \"topk\" or \"randk\" only, not \"{c}\""));
            }
            if !(r > 0.0 && r <= 1.0) {
                return err("ratio", format!("must be in (0, 1], got {r}"));
            }
        }
        if let Some(r) = self.rank {
            if c != CodecName::Powersgd {
                return err("rank", format!("applies to codec = \"powersgd\" only, not \"{c}\""));
            }
            if r == 0 {
                return err("rank", "must be at least 1".into());
            }
        }
        if self.stochastic && c != CodecName::Int8 {
            return err("stochastic", format!("applies to codec = \"int8\" only, not \"{c}\""));
        }
        let w = self.warmup_codec;
        if !matches!(w, CodecName::None | CodecName::Fp16 | CodecName::Bf16 | CodecName::Int8) {
            return err(
                "warmup_codec",
                format!("is \"none\", \"fp16\", \"bf16\" or \"int8\" (a code of each value), not \"{w}\""),
            );
        }
        if w != CodecName::None && (!self.is_on() || self.warmup_steps == 0) {
            return err("warmup_codec", "codes the warm-up's steps: set compression.codec and warmup_steps".into());
        }
        if self.momentum {
            if !self.is_on() {
                return err("momentum", "sends the moment through compression.codec: set one".into());
            }
            if optimizer != OptimizerKind::Adamw {
                return err(
                    "momentum",
                    format!("sends AdamW's first moment; train.optimizer is \"{}\"", optimizer.as_str()),
                );
            }
            if strategy != Strategy::Ddp {
                return err(
                    "momentum",
                    format!(
                        "needs every rank to hold the whole first moment (ddp); train.strategy = \"{strategy}\" \
                         shards it"
                    ),
                );
            }
            if self.warmup_steps == 0 {
                return err(
                    "warmup_steps",
                    "must be at least 1 with compression.momentum: the second moment, frozen after the warm-up, is \
                     estimated during it"
                        .into(),
                );
            }
        }
        if !self.is_on() {
            return Ok(());
        }
        if !strategy.is_data_parallel() {
            return err(
                "codec",
                format!(
                    "compresses the gradients of a data-parallel strategy (ddp, zero1, zero2, zero3); \
                     train.strategy = \"{strategy}\" exchanges activations and parts of layers, which it does not \
                     compress"
                ),
            );
        }
        if c == CodecName::Powersgd && strategy != Strategy::Ddp {
            return err(
                "codec",
                format!(
                    "\"powersgd\" needs every gradient matrix whole on every rank; train.strategy = \"{strategy}\" \
                     reduce-scatters them (use it with ddp, or int8, sign, topk with {strategy})"
                ),
            );
        }
        Ok(())
    }
}
