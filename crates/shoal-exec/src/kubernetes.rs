//! The Kubernetes executor (feature `kubernetes`): a placed gang becomes, per attempt, a headless Service and one
//! Pod per rank, through the API server (kube-rs).
//!
//! - Objects of attempt A of job J: the Service `shoal-J-A` (the owner: its deletion takes the rest with it, by the
//!   cluster's garbage collector), the Secret `shoal-J-A` with the job secret, and the Pods `shoal-J-A-R`, each
//!   owned by the Service, pinned to the node Shoal's scheduler chose (node affinity on the Node's name, so the
//!   cluster's scheduler still binds it and says why when it cannot), with requests equal to limits (`cpu`,
//!   `memory`, `nvidia.com/gpu`), labels (`app.kubernetes.io/managed-by=shoal`, `shoal.dev/instance`,
//!   `shoal.dev/job`, `shoal.dev/attempt`, `shoal.dev/rank`; `kueue.x-k8s.io/queue-name` from the job's queue), the
//!   environment contract (written by `TaskEnv::vars` through `task_env`; the job secret from the Secret) and the
//!   server's data volume — a PersistentVolumeClaim mounted at the server's own data directory path, so that the
//!   workers read their spec and write checkpoints, metrics and logs where the server reads them.
//! - The rendezvous is rank 0's DNS name under the Service (`shoal-J-A-0.shoal-J-A.NS.svc:29400`); rank 0 hosts
//!   the store.
//! - Pods are *watched*, never polled: one watch of this instance's Pods feeds a cache that [`Executor::probe`]
//!   reads, so a probe costs no request. Until the watch has listed once, and after it fails until it answers
//!   again, probes say the executor cannot tell. A Pod's end is read from its container's terminated state (exit
//!   status; `OOMKilled` and `Evicted` are reported as lost with the cluster's reason and message); a Pod that
//!   cannot be scheduled or whose image cannot be pulled keeps waiting and says why ([`Executor::notes`]), except
//!   an image that can never be pulled (`InvalidImageName`, `ErrImageNeverPull`, a broken container
//!   configuration), or one still not pulled after [`PULL_GRACE`]: lost with the reason.
//! - [`Executor::stop`] deletes the Pod (SIGTERM, then SIGKILL after its grace period; 1 s for a kill) and the
//!   attempt's Service (Shoal stops a gang whole). An attempt whose Pods have all ended is removed [`KEEP_FINISHED`] later (its Service, and so
//!   everything it owns), once the control loop has read how each ended.
//! - The container runs the worker under `sh`: output appended to the rank's log in the data directory (where
//!   `shoal logs` reads it), SIGTERM passed on to the worker, the worker's exit status as the container's.
//! - Calls into the API server run on the executor's own single-threaded runtime, on its own thread, each with a
//!   deadline ([`CALL_TIMEOUT`]); the trait's calls block at most that long and never on a task.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod, Secret, Service};
use kube::api::{Api, DeleteParams, ListParams, PostParams, PropagationPolicy};
use kube::runtime::watcher;
use serde_json::{Value, json};
use shoal_comm::env::TaskEnv;

use crate::error::{ExecError, Result};
use crate::executor::{Executor, GangError, NodeInfo, Stop, Stray, Task, TaskLaunch, TaskStatus, Usage, task_env};
use crate::k8s::{RENDEZVOUS_PORT, dns_name, env_values, headless_service, resources, secret};
use crate::local::task_dir_for;

/// How long one call to the API server may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a Pod may wait for its image before it is given up as lost.
pub const PULL_GRACE: Duration = Duration::from_secs(120);
/// How long the objects of an attempt whose Pods have all ended are kept (for `kubectl` and for the control loop
/// to read how each ended).
pub const KEEP_FINISHED: Duration = Duration::from_secs(60);
/// The grace period of a Pod deleted to stop it (`Stop::Term`), as a kubelet gives it before SIGKILL.
const TERM_GRACE_SECONDS: u32 = 30;
/// Repeated stops of one Pod within this long are one.
const STOP_REPEAT: Duration = Duration::from_secs(2);
/// How long a Pod deleted from the cluster is remembered (how it ended, for the probes that follow).
const TOMBSTONE: Duration = Duration::from_secs(600);
/// The longest job part of an object's name: `shoal-<job>-<attempt>-<rank>` stays a 63-character DNS label.
const MAX_JOB_PART: usize = 36;
/// Waiting reasons after which a container never starts.
const FATAL_WAITING: [&str; 4] =
    ["InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError", "CreateContainerError"];
/// Waiting reasons of an image that cannot be pulled (yet).
const PULL_WAITING: [&str; 2] = ["ImagePullBackOff", "ErrImagePull"];

/// The rank's wrapper (`sh -c WRAPPER shoal-rank LOG PROGRAM ARGS...`): runs the worker with its output appended to
/// LOG, passes SIGTERM and SIGINT on to it (the container's first process would otherwise ignore them), and exits
/// with its status.
const WRAPPER: &str = "log=$1; shift; \"$@\" >>\"$log\" 2>&1 & w=$!; trap 'kill -TERM \"$w\" 2>/dev/null' TERM INT; \
                       while :; do wait \"$w\"; c=$?; kill -0 \"$w\" 2>/dev/null || break; done; exit $c";

