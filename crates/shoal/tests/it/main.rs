//! Multi-process tests of the `shoal` binary: real processes, real sockets and
//! shared memory.

mod balance;
mod bench;
mod checkpoint;
mod cli;
mod compression;
mod dashboard;
mod data;
mod deploy;
mod diagnose;
mod faults;
mod federated;
mod federated_remote;
mod frameworks;
mod hosts;
mod kubelet;
mod kubernetes;
mod lake;
mod multihost;
mod platform;
mod ps;
mod remote;
mod run;
mod shards;
mod sim;
mod slurm;
mod support_s3;
mod tls;
mod train;
mod validate;
