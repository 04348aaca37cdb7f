//! What a worker writes for others to read: the lines of `metrics.jsonl` ([`StepMetrics`], one file a rank) and
//! `eval.jsonl` ([`EvalMetrics`]), and `summary.json` ([`Summary`]) — read back by `shoal run`, and by the server,
//! which ingests every rank's metrics files.

use serde::{Deserialize, Serialize};

use crate::spec::Strategy;

/// Medians of the per-step time split.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
pub struct StepTime {
    pub data_s: f64,
    pub compute_s: f64,
    pub comm_s: f64,
    pub optimizer_s: f64,
    /// The whole step, as the loop saw it.
    #[serde(default)]
    pub step_s: f64,
}

/// What `summary.json` holds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub name: String,
    pub model: String,
    pub dataset: String,
    pub parameters: usize,
    pub steps: usize,
    pub world_size: usize,
    /// How the work was spread over the workers: the strategy that ran (`train.strategy`).
    #[serde(default)]
    pub strategy: Strategy,
    /// The loss of the last step; none (null or absent in the file) when it was not a finite number, or when no
    /// step ran and the checkpoint resumed from recorded none.
    #[serde(default)]
    pub final_loss: Option<f64>,
    /// NaN (null in the file) when nothing was evaluated (a job's own program that printed no `eval_loss`).
    #[serde(deserialize_with = "nan_if_null")]
    pub eval_loss: f64,
    pub eval_accuracy: Option<f64>,
    pub eval_perplexity: Option<f64>,
    /// Text: cross-entropy (nats per token) on the eval set of a unigram model
    /// fitted on the training tokens — the baseline a language model must beat.
    pub baseline_loss: Option<f64>,
    pub samples_per_s: f64,
    /// Bytes rank 0 sent in collectives over the run (training, checkpoints and evaluation): what really went out,
    /// payload, indices and scales.
    pub comm_bytes: u64,
    /// Bytes rank 0 sent per training step, on average (this attempt's steps).
    #[serde(default)]
    pub comm_bytes_per_step: f64,
    /// `[compression]`, when the gradients were sent compressed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<shoal_spec::CompressionSpec>,
    /// Whether gradient all-reduces overlapped backward (`train.overlap`, resolved).
    #[serde(default)]
    pub overlap: bool,
    pub step_time: StepTime,
    pub elapsed_s: f64,
    /// Step the run started from (0, or the checkpoint it resumed).
    pub resumed_from: u64,
    /// Checkpoints written, the last save's speed, and how long the step loop
    /// waited for saves in total.
    pub checkpoints: usize,
    pub checkpoint_mb_per_s: Option<f64>,
    pub checkpoint_stall_s: f64,
    /// Seconds the saves took in the background, in total (the stall is what the loop paid of it).
    #[serde(default)]
    pub checkpoint_save_s: f64,
    /// In-memory copies (`checkpoint.memory_every`) rank 0 wrote for its host, and the seconds the step loop spent
    /// on them in total (the rest of each copy runs on threads).
    #[serde(default)]
    pub memory_copies: usize,
    #[serde(default)]
    pub memory_stall_s: f64,
    /// Whether the run resumed from an in-memory copy (else from storage, or from nothing).
    #[serde(default)]
    pub resumed_from_memory: bool,
    /// What each rank's memory held, from its real buffers.
    #[serde(default)]
    pub memory_bytes: Vec<RankMemory>,
    /// Under a pipeline: the median over the steps of the part of the schedule the stages spent waiting for their
    /// neighbours (averaged over the stages), and `(S-1)/(M+S-1)` (theory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bubble_fraction: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bubble_theory: Option<f64>,
    /// Under pipeline stages: the model's layers of every chunk, `[first, end)`, in the order of the cut (chunk `c`
    /// of stage `s` is entry `c · stages + s`), as the run ended — after any cut by measured time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_layers: Option<Vec<[usize; 2]>>,
    /// Under `train.balance = "dynamic"`: each data-parallel rank's part of the global batch as the run ended (equal
    /// parts when no setting was made).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shares: Option<Vec<f64>>,
    /// A job's own program (`train.command`), and the metrics lines it printed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub metrics_lines: u64,
    /// Under `train.strategy = "federated"`: the rounds, and the privacy spent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub federated: Option<FederatedReport>,
}