/// How the executor reaches its cluster and what it puts there (`shoal server --executor kubernetes`).
#[derive(Debug, Clone)]
pub struct KubeOptions {
    /// The kubeconfig to use; `None`: `KUBECONFIG`, `~/.kube/config`, or the Pod's service account in a cluster.
    pub kubeconfig: Option<PathBuf>,
    /// The namespace of every object; `None`: the kubeconfig's (or the service account's) namespace.
    pub namespace: Option<String>,
    /// The workers' image.
    pub image: String,
    /// The PersistentVolumeClaim holding the server's data directory, mounted in every Pod where the server has it
    /// mounted ([`KubeOptions::data_mount`]), so that the data directory is at the same path in both.
    pub data_pvc: String,
    /// Where the server has the claim mounted (the data directory or a directory above it); `None`: the data
    /// directory itself.
    pub data_mount: Option<PathBuf>,
    /// The `shoal` program in the image (the workers' command).
    pub program: String,
    /// This server's name among others in the same namespace (`shoal.dev/instance`).
    pub instance: String,
}

impl KubeOptions {
    pub fn new(image: &str) -> KubeOptions {
        KubeOptions {
            kubeconfig: None,
            namespace: None,
            image: image.to_owned(),
            data_pvc: "shoal-data".into(),
            data_mount: None,
            program: "shoal".into(),
            instance: "shoal".into(),
        }
    }
}

/// What the watch last saw of a Pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PodView {
    job: String,
    attempt: i64,
    rank: i64,
    node: String,
    phase: String,
    deleting: bool,
    /// The worker container's end: exit status, reason (`Completed`, `Error`, `OOMKilled`), message.
    terminated: Option<(i32, String, String)>,
    /// Why its container has not started: reason, message.
    waiting: Option<(String, String)>,
    /// Why the cluster's scheduler has not bound it.
    unschedulable: Option<String>,
    /// The Pod's own reason and message (`Evicted`, ...).
    reason: Option<(String, String)>,
    /// Its memory limit, as written.
    memory: String,
}

/// The watch's picture of this instance's Pods.
#[derive(Debug, Default)]
struct Cache {
    pods: HashMap<String, PodView>,
    /// Pods gone from the cluster: what was last seen of them, and when they went.
    gone: HashMap<String, (PodView, Instant)>,
    /// The watch has listed once and has not failed since.
    healthy: bool,
    /// Why the watch last failed.
    error: Option<String>,
    /// When each waiting-for-its-image Pod was first seen so.
    pulling_since: HashMap<String, Instant>,
    /// When every Pod of an attempt (its Service's name) was first seen ended.
    ended_since: HashMap<String, Instant>,
}

/// Runs tasks as Pods.
pub struct KubeExecutor {
    opts: KubeOptions,
    namespace: String,
    data_dir: PathBuf,
    host: String,
    runtime: tokio::runtime::Handle,
    client: kube::Client,
    cache: Arc<Mutex<Cache>>,
    stops: Mutex<HashMap<String, (Instant, Stop)>>,
    /// Dropped with the executor: ends its runtime's thread.
    _shutdown: tokio::sync::oneshot::Sender<()>,
}

impl std::fmt::Debug for KubeExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeExecutor")
            .field("namespace", &self.namespace)
            .field("opts", &self.opts)
            .finish_non_exhaustive()
    }
}

fn api_error(what: &str, e: impl std::fmt::Display) -> ExecError {
    ExecError::Unavailable(format!("Kubernetes API: {what}: {e}"))
}

