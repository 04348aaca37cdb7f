//! The scheduler: job states, one scheduling pass, shrink/preemption, backfill
//! reservation, elastic growth.

use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};

use crate::error::{Result, SchedError};
use crate::fgd;
use crate::free::FitCount;
use crate::model::{
    Config, Decision, JobId, JobRequest, JobStatus, Node, NodeAllocation, PreemptReason, Queue, Quota, Resources,
    TaskPlacement,
};
use crate::pending::{Class, ClassKey, PendInfo, PendKey, Pos};
use crate::place::{self, NodeFree, Pack, TaskAlloc};
use crate::policy::{Ordering, Packing};

/// The most task shapes [`Packing::Fgd`] weighs.
const WORKLOAD_SHAPES: usize = 16;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Usage {
    cpu: u64,
    mem: u64,
    gpu: u64,
}

impl Usage {
    fn of(r: &Resources, tasks: u32) -> Usage {
        let k = tasks as u64;
        Usage {
            cpu: r.cpus_milli.saturating_mul(k),
            mem: r.memory_bytes.saturating_mul(k),
            gpu: r.gpus_milli.saturating_mul(k),
        }
    }
    fn add(&mut self, o: Usage) {
        self.cpu += o.cpu;
        self.mem += o.mem;
        self.gpu += o.gpu;
    }
    fn sub(&mut self, o: Usage) {
        self.cpu -= o.cpu;
        self.mem -= o.mem;
        self.gpu -= o.gpu;
    }
    fn within(&self, add: Usage, q: &Quota) -> bool {
        self.cpu.saturating_add(add.cpu) <= q.cpus_milli
            && self.mem.saturating_add(add.mem) <= q.memory_bytes
            && self.gpu.saturating_add(add.gpu) <= q.gpus_milli
    }
}

#[derive(Debug, Clone)]
struct QueueState {
    queue: Queue,
    used: Usage,
}

impl QueueState {
    fn allows(&self, add: Usage) -> bool {
        self.queue.can_borrow || self.used.within(add, &self.queue.guaranteed)
    }
    fn over_guarantee(&self) -> bool {
        !self.used.within(Usage::default(), &self.queue.guaranteed)
    }
}

#[derive(Debug, Clone)]
enum State {
    Pending,
    Running { started_ms: u64, tasks: Vec<TaskAlloc> },
    Draining { until_ms: u64, tasks: Vec<TaskAlloc> },
}

#[derive(Debug, Clone)]
struct Job {
    req: JobRequest,
    state: State,
    /// Attained service: thousandths of a GPU times milliseconds held while running.
    attained: u64,
    /// Since when `attained` has not counted the job's running tasks.
    since: u64,
    /// The value of [`Scheduler::released`] when every size of the job last failed to fit the cluster as it was:
    /// while nothing has been released since, it still cannot fit (fitting is monotone in free capacity).
    failed_at: Option<u64>,
    /// When making room for the job last found that even every job it may take from and every draining one would
    /// not be enough: (`Scheduler::released`, `Scheduler::preempted`, time). While nothing was freed, preempted or
    /// shrunk since, and (under LAS) no running job of its priority crossed its level's threshold, it still is
    /// not: a job started since takes from the free capacity what it adds to the jobs taken from, or less.
    room_failed: Option<(u64, u64, u64)>,
    /// Under LAS while it runs: the level it is filed under in `Scheduler::las_running`.
    las_filed: usize,
}

impl Job {
    fn new(req: JobRequest) -> Job {
        Job { req, state: State::Pending, attained: 0, since: 0, failed_at: None, room_failed: None, las_filed: 0 }
    }
}

/// What a job's tasks count for attained service: thousandths of a GPU, a task without GPUs as one GPU.
fn service_rate(req: &JobRequest, tasks: usize) -> u64 {
    let per = if req.per_task.gpus_milli == 0 { 1000 } else { req.per_task.gpus_milli };
    per.saturating_mul(tasks as u64)
}

/// The packing's view of the workload.
fn pack_of(packing: Packing, workload: &[(Resources, u64)]) -> Pack<'_> {
    match packing {
        Packing::BestFit => Pack::BestFit,
        Packing::Fgd => Pack::Fgd(workload),
    }
}

type ShapeKey = (u64, u64, u64, u64);

fn shape_key(r: &Resources) -> ShapeKey {
    (r.cpus_milli, r.memory_bytes, r.gpus_milli, r.gpu_memory_bytes)
}

/// The cluster at the head job's reserved start, with the head job placed.
#[derive(Debug)]
struct Reservation {
    time: u64,
    free: Vec<NodeFree>,
}

/// A running job's place among the victims of its priority and level.
type LasVictim = (std::cmp::Reverse<u64>, std::cmp::Reverse<u64>, JobId);

/// The jobs of an LAS index of `priority` above `level`, in victim order: the deepest level first.
fn las_in_order(
    index: &BTreeMap<(i32, usize), BTreeSet<LasVictim>>,
    priority: i32,
    level: usize,
    deepest: usize,
) -> impl Iterator<Item = &JobId> {
    (level + 1..=deepest).rev().filter_map(move |l| index.get(&(priority, l))).flat_map(|set| set.iter().map(|v| &v.2))
}

/// One step of "making room" for a pending job.
#[derive(Debug)]
enum Step {
    Drain(JobId),
    ShrinkOne(JobId, usize),
    Preempt(JobId),
}

/// The scheduler. See the crate docs.
#[derive(Debug, Clone)]
pub struct Scheduler {
    config: Config,
    nodes: Vec<Node>,
    free: Vec<NodeFree>,
    pristine: Vec<NodeFree>,
    total: Usage,
    queues: BTreeMap<String, QueueState>,
    teams: BTreeMap<String, Usage>,
    /// Every job by id. Hashed: nothing iterates it where the order would show (a pass sorts what it takes). With
    /// Fx, not SipHash: it is looked up several times per job a pass, and ids are the server's own random ones or
    /// a trace's, not chosen by a caller to collide.
    jobs: rustc_hash::FxHashMap<JobId, Job>,
    /// The head job's reservation made by the last pass: `(job, start time)`.
    last_reservation: Option<(JobId, u64)>,
    /// Largest node CPU, memory, GPU count and GPU memory (for `submit`).
    largest: (u64, u64, u64, u64),
    /// What the running and draining jobs hold.
    allocated: Usage,
    /// How many times capacity was freed (finish, requeue, shrink, release).
    released: u64,
    /// How many jobs were preempted or shrunk.
    preempted: u64,
    /// The latest submitted jobs' task shapes (at most `config.shape_window`) and how many of each.
    shapes: VecDeque<ShapeKey>,
    shape_counts: BTreeMap<ShapeKey, u64>,
    /// The commonest shapes among them, [`Packing::Fgd`]'s workload; `None` when it must be recounted.
    workload: Option<Vec<(Resources, u64)>>,
    /// The first job of the last pass's order that could not start.
    last_blocked: Option<JobId>,
    /// Whether no queue has a guarantee (no job ever borrows): then a pending job's place in the order never
    /// changes and the pending jobs are kept in order in `classes`.
    static_order: bool,
    /// The pending jobs by class, each in pass order (`pending.rs`).
    classes: BTreeMap<ClassKey, Class>,
    /// Under [`Ordering::Fifo`] in a static order: every job of `classes`, in pass order, with its class (strict FIFO
    /// stops at the first job that waits, so its pass walks this instead of merging the classes).
    fifo_order: BTreeMap<PendKey, ClassKey>,
    /// The jobs running or draining.
    active: BTreeSet<JobId>,
    /// The running jobs with more tasks than their minimum (elastic jobs that could shrink).
    above_min: BTreeSet<JobId>,
    /// The running jobs with fewer tasks than their maximum (those that could grow); kept with `above_min`.
    below_max: BTreeSet<JobId>,
    /// When they end: a running job at its start plus its expected run time (none without one), a draining one
    /// at the end of its grace period.
    ends: BTreeSet<(u64, JobId)>,
    /// Jobs draining.
    draining: BTreeSet<JobId>,
    /// Running jobs by priority, and how many of them may grow or shrink.
    running_by_priority: BTreeMap<i32, usize>,
    running_elastic: usize,
    /// Under [`Ordering::Las`], for each running job and each threshold: (threshold's position, the job's
    /// priority, when its attained service reaches the threshold at its present size, its id). Whether some
    /// running job of a priority is above a level now is one look-up.
    las_reach: BTreeSet<(usize, i32, u64, JobId)>,
    /// Under LAS: the running jobs by priority and level (as of the last pass), each in the order they are
    /// preempted in: most recent start first, then the latest submitted, then id.
    las_running: BTreeMap<(i32, usize), BTreeSet<LasVictim>>,
    /// Under LAS: when running jobs will reach a threshold they have not yet, to refile them then.
    las_cross: BTreeSet<(u64, JobId)>,
    /// Under LAS: the running jobs with more tasks than their minimum (so could be shrunk), filed as in
    /// `las_running`.
    las_shrinkable: BTreeMap<(i32, usize), BTreeSet<LasVictim>>,
    /// In this pass, a rank for which no job was running below it, nothing drained and no peer could shrink: no
    /// job of that rank or lower can make room until something is preempted.
    no_room_below: Option<(i32, i64)>,
    /// A copy of `free` that room-making works on, kept between passes so that copying reuses its memory.
    scratch: Vec<NodeFree>,
}

fn gpus_text(milli: u64) -> String {
    if milli.is_multiple_of(1000) { format!("{} GPUs", milli / 1000) } else { format!("{} GPU", milli as f64 / 1000.0) }
}

