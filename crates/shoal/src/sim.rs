//! `shoal sim`: a job trace replayed through the scheduler on a simulated cluster (`shoal_sim`); `shoal sim
//! compare` runs several policies on one trace, `shoal sim synth` writes a Philly-like trace.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use shoal_sim::{Outcome, Report, SimOptions, SynthOptions, Trace};

/// `shoal sim`.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct SimArgs {
    #[command(subcommand)]
    pub cmd: Option<SimCmd>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(Debug, clap::Subcommand)]
pub enum SimCmd {
    /// Run several policies on one trace: a table, and with --out each policy's report and the plots (JCT CDF,
    /// allocation, queue length and fragmentation over time, SVG).
    Compare {
        #[command(flatten)]
        input: Input,
        /// Policies, comma-separated (each an ordering, a packing or ORDERING+PACKING).
        #[arg(long, value_delimiter = ',', required = true)]
        policies: Vec<String>,
        #[command(flatten)]
        tuning: Tuning,
        /// Print one JSON object (`policies`, `reports`) instead of the table.
        #[arg(long)]
        json: bool,
        /// Write `compare.json`, the plots and each policy's report and series (in a folder named after it) here.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Write a Philly-like synthetic trace in Shoal's CSV (heavy-tailed run times, mostly one-GPU jobs, Poisson
    /// arrivals at an offered load).
    Synth {
        /// Jobs.
        #[arg(long)]
        jobs: usize,
        /// GPUs of the cluster it is meant for (sets the arrival rate).
        #[arg(long)]
        gpus: u64,
        /// Offered load: the jobs' GPU time over the cluster's GPU capacity over the arrival span.
        #[arg(long, default_value_t = 0.9)]
        load: f64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// The CSV file to write.
        #[arg(long)]
        out: PathBuf,
    },
}

/// Where the jobs and the cluster come from.
#[derive(Debug, clap::Args)]
pub struct Input {
    /// The trace: Shoal's CSV (job_id,submit_s,duration_s,gpus,gpu_milli,cpus,memory_mib,team[,priority,queue,
    /// min_workers,max_workers]) or the Alibaba 2023 GPU trace's pod list, told apart by the header.
    #[arg(long, required_unless_present = "synthetic")]
    pub trace: Option<PathBuf>,
    /// Instead of a trace, this many jobs of the Philly-like generator (`shoal sim synth`), drawn with --seed at
    /// offered load --load.
    #[arg(long, conflicts_with = "trace")]
    pub synthetic: Option<usize>,
    /// The cluster: a node list (sn,cpu_milli,memory_mib,gpu,model, as the Alibaba trace's).
    #[arg(long, conflicts_with_all = ["nodes", "gpus_per_node"])]
    pub cluster: Option<PathBuf>,
    /// Or this many identical nodes (128 cores, 2 TiB, --gpus-per-node 80 GiB GPUs each).
    #[arg(long, requires = "gpus_per_node")]
    pub nodes: Option<usize>,
    #[arg(long, requires = "nodes")]
    pub gpus_per_node: Option<usize>,
    /// A trace's arrivals this many times as fast (durations kept), to load the cluster; for --synthetic, the
    /// offered load.
    #[arg(long, default_value_t = 1.0)]
    pub load: f64,
    /// Seed of --synthetic.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// Scheduler settings.
#[derive(Debug, clap::Args)]
pub struct Tuning {
    /// Replay the trace this many times back to back (ids suffixed ~1, ~2...), to offer more work than the cluster
    /// holds.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub repeat: u32,
    /// The scheduler's loop: a pass at most every this many seconds (0: at every instant something happens).
    #[arg(long, default_value_t = 1.0)]
    pub interval_s: f64,
    /// Grace period of a preempted job, seconds.
    #[arg(long, default_value_t = 30.0)]
    pub grace_s: f64,
    /// LAS thresholds in GPU-seconds, comma-separated (default: the scheduler's).
    #[arg(long, value_delimiter = ',')]
    pub las_thresholds: Option<Vec<f64>>,
    /// Check invariants after every pass (no node over capacity, the books balance): slow.
    #[arg(long)]
    pub audit: bool,
    /// What the trace runs through: `scheduler` (shoal-sched alone, fast) or `control` (the server's own control
    /// loop: its store, admission, placement, preemption and requeueing, with a fake executor for processes and
    /// simulated time; for traces of up to some thousands of jobs).
    #[arg(long, value_enum, default_value_t = Engine::Scheduler)]
    pub engine: Engine,
}

/// See [`Tuning::engine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Engine {
    Scheduler,
    Control,
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub input: Input,
    /// The policy: an ordering (fifo, backfill, sjf, las, drf, elastic), a packing (bestfit, fgd) or
    /// ORDERING+PACKING.
    #[arg(long, default_value = "drf+bestfit")]
    pub policy: String,
    #[command(flatten)]
    pub tuning: Tuning,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Write report.json, series.csv and jobs.csv here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: &SimArgs) -> Result<bool> {
    match &args.cmd {
        Some(SimCmd::Synth { jobs, gpus, load, seed, out }) => synth(*jobs, *gpus, *load, *seed, out),
        Some(SimCmd::Compare { input, policies, tuning, json, out }) => {
            compare(input, policies, tuning, *json, out.as_deref())
        }
        None => {
            let r = &args.run;
            let (trace, nodes, seed, load) = load_input(&r.input)?;
            let outcome = simulate(&trace, nodes, &r.policy, &r.tuning, seed, load)?;
            let report = Report::of(&outcome);
            if let Some(dir) = &r.out {
                for p in shoal_sim::write_outcome(dir, &outcome)? {
                    eprintln!("wrote {}", p.display());
                }
            }
            if r.json {
                println!("{}", report.to_json()?);
            } else {
                print_table(&[report]);
            }
            Ok(true)
        }
    }
}

/// The trace, the cluster, the seed and the arrival speed-up.
fn load_input(i: &Input) -> Result<(Trace, Vec<shoal_sched::Node>, u64, f64)> {
    let nodes = match (&i.cluster, i.nodes, i.gpus_per_node) {
        (Some(path), _, _) => shoal_sim::read_cluster(path)?,
        (None, Some(n), Some(g)) => shoal_sim::homogeneous(n, g)?,
        _ => bail!("give the cluster: --cluster FILE, or --nodes N --gpus-per-node G"),
    };
    if let Some(n) = i.synthetic {
        let gpus = nodes.iter().map(|n| n.gpus.len() as u64).sum();
        let jobs = shoal_sim::philly_like(&SynthOptions { jobs: n, gpus, load: i.load, seed: i.seed });
        let trace = Trace { name: format!("synthetic-{n}"), format: shoal_sim::TraceFormat::Shoal, jobs, skipped: 0 };
        return Ok((trace, nodes, i.seed, 1.0));
    }
    let Some(path) = &i.trace else { bail!("give --trace FILE or --synthetic N") };
    Ok((shoal_sim::read_trace(path)?, nodes, i.seed, i.load))
}

fn simulate(
    trace: &Trace,
    nodes: Vec<shoal_sched::Node>,
    policy: &str,
    t: &Tuning,
    seed: u64,
    load: f64,
) -> Result<Outcome> {
    let policy = policy.parse()?;
    if !(t.grace_s.is_finite() && t.grace_s >= 0.0) {
        bail!("--grace-s must be 0 or more, not {}", t.grace_s);
    }
    if !(t.interval_s.is_finite() && t.interval_s >= 0.0) {
        bail!("--interval-s must be 0 or more, not {}", t.interval_s);
    }
    let las = match &t.las_thresholds {
        Some(v) if v.iter().any(|x| !(x.is_finite() && *x >= 0.0)) => bail!("--las-thresholds must be 0 or more"),
        Some(v) => Some(v.iter().map(|x| (x * 1000.0).round() as u64).collect()),
        None => None,
    };
    let options = SimOptions {
        policy,
        load,
        repeat: t.repeat,
        interval_ms: (t.interval_s * 1000.0).round() as u64,
        grace_ms: (t.grace_s * 1000.0).round() as u64,
        las_thresholds_gpu_ms: las,
        audit: t.audit,
        seed,
    };
    let started = std::time::Instant::now();
    let o = match t.engine {
        Engine::Scheduler => shoal_sim::simulate(trace, nodes, &options),
        Engine::Control => shoal_sim::simulate_control(trace, nodes, &options),
    }
    .with_context(|| format!("simulating {policy}"))?;
    tracing::info!(policy = %policy, jobs = trace.jobs.len(), seconds = started.elapsed().as_secs_f64(), "simulated");
    let through = if t.engine == Engine::Control { " through the control loop" } else { "" };
    eprintln!("{policy}: {} jobs simulated{through} in {:.2} s", trace.jobs.len(), started.elapsed().as_secs_f64());
    Ok(o)
}

fn compare(input: &Input, policies: &[String], tuning: &Tuning, json: bool, out: Option<&Path>) -> Result<bool> {
    let (trace, nodes, seed, load) = load_input(input)?;
    let mut outcomes = Vec::new();
    for p in policies {
        outcomes.push(simulate(&trace, nodes.clone(), p, tuning, seed, load)?);
    }
    let reports: Vec<Report> = outcomes.iter().map(Report::of).collect();
    let doc = serde_json::json!({
        "trace": trace.name,
        "policies": reports.iter().map(|r| r.policy.clone()).collect::<Vec<_>>(),
        "reports": reports,
    });
    if let Some(dir) = out {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for o in &outcomes {
            shoal_sim::write_outcome(&dir.join(o.policy.to_string()), o)?;
        }
        let path = dir.join("compare.json");
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        for p in shoal_sim::write_plots(dir, &outcomes)? {
            eprintln!("wrote {}", p.display());
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_table(&reports);
    }
    Ok(true)
}

fn print_table(reports: &[Report]) {
    println!(
        "{:<18} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7} {:>7} {:>9} {:>9} {:>7} {:>6}",
        "policy",
        "jobs",
        "avg JCT s",
        "med JCT s",
        "p99 JCT s",
        "avg queue",
        "makespan",
        "alloc",
        "alloc*",
        "util",
        "unalloc",
        "frag",
        "preempt",
        "jain"
    );
    for r in reports {
        println!(
            "{:<18} {:>6} {:>10.0} {:>10.0} {:>10.0} {:>10.0} {:>10.0} {:>6.1}% {:>6.1}% {:>6.1}% {:>9.1} {:>9.1} {:>7} {:>6.3}",
            r.policy,
            r.completed,
            r.avg_jct_s,
            r.median_jct_s,
            r.p99_jct_s,
            r.avg_queue_s,
            r.makespan_s,
            100.0 * r.gpu_allocation_mean,
            100.0 * r.gpu_allocation_arrivals_mean,
            100.0 * r.utilisation,
            r.unallocated_gpus_mean,
            r.fragmentation_gpus_mean,
            r.preemptions,
            r.fairness_jain
        );
    }
    println!(
        "(alloc: GPUs allocated over the makespan; alloc*: while jobs arrive; unalloc and frag: GPUs, while jobs wait)"
    );
}

fn synth(jobs: usize, gpus: u64, load: f64, seed: u64, out: &Path) -> Result<bool> {
    if !(load.is_finite() && load > 0.0) {
        bail!("--load must be a positive number, not {load}");
    }
    let trace = shoal_sim::philly_like(&SynthOptions { jobs, gpus, load, seed });
    std::fs::write(out, shoal_sim::write_trace(&trace)).with_context(|| format!("writing {}", out.display()))?;
    eprintln!("wrote {} jobs to {}", trace.len(), out.display());
    Ok(true)
}