impl KubeExecutor {
    /// Connects to the cluster (a call to the API server checks it answers), and starts watching this instance's
    /// Pods.
    pub fn new(data_dir: &Path, opts: KubeOptions) -> Result<KubeExecutor> {
        if opts.image.trim().is_empty() || opts.image.contains(char::is_whitespace) {
            return Err(ExecError::Config(format!("{:?} is not an image reference", opts.image)));
        }
        if !crate::k8s::is_dns_label(&opts.data_pvc) {
            return Err(ExecError::Config(format!("{:?} is not a PersistentVolumeClaim name", opts.data_pvc)));
        }
        if !crate::k8s::is_dns_label(&opts.instance) {
            return Err(ExecError::Config(format!("{:?} is not an instance name (a DNS label)", opts.instance)));
        }
        let data_dir =
            std::path::absolute(data_dir).map_err(|e| ExecError::io(format!("resolving {}", data_dir.display()), e))?;
        let (handle_tx, handle_rx) = std::sync::mpsc::channel();
        let (shutdown, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("shoal-kube".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = handle_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = handle_tx.send(Ok(rt.handle().clone()));
                rt.block_on(async {
                    let _ = shutdown_rx.await;
                });
            })
            .map_err(|e| ExecError::io("starting the Kubernetes executor's thread", e))?;
        let runtime = handle_rx
            .recv_timeout(CALL_TIMEOUT)
            .map_err(|_| ExecError::Config("the Kubernetes executor's runtime did not start".into()))?
            .map_err(|e| ExecError::Config(format!("the Kubernetes executor's runtime: {e}")))?;
        let (kubeconfig, namespace) = (opts.kubeconfig.clone(), opts.namespace.clone());
        let (client, namespace) = call(&runtime, "reading the cluster's configuration", async move {
            let config = match &kubeconfig {
                Some(path) => {
                    let kc = kube::config::Kubeconfig::read_from(path)
                        .map_err(|e| ExecError::Config(format!("--kubeconfig {}: {e}", path.display())))?;
                    kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                        .await
                        .map_err(|e| ExecError::Config(format!("--kubeconfig {}: {e}", path.display())))?
                }
                None => kube::Config::infer().await.map_err(|e| {
                    ExecError::Config(format!(
                        "no Kubernetes configuration (KUBECONFIG, ~/.kube/config, in-cluster): {e}"
                    ))
                })?,
            };
            let namespace = namespace.unwrap_or_else(|| config.default_namespace.clone());
            let client =
                kube::Client::try_from(config).map_err(|e| ExecError::Config(format!("Kubernetes client: {e}")))?;
            Ok((client, namespace))
        })?;
        if !crate::k8s::is_dns_label(&namespace) {
            return Err(ExecError::Config(format!("{namespace:?} is not a namespace name")));
        }
        let host = format!("kubernetes/{namespace}");
        let exec = KubeExecutor {
            opts,
            namespace,
            data_dir,
            host,
            runtime,
            client,
            cache: Arc::new(Mutex::new(Cache::default())),
            stops: Mutex::new(HashMap::new()),
            _shutdown: shutdown,
        };
        // The API server answers, and this identity may list Pods here.
        let pods: Api<Pod> = exec.pods();
        exec.call("listing Pods", async move {
            pods.list(&ListParams::default().limit(1)).await.map(|_| ()).map_err(|e| api_error("listing Pods", e))
        })?;
        exec.watch();
        exec.janitor();
        tracing::info!(namespace = %exec.namespace, image = %exec.opts.image, pvc = %exec.opts.data_pvc,
            "Kubernetes executor ready");
        Ok(exec)
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn services(&self) -> Api<Service> {
        Api::namespaced(self.client.clone(), &self.namespace)
    }

    fn selector(&self) -> String {
        format!("app.kubernetes.io/managed-by=shoal,shoal.dev/instance={}", self.opts.instance)
    }

    /// Runs `fut` on the executor's runtime and waits for it, at most [`CALL_TIMEOUT`].
    fn call<T: Send + 'static>(&self, what: &str, fut: impl Future<Output = Result<T>> + Send + 'static) -> Result<T> {
        call(&self.runtime, what, fut)
    }

    /// `shoal-<job>-<attempt>`: the Service's and the Secret's name.
    pub fn attempt_name(job: &str, attempt: i64) -> String {
        let job: String = dns_name(job).chars().take(MAX_JOB_PART).collect();
        format!("shoal-{}-{attempt}", job.trim_end_matches('-'))
    }

    /// Rank `rank`'s Pod (and host) name.
    pub fn pod_name(job: &str, attempt: i64, rank: i64) -> String {
        format!("{}-{rank}", Self::attempt_name(job, attempt))
    }

    fn labels(&self, job: &str, attempt: i64) -> serde_json::Map<String, Value> {
        let mut m = serde_json::Map::new();
        m.insert("app.kubernetes.io/name".into(), "shoal".into());
        m.insert("app.kubernetes.io/component".into(), "worker".into());
        m.insert("app.kubernetes.io/managed-by".into(), "shoal".into());
        m.insert("shoal.dev/instance".into(), self.opts.instance.clone().into());
        m.insert("shoal.dev/job".into(), dns_name(job).into());
        m.insert("shoal.dev/attempt".into(), attempt.to_string().into());
        m
    }

    fn log_file(&self, job: &str, attempt: i64, rank: i64) -> PathBuf {
        self.data_dir.join("jobs").join(job).join(format!("attempt-{attempt}")).join(format!("rank-{rank}.log"))
    }