impl Scheduler {
    /// A scheduler over these nodes and queues.
    pub fn new(nodes: Vec<Node>, queues: Vec<Queue>, config: Config) -> Result<Scheduler> {
        let mut seen = std::collections::BTreeSet::new();
        for n in &nodes {
            if !seen.insert(n.id.clone()) {
                return Err(SchedError::DuplicateNode { node: n.id.clone() });
            }
        }
        let mut qs = BTreeMap::new();
        for q in queues {
            let name = q.name.clone();
            if qs.insert(name.clone(), QueueState { queue: q, used: Usage::default() }).is_some() {
                return Err(SchedError::DuplicateQueue { queue: name });
            }
        }
        let pristine: Vec<NodeFree> = nodes.iter().map(NodeFree::of).collect();
        let mut total = Usage::default();
        for n in &nodes {
            total.add(Usage { cpu: n.cpus_milli, mem: n.memory_bytes, gpu: 1000 * n.gpus.len() as u64 });
        }
        let largest = (
            nodes.iter().map(|n| n.cpus_milli).max().unwrap_or(0),
            nodes.iter().map(|n| n.memory_bytes).max().unwrap_or(0),
            nodes.iter().map(|n| n.gpus.len() as u64).max().unwrap_or(0),
            nodes.iter().flat_map(|n| n.gpus.iter().map(|g| g.memory_bytes)).max().unwrap_or(0),
        );
        Ok(Scheduler {
            last_reservation: None,
            largest,
            config,
            free: pristine.clone(),
            pristine,
            nodes,
            total,
            queues: qs.clone(),
            teams: BTreeMap::new(),
            jobs: rustc_hash::FxHashMap::default(),
            allocated: Usage::default(),
            released: 0,
            preempted: 0,
            shapes: VecDeque::new(),
            shape_counts: BTreeMap::new(),
            workload: None,
            last_blocked: None,
            static_order: qs.values().all(|q: &QueueState| q.queue.guaranteed == Quota::UNLIMITED),
            classes: BTreeMap::new(),
            fifo_order: BTreeMap::new(),
            active: BTreeSet::new(),
            above_min: BTreeSet::new(),
            below_max: BTreeSet::new(),
            ends: BTreeSet::new(),
            las_reach: BTreeSet::new(),
            las_running: BTreeMap::new(),
            las_cross: BTreeSet::new(),
            las_shrinkable: BTreeMap::new(),
            draining: BTreeSet::new(),
            running_by_priority: BTreeMap::new(),
            running_elastic: 0,
            no_room_below: None,
            scratch: Vec::new(),
        })
    }

    /// The nodes, in the order given.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Where a job stands, if known.
    pub fn status(&self, job: &str) -> Option<JobStatus> {
        let j = self.jobs.get(job)?;
        Some(match &j.state {
            State::Pending => JobStatus::Pending,
            State::Running { started_ms, tasks } => {
                JobStatus::Running { started_ms: *started_ms, tasks: self.placements(tasks) }
            }
            State::Draining { until_ms, .. } => JobStatus::Draining { until_ms: *until_ms },
        })
    }

    /// The backfill reservation made by the last pass: the first job that could
    /// not start and the earliest time it will, from the running jobs' expected
    /// run times. `None` when every job started or no time could be computed.
    pub fn reservation(&self) -> Option<(&str, u64)> {
        self.last_reservation.as_ref().map(|(j, t)| (j.as_str(), *t))
    }

    /// The configuration it runs with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The first job of the last pass's order that could not start (the head of the queue), if any.
    pub fn blocked(&self) -> Option<&str> {
        self.last_blocked.as_deref()
    }

    /// A job's request, if known.
    pub fn request(&self, job: &str) -> Option<&JobRequest> {
        self.jobs.get(job).map(|j| &j.req)
    }

    /// A job's attained service at `now_ms`: thousandths of a GPU times milliseconds held while running (a task
    /// without GPUs counts as one GPU).
    pub fn attained_service(&self, job: &str, now_ms: u64) -> Option<u64> {
        self.jobs.get(job).map(|j| Self::attained_at(j, now_ms))
    }

    /// The GPU capacity of the cluster, in thousandths of a GPU.
    pub fn total_gpu_milli(&self) -> u64 {
        self.total.gpu
    }

    /// The GPU capacity held by running and draining jobs, in thousandths of a GPU.
    pub fn allocated_gpu_milli(&self) -> u64 {
        self.allocated.gpu
    }

    /// The CPU held by running and draining jobs, in thousandths of a core, and the cluster's.
    pub fn allocated_cpu_milli(&self) -> (u64, u64) {
        (self.allocated.cpu, self.total.cpu)
    }

    /// FGD's fragmentation of the cluster for a task of shape `r`: the free GPU capacity (thousandths of a GPU)
    /// that such a task could not use — on each node, all of it where the task does not fit at all, else that of
    /// the GPUs too full for the task's share of one GPU.
    pub fn fragmentation_milli(&self, r: &Resources) -> u64 {
        self.free.iter().map(|n| fgd::frag_for(n, fgd::free_gpu(n), r)).sum()
    }

    /// Number of pending jobs.
    pub fn pending_count(&self) -> usize {
        self.jobs.len() - self.active.len()
    }

    /// What is allocated on each node, recomputed from the jobs' tasks.
    pub fn allocations(&self) -> Vec<NodeAllocation> {
        let mut out: Vec<NodeAllocation> = self
            .nodes
            .iter()
            .map(|n| NodeAllocation {
                node: n.id.clone(),
                cpus_milli: 0,
                memory_bytes: 0,
                gpus: vec![(0, 0); n.gpus.len()],
            })
            .collect();
        for j in self.jobs.values() {
            let tasks = match &j.state {
                State::Pending => continue,
                State::Running { tasks, .. } | State::Draining { tasks, .. } => tasks,
            };
            let r = &j.req.per_task;
            for t in tasks {
                let a = &mut out[t.node];
                a.cpus_milli += r.cpus_milli;
                a.memory_bytes += r.memory_bytes;
                for &(g, s) in &t.gpus {
                    a.gpus[g as usize].0 += s;
                    a.gpus[g as usize].1 += r.gpu_memory_bytes;
                }
            }
        }
        out
    }

    /// Whether the incremental free-capacity book agrees with the jobs' tasks.
    pub fn books_balance(&self) -> bool {
        self.allocations().iter().zip(&self.nodes).zip(&self.free).all(|((a, n), f)| {
            a.cpus_milli + f.cpu == n.cpus_milli
                && a.memory_bytes + f.mem == n.memory_bytes
                && a.gpus
                    .iter()
                    .zip(&n.gpus)
                    .zip(&f.gpus)
                    .all(|((a, g), f)| a.0 + f.share == 1000 && a.1 + f.mem == g.memory_bytes)
        })
    }

    fn placements(&self, tasks: &[TaskAlloc]) -> Vec<TaskPlacement> {
        tasks
            .iter()
            .map(|t| {
                let n = &self.nodes[t.node];
                TaskPlacement {
                    node: n.id.clone(),
                    gpus: t.gpus.iter().map(|&(g, s)| (n.gpus[g as usize].index, s)).collect(),
                }
            })
            .collect()
    }

    /// Accepts a job after checking that it could ever run ([`Scheduler::admissible`]).
    pub fn submit(&mut self, job: JobRequest) -> Result<()> {
        if self.jobs.contains_key(&job.id) {
            return Err(SchedError::DuplicateJob { job: job.id });
        }
        self.admissible(&job)?;
        if self.config.policy.packing == Packing::Fgd {
            self.remember_shape(&job.per_task);
        }
        let j = Job::new(job);
        self.index_pending(&j);
        self.jobs.insert(j.req.id.clone(), j);
        Ok(())
    }

    /// The job's place in a static order.
    fn pend_key(&self, j: &Job) -> PendKey {
        let key = match self.config.policy.ordering {
            Ordering::Sjf => j.req.expected_runtime_ms.unwrap_or(u64::MAX),
            Ordering::Las => self.las_level(j, 0) as u64,
            _ => 0,
        };
        (std::cmp::Reverse(j.req.priority), key, j.req.submitted_at_ms, j.req.id.clone())
    }

    /// The class of a job in the static order.
    fn class_key(&self, req: &JobRequest) -> ClassKey {
        let team = if self.config.policy.ordering == Ordering::Drf { req.team.clone() } else { String::new() };
        (team, shape_key(&req.per_task), req.tasks_min, req.tasks_max, req.spread)
    }

    /// Puts a job that became pending in the static order.
    fn index_pending(&mut self, j: &Job) {
        if !self.static_order {
            return;
        }
        let info = PendInfo {
            per_task: j.req.per_task,
            tasks_min: j.req.tasks_min,
            tasks_max: j.req.tasks_max,
            spread: j.req.spread,
            runtime: j.req.expected_runtime_ms.unwrap_or(u64::MAX),
            failed_at: j.failed_at,
        };
        let key = self.pend_key(j);
        let ck = self.class_key(&j.req);
        if self.config.policy.ordering == Ordering::Fifo {
            self.fifo_order.insert(key.clone(), ck.clone());
        }
        self.classes.entry(ck).or_default().insert(key, info);
    }

    /// Takes a job out of the static order.
    fn unindex_pending(&mut self, j: &Job) {
        if !self.static_order {
            return;
        }
        let (ck, key) = (self.class_key(&j.req), self.pend_key(j));
        self.fifo_order.remove(&key);
        if let Some(c) = self.classes.get_mut(&ck) {
            c.remove(&key);
            if c.is_empty() {
                self.classes.remove(&ck);
            }
        }
    }

