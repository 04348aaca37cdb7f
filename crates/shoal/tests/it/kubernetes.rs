//! The Kubernetes executor end to end, against a real control plane (`scripts/test-k8s.sh`: etcd,
//! kube-apiserver, kube-controller-manager and kube-scheduler v1.20.2) with the stand-in kubelet of
//! [`crate::kubelet`] playing two Nodes: a real `shoal server --executor kubernetes`, jobs submitted with the real
//! CLI, each attempt a headless Service and a Pod per rank that the cluster's scheduler binds and the stand-in runs
//! as real processes in network namespaces of their own.
//!
//! - A two-worker DDP job trains through two Pods, one per Node, and succeeds; its objects carry what they must
//!   (requests equal to limits, labels, owner references to the attempt's Service, the environment contract with
//!   the job secret from the Secret, the data volume, the Node); the time from `shoal submit` to every rank
//!   running is printed.
//! - Cancelling a job deletes its Pods, its Service and (by the garbage collector) its Secret.
//! - A Pod killed by the OOM killer is reported `OOMKilled` in the job's events, and the restart policy acts.
//! - A Pod no Node can take, and one whose image cannot be pulled, say so in the job's events while they wait.
//!
//! The set-up needs root (network namespaces, cgroups) and, on a fresh machine, Debian's mirror (the control plane
//! is built once from Debian's source package and cached): without them these tests fail, saying so; they never
//! skip. They run one at a time.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::kubelet::{Kubelet, KubeletConfig};
use crate::platform::{Platform, events, kinds, text};

/// How long the control plane's set-up may take (a cold one builds it: 6-10 minutes on 2 cores).
const SETUP: Duration = Duration::from_secs(1500);
const IMAGE: &str = "shoal:test";
const NODES: [&str; 2] = ["kube-node-0", "kube-node-1"];

struct Cluster {
    kubeconfig: PathBuf,
    api: String,
    ca: PathBuf,
}

fn cluster() -> (MutexGuard<'static, ()>, &'static Cluster) {
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    match CLUSTER.get_or_init(start_cluster) {
        Ok(c) => (guard, c),
        Err(e) => panic!("{e}"),
    }
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/test-k8s.sh")
}

fn start_cluster() -> Result<Cluster, String> {
    let t0 = Instant::now();
    let out = crate::platform::run_setup(&script(), SETUP, "the Kubernetes control plane")?;
    let stdout = text(&out.stdout);
    let ok = stdout.lines().find(|l| l.starts_with("OK "));
    let field = |k: &str| ok.and_then(|l| l.split_whitespace().find_map(|w| w.strip_prefix(k)).map(str::to_owned));
    match (out.status.success(), field("KUBECONFIG="), field("API=")) {
        (true, Some(kc), Some(api)) => {
            eprintln!("kubernetes: {} (set-up took {:.1} s here)", ok.unwrap_or(""), t0.elapsed().as_secs_f64());
            let ca = Path::new(&kc).parent().map(|d| d.join("pki/apiserver.crt")).unwrap_or_default();
            Ok(Cluster { kubeconfig: PathBuf::from(kc), api, ca })
        }
        _ => Err(format!(
            "the Kubernetes control plane could not be set up ({}): these tests need root and, once, Debian's \
             mirror (to build it); nothing was skipped.\nstdout:\n{stdout}\nstderr:\n{}",
            out.status,
            text(&out.stderr)
        )),
    }
}

impl Cluster {
    /// A request to the API server as its admin; the JSON answer and the HTTP status.
    fn request(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let mut c = Command::new("curl");
        c.args(["-sS", "-w", "\n%{http_code}", "-X", method, "--cacert"])
            .arg(&self.ca)
            .args(["-H", "Authorization: Bearer shoal-test-admin", "-H", "Content-Type: application/json"])
            .arg(format!("{}{path}", self.api));
        if let Some(b) = body {
            c.args(["-d", &b.to_string()]);
        }
        let out = c.output().expect("curl");
        let t = text(&out.stdout);
        let (body, code) = t.rsplit_once('\n').unwrap_or((&t, "0"));
        (code.trim().parse().unwrap_or(0), serde_json::from_str(body).unwrap_or(Value::Null))
    }

