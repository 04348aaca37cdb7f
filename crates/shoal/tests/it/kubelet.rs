//! A stand-in for the kubelet, for the Kubernetes executor's tests against a real API server (no container
//! runtime exists here). It registers its Nodes, watches the Pods of one namespace, and for each Pod the cluster's
//! scheduler bound to one of its Nodes does what a kubelet would, with real processes:
//!
//! - runs the container's command as a local process in a network namespace of its own (a host of [`Hosts`]: its
//!   own address, the Pod's IP), under the Pod's hostname, with the Pod's environment (values, Secret keys, the
//!   Pod's name and IP), its PersistentVolumeClaims' volumes (`hostPath` PersistentVolumes, bind-mounted at the
//!   mount path when the paths differ), and `/etc/hosts` naming every Pod of the namespace under its Service (`HOST.SUBDOMAIN.NS.svc`, what
//!   cluster DNS answers for a headless Service);
//! - holds it to its memory limit with a memory cgroup: the kernel's OOM killer ends it, and the stand-in reports
//!   `OOMKilled`, as a kubelet does;
//! - an image it does not have (not in its list) is never pulled: the container waits with `ImagePullBackOff`;
//! - writes the Pod's status back through the API (Running with its IP; then Succeeded or Failed with the
//!   container's exit status and reason);
//! - on deletion sends SIGTERM to the container's first process, SIGKILL to all of them after the grace period,
//!   then removes the Pod (a delete with grace 0, as a kubelet confirms one).

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use serde_json::json;

use crate::hosts::Hosts;

/// Where the memory cgroups of Pods go (cgroup v1's memory controller).
const CGROUPS: &str = "/sys/fs/cgroup/memory/shoal-kubelet";

/// What the stand-in was started for.
#[derive(Debug, Clone)]
pub struct KubeletConfig {
    pub kubeconfig: PathBuf,
    pub namespace: String,
    /// Node names with CPUs and memory each offers (`"2"`, `"8Gi"`).
    pub nodes: Vec<(String, String, String)>,
    /// The images this "node" has; any other cannot be pulled.
    pub images: Vec<String>,
    /// `PATH` of the containers (the `shoal` in the image is the one built for the tests).
    pub path: String,
    /// Where containers' output goes (`NAME.log`).
    pub logs: PathBuf,
}

/// A Pod the stand-in started.
#[derive(Debug, Clone)]
pub struct Started {
    pub name: String,
    pub node: String,
    pub ip: String,
    /// The container's first process.
    pub pid: u32,
}

/// The running stand-in; dropped, it kills what it started and stops.
pub struct Kubelet {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub started: Arc<Mutex<Vec<Started>>>,
    /// This machine's address on the Pods' network (where they reach a server running here).
    pub head: String,
}

