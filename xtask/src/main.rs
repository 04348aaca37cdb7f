//! Project automation for Shoal: `cargo xtask <command>`. See xtask/README.md.

mod bench;
mod ddp;
mod idle;
mod limits;
mod setup;
mod structure;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "xtask", about = "Shoal project tasks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Install the peers (Open MPI, mpi4py, PyTorch) into ${SHOAL_PEERS_DIR:-~/.cache/shoal/peers-v1}.
    SetupPeers(setup::SetupArgs),
    /// Shoal's all-reduce side by side with Open MPI and Gloo, plus the machine's limits.
    BenchVsPeers(bench::BenchArgs),
    /// Data-parallel training throughput (MLP on synthetic data): ours vs PyTorch and PyTorch DDP (Gloo).
    BenchDdp(ddp::DdpArgs),
    /// Only the physical limits: memcpy (1 thread) and loopback TCP both ways.
    Limits,
    /// The layout rules of ARCHITECTURE.md: no import circle between source files, the environment contract's
    /// names spelled out only in its module.
    CheckStructure,
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::SetupPeers(a) => setup::setup_peers(&a),
        Cmd::BenchVsPeers(a) => bench::bench_vs_peers(a),
        Cmd::BenchDdp(a) => ddp::bench_ddp(a),
        Cmd::CheckStructure => structure::check(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")),
        Cmd::Limits => {
            let l = limits::measure()?;
            println!("memcpy, 1 thread, 256 MiB (best of 10):  {:.2} GB/s", l.memcpy_1t_gbps);
            println!(
                "loopback TCP, both directions at once:    {:.2} GB/s per direction ({:.2} / {:.2})",
                l.tcp_bidir_per_dir_gbps, l.tcp_bidir_a_to_b_gbps, l.tcp_bidir_b_to_a_gbps
            );
            Ok(())
        }
    }
}
