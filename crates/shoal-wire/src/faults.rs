//! Faults: a worker's heartbeat (what it is doing now), the dump of a job's ranks that a hang or `shoal debug`
//! gives, and the chaos endpoint's request and answer.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// One rank's heartbeat, sent by the worker's reporter thread twice a second: to the server
/// (`POST /api/v1/jobs/{id}/heartbeat`, tagged with the job secret) when the task was told where it is
/// (`SHOAL_SERVER`), else — or while the server cannot be reached — the file `heartbeat.rank-R.json` in the job's run
/// directory (replaced atomically). The control loop takes the newer of the two.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Heartbeat {
    pub rank: i64,
    /// The attempt (`SHOAL_ATTEMPT`) the worker belongs to; 0 outside the platform.
    pub attempt: i64,
    /// The training process.
    pub pid: u32,
    /// Counts up with every heartbeat: the control loop sees a rank live while it changes.
    pub beat: u64,
    /// When it was written (ms since the epoch).
    pub time_ms: i64,
    /// `resume` (loading a checkpoint; the first heartbeat comes once the communicator is built), `train` (the
    /// step loop), `checkpoint` (handing a checkpoint to the saver), `eval` (a periodic evaluation) or `finish`
    /// (final evaluation and summary). Only `train` is judged for hangs.
    pub phase: String,
    /// Optimizer steps completed (counting the ones a resumed run started from).
    pub step: u64,
    /// The collective the rank is in (`in_op`) or finished last; empty before the first.
    pub op: String,
    /// Its sequence number (the same on every rank for one collective); 0 before the first.
    pub seq: u64,
    pub in_op: bool,
    /// Seconds in that collective (`in_op`), or since it finished.
    pub op_s: f64,
    /// Collectives completed.
    pub ops_done: u64,
    /// Where the attempt's state came from, once loaded (rank 0): `memory copy at step N` or `storage checkpoint at
    /// step N`; absent before, or when it started from nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed: Option<String>,
    /// What `train.strategy = "auto"` chose for the attempt, and why (rank 0, once decided).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strategy: Option<String>,
    /// Why the rank is failing, sent once, at once, before it exits (a collective's report: the operation, its
    /// sequence number, the ranks that never arrived); absent while it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The group generation the rank trains in: 0 for the attempt's first group, one more at each regrouping in
    /// place ([`Regroup`]).
    #[serde(default)]
    pub generation: u32,
}

/// The server's answer to a heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HeartbeatReply {
    /// A newer group for this rank to train in, when the job regroups in place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub regroup: Option<Regroup>,
}

/// An elastic job's group regrouped in place (a member lost, or newcomers joining): the survivors keep their
/// processes and their state, build a communicator at the new size at their next step boundary, and take the
/// group's rank 0's state (the newcomers receive it the same way).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Regroup {
    /// One more than the group it follows.
    pub generation: u32,
    /// This task's rank in the new group, and the group's size.
    pub rank: usize,
    pub world: usize,
    /// `host:port` of the rendezvous store the group meets at (the control plane's).
    pub rendezvous: String,
    /// The attempt's task numbers of the members, in rank order.
    pub members: Vec<i64>,
}

/// Where one rank stands in a dump.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RankDump {
    pub rank: i64,
    /// `in_collective` (waiting in `op`), `computing` (between collectives), `silent` (no heartbeat for `silent_s`:
    /// stopped, descheduled or hung outside the runtime), `exited` or `unknown` (no heartbeat yet).
    pub state: String,
    pub phase: String,
    pub step: u64,
    /// The collective it is in or finished last (empty: none yet).
    pub op: String,
    pub seq: u64,
    pub in_op: bool,
    /// Seconds in `op` (`in_op`) or since it finished, as of its last heartbeat plus the time since then.
    pub op_s: f64,
    /// Seconds since its last heartbeat changed (`null`: none seen).
    pub silent_s: Option<f64>,
    pub pid: Option<u32>,
    /// The same, said in words (`in all_reduce #1234 for 3.2 s`).
    pub note: String,
}

/// The ranks of a running job at one moment: what a hang event records (and `shoal status --json` shows as
/// `hang_dump`), and what `shoal debug` prints on demand.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct HangDump {
    pub job_id: String,
    pub attempt: i64,
    /// When it was taken (ms since the epoch).
    pub time_ms: i64,
    /// The highest step any rank completed.
    pub step: u64,
    /// Seconds since that step counter last moved (`null`: not watched yet).
    pub stalled_s: Option<f64>,
    /// The ranks that hold the others up: silent ones, and those not in the collective the others wait in.
    pub culprits: Vec<i64>,
    /// One line for people: who waits where, and who is missing.
    pub summary: String,
    pub ranks: Vec<RankDump>,
}

/// What `POST /api/v1/jobs/{id}/chaos` does to one worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ChaosAction {
    /// SIGKILL the worker's training process (a crash).
    Kill,
    /// SIGSTOP it (a hang: the process lives and does nothing).
    Stop,
}

impl ChaosAction {
    pub fn as_str(self) -> &'static str {
        match self {
            ChaosAction::Kill => "kill",
            ChaosAction::Stop => "stop",
        }
    }
}

/// `POST /api/v1/jobs/{id}/chaos`: a fault injected into one running worker of the job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ChaosRequest {
    pub action: ChaosAction,
    /// The rank to hit: one of the current attempt's running workers.
    pub rank: i64,
}

/// What the chaos endpoint did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChaosDone {
    pub job_id: String,
    pub attempt: i64,
    pub rank: i64,
    pub action: ChaosAction,
    pub host: String,
    /// The process signalled, where the executor knows it.
    pub pid: Option<i64>,
    /// When (ms since the epoch).
    pub time_ms: i64,
    pub message: String,
}