impl Summary {
    /// A summary of a run that has none of built-in training's measures (a job's own program, federated rounds):
    /// the names and sizes given, every measure empty.
    pub fn bare(name: &str, model: &str, dataset: &str, world_size: usize, strategy: Strategy, elapsed_s: f64) -> Self {
        Summary {
            name: name.to_owned(),
            model: model.to_owned(),
            dataset: dataset.to_owned(),
            parameters: 0,
            steps: 0,
            world_size,
            strategy,
            final_loss: None,
            eval_loss: f64::NAN,
            eval_accuracy: None,
            eval_perplexity: None,
            baseline_loss: None,
            samples_per_s: 0.0,
            comm_bytes: 0,
            comm_bytes_per_step: 0.0,
            compression: None,
            overlap: false,
            step_time: StepTime::default(),
            elapsed_s,
            resumed_from: 0,
            checkpoints: 0,
            checkpoint_mb_per_s: None,
            checkpoint_stall_s: 0.0,
            checkpoint_save_s: 0.0,
            memory_copies: 0,
            memory_stall_s: 0.0,
            resumed_from_memory: false,
            memory_bytes: Vec::new(),
            bubble_fraction: None,
            bubble_theory: None,
            stage_layers: None,
            shares: None,
            command: Vec::new(),
            metrics_lines: 0,
            federated: None,
        }
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// One rank's memory, in bytes: its parameters, its gradient buffers, its optimizer state (a shard of it under
/// ZeRO), and the most a step allocated beyond what it started with — activations and the temporaries of forward
/// and backward (measured by the `shoal` binary's counting allocator; `null` where none is installed).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct RankMemory {
    pub rank: usize,
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    pub activations_peak: Option<u64>,
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    pub samples: usize,
    pub data_s: f64,
    pub compute_s: f64,
    pub comm_s: f64,
    pub optimizer_s: f64,
    pub step_s: f64,
    /// The rank that measured this line.
    #[serde(default)]
    pub rank: usize,
    /// Bytes this rank has sent in collectives so far (cumulative).
    #[serde(default)]
    pub comm_bytes: u64,
    /// Bytes this rank sent in this step's collectives (payload, indices and scales of what `[compression]` sends).
    #[serde(default)]
    pub step_comm_bytes: u64,
    /// When the step ended: milliseconds since the Unix epoch on this rank's host (0: not recorded), so that a
    /// reader judges a window of time rather than a count of steps.
    #[serde(default)]
    pub unix_ms: u64,
    /// Seconds this rank was held up inside collectives by each rank, as the root of the delay (cumulative;
    /// `shoal_comm::ArrivalStats::waited_for`): the rank the others wait for stands out in theirs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub comm_waited_for: Vec<f64>,
    /// Their sum: seconds this rank waited inside collectives for a peer that had not sent yet (cumulative).
    #[serde(default)]
    pub comm_wait_s: f64,
    /// Seconds messages sat ready before this rank took them: it was stopped or descheduled inside a collective,
    /// or the link was slower than its best (cumulative; `shoal_comm::ArrivalStats::lag`).
    #[serde(default)]
    pub comm_lag_s: f64,
    /// What this rank holds, in bytes, from its real buffers (as `summary.json`'s `memory_bytes`): parameters,
    /// gradient buffers, optimizer state, and what this step's forward and backward allocated at most beyond what
    /// was held at its start (absent where the allocator is not the counting one).
    #[serde(default)]
    pub params_bytes: u64,
    #[serde(default)]
    pub grads_bytes: u64,
    #[serde(default)]
    pub optimizer_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activations_bytes: Option<u64>,
    /// Under a pipeline: the part of this step's schedule this rank spent waiting for its neighbours (measured), and
    /// `(S-1)/(M+S-1)` for `S` stages and `M` micro-batches (theory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bubble_fraction: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bubble_theory: Option<f64>,
    /// Under `train.balance = "dynamic"`: this rank's part of the step's global batch (the shares sum to 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<f64>,
}

/// The metrics file of a rank: `metrics.jsonl` for rank 0 (the job's curve), `metrics.rank-R.jsonl` for the others.
pub fn metrics_file(output: &std::path::Path, rank: usize) -> std::path::PathBuf {
    if rank == 0 { output.join("metrics.jsonl") } else { output.join(format!("metrics.rank-{rank}.jsonl")) }
}

/// One line of `eval.jsonl` (rank 0): an evaluation pass.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalMetrics {
    pub step: usize,
    pub eval_loss: f64,
    pub eval_accuracy: Option<f64>,
    pub eval_perplexity: Option<f64>,
}

/// What a federated run did, for `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FederatedReport {
    pub algorithm: String,
    pub clients: usize,
    pub clients_per_round: usize,
    pub partition: String,
    /// Each round: clients sampled, held-out accuracy after it, bytes this process sent, ε spent so far.
    pub rounds: Vec<RoundReport>,
    /// Under DP: the noise multiplier used, δ, and the ε spent over every round.
    pub noise_multiplier: Option<f64>,
    pub delta: Option<f64>,
    pub epsilon: Option<f64>,
    /// Each client's samples of each class (the partition's label histogram; empty with remote clients, whose
    /// data the server never sees).
    pub histogram: Vec<Vec<usize>>,
    /// `[robust]`'s rule the server combined the updates by (`mean` without the table).
    #[serde(default)]
    pub rule: String,
    /// Whether the clients were remote (`federated.listen`).
    #[serde(default)]
    pub remote: bool,
}

/// One federated round, as `summary.json` and the round's line of `metrics.jsonl` give it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RoundReport {
    pub round: usize,
    /// Clients whose updates were combined.
    pub clients: usize,
    /// Clients sampled for the round.
    #[serde(default)]
    pub sampled: usize,
    /// Sampled clients that dropped out (never sent an update).
    #[serde(default)]
    pub dropped: usize,
    /// Sampled clients whose update missed `federated.round_timeout`.
    #[serde(default)]
    pub late: usize,
    pub loss: f64,
    pub eval_loss: f64,
    pub eval_accuracy: f64,
    pub bytes: u64,
    pub epsilon: Option<f64>,
}