    fn get(&self, path: &str) -> Value {
        let (code, v) = self.request("GET", path, None);
        assert_eq!(code, 200, "GET {path}: {v}");
        v
    }

    fn items(&self, path: &str) -> Vec<Value> {
        self.get(path)["items"].as_array().cloned().unwrap_or_default()
    }
}

/// One test's world: a namespace, the stand-in kubelet for it, and a server whose executor puts Pods there.
struct KubePlatform {
    p: Platform,
    c: &'static Cluster,
    ns: String,
    kubelet: Option<Kubelet>,
    _one: MutexGuard<'static, ()>,
}

impl KubePlatform {
    fn new(tag: &str) -> KubePlatform {
        KubePlatform::with_image(tag, IMAGE)
    }

    /// A platform whose workers' image is `image` (the stand-in has only [`IMAGE`]).
    fn with_image(tag: &str, image: &str) -> KubePlatform {
        let (one, c) = cluster();
        let ns = format!("t-{tag}-{}", std::process::id());
        let (code, v) = c.request("POST", "/api/v1/namespaces", Some(&json!({ "metadata": { "name": ns } })));
        assert!(code == 201 || code == 409, "creating namespace {ns}: {v}");
        // The platform's data directory, on a hostPath PersistentVolume claimed as `shoal-data` (what the server and
        // its workers share).
        let data = std::env::temp_dir().join(format!("shoal-platform-test-{tag}-{}", std::process::id())).join("data");
        let pv = format!("{ns}-data");
        let (code, v) = c.request(
            "POST",
            "/api/v1/persistentvolumes",
            Some(&json!({
                "metadata": { "name": pv },
                "spec": {
                    "capacity": { "storage": "1Gi" },
                    "accessModes": ["ReadWriteMany"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "hostPath": { "path": data.display().to_string() },
                    "claimRef": { "namespace": ns, "name": "shoal-data" },
                },
            })),
        );
        assert!(code == 201 || code == 409, "creating PersistentVolume {pv}: {v}");
        let (code, v) = c.request(
            "POST",
            &format!("/api/v1/namespaces/{ns}/persistentvolumeclaims"),
            Some(&json!({
                "metadata": { "name": "shoal-data" },
                "spec": {
                    "accessModes": ["ReadWriteMany"],
                    "storageClassName": "",
                    "volumeName": pv,
                    "resources": { "requests": { "storage": "1Gi" } },
                },
            })),
        );
        assert!(code == 201 || code == 409, "creating the claim shoal-data: {v}");
        let bound = |c: &Cluster| {
            c.get(&format!("/api/v1/namespaces/{ns}/persistentvolumeclaims/shoal-data"))["status"]["phase"] == "Bound"
        };
        let t0 = Instant::now();
        while !bound(c) {
            assert!(t0.elapsed() < Duration::from_secs(60), "the claim shoal-data was not bound within 60 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        let logs = std::env::temp_dir().join(format!("shoal-kubelet-{tag}-{}", std::process::id()));
        let bin = Path::new(env!("CARGO_BIN_EXE_shoal")).parent().expect("bin dir").display().to_string();
        let kubelet = Kubelet::start(KubeletConfig {
            kubeconfig: c.kubeconfig.clone(),
            namespace: ns.clone(),
            nodes: NODES.iter().map(|n| ((*n).to_owned(), "2".to_owned(), "8Gi".to_owned())).collect(),
            images: vec![IMAGE.to_owned()],
            path: format!("{bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
            logs,
        });
        let kc = c.kubeconfig.display().to_string();
        // The Pods reach the server (their heartbeats, a regrouping group's store) at this machine's address on
        // their network.
        let advertise = format!("http://{}:{{port}}", kubelet.head);
        let args = [
            "--executor",
            "kubernetes",
            "--kubeconfig",
            &kc,
            "--namespace",
            &ns,
            "--image",
            image,
            "--advertise-url",
            &advertise,
        ];
        let p = Platform::with_server(tag, &args, &[("SHOAL_LOG", "shoal_control=info,shoal_exec=info,warn")]);
        assert_eq!(p.data(), data, "the claim stands for the platform's data directory");
        KubePlatform { p, c, ns, kubelet: Some(kubelet), _one: one }
    }

    fn kubelet(&self) -> &Kubelet {
        self.kubelet.as_ref().expect("kubelet")
    }

    fn pods(&self) -> Vec<Value> {
        self.c.items(&format!("/api/v1/namespaces/{}/pods", self.ns))
    }

    fn services(&self) -> Vec<Value> {
        self.c.items(&format!("/api/v1/namespaces/{}/services", self.ns))
    }

    fn secrets(&self) -> Vec<Value> {
        self.c
            .items(&format!("/api/v1/namespaces/{}/secrets", self.ns))
            .into_iter()
            .filter(|s| s["metadata"]["name"].as_str().is_some_and(|n| n.starts_with("shoal-")))
            .collect()
    }

    /// Waits until `f` holds of the namespace, naming `what` on a timeout.
    fn wait_for(&self, what: &str, f: impl Fn(&KubePlatform) -> bool) {
        self.p.wait(what, || f(self).then_some(()));
    }
}

impl Drop for KubePlatform {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "==== pods of {} ====\n{}",
                self.ns,
                serde_json::to_string_pretty(&self.pods()).unwrap_or_default()
            );
        }
        // The stand-in first (it kills what it runs), then the namespace with whatever is left in it.
        self.kubelet.take();
        let _ = self.c.request("DELETE", &format!("/api/v1/namespaces/{}", self.ns), None);
        let _ = self.c.request("DELETE", &format!("/api/v1/persistentvolumes/{}-data", self.ns), None);
    }
}

/// A digits MLP, 2 workers one per node, 1 CPU each.
fn job(name: &str, steps: usize, memory: &str, restart_max: u32) -> String {
    job_with(name, steps, memory, restart_max, "[256, 256]")
}

/// [`job`] with its hidden layers.
fn job_with(name: &str, steps: usize, memory: &str, restart_max: u32, hidden: &str) -> String {
    format!(
        r#"
name = "{name}"

[workers]
count = 2
spread = true

[resources]
cpus = 1
memory = "{memory}"

[fault_tolerance]
max_restarts = {restart_max}
backoff = "1s"

[train]
dataset = "digits"
global_batch = 128
steps = {steps}
seed = 0
optimizer = "adamw"
lr = 3e-3
warmup_steps = 10
log_every = 10

[train.model]
kind = "mlp"
hidden = {hidden}
"#
    )
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

fn env_of(pod: &Value) -> HashMap<String, Value> {
    pod["spec"]["containers"][0]["env"]
        .as_array()
        .map(|es| es.iter().map(|e| (e["name"].as_str().unwrap_or("").to_owned(), e.clone())).collect())
        .unwrap_or_default()
}

#[test]
fn kubernetes_runs_a_two_worker_ddp_job_as_pods_on_two_nodes() {
    let k = KubePlatform::new("k8s-ddp");
    let p = &k.p;
    // The scheduler's nodes are the cluster's.
    let n = p.cli_json(&["nodes", "--json"]);
    let mut names: Vec<&str> = n["nodes"].as_array().expect("nodes").iter().filter_map(|x| x["id"].as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, NODES, "shoal nodes shows the cluster's Nodes: {n}");
    for x in n["nodes"].as_array().expect("nodes") {
        assert_eq!(x["cpus"].as_f64(), Some(2.0), "{x}");
        assert_eq!(x["memory_bytes"].as_u64(), Some(8 << 30), "{x}");
    }

    let t0 = now_ms();
    let id = p.submit("ddp", &job("ddp", 400, "1GiB", 0));
    let pods = {
        let mut created_ms = None;
        let pods = p.wait(&format!("both Pods of {id} to run"), || {
            let st = p.try_status(&id).map(|v| v["state"].as_str().unwrap_or("").to_owned()).unwrap_or_default();
            assert!(!["failed", "cancelled", "succeeded"].contains(&st.as_str()), "job {id} ended {st} before running");
            let pods = k.pods();
            if created_ms.is_none() && pods.len() == 2 {
                created_ms = Some(now_ms());
            }
            (pods.len() == 2 && pods.iter().all(|x| x["status"]["phase"] == "Running")).then_some(pods)
        });
        let running_ms = now_ms();
        let v = p.try_status(&id).expect("status");
        let placed = v["events"]
            .as_array()
            .and_then(|es| es.iter().find(|e| e["kind"] == "placed"))
            .and_then(|e| e["time_ms"].as_i64())
            .unwrap_or_else(|| panic!("no placed event with a time: {v}"));
        eprintln!(
            "latency from shoal submit: placed by Shoal's scheduler {} ms; both Pods created (seen) {} ms; both Pods \
             Running (bound by kube-scheduler, started by the stand-in kubelet) {} ms",
            placed - t0,
            created_ms.map_or(-1, |c| c - t0),
            running_ms - t0
        );
        pods
    };

    // The objects.
    let services = k.services();
    assert_eq!(services.len(), 1, "one Service per attempt: {services:?}");
    let svc = &services[0];
    let svc_name = svc["metadata"]["name"].as_str().expect("service name").to_owned();
    assert_eq!(svc_name, format!("shoal-{id}-1"));
    assert_eq!(svc["spec"]["clusterIP"], "None", "headless: {svc}");
    let uid = svc["metadata"]["uid"].as_str().expect("uid").to_owned();
    let secrets = k.secrets();
    assert_eq!(secrets.len(), 1, "{secrets:?}");
    assert_eq!(secrets[0]["metadata"]["ownerReferences"][0]["uid"], uid.as_str());
    let mut nodes = Vec::new();
    for pod in &pods {
        let rank: usize =
            pod["metadata"]["labels"]["shoal.dev/rank"].as_str().and_then(|r| r.parse().ok()).expect("rank");
        assert_eq!(pod["metadata"]["name"], format!("{svc_name}-{rank}"));
        let labels = &pod["metadata"]["labels"];
        assert_eq!(labels["app.kubernetes.io/managed-by"], "shoal");
        assert_eq!(labels["shoal.dev/job"], id.as_str());
        assert_eq!(labels["shoal.dev/attempt"], "1");
        let owner = &pod["metadata"]["ownerReferences"][0];
        assert_eq!((owner["kind"].as_str(), owner["uid"].as_str()), (Some("Service"), Some(uid.as_str())), "{pod}");
        let c = &pod["spec"]["containers"][0];
        assert_eq!(c["image"], IMAGE);
        assert_eq!(c["resources"]["requests"], c["resources"]["limits"], "{c}");
        assert_eq!(c["resources"]["requests"], json!({ "cpu": "1", "memory": "1Gi" }), "{c}");
        let env = env_of(pod);
        assert_eq!(env["SHOAL_RANK"]["value"], rank.to_string());
        assert_eq!(env["SHOAL_WORLD_SIZE"]["value"], "2");
        assert_eq!(env["SHOAL_JOB_ID"]["value"], id.as_str());
        assert_eq!(
            env["SHOAL_RENDEZVOUS"]["value"],
            format!("{svc_name}-0.{svc_name}.{}.svc:29400", k.ns),
            "rank 0's name under the Service"
        );
        assert_eq!(env["SHOAL_JOB_SECRET"]["valueFrom"]["secretKeyRef"]["name"], svc_name.as_str());
        assert!(env["SHOAL_JOB_SECRET"].get("value").is_none(), "the secret is not in the Pod");
        let vol = &pod["spec"]["volumes"][0];
        assert_eq!(vol["persistentVolumeClaim"]["claimName"], "shoal-data");
        assert_eq!(c["volumeMounts"][0]["mountPath"], p.data().display().to_string());
        let affinity = &pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"];
        let wanted = affinity["nodeSelectorTerms"][0]["matchFields"][0]["values"][0].as_str().expect("node").to_owned();
        assert_eq!(pod["spec"]["nodeName"], wanted.as_str(), "bound where Shoal's scheduler placed it");
        nodes.push(wanted);
    }
    nodes.sort();
    assert_eq!(nodes, NODES, "one rank per Node");
    // Each rank ran in its own Pod's network namespace, with its own address.
    let started = k.kubelet().started();
    assert_eq!(started.len(), 2, "{started:?}");
    assert_ne!(started[0].ip, started[1].ip);
    for s in &started {
        let pod = pods.iter().find(|x| x["metadata"]["name"] == s.name.as_str()).expect("a started Pod is the job's");
        assert_eq!(pod["spec"]["nodeName"], s.node.as_str());
        assert_eq!(pod["status"]["podIP"], s.ip.as_str());
    }

    let v = p.wait_state(&id, "succeeded");
    for w in v["workers"].as_array().expect("workers") {
        assert_eq!((w["state"].as_str(), w["exit_code"].as_i64()), (Some("exited"), Some(0)), "{w}");
        assert!(NODES.contains(&w["node"].as_str().unwrap_or("")), "{w}");
    }
    // Training went through: metrics from rank 0 (through the data volume), a falling loss.
    let m = p.get(&format!("/api/v1/jobs/{id}/metrics?rank=0"));
    let losses: Vec<f64> = m["metrics"]
        .as_array()
        .map(|ps| ps.iter().filter_map(|x| x["data"]["loss"].as_f64()).collect())
        .unwrap_or_default();
    assert!(losses.len() >= 10, "metrics: {m}");
    assert!(losses[losses.len() - 1] < losses[0] * 0.5, "the loss fell: {losses:?}");
    let log = std::fs::read_to_string(p.job_dir(&id).join("attempt-1/rank-0.log")).unwrap_or_default();
    assert!(!log.is_empty(), "rank 0's log reached the data directory");
    assert!(kinds(&v).contains(&"started".to_owned()), "{v}");
}

#[test]
fn kubernetes_cancel_deletes_the_pods_service_and_secret() {
    let k = KubePlatform::new("k8s-cancel");
    let p = &k.p;
    let id = p.submit("long", &job("long", 1_000_000, "1GiB", 0));
    k.wait_for("both Pods to run", |k| {
        let pods = k.pods();
        pods.len() == 2 && pods.iter().all(|x| x["status"]["phase"] == "Running")
    });
    let pids: Vec<u32> = k.kubelet().started().iter().map(|s| s.pid).collect();
    let out = p.cli(&admin_token(p), &["cancel", &id]);
    assert!(out.status.success(), "shoal cancel: {}", text(&out.stderr));
    p.wait_state(&id, "cancelled");
    k.wait_for("the job's Pods, Service and Secret to be deleted", |k| {
        k.pods().is_empty() && k.services().is_empty() && k.secrets().is_empty()
    });
    for pid in pids {
        assert!(!crate::platform::alive(i64::from(pid)), "container process {pid} is gone");
    }
}

fn admin_token(p: &Platform) -> String {
    std::fs::read_to_string(p.data().join("admin.token")).expect("admin token").trim().to_owned()
}

#[test]
fn kubernetes_oom_killed_pod_is_reported_and_the_restart_policy_acts() {
    let k = KubePlatform::new("k8s-oom");
    let p = &k.p;
    // A worker of this model needs far more than 24 MiB (its parameters alone take 17 MiB, AdamW's state twice
    // that): the memory cgroup's OOM killer ends it.
    let id = p.submit("oom", &job_with("oom", 100, "24MiB", 1, "[2048, 2048]"));
    let v = p.wait_state(&id, "failed");
    let evs = events(&v);
    let oom: Vec<&(i64, String, String)> = evs.iter().filter(|(_, _, m)| m.contains("OOMKilled")).collect();
    assert!(!oom.is_empty(), "an event names OOMKilled: {evs:?}");
    assert!(oom.iter().any(|(_, _, m)| m.contains("24Mi")), "with the limit: {oom:?}");
    assert_eq!(kinds(&v).iter().filter(|k| *k == "restarted").count(), 1, "restarted once by policy: {evs:?}");
    assert_eq!(v["attempt"], 2, "{v}");
    assert!(v["reason"].as_str().is_some_and(|r| r.contains("OOMKilled")), "{v}");
}

#[test]
fn kubernetes_pods_that_wait_say_why() {
    let k = KubePlatform::new("k8s-wait");
    let p = &k.p;
    // Something outside Shoal takes kube-node-1's CPUs: Shoal's scheduler does not know, the cluster's does.
    let hog = json!({
        "metadata": { "name": "hog" },
        "spec": {
            "nodeName": "kube-node-1",
            "containers": [{ "name": "worker", "image": IMAGE, "command": ["sleep", "600"],
                             "resources": { "requests": { "cpu": "2" }, "limits": { "cpu": "2" } } }],
        },
    });
    let (code, r) = k.c.request("POST", &format!("/api/v1/namespaces/{}/pods", k.ns), Some(&hog));
    assert_eq!(code, 201, "{r}");
    let id = p.submit("wait", &job("wait", 200, "1GiB", 0));
    let v = p.wait_state_where(&id, "an event saying a Pod is unschedulable", |v| {
        events(v).iter().any(|(_, kd, m)| kd == "waiting" && m.contains("Unschedulable"))
    });
    let note = events(&v).into_iter().find(|(_, kd, _)| kd == "waiting").map(|(_, _, m)| m).unwrap_or_default();
    assert!(note.contains("Insufficient cpu"), "the cluster's scheduler's words: {note}");
    // The capacity comes back: the job runs and succeeds.

    let (code, r) = k.c.request("DELETE", &format!("/api/v1/namespaces/{}/pods/hog?gracePeriodSeconds=1", k.ns), None);
    assert_eq!(code, 200, "{r}");
    p.wait_state(&id, "succeeded");
}

/// What `shoal k8s manifests --format trainjob` prints runs as Kubeflow Trainer's torch runtime would run it: two
/// `node` processes given only the runtime's variables (`PET_*`) and the TrainJob's own environment, the spec from
/// its ConfigMap, train one model together (no cluster needed: the runtime's part is the variables).
#[test]
fn a_trainjobs_nodes_train_on_kubeflow_trainers_variables() {
    let dir = std::env::temp_dir().join(format!("shoal-trainjob-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let toml = dir.join("job.toml");
    std::fs::write(&toml, job("tj", 40, "1GiB", 0)).expect("spec");
    let out = crate::platform::shoal()
        .args(["k8s", "manifests", "--format", "trainjob", "--json", "--namespace", "ml"])
        .arg(&toml)
        .output()
        .expect("shoal k8s manifests");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let objs: Vec<Value> = serde_json::from_slice(&out.stdout).expect("JSON array");
    let kinds: Vec<&str> = objs.iter().filter_map(|o| o["kind"].as_str()).collect();
    assert_eq!(kinds, ["ConfigMap", "Secret", "TrainJob"]);
    let spec_path = dir.join("job.json");
    std::fs::write(&spec_path, objs[0]["data"]["job.json"].as_str().expect("job.json")).expect("spec file");
    let secret = objs[1]["stringData"]["secret"].as_str().expect("secret").to_owned();
    let trainer = &objs[2]["spec"]["trainer"];
    assert_eq!(trainer["numNodes"], 2);
    let command: Vec<String> = trainer["command"]
        .as_array()
        .expect("command")
        .iter()
        .map(|a| a.as_str().unwrap_or("").replace("/etc/shoal/job.json", &spec_path.display().to_string()))
        .collect();
    let port = crate::platform::free_port().to_string();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let out_dir = dir.join(format!("run-{rank}"));
            let args: Vec<String> = command[1..]
                .iter()
                .map(|a| if a == "/var/lib/shoal/run" { out_dir.display().to_string() } else { a.clone() })
                .collect();
            let mut c = crate::platform::shoal();
            c.args(&args).env_clear().env("PATH", std::env::var("PATH").unwrap_or_default());
            for e in trainer["env"].as_array().expect("env") {
                let name = e["name"].as_str().expect("name");
                let value = if e.get("valueFrom").is_some() {
                    secret.clone()
                } else {
                    e["value"].as_str().unwrap_or("").into()
                };
                c.env(name, value);
            }
            c.envs([
                ("PET_NNODES", "2".to_owned()),
                ("PET_NODE_RANK", rank.to_string()),
                ("PET_MASTER_ADDR", "127.0.0.1".to_owned()),
                ("PET_MASTER_PORT", port.clone()),
            ]);
            c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().expect("spawn a node")
        })
        .collect();
    for (rank, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().expect("node process");
        assert!(out.status.success(), "node {rank}: {}{}", text(&out.stdout), text(&out.stderr));
    }
    let summary = std::fs::read_to_string(dir.join("run-0/summary.json")).expect("rank 0's summary");
    let v: Value = serde_json::from_str(&summary).expect("summary JSON");
    assert_eq!(v["world_size"], 2, "the two nodes trained together: {v}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kubernetes_a_restarted_server_adopts_its_running_pods() {
    let mut k = KubePlatform::new("k8s-adopt");
    let id = k.p.submit("long", &job("long", 1_000_000, "1GiB", 0));
    k.wait_for("both Pods to run", |k| {
        let pods = k.pods();
        pods.len() == 2 && pods.iter().all(|x| x["status"]["phase"] == "Running")
    });
    let before: Vec<String> =
        k.pods().iter().filter_map(|x| x["metadata"]["name"].as_str().map(str::to_owned)).collect();
    k.p.kill_server();
    k.p.start_server(None);
    // The same attempt goes on in the same Pods: nothing was restarted, nothing taken for a stray.
    std::thread::sleep(Duration::from_secs(3));
    let v = k.p.try_status(&id).expect("status");
    assert_eq!((v["state"].as_str(), v["attempt"].as_i64()), (Some("running"), Some(1)), "{v}");
    let mut after: Vec<String> =
        k.pods().iter().filter_map(|x| x["metadata"]["name"].as_str().map(str::to_owned)).collect();
    let mut before = before;
    before.sort();
    after.sort();
    assert_eq!(before, after, "the same Pods run");
    assert!(k.pods().iter().all(|x| x["status"]["phase"] == "Running" && x["metadata"]["deletionTimestamp"].is_null()));
    // And it still controls them.
    let out = k.p.cli(&admin_token(&k.p), &["cancel", &id]);
    assert!(out.status.success(), "shoal cancel: {}", text(&out.stderr));
    k.p.wait_state(&id, "cancelled");
    k.wait_for("the Pods to be deleted", |k| k.pods().is_empty());
}

#[test]
fn kubernetes_an_image_that_cannot_be_pulled_is_said_and_cancel_still_cleans_up() {
    let k = KubePlatform::with_image("k8s-pull", "registry.example/nowhere:1");
    let p = &k.p;
    let id = p.submit("pull", &job("pull", 100, "1GiB", 0));
    let v = p.wait_state_where(&id, "an event saying the image cannot be pulled", |v| {
        events(v).iter().any(|(_, kd, m)| kd == "waiting" && m.contains("ImagePullBackOff"))
    });
    let note = events(&v).into_iter().find(|(_, kd, _)| kd == "waiting").map(|(_, _, m)| m).unwrap_or_default();
    assert!(note.contains("registry.example/nowhere:1"), "names the image: {note}");
    assert_eq!(v["state"], "running", "it waits (the pull may still succeed): {v}");
    let out = p.cli(&admin_token(p), &["cancel", &id]);
    assert!(out.status.success(), "shoal cancel: {}", text(&out.stderr));
    p.wait_state(&id, "cancelled");
    k.wait_for("the Pods and Service to be deleted", |k| k.pods().is_empty() && k.services().is_empty());
}

#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "slows the job's data: needs `--features shoal/failpoints`")]
fn kubernetes_elastic_job_regroups_in_place_and_a_newcomer_joins_as_one_more_pod() {
    let k = KubePlatform::new("k8s-elastic");
    let p = &k.p;
    let steps = 8000;
    let spec = job("stretchy", steps, "1GiB", 0)
        .replace("count = 2\n", "min = 1\nmax = 2\n")
        .replace("max_restarts = 0\n", "policy = \"elastic\"\nmax_restarts = 0\n")
        .replace("[train]\n", "[env]\nSHOAL_FAULT_DATA_DELAY = \"5ms\"\n[train]\n");
    let id = p.submit("stretchy", &spec);
    p.wait_state_where(&id, "training past step 100", |v| v["last_metrics"]["step"].as_u64().is_some_and(|s| s > 100));
    let started = k.kubelet().started();
    let container = |rank: usize| {
        started
            .iter()
            .find(|s| s.name.ends_with(&format!("-{rank}")))
            .unwrap_or_else(|| panic!("no Pod of rank {rank}: {started:?}"))
            .pid
    };
    // The training process: the child of the Pod's wrapper.
    let children = |pid: u32| -> Vec<i32> {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|c| c.parse().ok())
            .collect()
    };
    let (first, victim) = (children(container(0)), children(container(1)));
    assert!(!first.is_empty() && !victim.is_empty(), "training processes: {first:?} {victim:?}");
    for pid in &victim {
        // SAFETY: kill(2) on rank 1's training process, which the stand-in kubelet started for this test.
        assert_eq!(unsafe { libc::kill(*pid, libc::SIGKILL) }, 0, "kill rank 1's training process {pid}");
    }

    let grown = p.wait_state_where(&id, "regrouped in place twice", |v| {
        events(v).iter().filter(|e| e.1 == "regrouped").count() >= 2
            && v["workers"].as_array().is_some_and(|w| w.len() == 2)
    });
    let said: Vec<String> = events(&grown).into_iter().filter(|e| e.1 == "regrouped").map(|e| e.2).collect();
    assert!(said[0].contains("rank 1 exited with status 137") && said[0].contains("survivors (task 0)"), "{said:?}");
    assert!(said[1].contains("grows in place from 1 to 2 workers") && said[1].contains("task 2 joins"), "{said:?}");
    assert_eq!(grown["attempt"].as_i64(), Some(1), "{grown}");
    assert_eq!(children(container(0)), first, "the survivor kept its training process");
    // The newcomer is one more Pod of the attempt, owned by its Service.
    let newcomer = format!("shoal-{id}-1-2");
    k.wait_for("the newcomer's Pod", |k| k.pods().iter().any(|x| x["metadata"]["name"] == newcomer.as_str()));
    let pod = k.pods().into_iter().find(|x| x["metadata"]["name"] == newcomer.as_str()).expect("the newcomer's Pod");
    assert_eq!(pod["metadata"]["ownerReferences"][0]["kind"], "Service", "{pod}");
    let env = env_of(&pod);
    assert_eq!(env.get("SHOAL_GENERATION").map(|e| e["value"].clone()), Some(json!("2")), "{pod}");

    let v = p.wait_state(&id, "succeeded");
    assert_eq!((v["attempt"].as_i64(), v["restarts"].as_i64()), (Some(1), Some(0)), "{}", v["events"]);
    assert_eq!(v["summary"]["steps"], steps, "{}", v["summary"]);
    assert_eq!(v["summary"]["world_size"], 2, "{}", v["summary"]);
}