    fn remember_shape(&mut self, r: &Resources) {
        let key = shape_key(r);
        self.shapes.push_back(key);
        *self.shape_counts.entry(key).or_default() += 1;
        while self.shapes.len() > self.config.shape_window.max(1) {
            let Some(old) = self.shapes.pop_front() else { break };
            if let Some(c) = self.shape_counts.get_mut(&old) {
                *c -= 1;
                if *c == 0 {
                    self.shape_counts.remove(&old);
                }
            }
        }
        self.workload = None;
    }

    /// The commonest task shapes of the window, commonest first (ties by shape).
    fn count_workload(&self) -> Vec<(Resources, u64)> {
        let mut all: Vec<(u64, ShapeKey)> = self.shape_counts.iter().map(|(k, c)| (*c, *k)).collect();
        all.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        all.truncate(WORKLOAD_SHAPES);
        all.into_iter()
            .map(|(c, (cpu, mem, gpu, gmem))| {
                (Resources { cpus_milli: cpu, memory_bytes: mem, gpus_milli: gpu, gpu_memory_bytes: gmem }, c)
            })
            .collect()
    }

    /// Whether `job` could ever run on this cluster and queue — the one admission check, which a control plane
    /// also runs at submission to refuse early — without accepting it.
    pub fn admissible(&self, job: &JobRequest) -> Result<()> {
        let id = job.id.clone();
        let Some(q) = self.queues.get(&job.queue) else {
            return Err(SchedError::UnknownQueue { job: id, queue: job.queue.clone() });
        };
        if job.tasks_max == 0 {
            return Err(SchedError::ZeroTasks { job: id, field: "tasks_max" });
        }
        if job.tasks_min == 0 {
            return Err(SchedError::ZeroTasks { job: id, field: "tasks_min" });
        }
        if job.tasks_min > job.tasks_max {
            return Err(SchedError::MinAboveMax { job: id, min: job.tasks_min, max: job.tasks_max });
        }
        if job.tasks_max > self.config.max_tasks_per_job {
            return Err(SchedError::TooManyTasks {
                job: id,
                tasks_max: job.tasks_max,
                limit: self.config.max_tasks_per_job,
            });
        }
        let r = job.per_task;
        if r.cpus_milli == 0 && r.memory_bytes == 0 && r.gpus_milli == 0 {
            return Err(SchedError::EmptyRequest { job: id });
        }
        if r.gpus_milli >= 1000 && !r.gpus_milli.is_multiple_of(1000) {
            return Err(SchedError::FractionalMultiGpu { job: id, gpus_milli: r.gpus_milli });
        }
        if r.gpus_milli == 0 && r.gpu_memory_bytes > 0 {
            return Err(SchedError::GpuMemoryWithoutGpu { job: id, gpu_memory_bytes: r.gpu_memory_bytes });
        }
        let never = |field: &'static str, asked: String, limit: String| SchedError::NeverFits {
            job: id.clone(),
            field,
            asked,
            limit,
        };
        let (max_cpu, max_mem, max_gpus, max_gmem) = self.largest;
        if r.cpus_milli > max_cpu {
            return Err(never(
                "per_task.cpus_milli",
                format!("{} milli-CPUs per task", r.cpus_milli),
                format!("the largest node has {max_cpu}"),
            ));
        }
        if r.memory_bytes > max_mem {
            return Err(never(
                "per_task.memory_bytes",
                format!("{} bytes per task", r.memory_bytes),
                format!("the largest node has {max_mem}"),
            ));
        }
        if r.gpus_milli > 1000 * max_gpus || (r.gpus_milli > 0 && max_gpus == 0) {
            return Err(never(
                "per_task.gpus_milli",
                format!("{} per task", gpus_text(r.gpus_milli)),
                format!("the largest node has {}", gpus_text(1000 * max_gpus)),
            ));
        }
        if r.gpu_memory_bytes > max_gmem {
            return Err(never(
                "per_task.gpu_memory_bytes",
                format!("{} bytes per GPU", r.gpu_memory_bytes),
                format!("the largest GPU has {max_gmem}"),
            ));
        }
        if !place::fits(&self.pristine, &r, 1, false) {
            return Err(never(
                "per_task",
                "this combination of CPU, memory and GPUs for one task".into(),
                "no node has all of it".into(),
            ));
        }
        if !place::fits(&self.pristine, &r, job.tasks_min, job.spread) {
            return Err(never(
                "tasks_min",
                format!("{} tasks{}", job.tasks_min, if job.spread { " on distinct nodes" } else { "" }),
                "the whole empty cluster holds fewer".into(),
            ));
        }
        let need = Usage::of(&r, job.tasks_min);
        if !q.queue.can_borrow {
            let g = q.queue.guaranteed;
            for (field, asked, guaranteed) in [
                ("cpus_milli", need.cpu, g.cpus_milli),
                ("memory_bytes", need.mem, g.memory_bytes),
                ("gpus_milli", need.gpu, g.gpus_milli),
            ] {
                if asked > guaranteed {
                    return Err(SchedError::AboveQuota { job: id, queue: job.queue.clone(), field, asked, guaranteed });
                }
            }
        }
        Ok(())
    }

    /// Forgets a job (done, failed or cancelled), freeing what it held.
    pub fn finish(&mut self, job: &str) -> Result<()> {
        self.las_mark(job, false);
        self.end_mark(job, false);
        let Some(j) = self.jobs.remove(job) else {
            return Err(SchedError::UnknownJob { job: job.to_string() });
        };
        match &j.state {
            State::Pending => self.unindex_pending(&j),
            State::Running { tasks, .. } => {
                self.active.remove(job);
                self.stopped_running(&j.req);
                self.free_tasks(&j.req, tasks);
            }
            State::Draining { tasks, .. } => {
                self.active.remove(job);
                self.draining.remove(job);
                self.free_tasks(&j.req, tasks);
            }
        }
        Ok(())
    }

    /// The positions of the nodes `req` avoids.
    fn avoided(&self, req: &JobRequest) -> Vec<usize> {
        if req.avoid_nodes.is_empty() {
            return Vec::new();
        }
        self.nodes.iter().enumerate().filter(|(_, n)| req.avoid_nodes.contains(&n.id)).map(|(i, _)| i).collect()
    }

    /// Asks that `job`'s later tasks (its growth, or its next placement) go elsewhere than `node` where they fit.
    pub fn avoid(&mut self, job: &str, node: &str) -> Result<()> {
        let Some(j) = self.jobs.get_mut(job) else {
            return Err(SchedError::UnknownJob { job: job.to_string() });
        };
        if !j.req.avoid_nodes.iter().any(|n| n == node) {
            j.req.avoid_nodes.push(node.to_owned());
            j.failed_at = None;
            if matches!(j.state, State::Pending) && self.static_order {
                let j = &self.jobs[job];
                let (ck, key) = (self.class_key(&j.req), self.pend_key(j));
                if let Some(info) = self.classes.get_mut(&ck).and_then(|c| c.get_mut(&key)) {
                    info.failed_at = None;
                }
            }
        }
        Ok(())
    }

    /// Frees the tasks at `positions` (in the order the job's tasks were placed and grown) of a running job that
    /// goes on without them (an elastic job that lost them and regrouped in place); the rest keep their places.
    pub fn release_tasks(&mut self, job: &str, positions: &[usize]) -> Result<()> {
        self.las_mark(job, false);
        let Some(j) = self.jobs.get_mut(job) else {
            return Err(SchedError::UnknownJob { job: job.to_string() });
        };
        let State::Running { tasks, .. } = &mut j.state else {
            self.las_mark(job, true);
            return Ok(());
        };
        let mut freed = Vec::new();
        let mut i = 0;
        tasks.retain(|t| {
            let keep = !positions.contains(&i);
            i += 1;
            if !keep {
                freed.push(t.clone());
            }
            keep
        });
        let req = j.req.clone();
        self.free_tasks(&req, &freed);
        self.las_mark(job, true);
        Ok(())
    }

    /// Counts a job out of the running ones.
    fn stopped_running(&mut self, req: &JobRequest) {
        if let Some(c) = self.running_by_priority.get_mut(&req.priority) {
            *c -= 1;
            if *c == 0 {
                self.running_by_priority.remove(&req.priority);
            }
        }
        self.running_elastic -= usize::from(req.tasks_max > req.tasks_min);
    }

    fn free_tasks(&mut self, req: &JobRequest, tasks: &[TaskAlloc]) {
        for t in tasks {
            place::release(&mut self.free, t, &req.per_task);
        }
        let u = Usage::of(&req.per_task, tasks.len() as u32);
        self.allocated.sub(u);
        self.released += 1;
        if let Some(q) = self.queues.get_mut(&req.queue) {
            q.used.sub(u);
        }
        if let Some(t) = self.teams.get_mut(&req.team) {
            t.sub(u);
        }
    }

    fn charge(&mut self, req: &JobRequest, tasks: u32) {
        let u = Usage::of(&req.per_task, tasks);
        self.allocated.add(u);
        if let Some(q) = self.queues.get_mut(&req.queue) {
            q.used.add(u);
        }
        self.teams.entry(req.team.clone()).or_default().add(u);
    }

    fn dominant_share(&self, team: &str) -> f64 {
        let Some(u) = self.teams.get(team) else { return 0.0 };
        let f = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        f(u.cpu, self.total.cpu).max(f(u.mem, self.total.mem)).max(f(u.gpu, self.total.gpu))
    }

    fn queue_allows(&self, req: &JobRequest, tasks: u32) -> bool {
        self.queues.get(&req.queue).is_some_and(|q| q.allows(Usage::of(&req.per_task, tasks)))
    }

    /// A job's attained service at `now`: what it had when it last started, stopped or changed size, plus what
    /// it has had running since.
    fn attained_at(j: &Job, now: u64) -> u64 {
        match &j.state {
            State::Running { tasks, .. } => {
                j.attained.saturating_add(service_rate(&j.req, tasks.len()).saturating_mul(now.saturating_sub(j.since)))
            }
            _ => j.attained,
        }
    }

    /// A job's LAS level at `now`: how many of the thresholds its attained service has reached.
    fn las_level(&self, j: &Job, now: u64) -> usize {
        let gpu_ms = Self::attained_at(j, now) / 1000;
        self.config.las_thresholds_gpu_ms.iter().take_while(|&&t| gpu_ms >= t).count()
    }

    /// Who may preempt whom at `now`: higher ranks first. The job's priority, then, under [`Ordering::Las`], its
    /// level (a lower level ranks higher).
    fn rank(&self, j: &Job, now: u64) -> (i32, i64) {
        match self.config.policy.ordering {
            Ordering::Las => (j.req.priority, -(self.las_level(j, now) as i64)),
            _ => (j.req.priority, 0),
        }
    }

    /// A running or draining job's entry in `ends`.
    fn end_of(j: &Job) -> Option<(u64, JobId)> {
        match &j.state {
            State::Running { started_ms, .. } => {
                j.req.expected_runtime_ms.map(|rt| (started_ms.saturating_add(rt), j.req.id.clone()))
            }
            State::Draining { until_ms, .. } => Some((*until_ms, j.req.id.clone())),
            State::Pending => None,
        }
    }

    /// Takes the job's entry out of `ends` (before its state changes) or puts it in (after).
    fn end_mark(&mut self, id: &str, add: bool) {
        let Some(e) = self.jobs.get(id).and_then(Self::end_of) else { return };
        if add {
            self.ends.insert(e);
        } else {
            self.ends.remove(&e);
        }
    }

    /// A running job's entries in `las_reach` (none but under [`Ordering::Las`]).
    fn las_marks(&self, j: &Job) -> Vec<(usize, i32, u64, JobId)> {
        let State::Running { tasks, .. } = &j.state else { return Vec::new() };
        if self.config.policy.ordering != Ordering::Las {
            return Vec::new();
        }
        let rate = service_rate(&j.req, tasks.len());
        let marks = self.config.las_thresholds_gpu_ms.iter().enumerate().map(|(i, &t)| {
            let target = t.saturating_mul(1000);
            let at = match target.checked_sub(j.attained) {
                None | Some(0) => 0,
                Some(_) if rate == 0 => u64::MAX,
                Some(left) => j.since.saturating_add(left.div_ceil(rate)),
            };
            (i, j.req.priority, at, j.req.id.clone())
        });
        marks.collect()
    }

    /// Takes the job out of `above_min` and, under LAS, its entries out of the LAS indexes (before it stops or changes
    /// size) or puts them in (after).
    fn las_mark(&mut self, id: &str, add: bool) {
        if let Some(j) = self.jobs.get(id)
            && let State::Running { tasks, .. } = &j.state
        {
            if tasks.len() > j.req.tasks_min as usize {
                if add {
                    self.above_min.insert(j.req.id.clone());
                } else {
                    self.above_min.remove(id);
                }
            }
            if tasks.len() < j.req.tasks_max as usize {
                if add {
                    self.below_max.insert(j.req.id.clone());
                } else {
                    self.below_max.remove(id);
                }
            }
        }
        if self.config.policy.ordering != Ordering::Las {
            return;
        }
        let Some(j) = self.jobs.get(id) else { return };
        let State::Running { started_ms, tasks } = &j.state else { return };
        let marks = self.las_marks(j);
        let slot = (j.req.priority, if add { Self::level_by(&marks, j.since) } else { j.las_filed });
        let victim = (std::cmp::Reverse(*started_ms), std::cmp::Reverse(j.req.submitted_at_ms), j.req.id.clone());
        let above_min = tasks.len() > j.req.tasks_min as usize;
        for m in marks {
            let cross = (m.2 > 0 && m.2 < u64::MAX).then(|| (m.2, m.3.clone()));
            if add {
                self.las_reach.insert(m);
                self.las_cross.extend(cross);
            } else {
                self.las_reach.remove(&m);
                if let Some(c) = cross {
                    self.las_cross.remove(&c);
                }
            }
        }
        if add {
            if above_min {
                self.las_shrinkable.entry(slot).or_default().insert(victim.clone());
            }
            self.las_running.entry(slot).or_default().insert(victim);
            if let Some(j) = self.jobs.get_mut(id) {
                j.las_filed = slot.1;
            }
        } else {
            Self::unfile(&mut self.las_running, slot, &victim);
            Self::unfile(&mut self.las_shrinkable, slot, &victim);
        }
    }

    fn unfile(index: &mut BTreeMap<(i32, usize), BTreeSet<LasVictim>>, slot: (i32, usize), v: &LasVictim) {
        if let Some(set) = index.get_mut(&slot) {
            set.remove(v);
            if set.is_empty() {
                index.remove(&slot);
            }
        }
    }

    /// The level of a running job at `t` (at or after its `since`) from its marks: how many thresholds, in order,
    /// it has reached.
    fn level_by(marks: &[(usize, i32, u64, JobId)], t: u64) -> usize {
        marks.iter().take_while(|m| m.2 <= t).count()
    }

    /// Refiles the running jobs that crossed a threshold by `now` under their level now.
    fn las_refile(&mut self, now: u64) {
        while let Some((at, id)) = self.las_cross.first().cloned() {
            if at > now {
                break;
            }
            self.las_cross.pop_first();
            let Some(j) = self.jobs.get(&id) else { continue };
            let State::Running { started_ms, .. } = &j.state else { continue };
            let level = Self::level_by(&self.las_marks(j), now);
            let old = (j.req.priority, j.las_filed);
            if level == old.1 {
                continue;
            }
            let victim = (std::cmp::Reverse(*started_ms), std::cmp::Reverse(j.req.submitted_at_ms), id.clone());
            Self::unfile(&mut self.las_running, old, &victim);
            if self.las_shrinkable.get(&old).is_some_and(|set| set.contains(&victim)) {
                Self::unfile(&mut self.las_shrinkable, old, &victim);
                self.las_shrinkable.entry((old.0, level)).or_default().insert(victim.clone());
            }
            self.las_running.entry((old.0, level)).or_default().insert(victim);
            if let Some(j) = self.jobs.get_mut(&id) {
                j.las_filed = level;
            }
        }
    }

    /// Whether some running job of `priority` has reached threshold `level` (so stands at a lower rank than a job
    /// of that level) at `now`.
    fn las_above(&self, priority: i32, level: usize, now: u64) -> bool {
        self.las_reach
            .range((level, priority, 0, String::new())..)
            .next()
            .is_some_and(|&(l, p, at, _)| l == level && p == priority && at <= now)
    }

    /// Whether some running job of `priority` reached threshold `level` after `after`, up to `now`.
    fn las_crossed(&self, priority: i32, level: usize, after: u64, now: u64) -> bool {
        self.las_reach
            .range((level, priority, after.saturating_add(1), String::new())..)
            .next()
            .is_some_and(|&(l, p, at, _)| l == level && p == priority && at <= now)
    }

    /// Folds a running job's service up to `now` into its attained service (before its size changes).
    fn fold_service(j: &mut Job, now: u64) {
        j.attained = Self::attained_at(j, now);
        j.since = j.since.max(now);
    }

    /// One scheduling pass at time `now_ms`: decisions to carry out, in order.
    pub fn schedule(&mut self, now_ms: u64) -> Vec<Decision> {
        let mut out = Vec::new();
        let ordering = self.config.policy.ordering;
        self.no_room_below = None;
        if ordering == Ordering::Las {
            self.las_refile(now_ms);
        }
        if self.config.policy.packing == Packing::Fgd && self.workload.is_none() {
            self.workload = Some(self.count_workload());
        }

        // Preempted jobs whose grace period is over go back to pending.
        let expired: Vec<JobId> = self
            .draining
            .iter()
            .filter(|id| matches!(self.jobs[*id].state, State::Draining { until_ms, .. } if until_ms <= now_ms))
            .cloned()
            .collect();
        for id in expired {
            self.end_mark(&id, false);
            let Some(j) = self.jobs.get_mut(&id) else { continue };
            let State::Draining { tasks, .. } = std::mem::replace(&mut j.state, State::Pending) else {
                continue;
            };
            let req = j.req.clone();
            self.active.remove(&id);
            self.draining.remove(&id);
            self.free_tasks(&req, &tasks);
            if let Some(j) = self.jobs.get(&id) {
                let j = j.clone();
                self.index_pending(&j);
            }
            out.push(Decision::Requeue { job: id });
        }
        if self.static_order {
            let waiting = self.pass_static(now_ms, &mut out);
            if !waiting {
                self.grow(now_ms, &mut out);
            }
            return out;
        }

        // Pending jobs by priority (high first); within one priority, jobs that
        // fit their queue's guarantee before jobs that would borrow; within
        // those, the ordering's key (shortest expected run time, lowest LAS level), then under DRF teams take
        // turns by dominant share (lowest first), each team in FIFO order; otherwise FIFO.
        // ((priority, borrows), ordering key, submitted, id, team).
        type Entry = ((i32, bool), u64, u64, JobId, String);
        let mut pending: Vec<Entry> =
            self.jobs
                .iter()
                .filter(|(_, j)| matches!(j.state, State::Pending))
                .map(|(id, j)| {
                    let borrows = self.queues.get(&j.req.queue).is_none_or(|q| {
                        !q.used.within(Usage::of(&j.req.per_task, j.req.tasks_min), &q.queue.guaranteed)
                    });
                    let key = match ordering {
                        Ordering::Sjf => j.req.expected_runtime_ms.unwrap_or(u64::MAX),
                        Ordering::Las => self.las_level(j, 0) as u64,
                        _ => 0,
                    };
                    let team = if ordering == Ordering::Drf { j.req.team.clone() } else { String::new() };
                    ((j.req.priority, borrows), key, j.req.submitted_at_ms, id.clone(), team)
                })
                .collect();
        pending.sort_by(|a, b| {
            (b.0.0.cmp(&a.0.0)).then(a.0.1.cmp(&b.0.1)).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)).then(a.3.cmp(&b.3))
        });

        let mut reservation: Option<Reservation> = None;
        self.last_reservation = None;
        self.last_blocked = None;
        let mut tries = self.config.max_preemption_tries_per_pass;
        let mut waiting = false;
        let mut failed_now: Vec<(Resources, u32, bool)> = Vec::new();
        let mut failed_dual: Vec<(Resources, u32, bool)> = Vec::new();

        let mut i = 0;
        'pass: while i < pending.len() {
            let group = (pending[i].0, pending[i].1);
            let mut teams: Vec<(String, VecDeque<(u64, JobId)>)> = Vec::new();
            while i < pending.len() && (pending[i].0, pending[i].1) == group {
                let (_, _, at, id, team) = std::mem::take(&mut pending[i]);
                match teams.iter_mut().find(|(t, _)| *t == team) {
                    Some((_, q)) => q.push_back((at, id)),
                    None => teams.push((team, VecDeque::from([(at, id)]))),
                }
                i += 1;
            }
            loop {
                let mut best: Option<(f64, u64, usize)> = None;
                for (ti, (team, q)) in teams.iter().enumerate() {
                    let Some(&(at, _)) = q.front() else { continue };
                    let share = self.dominant_share(team);
                    if best.is_none_or(|(bs, bat, _)| share < bs || (share == bs && at < bat)) {
                        best = Some((share, at, ti));
                    }
                }
                let Some((_, _, ti)) = best else { break };
                let Some((_, id)) = teams[ti].1.pop_front() else { break };
                let placed = self.try_job(
                    &id,
                    now_ms,
                    &mut reservation,
                    &mut tries,
                    &mut failed_now,
                    &mut failed_dual,
                    &mut out,
                );
                if placed == Attempt::Waiting {
                    waiting = true;
                    if self.last_blocked.is_none() {
                        self.last_blocked = Some(id);
                    }
                    if ordering == Ordering::Fifo {
                        break 'pass;
                    }
                }
            }
        }

        if !waiting {
            self.grow(now_ms, &mut out);
        }
        out
    }

    /// [`Scheduler::schedule`]'s pass over the pending jobs when their order is static: the same decisions as the
    /// general pass, with the jobs taken in order from their classes (`pending.rs`), a class dropped for the rest
    /// of the pass once its jobs cannot fit, and those known not to fit passed over without being looked up.
    /// Whether some job waits.
    fn pass_static(&mut self, now: u64, out: &mut Vec<Decision>) -> bool {
        let classes = std::mem::take(&mut self.classes);
        self.last_reservation = None;
        self.last_blocked = None;
        let mut st = Pass {
            reservation: None,
            tries: self.config.max_preemption_tries_per_pass,
            waiting: false,
            failed_now: Vec::new(),
            failed_dual: Vec::new(),
            placed: Vec::new(),
            failed: Vec::new(),
        };
        if self.config.policy.ordering == Ordering::Fifo {
            self.walk_fifo(&classes, now, &mut st, out);
        } else {
            self.merge_classes(&classes, now, &mut st, out);
        }
        self.classes = classes;
        for (k, f) in st.failed {
            let Some(j) = self.jobs.get(&k.3) else { continue };
            let ck = self.class_key(&j.req);
            if let Some(info) = self.classes.get_mut(&ck).and_then(|c| c.get_mut(&k)) {
                info.failed_at = f;
            }
        }
        for k in st.placed {
            self.fifo_order.remove(&k);
            let Some(j) = self.jobs.get(&k.3) else { continue };
            let ck = self.class_key(&j.req);
            if let Some(c) = self.classes.get_mut(&ck) {
                c.remove(&k);
                if c.is_empty() {
                    self.classes.remove(&ck);
                }
            }
        }
        st.waiting
    }

    /// Strict FIFO's pass: the jobs in `fifo_order`, the pass order, up to the first that waits; a class's later jobs
    /// are passed over as [`Scheduler::merge_classes`] passes them over (all of them once its jobs cannot fit, beside a
    /// reservation those that do not end before it), so the decisions are the merge's.
    fn walk_fifo(&mut self, classes: &BTreeMap<ClassKey, Class>, now: u64, st: &mut Pass, out: &mut Vec<Decision>) {
        let order = std::mem::take(&mut self.fifo_order);
        // The longest expected run time still worth a look in each class (none: no job of it).
        let mut bound: BTreeMap<&ClassKey, Option<u64>> = BTreeMap::new();
        for (key, ck) in &order {
            let Some(info) = classes.get(ck).and_then(|c| c.get(key)) else { continue };
            match bound.get(ck) {
                Some(None) => continue,
                Some(Some(t)) if info.runtime > *t => continue,
                _ => {}
            }
            let (stop, fate) = self.visit(key, info, now, st, out);
            if stop {
                break;
            }
            let b = match fate {
                Fate::Dead => None,
                Fate::Next => Some(u64::MAX),
                Fate::EndsBy(t) => Some(t),
            };
            bound.insert(ck, b);
        }
        drop(bound);
        // Nothing in the walk adds pending jobs; should something, it is kept.
        let added = std::mem::replace(&mut self.fifo_order, order);
        self.fifo_order.extend(added);
    }

    /// The pass over the classes merged by their next job (every static ordering but strict FIFO).
    fn merge_classes(&mut self, classes: &BTreeMap<ClassKey, Class>, now: u64, st: &mut Pass, out: &mut Vec<Decision>) {
        // Each team (one, unnamed, but under DRF) merges its classes by their next job.
        type Next<'a> = std::cmp::Reverse<(&'a PendKey, usize, Pos)>;
        let list: Vec<(&ClassKey, &Class)> = classes.iter().collect();
        let mut teams: Vec<(&str, BinaryHeap<Next<'_>>, Vec<usize>)> = Vec::new();
        for (ci, (ck, c)) in list.iter().enumerate() {
            let ti = match teams.iter().position(|t| t.0 == ck.0) {
                Some(ti) => ti,
                None => {
                    teams.push((ck.0.as_str(), BinaryHeap::new(), Vec::new()));
                    teams.len() - 1
                }
            };
            teams[ti].2.push(ci);
            if let Some(p) = c.next(None, u64::MAX) {
                teams[ti].1.push(std::cmp::Reverse((c.at(p).0, ci, p)));
            }
        }
        // The next priority; under DRF the teams take turns by dominant share, ties to the earliest head and then
        // to the team whose first job of the priority (whatever became of it) comes first.
        'pass: while let Some(group) = teams.iter().filter_map(|t| t.1.peek().map(|n| n.0.0.0)).min() {
            let mut order: Vec<(&PendKey, usize)> = Vec::new();
            if teams.len() > 1 {
                let from: PendKey = (group, 0, 0, String::new());
                for (ti, t) in teams.iter().enumerate() {
                    let first = t.2.iter().filter_map(|&ci| list[ci].1.first_from(&from)).min();
                    if let Some(k) = first.filter(|k| k.0 == group) {
                        order.push((k, ti));
                    }
                }
                order.sort();
            } else if let Some(n) = teams[0].1.peek() {
                order.push((n.0.0, 0));
            }
            loop {
                let mut best: Option<(f64, u64, usize)> = None;
                for &(_, ti) in &order {
                    let Some(std::cmp::Reverse((k, _, _))) = teams[ti].1.peek() else { continue };
                    if k.0 != group {
                        continue;
                    }
                    let share = if teams.len() > 1 { self.dominant_share(teams[ti].0) } else { 0.0 };
                    if best.is_none_or(|(bs, bat, _)| share < bs || (share == bs && k.2 < bat)) {
                        best = Some((share, k.2, ti));
                    }
                }
                let Some((_, _, ti)) = best else { break };
                let Some(std::cmp::Reverse((key, ci, pos))) = teams[ti].1.pop() else { break };
                let class = list[ci].1;
                let (stop, fate) = self.visit(key, class.at(pos).1, now, st, out);
                if stop {
                    break 'pass;
                }
                let next = match fate {
                    Fate::Dead => None,
                    Fate::Next => class.next(Some(class.after(pos)), u64::MAX),
                    Fate::EndsBy(t) => class.next(Some(class.after(pos)), t),
                };
                if let Some(p) = next {
                    teams[ti].1.push(std::cmp::Reverse((class.at(p).0, ci, p)));
                }
            }
        }
    }

    /// One pending job of [`Scheduler::pass_static`]: whether the pass stops there, and what is left to try of
    /// the job's class in this pass.
    fn visit(
        &mut self,
        key: &PendKey,
        info: &PendInfo,
        now: u64,
        st: &mut Pass,
        out: &mut Vec<Decision>,
    ) -> (bool, Fate) {
        let ordering = self.config.policy.ordering;
        let passive = |st: &Pass| st.reservation.is_some() || (st.tries == 0 && !ordering.reserves());
        let known = info.failed_at == Some(self.released);
        let counts: &[u32] =
            if info.tasks_max > info.tasks_min { &[info.tasks_max, info.tasks_min] } else { &[info.tasks_min] };
        let dominated = |cache: &[(Resources, u32, bool)], k: u32| {
            cache.iter().any(|(c, ck, cs)| {
                *cs == info.spread
                    && k >= *ck
                    && info.per_task.cpus_milli >= c.cpus_milli
                    && info.per_task.memory_bytes >= c.memory_bytes
                    && info.per_task.gpus_milli >= c.gpus_milli
                    && info.per_task.gpu_memory_bytes >= c.gpu_memory_bytes
            })
        };
        let attempt = if passive(st) && (known || counts.iter().all(|&k| dominated(&st.failed_now, k))) {
            // It cannot fit now, so not beside the reservation either; and nothing is tried for it.
            Attempt::Waiting
        } else {
            let a = self.try_job(
                &key.3,
                now,
                &mut st.reservation,
                &mut st.tries,
                &mut st.failed_now,
                &mut st.failed_dual,
                out,
            );
            let f = self.jobs.get(&key.3).and_then(|j| j.failed_at);
            if f != info.failed_at {
                st.failed.push((key.clone(), f));
            }
            if a == Attempt::Placed {
                st.placed.push(key.clone());
            }
            a
        };
        if attempt == Attempt::Waiting {
            st.waiting = true;
            if self.last_blocked.is_none() {
                self.last_blocked = Some(key.3.clone());
            }
            if ordering == Ordering::Fifo {
                return (true, Fate::Dead);
            }
        }
        // From here on in this pass nothing is freed and no room is made: what cannot fit now never will, and
        // beside the reservation what cannot fit in both states only may if it ends before it starts.
        if !passive(st) {
            return (false, Fate::Next);
        }
        if (attempt == Attempt::Waiting && known) || counts.iter().all(|&k| dominated(&st.failed_now, k)) {
            return (false, Fate::Dead);
        }
        if let Some(rv) = &st.reservation
            && counts.iter().all(|&k| dominated(&st.failed_dual, k) || dominated(&st.failed_now, k))
        {
            return (false, Fate::EndsBy(rv.time.saturating_sub(now)));
        }
        (false, Fate::Next)
    }

    #[allow(clippy::too_many_arguments)]
    fn try_job(
        &mut self,
        id: &str,
        now: u64,
        reservation: &mut Option<Reservation>,
        tries: &mut usize,
        failed_now: &mut Vec<(Resources, u32, bool)>,
        failed_dual: &mut Vec<(Resources, u32, bool)>,
        out: &mut Vec<Decision>,
    ) -> Attempt {
        let Some(job) = self.jobs.get(id) else { return Attempt::Skipped };
        if !self.queue_allows(&job.req, job.req.tasks_min) {
            return Attempt::Skipped; // held back by its own queue's quota
        }
        // Known not to fit, and this pass will neither make room nor reserve for it: it waits.
        let reserves = self.config.policy.ordering.reserves();
        if job.failed_at == Some(self.released) && (reservation.is_some() || (*tries == 0 && !reserves)) {
            return Attempt::Waiting;
        }
        let req = job.req.clone();
        let r = req.per_task;
        let avoid = self.avoided(&req);
        let counts: &[u32] =
            if req.tasks_max > req.tasks_min { &[req.tasks_max, req.tasks_min] } else { &[req.tasks_min] };
        let dominated = |cache: &[(Resources, u32, bool)], k: u32| {
            cache.iter().any(|(c, ck, cs)| {
                *cs == req.spread
                    && k >= *ck
                    && r.cpus_milli >= c.cpus_milli
                    && r.memory_bytes >= c.memory_bytes
                    && r.gpus_milli >= c.gpus_milli
                    && r.gpu_memory_bytes >= c.gpu_memory_bytes
            })
        };
        let finishes_before =
            |rv: &Reservation| req.expected_runtime_ms.is_some_and(|rt| now.saturating_add(rt) <= rv.time);
        let pack = self.config.policy.packing;
        let mut placed = None;
        // Nothing was freed since every size of the job last failed to fit: it still does not.
        let known_to_fail = self.jobs.get(id).is_some_and(|j| j.failed_at == Some(self.released));
        let mut all_failed_now = !known_to_fail;
        for &k in counts {
            if known_to_fail {
                break;
            }
            if !self.queue_allows(&req, k) {
                all_failed_now = false;
                continue;
            }
            match reservation.as_mut() {
                Some(rv) if !finishes_before(rv) => {
                    all_failed_now = false;
                    if dominated(failed_dual, k) {
                        continue;
                    }
                    let w = self.workload.as_deref().unwrap_or_default();
                    match place::place_avoiding(
                        &mut self.free,
                        Some(&mut rv.free),
                        &r,
                        k,
                        req.spread,
                        &avoid,
                        pack_of(pack, w),
                    ) {
                        Some(t) => {
                            placed = Some(t);
                            break;
                        }
                        None => failed_dual.push((r, k, req.spread)),
                    }
                }
                _ => {
                    if dominated(failed_now, k) {
                        continue;
                    }
                    let w = self.workload.as_deref().unwrap_or_default();
                    match place::place_avoiding(&mut self.free, None, &r, k, req.spread, &avoid, pack_of(pack, w)) {
                        Some(t) => {
                            placed = Some(t);
                            break;
                        }
                        None => failed_now.push((r, k, req.spread)),
                    }
                }
            }
        }
        if placed.is_none()
            && all_failed_now
            && let Some(j) = self.jobs.get_mut(id)
        {
            j.failed_at = Some(self.released);
        }
        if placed.is_none() && reservation.is_none() {
            // The first job that cannot start: make room by shrinking or
            // preempting, else reserve its earliest start.
            if *tries > 0 {
                *tries -= 1;
                if let Some(decisions) = self.make_room(&req, now) {
                    if !decisions.is_empty() {
                        failed_now.clear();
                        failed_dual.clear();
                    }
                    out.extend(decisions);
                    let w = self.workload.as_deref().unwrap_or_default();
                    placed = place::place_avoiding(
                        &mut self.free,
                        None,
                        &r,
                        req.tasks_min,
                        req.spread,
                        &avoid,
                        pack_of(pack, w),
                    );
                }
            }
            if placed.is_none() && self.config.policy.ordering.reserves() {
                *reservation = self.reserve(&req, now);
                self.last_reservation = reservation.as_ref().map(|rv| (req.id.clone(), rv.time));
            }
        }
        match placed {
            Some(tasks) => {
                self.charge(&req, tasks.len() as u32);
                out.push(Decision::Place { job: req.id.clone(), assignments: self.placements(&tasks) });
                if let Some(j) = self.jobs.get_mut(id) {
                    j.state = State::Running { started_ms: now, tasks };
                    self.active.insert(req.id.clone());
                    *self.running_by_priority.entry(req.priority).or_default() += 1;
                    self.running_elastic += usize::from(req.tasks_max > req.tasks_min);
                    j.since = now;
                    j.failed_at = None;
                }
                self.las_mark(id, true);
                self.end_mark(id, true);
                Attempt::Placed
            }
            None => Attempt::Waiting,
        }
    }

    /// The earliest time the job fits as running jobs end (by their expected
    /// run times), and the cluster then with the job placed.
    ///
    /// The ends are taken in time order from `ends` (those already past count as now), a group of equal times at a
    /// time, as far as needed: galloping (1, 2, 4... groups) to the first count of groups after which the job
    /// fits, then a binary search below it. Fitting is monotone in what is released, so this is the first group
    /// after which it fits, as a search over every end would find.
    fn reserve(&self, req: &JobRequest, now: u64) -> Option<Reservation> {
        let mut source =
            self.ends.iter().filter_map(|(t, id)| self.jobs.get(id).map(|j| ((*t).max(now), j))).peekable();
        let mut ends: Vec<(u64, &Job)> = Vec::new();
        // Group boundaries: after releasing ends[..b], the time is ends[b-1].0.
        let mut bounds: Vec<usize> = Vec::new();
        // Releases (or takes back, which undoes it exactly) what the jobs of a range of `ends` hold.
        let release = |f: &mut Vec<NodeFree>, ends: &[(u64, &Job)], range: std::ops::Range<usize>, undo: bool| {
            for (_, j) in &ends[range] {
                if let State::Running { tasks, .. } | State::Draining { tasks, .. } = &j.state {
                    for t in tasks {
                        if undo {
                            place::alloc(f, t, &j.req.per_task);
                        } else {
                            place::release(f, t, &j.req.per_task);
                        }
                    }
                }
            }
        };
        let r = &req.per_task;
        let fits = |f: &[NodeFree]| place::fits(f, r, req.tasks_min, req.spread);
        let before = |bounds: &[usize], g: usize| if g == 0 { 0 } else { bounds[g - 1] };
        let mut below = self.free.clone();
        // Galloping: `done` groups released in `below`, known not to be enough.
        let (mut done, mut want) = (0usize, 1usize);
        let (mut lo, mut hi) = loop {
            while bounds.len() < want {
                let Some(&(t, _)) = source.peek() else { break };
                while let Some(&(u, j)) = source.peek() {
                    if u != t {
                        break;
                    }
                    ends.push((u, j));
                    source.next();
                }
                bounds.push(ends.len());
            }
            let upto = bounds.len().min(want);
            if upto <= done {
                return None;
            }
            release(&mut below, &ends, before(&bounds, done)..bounds[upto - 1], false);
            if fits(&below) {
                release(&mut below, &ends, before(&bounds, done)..bounds[upto - 1], true);
                break (done, upto - 1);
            }
            done = upto;
            want *= 2;
        };
        // `below`: the cluster with ends[..done] released, every bound before `lo` known not to fit.
        let mut done = before(&bounds, lo);
        while lo < hi {
            let mid = (lo + hi) / 2;
            release(&mut below, &ends, done..bounds[mid], false);
            if fits(&below) {
                hi = mid;
                release(&mut below, &ends, done..bounds[mid], true);
            } else {
                lo = mid + 1;
                done = bounds[mid];
            }
        }
        let b = bounds[lo];
        let mut free = below;
        release(&mut free, &ends, done..b, false);
        place::place(&mut free, None, r, req.tasks_min, req.spread, Pack::BestFit)?;
        Some(Reservation { time: ends[b - 1].0, free })
    }

    /// Shrinks or preempts so that `req` fits. `None`: it cannot be done;
    /// `Some(vec![])`: jobs already draining will make enough room.
    fn make_room(&mut self, req: &JobRequest, now: u64) -> Option<Vec<Decision>> {
        // Nothing to drain, no queue to reclaim from, no running job of a lower priority (nor a peer to shrink):
        // no room can be made, without looking at every job.
        let ordering = self.config.policy.ordering;
        if self.static_order
            && self.draining.is_empty()
            && (ordering != Ordering::Elastic || self.running_elastic == 0)
            && self.running_by_priority.keys().next().is_none_or(|&p| p >= req.priority)
        {
            if ordering != Ordering::Las {
                return None;
            }
            // Under LAS a running job of the same priority is below it once it has reached the threshold of the
            // job's level.
            let level = self.jobs.get(&req.id).map(|j| self.las_level(j, now)).unwrap_or(0);
            if !self.las_above(req.priority, level, now) {
                let rank = (req.priority, -(level as i64));
                self.no_room_below = Some(self.no_room_below.map_or(rank, |r| r.max(rank)));
                return None;
            }
        }
        let reclaim = self
            .queues
            .get(&req.queue)
            .is_some_and(|q| q.used.within(Usage::of(&req.per_task, req.tasks_min), &q.queue.guaranteed));
        let req_rank = self.jobs.get(&req.id).map(|j| self.rank(j, now)).unwrap_or((req.priority, 0));
        if self.static_order && self.no_room_below.is_some_and(|r| req_rank <= r) {
            return None;
        }
        // Known not to be enough, and nothing since could have made it so (see `Job::room_failed`); not under the
        // elastic ordering, where a job started since may be a peer to shrink.
        let memo = self.static_order && ordering != Ordering::Elastic;
        if memo
            && let Some((released, preempted, at)) = self.jobs.get(&req.id).and_then(|j| j.room_failed)
            && released == self.released
            && preempted == self.preempted
            && (ordering != Ordering::Las || !self.las_crossed(req.priority, (-req_rank.1) as usize, at, now))
        {
            return None;
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        let eligible = |v: &Job| {
            v.req.id != req.id
                && ((v.req.queue == req.queue && self.rank(v, now) < req_rank)
                    || (v.req.queue != req.queue
                        && reclaim
                        && self.queues.get(&v.req.queue).is_some_and(QueueState::over_guarantee)))
        };
        // Under the elastic ordering, running elastic jobs of the same rank may shrink (never be preempted).
        let shrinkable = |v: &Job| {
            self.config.policy.ordering == Ordering::Elastic
                && v.req.id != req.id
                && v.req.queue == req.queue
                && self.rank(v, now) == req_rank
        };
        let mut steps: Vec<Step> = Vec::new();
        // Victim order: lowest rank, then least progress lost (most recent
        // start), then the latest submitted, then id.
        type Victim<'a> = ((i32, i64), u64, std::cmp::Reverse<u64>, &'a JobId);
        let mut victims: Vec<Victim<'_>> = Vec::new();
        let mut peers: Vec<(u64, std::cmp::Reverse<u64>, &JobId)> = Vec::new();
        // Every running or draining job; under LAS in a static order with nothing running at a lower priority, only
        // the draining ones and those of its priority that reached its level's threshold (the others are no
        // victims).
        let las_only = self.static_order
            && ordering == Ordering::Las
            && self.running_by_priority.keys().next().is_none_or(|&p| p >= req.priority);
        let level = (-req_rank.1) as usize;
        // The cluster after every step (in `scratch`) with its fit count, when already known.
        let mut after_all: Option<FitCount<'_>> = None;
        if las_only {
            // The steps are the draining jobs, the shrinking of the victims above their minimum, then the victims
            // in order, the deepest level first — taken from `las_running` only as far as needed (galloping: 1,
            // 2, 4... victims), not all gathered and sorted. The search below then runs on that prefix, in which
            // the shortest one that makes room lies.
            // What a step releases: a preempted job's tasks but those its shrink steps released.
            let release_all = |f: &mut Vec<NodeFree>, fit: &mut FitCount<'_>, j: &Job, preempt: bool| {
                if let State::Running { tasks, .. } | State::Draining { tasks, .. } = &j.state {
                    let keep = if preempt { (j.req.tasks_min as usize).min(tasks.len()) } else { tasks.len() };
                    for t in &tasks[..keep] {
                        fit.release(f, t, &j.req.per_task);
                    }
                }
            };
            scratch.clone_from(&self.free);
            let mut fit = FitCount::new(&scratch, &req.per_task, req.tasks_min, req.spread);
            for id in &self.draining {
                release_all(&mut scratch, &mut fit, &self.jobs[id], false);
            }
            if !self.draining.is_empty() && fit.fits() {
                // The draining jobs make room: the shortest prefix that does holds only drains, so nothing is
                // decided (what the search below would find, without building the steps).
                self.scratch = scratch;
                return Some(Vec::new());
            }
            steps.extend(self.draining.iter().map(|id| Step::Drain(id.clone())));
            let deepest = self.config.las_thresholds_gpu_ms.len();
            let is_victim =
                |id: &&JobId| matches!(self.jobs[*id].state, State::Running { .. }) && eligible(&self.jobs[*id]);
            for id in las_in_order(&self.las_shrinkable, req.priority, level, deepest).filter(is_victim) {
                let j = &self.jobs[id];
                if let State::Running { tasks, .. } = &j.state {
                    for t in (j.req.tasks_min as usize..tasks.len()).rev() {
                        steps.push(Step::ShrinkOne(id.clone(), t));
                    }
                }
            }
            let mut source = las_in_order(&self.las_running, req.priority, level, deepest).filter(is_victim);
            for s in &steps {
                if let Step::ShrinkOne(id, t) = s
                    && let State::Running { tasks, .. } = &self.jobs[id].state
                {
                    fit.release(&mut scratch, &tasks[*t], &self.jobs[id].req.per_task);
                }
            }
            let mut taken: Vec<&JobId> = Vec::new();
            let mut enough = !steps.is_empty() && fit.fits();
            let mut want = 1usize;
            while !enough {
                let before = taken.len();
                taken.extend(source.by_ref().take(want - before));
                if taken.len() == before {
                    break;
                }
                for id in &taken[before..] {
                    release_all(&mut scratch, &mut fit, &self.jobs[*id], true);
                }
                enough = fit.fits();
                want *= 2;
            }
            if steps.is_empty() && taken.is_empty() {
                drop(source);
                self.scratch = scratch;
                self.no_room_below = Some(self.no_room_below.map_or(req_rank, |r| r.max(req_rank)));
                return None;
            }
            if !enough {
                drop(source);
                self.scratch = scratch;
                if memo && let Some(j) = self.jobs.get_mut(&req.id) {
                    j.room_failed = Some((self.released, self.preempted, now));
                }
                return None;
            }
            steps.extend(taken.into_iter().map(|id| Step::Preempt(id.clone())));
            after_all = Some(fit);
        } else {
            // Under the elastic ordering in a static order with nothing running at a lower priority: the draining jobs
            // and the peers that could shrink.
            let elastic_only = self.static_order
                && ordering == Ordering::Elastic
                && self.running_by_priority.keys().next().is_none_or(|&p| p >= req.priority);
            let candidates: Box<dyn Iterator<Item = &JobId>> = if elastic_only {
                Box::new(self.draining.iter().chain(self.above_min.iter()))
            } else if las_only {
                let reached = self
                    .las_reach
                    .range((level, req.priority, 0, String::new())..)
                    .take_while(|&&(l, p, at, _)| l == level && p == req.priority && at <= now)
                    .map(|(_, _, _, id)| id);
                Box::new(self.draining.iter().chain(reached))
            } else {
                Box::new(self.active.iter())
            };
            for id in candidates {
                let j = &self.jobs[id];
                match &j.state {
                    State::Draining { .. } => steps.push(Step::Drain(id.clone())),
                    State::Running { started_ms, .. } if eligible(j) => {
                        victims.push((
                            self.rank(j, now),
                            now.saturating_sub(*started_ms),
                            std::cmp::Reverse(j.req.submitted_at_ms),
                            id,
                        ));
                    }
                    State::Running { started_ms, tasks } if shrinkable(j) && tasks.len() > j.req.tasks_min as usize => {
                        peers.push((now.saturating_sub(*started_ms), std::cmp::Reverse(j.req.submitted_at_ms), id));
                    }
                    _ => {}
                }
            }
            if steps.is_empty() && victims.is_empty() && peers.is_empty() {
                // Fewer jobs still are below a lower rank.
                self.scratch = scratch;
                self.no_room_below = Some(self.no_room_below.map_or(req_rank, |r| r.max(req_rank)));
                return None;
            }
            peers.sort();
            victims.sort();
            // Reclaim takes from another queue only what it holds beyond its guarantee.
            let mut left: BTreeMap<&str, Usage> = BTreeMap::new();
            victims.retain(|&(_, _, _, id)| {
                let v = &self.jobs[id];
                if v.req.queue == req.queue {
                    return true;
                }
                let Some(q) = self.queues.get(&v.req.queue) else { return false };
                let used = left.entry(v.req.queue.as_str()).or_insert(q.used);
                if used.within(Usage::default(), &q.queue.guaranteed) {
                    return false; // back within its guarantee
                }
                if let State::Running { tasks, .. } = &v.state {
                    used.sub(Usage::of(&v.req.per_task, tasks.len() as u32));
                }
                true
            });
            // Shrinking elastic jobs first (they lose no progress), lower ranks before peers, then preemption.
            for id in victims.iter().map(|v| v.3).chain(peers.iter().map(|p| p.2)) {
                let j = &self.jobs[id];
                if let State::Running { tasks, .. } = &j.state {
                    for t in (j.req.tasks_min as usize..tasks.len()).rev() {
                        steps.push(Step::ShrinkOne(id.clone(), t));
                    }
                }
            }
            for &(_, _, _, id) in &victims {
                steps.push(Step::Preempt(id.clone()));
            }
        }
        // Each step's job, looked up once, and how many tasks each job's shrink steps release.
        let jobs_of: Vec<&Job> = steps
            .iter()
            .map(|s| match s {
                Step::Drain(id) | Step::Preempt(id) | Step::ShrinkOne(id, _) => &self.jobs[id],
            })
            .collect();
        let mut shrunk: BTreeMap<&str, usize> = BTreeMap::new();
        for s in &steps {
            if let Step::ShrinkOne(id, _) = s {
                *shrunk.entry(id.as_str()).or_default() += 1;
            }
        }
        // Carries out a range of steps on `f` (or takes them back, which undoes them exactly), counted in `fit`.
        let apply = |f: &mut Vec<NodeFree>, fit: &mut FitCount<'_>, range: std::ops::Range<usize>, undo: bool| {
            let mut free = |t: &TaskAlloc, r: &Resources| {
                if undo {
                    fit.alloc(f, t, r);
                } else {
                    fit.release(f, t, r);
                }
            };
            for (s, j) in steps[range.clone()].iter().zip(&jobs_of[range]) {
                let (State::Running { tasks, .. } | State::Draining { tasks, .. }) = &j.state else { continue };
                match s {
                    Step::ShrinkOne(_, t) => free(&tasks[*t], &j.req.per_task),
                    Step::Drain(_) => {
                        for t in tasks {
                            free(t, &j.req.per_task);
                        }
                    }
                    Step::Preempt(id) => {
                        // Tasks already released by this job's shrink steps.
                        let gone = shrunk.get(id.as_str()).copied().unwrap_or(0);
                        for t in &tasks[..tasks.len() - gone] {
                            free(t, &j.req.per_task);
                        }
                    }
                }
            }
        };
        let mut below = scratch;
        let mut fit = match after_all {
            Some(fit) => fit,
            None => {
                below.clone_from(&self.free);
                let mut fit = FitCount::new(&below, &req.per_task, req.tasks_min, req.spread);
                apply(&mut below, &mut fit, 0..steps.len(), false);
                fit
            }
        };
        if !fit.fits() {
            drop(jobs_of);
            self.scratch = below;
            if memo && let Some(j) = self.jobs.get_mut(&req.id) {
                j.room_failed = Some((self.released, self.preempted, now));
            }
            return None;
        }
        apply(&mut below, &mut fit, 0..steps.len(), true);
        // The shortest prefix of steps that makes room (monotone: binary search); `below` is the cluster after
        // steps[..done], a prefix known not to make room.
        let (mut lo, mut hi) = (1usize, steps.len());
        let mut done = 0usize;
        while lo < hi {
            let mid = (lo + hi) / 2;
            apply(&mut below, &mut fit, done..mid, false);
            if fit.fits() {
                hi = mid;
                apply(&mut below, &mut fit, done..mid, true);
            } else {
                lo = mid + 1;
                done = mid;
            }
        }
        drop(jobs_of);
        self.scratch = below;
        let used = lo;
        let steps: Vec<Step> = steps.into_iter().take(used).collect();
        let mut out = Vec::new();
        let preempted: Vec<&JobId> =
            steps.iter().filter_map(|s| if let Step::Preempt(id) = s { Some(id) } else { None }).collect();
        // Shrinks, grouped by job, unless the job is preempted anyway.
        let mut shrinks: BTreeMap<JobId, u32> = BTreeMap::new();
        for s in &steps {
            if let Step::ShrinkOne(id, _) = s
                && !preempted.contains(&id)
            {
                *shrinks.entry(id.clone()).or_default() += 1;
            }
        }
        for (id, by) in shrinks {
            self.las_mark(&id, false);
            let Some(j) = self.jobs.get_mut(&id) else { continue };
            let State::Running { tasks, .. } = &mut j.state else { continue };
            let rate = service_rate(&j.req, tasks.len());
            j.attained = j.attained.saturating_add(rate.saturating_mul(now.saturating_sub(j.since)));
            j.since = j.since.max(now);
            let removed = tasks.split_off(tasks.len() - by as usize);
            self.preempted += 1;
            let vreq = j.req.clone();
            self.free_tasks(&vreq, &removed);
            self.las_mark(&id, true);
            out.push(Decision::Shrink { job: id, by, for_job: req.id.clone() });
        }
        let grace = self.config.preempt_grace_ms;
        for id in preempted {
            self.las_mark(id, false);
            self.end_mark(id, false);
            let Some(j) = self.jobs.get_mut(id) else { continue };
            let State::Running { tasks, .. } = std::mem::replace(&mut j.state, State::Pending) else {
                continue;
            };
            let reason = if j.req.queue == req.queue {
                PreemptReason::Priority { by: req.id.clone() }
            } else {
                PreemptReason::QuotaReclaim { owner_queue: req.queue.clone(), by: req.id.clone() }
            };
            let rate = service_rate(&j.req, tasks.len());
            j.attained = j.attained.saturating_add(rate.saturating_mul(now.saturating_sub(j.since)));
            j.since = now;
            j.state = State::Draining { until_ms: now.saturating_add(grace), tasks };
            self.ends.insert((now.saturating_add(grace), id.clone()));
            self.preempted += 1;
            let vreq = j.req.clone();
            self.stopped_running(&vreq);
            self.draining.insert(id.clone());
            out.push(Decision::Preempt { job: id.clone(), reason, grace_ms: grace });
        }
        if !out.is_empty() {
            self.no_room_below = None;
        }
        Some(out)
    }

    /// Grows running elastic jobs into free capacity (called only when no job
    /// waits for capacity); a job spread one task per node grows onto nodes it has no task on.
    fn grow(&mut self, now: u64, out: &mut Vec<Decision>) {
        let pack = self.config.policy.packing;
        let mut elastic: Vec<(i32, u64, JobId)> = self
            .below_max
            .iter()
            .map(|id| (id, &self.jobs[id]))
            .filter(|(_, j)| matches!(&j.state, State::Running { tasks, .. } if (tasks.len() as u32) < j.req.tasks_max))
            .map(|(id, j)| (j.req.priority, j.req.submitted_at_ms, id.clone()))
            .collect();
        elastic.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        for (_, _, id) in elastic {
            let req = self.jobs[&id].req.clone();
            let mut added = Vec::new();
            while let State::Running { tasks, .. } = &self.jobs[&id].state {
                let have = tasks.len() + added.len();
                if have as u32 >= req.tasks_max || !self.queue_allows(&req, 1) {
                    break;
                }
                let avoid = self.avoided(&req);
                let w = self.workload.as_deref().unwrap_or_default();
                let placed = if req.spread {
                    // Strictly elsewhere than its tasks; away from the avoided nodes where it fits.
                    let taken: Vec<usize> = tasks.iter().chain(&added).map(|t| t.node).collect();
                    let both: Vec<usize> = taken.iter().chain(&avoid).copied().collect();
                    place::place_excluding(&mut self.free, None, &req.per_task, 1, false, &both, pack_of(pack, w))
                        .or_else(|| {
                            place::place_excluding(
                                &mut self.free,
                                None,
                                &req.per_task,
                                1,
                                false,
                                &taken,
                                pack_of(pack, w),
                            )
                        })
                } else {
                    place::place_avoiding(&mut self.free, None, &req.per_task, 1, false, &avoid, pack_of(pack, w))
                };
                let Some(mut t) = placed else {
                    break;
                };
                self.charge(&req, 1);
                added.append(&mut t);
            }
            if added.is_empty() {
                continue;
            }
            let tasks = self.placements(&added);
            self.las_mark(&id, false);
            if let Some(j) = self.jobs.get_mut(&id) {
                Self::fold_service(j, now);
                if let State::Running { tasks: have, .. } = &mut j.state {
                    have.extend(added);
                }
            }
            self.las_mark(&id, true);
            out.push(Decision::Grow { job: id, tasks });
        }
    }
}

/// The state of one [`Scheduler::pass_static`].
#[derive(Debug)]
struct Pass {
    reservation: Option<Reservation>,
    tries: usize,
    waiting: bool,
    failed_now: Vec<(Resources, u32, bool)>,
    failed_dual: Vec<(Resources, u32, bool)>,
    /// Jobs placed, and jobs whose `failed_at` changed, to write back into the classes.
    placed: Vec<PendKey>,
    failed: Vec<(PendKey, Option<u64>)>,
}

/// What is left to try of a class in a pass after one of its jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Its later jobs.
    Next,
    /// Nothing: none of them can fit.
    Dead,
    /// Those expected to end within this many milliseconds (before the reservation starts).
    EndsBy(u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    Placed,
    Waiting,
    Skipped,
}