    /// Rank `l.rank`'s Pod, owned by the attempt's Service.
    fn pod(&self, l: &TaskLaunch, owner: &Value) -> Result<Value> {
        let name = Self::pod_name(&l.job_id, l.attempt, l.rank as i64);
        let service = Self::attempt_name(&l.job_id, l.attempt);
        let fqdn = format!("{}.{service}.{}.svc", Self::pod_name(&l.job_id, l.attempt, 0), self.namespace);
        // A newcomer to a running group takes its seat there and meets at the control plane's store.
        let (rank, world_size, rendezvous) = l.seat();
        let (master_addr, master_port) = match &l.join {
            Some(_) => {
                let (h, p) = rendezvous.rsplit_once(':').unwrap_or((rendezvous, ""));
                (h.to_owned(), p.parse().unwrap_or(0))
            }
            None => (fqdn, RENDEZVOUS_PORT),
        };
        let contract = TaskEnv {
            job_id: l.job_id.clone(),
            rank,
            world_size,
            // One rank per Pod.
            local_rank: 0,
            local_world_size: 1,
            rendezvous: rendezvous.to_owned(),
            host_store: l.join.is_none(),
            secret: l.secret.clone(),
            master_addr,
            master_port,
            attempt: Some(l.attempt),
            exit_file: None,
            server_data: Some(self.data_dir.display().to_string()),
            server: l.server.clone(),
            server_ca: l.server_ca.clone(),
            threads: Some(l.cpus_milli.div_ceil(1000).max(1) as usize),
            // The device plugin says which GPUs a Pod that asked for some sees; one that asked none sees none.
            gpus: if l.gpus.is_empty() { Some(String::new()) } else { None },
            join: l.join.as_ref().map(|j| (j.generation, l.rank)),
        };
        let gpus_milli: u64 = l.gpus.iter().map(|(_, share)| u64::from(*share)).sum();
        let res = resources(l.cpus_milli, l.memory_bytes, gpus_milli)
            .map_err(|m| ExecError::BadTask(format!("job {}: {m}", l.job_id)))?;
        let Some((program, args)) = l.argv.split_first() else {
            return Err(ExecError::BadTask(format!("job {}: an empty command line", l.job_id)));
        };
        // The server's own path to `shoal` means nothing in the image: the image's program runs instead.
        let program =
            if Path::new(program).file_name().is_some_and(|n| n == "shoal") { &self.opts.program } else { program };
        let mut command: Vec<String> = vec!["sh".into(), "-c".into(), WRAPPER.into(), "shoal-rank".into()];
        command.push(self.log_file(&l.job_id, l.attempt, l.rank as i64).display().to_string());
        command.push(program.clone());
        command.extend(args.iter().cloned());
        let mut labels = self.labels(&l.job_id, l.attempt);
        labels.insert("shoal.dev/rank".into(), l.rank.to_string().into());
        if !l.queue.is_empty() && l.queue != "default" {
            labels.insert("kueue.x-k8s.io/queue-name".into(), l.queue.clone().into());
        }
        let data = self.opts.data_mount.as_deref().unwrap_or(&self.data_dir).display().to_string();
        Ok(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": labels,
                "ownerReferences": [owner],
            },
            "spec": {
                "hostname": name,
                "subdomain": service,
                "restartPolicy": "Never",
                "enableServiceLinks": false,
                "terminationGracePeriodSeconds": TERM_GRACE_SECONDS,
                "affinity": { "nodeAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{ "matchFields": [
                        { "key": "metadata.name", "operator": "In", "values": [l.node] },
                    ] }],
                } } },
                "containers": [{
                    "name": "worker",
                    "image": self.opts.image,
                    "command": command,
                    "env": env_values(task_env(&contract, &l.env), &service),
                    "ports": [{ "name": "rendezvous", "containerPort": RENDEZVOUS_PORT }],
                    "resources": res,
                    "volumeMounts": [{ "name": "data", "mountPath": data }],
                }],
                "volumes": [{ "name": "data", "persistentVolumeClaim": { "claimName": self.opts.data_pvc } }],
            },
        }))
    }

    /// Creates the attempt's Service, Secret and Pods, in that order; the Pods that were created, or the rank
    /// that could not be and why. Newcomers to a running group ([`TaskLaunch::join`]) get their Pods only, owned by
    /// the attempt's Service that is there already.
    fn create(&self, launches: &[TaskLaunch]) -> std::result::Result<Vec<Task>, GangError> {
        let fail = |started: Vec<Task>, rank: usize, error: ExecError| GangError { started, rank, error };
        let Some(first) = launches.first() else { return Ok(Vec::new()) };
        let (job, attempt) = (first.job_id.clone(), first.attempt);
        // The attempt's directory (its ranks' logs), on the volume the Pods mount.
        let dir = self.data_dir.join("jobs").join(&job).join(format!("attempt-{attempt}"));
        task_dir_for(&dir, None).map_err(|e| fail(Vec::new(), 0, e))?;
        let name = Self::attempt_name(&job, attempt);
        let meta = json!({ "name": name, "namespace": self.namespace, "labels": self.labels(&job, attempt) });
        let mut selector = serde_json::Map::new();
        selector.insert("shoal.dev/instance".into(), self.opts.instance.clone().into());
        selector.insert("shoal.dev/job".into(), dns_name(&job).into());
        selector.insert("shoal.dev/attempt".into(), attempt.to_string().into());
        let service: Service = serde_json::from_value(headless_service(meta.clone(), Value::Object(selector)))
            .map_err(|e| fail(Vec::new(), 0, ExecError::BadTask(format!("job {job}: the Service: {e}"))))?;
        let services = self.services();
        let joining = first.join.is_some();
        let created = match joining {
            true => {
                let name = name.clone();
                self.call("reading the attempt's Service", async move {
                    services.get(&name).await.map_err(|e| api_error("reading the attempt's Service", e))
                })
            }
            false => self.call("creating the Service", async move {
                services.create(&PostParams::default(), &service).await.map_err(|e| api_error("creating a Service", e))
            }),
        }
        .map_err(|e| fail(Vec::new(), 0, e))?;
        let uid = created.metadata.uid.unwrap_or_default();
        let owner = json!({
            "apiVersion": "v1", "kind": "Service", "name": name, "uid": uid,
            "controller": true, "blockOwnerDeletion": true,
        });
        if !joining {
            let mut secret_meta = meta;
            secret_meta["ownerReferences"] = json!([owner.clone()]);
            let sec: Secret = serde_json::from_value(secret(secret_meta, &first.secret))
                .map_err(|e| fail(Vec::new(), 0, ExecError::BadTask(format!("job {job}: the Secret: {e}"))))?;
            let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &self.namespace);
            self.call("creating the Secret", async move {
                secrets
                    .create(&PostParams::default(), &sec)
                    .await
                    .map(|_| ())
                    .map_err(|e| api_error("creating a Secret", e))
            })
            .map_err(|e| fail(Vec::new(), 0, e))?;
        }
        let mut started = Vec::with_capacity(launches.len());
        for l in launches {
            let pod = match self.pod(l, &owner).and_then(|v| {
                serde_json::from_value::<Pod>(v).map_err(|e| ExecError::BadTask(format!("job {job}: a Pod: {e}")))
            }) {
                Ok(p) => p,
                Err(e) => return Err(fail(started, l.rank, e)),
            };
            let pods = self.pods();
            let made = self.call("creating a Pod", async move {
                pods.create(&PostParams::default(), &pod).await.map_err(|e| api_error("creating a Pod", e))
            });
            match made {
                Ok(p) => started.push(Task {
                    job_id: l.job_id.clone(),
                    attempt: l.attempt,
                    rank: l.rank as i64,
                    host: l.node.clone(),
                    started_ms: Some(now_ms()),
                    external_id: p.metadata.name,
                    ..Task::default()
                }),
                Err(e) => return Err(fail(started, l.rank, e)),
            }
        }
        tracing::info!(job = %job, attempt, pods = started.len(), service = %name, "created the attempt's Pods");
        Ok(started)
    }

    /// Deletes a Pod (in the background: `stop` never waits).
    fn delete_pod(&self, name: &str, grace: u32) {
        let pods = self.pods();
        let name = name.to_owned();
        self.runtime.spawn(async move {
            let dp = DeleteParams { grace_period_seconds: Some(grace), ..DeleteParams::default() };
            match tokio::time::timeout(CALL_TIMEOUT, pods.delete(&name, &dp)).await {
                Ok(Ok(_)) => tracing::info!(pod = %name, grace, "deleted the Pod"),
                Ok(Err(kube::Error::Api(e))) if e.code == 404 => {}
                Ok(Err(e)) => tracing::warn!(pod = %name, error = %e, "deleting the Pod failed"),
                Err(_) => tracing::warn!(pod = %name, "deleting the Pod timed out"),
            }
        });
    }

    /// Deletes an attempt's Service; the cluster's garbage collector deletes what it owns.
    fn delete_attempt(&self, service: &str) {
        let services = self.services();
        let name = service.to_owned();
        self.runtime.spawn(delete_service(services, name));
    }

    /// Keeps the cache current from one watch of this instance's Pods (restarted with back-off when it fails).
    fn watch(&self) {
        let pods = self.pods();
        let cache = self.cache.clone();
        let config = watcher::Config::default().labels(&self.selector());
        self.runtime.spawn(async move {
            let mut stream = std::pin::pin!(kube::runtime::WatchStreamExt::default_backoff(watcher(pods, config)));
            let mut listing: HashMap<String, PodView> = HashMap::new();
            while let Some(ev) = stream.next().await {
                let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
                match ev {
                    Ok(watcher::Event::Init) => listing.clear(),
                    Ok(watcher::Event::InitApply(p)) => {
                        if let Some((name, v)) = view(&p) {
                            listing.insert(name, v);
                        }
                    }
                    Ok(watcher::Event::InitDone) => {
                        let now = Instant::now();
                        let old = std::mem::take(&mut c.pods);
                        for (name, v) in old {
                            if !listing.contains_key(&name) {
                                c.gone.insert(name, (v, now));
                            }
                        }
                        c.pods = std::mem::take(&mut listing);
                        c.healthy = true;
                        c.error = None;
                    }
                    Ok(watcher::Event::Apply(p)) => {
                        if let Some((name, v)) = view(&p) {
                            c.pods.insert(name, v);
                        }
                        c.healthy = c.healthy || c.error.is_some();
                        c.error = None;
                    }
                    Ok(watcher::Event::Delete(p)) => {
                        if let Some((name, v)) = view(&p) {
                            c.pods.remove(&name);
                            c.gone.insert(name, (v, Instant::now()));
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the watch of Pods failed; restarting it");
                        c.healthy = false;
                        c.error = Some(e.to_string());
                    }
                }
            }
        });
    }

    /// Every 5 s: removes the objects of attempts whose Pods all ended more than [`KEEP_FINISHED`] ago, and
    /// forgets Pods gone for more than [`TOMBSTONE`].
    fn janitor(&self) {
        let cache = self.cache.clone();
        let services = self.services();
        self.runtime.spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                let expired: Vec<String> = {
                    let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
                    if !c.healthy {
                        continue;
                    }
                    c.gone.retain(|_, (_, at)| at.elapsed() < TOMBSTONE);
                    let mut by_attempt: HashMap<String, bool> = HashMap::new();
                    for v in c.pods.values() {
                        let ended = matches!(v.phase.as_str(), "Succeeded" | "Failed");
                        let e = by_attempt.entry(KubeExecutor::attempt_name(&v.job, v.attempt)).or_insert(true);
                        *e = *e && ended;
                    }
                    let now = Instant::now();
                    c.ended_since.retain(|k, _| by_attempt.get(k) == Some(&true));
                    for (k, ended) in &by_attempt {
                        if *ended {
                            c.ended_since.entry(k.clone()).or_insert(now);
                        }
                    }
                    c.ended_since
                        .iter()
                        .filter(|(_, at)| at.elapsed() >= KEEP_FINISHED)
                        .map(|(k, _)| k.clone())
                        .collect()
                };
                for name in expired {
                    tracing::info!(service = %name, "every Pod of the attempt ended: removing its objects");
                    delete_service(services.clone(), name.clone()).await;
                    cache.lock().unwrap_or_else(|p| p.into_inner()).ended_since.remove(&name);
                }
            }
        });
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The watch's view of a task's Pod, live or gone; an error while the watch cannot be trusted.
    fn seen(&self, task: &Task) -> Result<Option<(String, PodView, bool)>> {
        let name = task.external_id.clone().unwrap_or_else(|| Self::pod_name(&task.job_id, task.attempt, task.rank));
        let c = self.cache();
        if !c.healthy {
            return Err(ExecError::Unavailable(match &c.error {
                Some(e) => format!("the watch of Pods fails: {e}"),
                None => "the watch of Pods has not listed them yet".into(),
            }));
        }
        if let Some(v) = c.pods.get(&name) {
            return Ok(Some((name, v.clone(), false)));
        }
        Ok(c.gone.get(&name).map(|(v, _)| (name.clone(), v.clone(), true)))
    }
}

