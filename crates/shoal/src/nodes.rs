//! The options of a launch over several hosts without a cluster manager, shared by `shoal run` and `shoal bench`:
//! `--nnodes N --node-rank R --rdzv HOST:PORT`, with the secret every host shares in `SHOAL_JOB_SECRET`.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};
use shoal_exec::launch::Nodes;

/// Shortest secret accepted for a launch over several hosts.
const MIN_SECRET: usize = 16;

#[derive(Debug, Clone, Default, clap::Args, Serialize, Deserialize)]
pub struct NodeArgs {
    /// How many hosts (launchers) the job spans; each runs the same command with its own --node-rank.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub nnodes: usize,
    /// This host's place among the --nnodes launchers, from 0 (node 0 hosts the rendezvous).
    #[arg(long, value_name = "R")]
    pub node_rank: Option<usize>,
    /// Where the launchers meet: node 0's address and a free port on it (several hosts only).
    #[arg(long, value_name = "HOST:PORT")]
    pub rdzv: Option<String>,
}

impl NodeArgs {
    /// Where this launcher sits among several; `None` for a launch on this host alone. Every missing or
    /// contradictory piece is named.
    pub fn nodes(&self) -> Result<Option<Nodes>> {
        if self.nnodes == 0 {
            bail!("--nnodes must be at least 1");
        }
        if self.nnodes == 1 {
            if self.node_rank.is_some_and(|r| r != 0) || self.rdzv.is_some() {
                bail!("--node-rank and --rdzv apply to launches over several hosts: give --nnodes N (N > 1) too");
            }
            return Ok(None);
        }
        let Some(rank) = self.node_rank else {
            bail!("--nnodes {}: give this host's --node-rank (0 to {})", self.nnodes, self.nnodes - 1)
        };
        if rank >= self.nnodes {
            bail!("--node-rank {rank} is not below --nnodes {}", self.nnodes);
        }
        let Some(rdzv) = self.rdzv.clone() else {
            bail!("--nnodes {}: give --rdzv HOST:PORT, where node 0 hosts the rendezvous", self.nnodes)
        };
        let secret_var = shoal_comm::env::var::JOB_SECRET;
        let secret = std::env::var(secret_var).unwrap_or_default();
        if secret.len() < MIN_SECRET {
            bail!(
                "--nnodes {}: set {secret_var} to the same secret ({MIN_SECRET} characters or more) on every host, \
                 e.g. `export {secret_var}=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')`",
                self.nnodes
            );
        }
        let nodes = Nodes { count: self.nnodes, rank, rendezvous: rdzv, secret };
        nodes.host_port()?;
        Ok(Some(nodes))
    }
}
