//! `[ps]`: the parameter servers of a job with `train.strategy = "ps"` (`shoal_ps::net`): how many server processes
//! hold the model beside the workers, and how the workers' pushes become updates.

use serde::{Deserialize, Serialize};

/// `[ps]`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PsSpec {
    /// Server processes, started beside the workers (default 1); the model is spread over them by size.
    #[serde(default = "one")]
    pub servers: usize,
    /// How pushes become updates (default `sync`).
    #[serde(default)]
    pub mode: PsMode,
    /// Under `mode = "ssp"`: how many steps a worker may run ahead of the slowest (default 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staleness: Option<u64>,
}

fn one() -> usize {
    1
}

impl Default for PsSpec {
    fn default() -> Self {
        PsSpec { servers: 1, mode: PsMode::Sync, staleness: None }
    }
}

/// `ps.mode`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PsMode {
    /// Every worker's gradient for step `t` is in before version `t + 1`: data parallelism's result.
    #[default]
    Sync,
    /// Each push applied on arrival; no worker waits for another.
    Async,
    /// Applied on arrival, no worker more than `staleness` steps ahead of the slowest.
    Ssp,
}

/// The most servers a job may ask for.
pub const MAX_SERVERS: usize = 256;

impl PsSpec {
    /// The mode as the servers run it.
    pub fn mode(&self) -> shoal_ps::Mode {
        match self.mode {
            PsMode::Sync => shoal_ps::Mode::Sync,
            PsMode::Async => shoal_ps::Mode::Async,
            PsMode::Ssp => shoal_ps::Mode::Ssp { staleness: self.staleness.unwrap_or(3) },
        }
    }

    /// The table alone. Errors are `(key path, message)`.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.servers == 0 || self.servers > MAX_SERVERS {
            return Err(("ps.servers".into(), format!("must be 1 to {MAX_SERVERS}, got {}", self.servers)));
        }
        if self.staleness.is_some() && self.mode != PsMode::Ssp {
            return Err(("ps.staleness".into(), "bounds mode = \"ssp\" only".into()));
        }
        Ok(())
    }
}