async fn delete_service(services: Api<Service>, name: String) {
    let dp = DeleteParams { propagation_policy: Some(PropagationPolicy::Background), ..DeleteParams::default() };
    match tokio::time::timeout(CALL_TIMEOUT, services.delete(&name, &dp)).await {
        Ok(Ok(_)) => {
            tracing::info!(service = %name, "deleted the attempt's Service (and, by its owner references, the rest)")
        }
        Ok(Err(kube::Error::Api(e))) if e.code == 404 => {}
        Ok(Err(e)) => tracing::warn!(service = %name, error = %e, "deleting the Service failed"),
        Err(_) => tracing::warn!(service = %name, "deleting the Service timed out"),
    }
}

/// Runs `fut` on `rt` and waits for its answer, at most [`CALL_TIMEOUT`] (from any thread, also one of another
/// runtime).
fn call<T: Send + 'static>(
    rt: &tokio::runtime::Handle,
    what: &str,
    fut: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    rt.spawn(async move {
        let _ = tx.send(tokio::time::timeout(CALL_TIMEOUT, fut).await);
    });
    match rx.recv_timeout(CALL_TIMEOUT + Duration::from_secs(1)) {
        Ok(Ok(r)) => r,
        Ok(Err(_)) | Err(_) => Err(ExecError::Unavailable(format!(
            "Kubernetes API: {what}: no answer within {} s",
            CALL_TIMEOUT.as_secs()
        ))),
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// A Pod's name and what matters of it, when it is one of Shoal's (labels of a job, attempt and rank).
fn view(p: &Pod) -> Option<(String, PodView)> {
    let name = p.metadata.name.clone()?;
    let labels = p.metadata.labels.as_ref()?;
    let job = labels.get("shoal.dev/job")?.clone();
    let attempt = labels.get("shoal.dev/attempt")?.parse().ok()?;
    let rank = labels.get("shoal.dev/rank")?.parse().ok()?;
    let status = p.status.clone().unwrap_or_default();
    let spec = p.spec.clone().unwrap_or_default();
    let container = status.container_statuses.as_ref().and_then(|cs| cs.iter().find(|c| c.name == "worker")).cloned();
    let state = container.and_then(|c| c.state).unwrap_or_default();
    let terminated =
        state.terminated.map(|t| (t.exit_code, t.reason.unwrap_or_default(), t.message.unwrap_or_default()));
    let waiting = state.waiting.and_then(|w| Some((w.reason?, w.message.unwrap_or_default())));
    let unschedulable = status.conditions.as_ref().and_then(|cs| {
        cs.iter()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
            .map(|c| c.message.clone().unwrap_or_else(|| "no node can take it".into()))
    });
    let memory = spec
        .containers
        .first()
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("memory"))
        .map(|q| q.0.clone())
        .unwrap_or_default();
    Some((
        name,
        PodView {
            job,
            attempt,
            rank,
            node: spec.node_name.unwrap_or_default(),
            phase: status.phase.unwrap_or_default(),
            deleting: p.metadata.deletion_timestamp.is_some(),
            terminated,
            waiting,
            unschedulable,
            reason: status.reason.map(|r| (r, status.message.unwrap_or_default())),
            memory,
        },
    ))
}