impl Kubelet {
    pub fn start(cfg: KubeletConfig) -> Kubelet {
        let (stop, stop_rx) = tokio::sync::oneshot::channel();
        let started = Arc::new(Mutex::new(Vec::new()));
        let log = started.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async move {
                let mut k = match State::new(cfg, log).await {
                    Ok(k) => k,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(k.hosts.link_this_machine()));
                k.run(stop_rx).await;
                k.shutdown();
            });
        });
        let head = match ready_rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Ok(head)) => head,
            Ok(Err(e)) => panic!("the stand-in kubelet could not start: {e}"),
            Err(_) => panic!("the stand-in kubelet did not start within 60 s"),
        };
        Kubelet { stop: Some(stop), thread: Some(thread), started, head }
    }

    pub fn started(&self) -> Vec<Started> {
        self.started.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A Pod's container, running.
struct Running {
    child: Child,
    cgroup: PathBuf,
    started_at: String,
    /// When it was sent SIGTERM for its deletion, and its grace period.
    term: Option<(Instant, Duration)>,
}

struct State {
    cfg: KubeletConfig,
    pods: Api<Pod>,
    client: kube::Client,
    hosts: Hosts,
    /// Pod → its host slot (taken when first seen, so that every Pod's name resolves once it starts).
    slots: HashMap<String, usize>,
    known: HashMap<String, Pod>,
    running: HashMap<String, Running>,
    /// Pods ended (or never to start) here.
    done: std::collections::HashSet<String>,
    log: Arc<Mutex<Vec<Started>>>,
}

const SLOTS: usize = 6;

fn now_rfc3339() -> String {
    let out = Command::new("date").args(["-u", "+%Y-%m-%dT%H:%M:%SZ"]).output().map(|o| o.stdout).unwrap_or_default();
    String::from_utf8_lossy(&out).trim().to_owned()
}

impl State {
    async fn new(cfg: KubeletConfig, log: Arc<Mutex<Vec<Started>>>) -> Result<State, String> {
        let kc = kube::config::Kubeconfig::read_from(&cfg.kubeconfig).map_err(|e| e.to_string())?;
        let config = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        let client = kube::Client::try_from(config).map_err(|e| e.to_string())?;
        let nodes: Api<Node> = Api::all(client.clone());
        for (name, cpu, memory) in &cfg.nodes {
            let node: Node = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Node",
                "metadata": { "name": name, "labels": { "kubernetes.io/hostname": name } },
            }))
            .map_err(|e| e.to_string())?;
            match nodes.create(&PostParams::default(), &node).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 409 => {}
                Err(e) => return Err(format!("registering node {name}: {e}")),
            }
            let status = json!({ "status": {
                "capacity": { "cpu": cpu, "memory": memory, "pods": "110" },
                "allocatable": { "cpu": cpu, "memory": memory, "pods": "110" },
                "conditions": [{ "type": "Ready", "status": "True", "reason": "KubeletReady",
                                 "message": "stand-in kubelet", "lastHeartbeatTime": now_rfc3339(),
                                 "lastTransitionTime": now_rfc3339() }],
                "addresses": [{ "type": "InternalIP", "address": "127.0.0.1" }, { "type": "Hostname", "address": name }],
            } });
            nodes
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
                .await
                .map_err(|e| format!("node {name} status: {e}"))?;
        }
        std::fs::create_dir_all(CGROUPS).map_err(|e| format!("{CGROUPS}: {e}"))?;
        std::fs::create_dir_all(&cfg.logs).map_err(|e| e.to_string())?;
        let pods = Api::namespaced(client.clone(), &cfg.namespace);
        Ok(State {
            hosts: Hosts::new(SLOTS, None),
            cfg,
            pods,
            client,
            slots: HashMap::new(),
            known: HashMap::new(),
            running: HashMap::new(),
            done: Default::default(),
            log,
        })
    }

    async fn run(&mut self, mut stop: tokio::sync::oneshot::Receiver<()>) {
        let mut stream = std::pin::pin!(watcher(self.pods.clone(), watcher::Config::default()));
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tokio::select! {
                _ = &mut stop => return,
                ev = stream.next() => match ev {
                    Some(Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p))) => {
                        if let Some(n) = p.metadata.name.clone() {
                            self.known.insert(n, p);
                        }
                    }
                    Some(Ok(watcher::Event::Delete(p))) => {
                        if let Some(n) = p.metadata.name.clone() {
                            self.known.remove(&n);
                            self.slots.remove(&n);
                        }
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        eprintln!("stand-in kubelet: watch: {e}");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    None => return,
                },
                _ = tick.tick() => {}
            }
            self.reconcile().await;
        }
    }

    fn free_slot(&self) -> Option<usize> {
        (0..SLOTS).find(|i| !self.slots.values().any(|s| s == i))
    }

    async fn reconcile(&mut self) {
        let names: Vec<String> = self.known.keys().cloned().collect();
        for name in names {
            if !self.slots.contains_key(&name)
                && !self.done.contains(&name)
                && let Some(s) = self.free_slot()
            {
                self.slots.insert(name.clone(), s);
            }
            let Some(pod) = self.known.get(&name).cloned() else { continue };
            let node = pod.spec.as_ref().and_then(|s| s.node_name.clone()).unwrap_or_default();
            let ours = self.cfg.nodes.iter().any(|(n, _, _)| *n == node);
            if pod.metadata.deletion_timestamp.is_some() {
                if let Some(r) = self.running.get_mut(&name) {
                    if r.term.is_none() {
                        let grace = pod.metadata.deletion_grace_period_seconds.unwrap_or(30).max(0) as u64;
                        // SAFETY: kill(2) on our own child.
                        unsafe { libc::kill(r.child.id() as i32, libc::SIGTERM) };
                        r.term = Some((Instant::now(), Duration::from_secs(grace)));
                    }
                } else if ours {
                    self.finalize(&name).await;
                }
                continue;
            }
            if ours && !self.running.contains_key(&name) && !self.done.contains(&name) {
                self.start_pod(&name, &pod, &node).await;
            }
        }
        // Ends, and kills past the grace period.
        let names: Vec<String> = self.running.keys().cloned().collect();
        for name in names {
            let Some(r) = self.running.get_mut(&name) else { continue };
            if let Some((at, grace)) = r.term
                && at.elapsed() >= grace
            {
                kill_cgroup(&r.cgroup);
            }
            let Ok(Some(st)) = r.child.try_wait() else { continue };
            // What else the container started goes with it.
            kill_cgroup(&r.cgroup);
            let oom = std::fs::read_to_string(r.cgroup.join("memory.oom_control"))
                .unwrap_or_default()
                .lines()
                .any(|l| l.strip_prefix("oom_kill ").is_some_and(|n| n.trim() != "0"));
            let code =
                st.code().unwrap_or_else(|| 128 + std::os::unix::process::ExitStatusExt::signal(&st).unwrap_or(0));
            let reason = if oom {
                "OOMKilled"
            } else if code == 0 {
                "Completed"
            } else {
                "Error"
            };
            let r = self.running.remove(&name).expect("running");
            let _ = std::fs::remove_dir(&r.cgroup);
            self.done.insert(name.clone());
            let status = json!({ "status": {
                "phase": if code == 0 { "Succeeded" } else { "Failed" },
                "containerStatuses": [{
                    "name": "worker", "ready": false, "restartCount": 0, "image": "", "imageID": "",
                    "state": { "terminated": { "exitCode": code, "reason": reason,
                        "startedAt": r.started_at, "finishedAt": now_rfc3339() } },
                }],
            } });
            if let Err(e) = self.pods.patch_status(&name, &PatchParams::default(), &Patch::Merge(&status)).await {
                eprintln!("stand-in kubelet: status of {name}: {e}");
            }
            self.slots.remove(&name);
            if self.known.get(&name).is_some_and(|p| p.metadata.deletion_timestamp.is_some()) {
                self.finalize(&name).await;
            }
        }
    }

    /// Confirms a deletion (what a kubelet does once the Pod's containers are gone).
    async fn finalize(&mut self, name: &str) {
        let dp = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
        match self.pods.delete(name, &dp).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => eprintln!("stand-in kubelet: deleting {name}: {e}"),
        }
        self.done.insert(name.to_owned());
        self.slots.remove(name);
    }

    async fn waiting(&self, name: &str, reason: &str, message: &str) {
        let status = json!({ "status": { "phase": "Pending", "containerStatuses": [{
            "name": "worker", "ready": false, "restartCount": 0, "image": "", "imageID": "",
            "state": { "waiting": { "reason": reason, "message": message } },
        }] } });
        if let Err(e) = self.pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await {
            eprintln!("stand-in kubelet: status of {name}: {e}");
        }
    }

    async fn start_pod(&mut self, name: &str, pod: &Pod, node: &str) {
        let Some(slot) = self.slots.get(name).copied() else { return };
        let spec = pod.spec.clone().unwrap_or_default();
        let Some(c) = spec.containers.first().cloned() else { return };
        let image = c.image.clone().unwrap_or_default();
        if !self.cfg.images.contains(&image) {
            let reason = "ImagePullBackOff";
            let already = pod
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .and_then(|cs| cs.first())
                .and_then(|c| c.state.as_ref()?.waiting.as_ref()?.reason.clone());
            if already.as_deref() != Some(reason) {
                self.waiting(name, reason, &format!("Back-off pulling image \"{image}\"")).await;
            }
            return;
        }
        let ip = self.hosts.addr(slot);
        let ns = self.cfg.namespace.clone();
        // Environment.
        let mut env: Vec<(String, String)> = vec![("PATH".into(), self.cfg.path.clone())];
        for e in c.env.clone().unwrap_or_default() {
            let value = if let Some(v) = e.value {
                v
            } else if let Some(from) = e.value_from {
                if let Some(r) = from.secret_key_ref {
                    let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &ns);
                    let got = secrets.get(&r.name).await.ok().and_then(|s| {
                        s.data.and_then(|d| d.get(&r.key).map(|b| String::from_utf8_lossy(&b.0).into_owned()))
                    });
                    match got {
                        Some(v) => v,
                        None => {
                            let msg = format!("secret \"{}\" key \"{}\" not found", r.name, r.key);
                            self.waiting(name, "CreateContainerConfigError", &msg).await;
                            return;
                        }
                    }
                } else if let Some(f) = from.field_ref {
                    match f.field_path.as_str() {
                        "metadata.name" => name.to_owned(),
                        "metadata.namespace" => ns.clone(),
                        "status.podIP" => ip.clone(),
                        "spec.nodeName" => node.to_owned(),
                        _ => String::new(),
                    }
                } else {
                    String::new()
                }
            } else {
                String::new()
            };
            env.push((e.name, value));
        }
        // Volumes.
        let mut binds: Vec<(PathBuf, String)> = Vec::new();
        for m in c.volume_mounts.clone().unwrap_or_default() {
            let vol = spec.volumes.as_ref().and_then(|vs| vs.iter().find(|v| v.name == m.name));
            let src = match vol {
                Some(v) if v.persistent_volume_claim.is_some() => {
                    let claim = v.persistent_volume_claim.as_ref().map(|p| p.claim_name.clone()).unwrap_or_default();
                    match self.claim_path(&claim).await {
                        Ok(d) => d,
                        Err(msg) => {
                            self.waiting(name, "CreateContainerConfigError", &msg).await;
                            return;
                        }
                    }
                }
                Some(v) if v.empty_dir.is_some() => {
                    let d = self.cfg.logs.join(format!("{name}-{}", m.name));
                    let _ = std::fs::create_dir_all(&d);
                    d
                }
                _ => {
                    let msg = format!("volume {:?}: only PersistentVolumeClaims and emptyDirs here", m.name);
                    self.waiting(name, "CreateContainerConfigError", &msg).await;
                    return;
                }
            };
            if src != Path::new(&m.mount_path) {
                binds.push((src, m.mount_path.clone()));
            }
        }
        // Names of the namespace's Pods under their Services.
        let mut hosts = String::from("127.0.0.1 localhost\n");
        for (other, p) in &self.known {
            let (Some(s), Some(slot)) = (p.spec.as_ref(), self.slots.get(other)) else { continue };
            let host = s.hostname.clone().unwrap_or_else(|| other.clone());
            let mut names = vec![host.clone()];
            if let Some(sub) = &s.subdomain {
                names.insert(0, format!("{host}.{sub}.{ns}.svc.cluster.local"));
                names.insert(1, format!("{host}.{sub}.{ns}.svc"));
            }
            hosts.push_str(&format!("{} {}\n", self.hosts.addr(*slot), names.join(" ")));
        }
        let etc = PathBuf::from("/etc/netns").join(self.hosts.ns(slot));
        let _ = std::fs::create_dir_all(&etc);
        if let Err(e) = std::fs::write(etc.join("hosts"), hosts) {
            eprintln!("stand-in kubelet: hosts of {name}: {e}");
        }
        // Memory limit.
        let cgroup = PathBuf::from(CGROUPS).join(format!("{ns}-{name}"));
        let _ = std::fs::create_dir_all(&cgroup);
        let limit = c
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("memory"))
            .and_then(|q| shoal_spec::parse_bytes(&q.0).ok());
        if let Some(l) = limit {
            let _ = std::fs::write(cgroup.join("memory.limit_in_bytes"), l.to_string());
        }
        // Join the cgroup (before `ip netns exec`, which mounts a /sys of the namespace's own), then the hostname,
        // the volumes, and the container's command.
        let mut script = String::from("hostname \"$0\" && ");
        for (src, dst) in &binds {
            script.push_str(&format!("mkdir -p '{dst}' && mount --bind '{}' '{dst}' && ", src.display()));
        }
        script.push_str("exec \"$@\"");
        let hostname = spec.hostname.clone().unwrap_or_else(|| name.to_owned());
        let mut argv: Vec<String> = c.command.clone().unwrap_or_default();
        argv.extend(c.args.clone().unwrap_or_default());
        if argv.is_empty() {
            self.waiting(name, "CreateContainerError", "no command (the stand-in has no image entrypoints)").await;
            return;
        }
        let out =
            match std::fs::OpenOptions::new().create(true).append(true).open(self.cfg.logs.join(format!("{name}.log")))
            {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("stand-in kubelet: log of {name}: {e}");
                    return;
                }
            };
        let err = out.try_clone().expect("log");
        let ip_bin = if Path::new("/usr/sbin/ip").exists() { "/usr/sbin/ip" } else { "/sbin/ip" };
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", "echo $$ > \"$0/cgroup.procs\" && exec \"$@\""])
            .arg(&cgroup)
            .args([ip_bin, "netns", "exec", &self.hosts.ns(slot), "unshare", "--uts", "--", "/bin/sh", "-c", &script])
            .arg(&hostname)
            .args(&argv)
            .env_clear()
            .envs(env)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                self.waiting(name, "CreateContainerError", &e.to_string()).await;
                return;
            }
        };
        let started_at = now_rfc3339();
        let pid = child.id();
        self.log.lock().unwrap_or_else(|p| p.into_inner()).push(Started {
            name: name.to_owned(),
            node: node.to_owned(),
            ip: ip.clone(),
            pid,
        });
        self.running.insert(name.to_owned(), Running { child, cgroup, started_at: started_at.clone(), term: None });
        let status = json!({ "status": {
            "phase": "Running", "podIP": ip, "podIPs": [{ "ip": ip }], "hostIP": "127.0.0.1", "startTime": started_at,
            "conditions": [
                { "type": "Initialized", "status": "True" }, { "type": "Ready", "status": "True" },
                { "type": "ContainersReady", "status": "True" }, { "type": "PodScheduled", "status": "True" },
            ],
            "containerStatuses": [{
                "name": "worker", "ready": true, "started": true, "restartCount": 0, "image": image, "imageID": "",
                "state": { "running": { "startedAt": started_at } },
            }],
        } });
        if let Err(e) = self.pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await {
            eprintln!("stand-in kubelet: status of {name}: {e}");
        }
    }

    /// The host directory behind a bound claim (its PersistentVolume's `hostPath`).
    async fn claim_path(&self, claim: &str) -> Result<PathBuf, String> {
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &self.cfg.namespace);
        let pvc = claims.get(claim).await.map_err(|e| format!("persistentvolumeclaim \"{claim}\": {e}"))?;
        let volume = pvc.spec.and_then(|s| s.volume_name).ok_or_else(|| format!("claim {claim} is not bound"))?;
        let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
        let pv = pvs.get(&volume).await.map_err(|e| format!("persistentvolume \"{volume}\": {e}"))?;
        pv.spec
            .and_then(|s| s.host_path)
            .map(|h| PathBuf::from(h.path))
            .ok_or_else(|| format!("persistentvolume {volume}: only hostPath volumes here"))
    }

    /// Kills every container it runs (the test is over).
    fn shutdown(&mut self) {
        for (_, mut r) in self.running.drain() {
            kill_cgroup(&r.cgroup);
            let _ = r.child.kill();
            let _ = r.child.wait();
            let _ = std::fs::remove_dir(&r.cgroup);
        }
        for i in 0..SLOTS {
            let _ = std::fs::remove_dir_all(PathBuf::from("/etc/netns").join(self.hosts.ns(i)));
        }
        let _ = std::io::stderr().flush();
    }
}

/// SIGKILL to every process of a cgroup.
fn kill_cgroup(cgroup: &Path) {
    for pid in std::fs::read_to_string(cgroup.join("cgroup.procs")).unwrap_or_default().lines() {
        if let Ok(p) = pid.trim().parse::<i32>() {
            // SAFETY: kill(2) on a process of a container this stand-in started.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
    }
}