/// How a task stands, from what was last seen of its Pod (`gone`: it was deleted since); `pulling` is how long it
/// has waited for its image.
fn judge(name: &str, v: &PodView, gone: bool, pulling: Option<Duration>) -> TaskStatus {
    if let Some((reason, message)) = &v.reason
        && v.phase == "Failed"
    {
        return TaskStatus::Lost(format!("pod {name}: {reason}: {}", message.trim()));
    }
    if let Some((code, reason, message)) = &v.terminated {
        if reason == "OOMKilled" {
            return TaskStatus::Lost(format!(
                "pod {name}: OOMKilled: its container went over its memory limit ({}) and was killed (exit {code})",
                if v.memory.is_empty() { "none set" } else { &v.memory }
            ));
        }
        if gone || matches!(v.phase.as_str(), "Succeeded" | "Failed") {
            if *code != 0 && !message.trim().is_empty() {
                tracing::info!(pod = name, code, reason = %reason, message = %message.trim(), "a worker container ended");
            }
            return TaskStatus::Exited(*code);
        }
    }
    if let Some((reason, message)) = &v.waiting {
        if FATAL_WAITING.contains(&reason.as_str()) {
            return TaskStatus::Lost(format!("pod {name}: {reason}: {}", message.trim()));
        }
        if PULL_WAITING.contains(&reason.as_str()) && pulling.is_some_and(|d| d >= PULL_GRACE) {
            return TaskStatus::Lost(format!(
                "pod {name}: {reason} for {} s: {}",
                pulling.map_or(0, |d| d.as_secs()),
                message.trim()
            ));
        }
    }
    match v.phase.as_str() {
        "Succeeded" => TaskStatus::Exited(0),
        "Failed" => TaskStatus::Lost(format!("pod {name} failed without a container status")),
        _ if gone => TaskStatus::Lost(format!("pod {name} was deleted before its worker ended")),
        _ => TaskStatus::Running,
    }
}

impl Executor for KubeExecutor {
    fn host(&self) -> &str {
        &self.host
    }

    /// The cluster's schedulable, ready Nodes with what they can allocate.
    fn nodes(&self) -> Result<Option<Vec<NodeInfo>>> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let list = self.call("listing Nodes", async move {
            nodes.list(&ListParams::default()).await.map_err(|e| api_error("listing Nodes", e))
        })?;
        let mut out = Vec::new();
        for n in list.items {
            let Some(name) = n.metadata.name.clone() else { continue };
            let spec = n.spec.clone().unwrap_or_default();
            let status = n.status.clone().unwrap_or_default();
            let ready = status
                .conditions
                .as_ref()
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
            if spec.unschedulable == Some(true) || !ready {
                tracing::info!(node = %name, "left out: not ready or cordoned");
                continue;
            }
            let alloc = status.allocatable.clone().or(status.capacity.clone()).unwrap_or_default();
            let get = |k: &str| alloc.get(k).map(|q| q.0.clone());
            let cpus_milli = get("cpu").and_then(|q| shoal_spec::parse_milli(&q).ok()).unwrap_or(0);
            let memory_bytes = get("memory").and_then(|q| shoal_spec::parse_bytes(&q).ok()).unwrap_or(0);
            let gpus = get("nvidia.com/gpu").and_then(|q| q.parse().ok()).unwrap_or(0);
            let labels = n.metadata.labels.clone().unwrap_or_default();
            let host = status
                .addresses
                .as_ref()
                .and_then(|a| a.iter().find(|a| a.type_ == "InternalIP").map(|a| a.address.clone()))
                .unwrap_or_else(|| name.clone());
            out.push(NodeInfo {
                name,
                host,
                cpus_milli,
                memory_bytes,
                gpus,
                gpu_kind: labels.get("nvidia.com/gpu.product").cloned().unwrap_or_else(|| "gpu".into()),
            });
        }
        if out.is_empty() {
            return Err(ExecError::Config(format!(
                "the cluster has no ready, schedulable Node for namespace {}",
                self.namespace
            )));
        }
        Ok(Some(out))
    }

    fn rendezvous(&self, job: &str, attempt: i64, _node: &str) -> Result<String> {
        let service = Self::attempt_name(job, attempt);
        Ok(format!("{}.{service}.{}.svc:{RENDEZVOUS_PORT}", Self::pod_name(job, attempt, 0), self.namespace))
    }

    fn task_dir(&self, dir: &Path) -> Result<()> {
        task_dir_for(dir, None)
    }

    fn give(&self, _path: &Path) -> Result<()> {
        Ok(())
    }

    fn start(&self, launch: &TaskLaunch) -> Result<Task> {
        self.create(std::slice::from_ref(launch))
            .map_err(|g| g.error)?
            .pop()
            .ok_or_else(|| ExecError::BadTask("no Pod was created".into()))
    }

    fn start_gang(&self, launches: &[TaskLaunch]) -> std::result::Result<Vec<Task>, GangError> {
        self.create(launches)
    }

    /// A newcomer is one more Pod of the attempt.
    fn joins_in_place(&self) -> bool {
        true
    }

    fn describe(&self, task: &Task) -> String {
        format!("pod {} on {}", task.external_id.as_deref().unwrap_or("?"), task.host)
    }

    fn probe(&self, task: &Task) -> Result<TaskStatus> {
        let Some((name, v, gone)) = self.seen(task)? else {
            let name = task.external_id.as_deref().unwrap_or("?");
            return Ok(TaskStatus::Lost(format!("pod {name} is gone from the cluster")));
        };
        let pulling = {
            let mut c = self.cache();
            match &v.waiting {
                Some((r, _)) if PULL_WAITING.contains(&r.as_str()) => {
                    Some(c.pulling_since.entry(name.clone()).or_insert_with(Instant::now).elapsed())
                }
                _ => {
                    c.pulling_since.remove(&name);
                    None
                }
            }
        };
        Ok(judge(&name, &v, gone, pulling))
    }

    fn notes(&self, task: &Task) -> Option<String> {
        let (name, v, gone) = self.seen(task).ok().flatten()?;
        if gone || v.terminated.is_some() {
            return None;
        }
        if let Some(why) = &v.unschedulable {
            return Some(format!("pod {name} waits: Unschedulable: {why}"));
        }
        v.waiting
            .as_ref()
            .filter(|(r, _)| r != "ContainerCreating")
            .map(|(reason, message)| format!("pod {name} waits: {reason}: {}", message.trim()))
    }

    fn stop(&self, task: &Task, how: Stop) {
        let name = task.external_id.clone().unwrap_or_else(|| Self::pod_name(&task.job_id, task.attempt, task.rank));
        let service = Self::attempt_name(&task.job_id, task.attempt);
        // Asked again within STOP_REPEAT the same way: already on its way (the Service once for all its ranks).
        let (pod_new, service_new) = {
            let mut stops = self.stops.lock().unwrap_or_else(|p| p.into_inner());
            stops.retain(|_, (at, _)| at.elapsed() < STOP_REPEAT);
            let mut fresh = |key: &str| {
                let again = stops.get(key).is_some_and(|(_, h)| *h == how);
                if !again {
                    stops.insert(key.to_owned(), (Instant::now(), how));
                }
                !again
            };
            (fresh(&name), fresh(&service))
        };
        // Shoal stops a gang whole: the attempt's Service goes too, and with it (by the garbage collector) its
        // Secret and any Pod left.
        if pod_new {
            self.delete_pod(&name, if how == Stop::Term { TERM_GRACE_SECONDS } else { 1 });
        }
        if service_new {
            self.delete_attempt(&service);
        }
    }

    /// Kubernetes' metrics API is optional: nothing is sampled.
    fn usage(&self, _task: &Task) -> Option<Usage> {
        None
    }

    /// The watch covers every Pod of this instance: nothing to do.
    fn adopt(&self, _task: &Task) {}

    /// Pods of this instance, not ended, that no adopted task owns (waiting up to [`CALL_TIMEOUT`] for the watch's
    /// first listing).
    fn strays(&self, adopted: &[Task]) -> Vec<Stray> {
        let deadline = Instant::now() + CALL_TIMEOUT;
        while !self.cache().healthy && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let owned: HashSet<String> = adopted
            .iter()
            .map(|t| t.external_id.clone().unwrap_or_else(|| Self::pod_name(&t.job_id, t.attempt, t.rank)))
            .collect();
        let c = self.cache();
        if !c.healthy {
            tracing::warn!("the watch of Pods has not listed them: strays are not looked for");
            return Vec::new();
        }
        c.pods
            .iter()
            .filter(|(name, v)| {
                !owned.contains(*name) && !v.deleting && !matches!(v.phase.as_str(), "Succeeded" | "Failed")
            })
            .map(|(name, v)| Stray { pid: 0, owner: 0, job_id: v.job.clone(), what: format!("pod {name}") })
            .collect()
    }

    fn kill_stray(&self, stray: &Stray) {
        if let Some(name) = stray.what.strip_prefix("pod ") {
            self.delete_pod(name, 1);
        }
    }

    fn log_path(&self, job: &str, attempt: i64, rank: i64) -> PathBuf {
        self.log_file(job, attempt, rank)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> PodView {
        PodView {
            job: "j".into(),
            attempt: 1,
            rank: 0,
            phase: "Running".into(),
            memory: "64Mi".into(),
            ..PodView::default()
        }
    }

    #[test]
    fn names_stay_dns_labels() {
        let long = "a".repeat(80);
        let pod = KubeExecutor::pod_name(&long, 123, 4095);
        assert!(pod.len() <= 63 && crate::k8s::is_dns_label(&pod), "{pod}");
        assert_eq!(KubeExecutor::pod_name("Mnist_7", 2, 1), "shoal-mnist-7-2-1");
    }

    #[test]
    fn a_pods_end_is_read_from_its_container() {
        let mut v = base();
        assert_eq!(judge("p", &v, false, None), TaskStatus::Running);
        v.phase = "Succeeded".into();
        v.terminated = Some((0, "Completed".into(), String::new()));
        assert_eq!(judge("p", &v, false, None), TaskStatus::Exited(0));
        v.phase = "Failed".into();
        v.terminated = Some((3, "Error".into(), String::new()));
        assert_eq!(judge("p", &v, false, None), TaskStatus::Exited(3));
        v.terminated = Some((137, "OOMKilled".into(), String::new()));
        let TaskStatus::Lost(why) = judge("p", &v, false, None) else { panic!("OOMKilled is a loss") };
        assert!(why.contains("OOMKilled") && why.contains("64Mi"), "{why}");
        let mut e = base();
        e.phase = "Failed".into();
        e.reason = Some(("Evicted".into(), "The node was low on resource: memory.".into()));
        let TaskStatus::Lost(why) = judge("p", &e, false, None) else { panic!("eviction is a loss") };
        assert!(why.contains("Evicted: The node was low"), "{why}");
    }

    #[test]
    fn waiting_pods_wait_unless_they_never_can_start() {
        let mut v = base();
        v.phase = "Pending".into();
        v.waiting = Some(("ImagePullBackOff".into(), "Back-off pulling image".into()));
        assert_eq!(judge("p", &v, false, Some(Duration::from_secs(5))), TaskStatus::Running);
        assert!(
            matches!(judge("p", &v, false, Some(PULL_GRACE)), TaskStatus::Lost(w) if w.contains("ImagePullBackOff"))
        );
        v.waiting = Some(("InvalidImageName".into(), "bad".into()));
        assert!(matches!(judge("p", &v, false, None), TaskStatus::Lost(w) if w.contains("InvalidImageName")));
        let mut gone = base();
        gone.phase = "Running".into();
        assert!(matches!(judge("p", &gone, true, None), TaskStatus::Lost(w) if w.contains("deleted")));
    }
}
