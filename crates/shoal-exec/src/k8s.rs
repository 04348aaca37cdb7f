//! The Kubernetes objects that run a job, as `serde_json::Value`s: `shoal k8s manifests` prints them (for GitOps),
//! and a Kubernetes executor would create the same. Pure: no IO, no client; the job secret is passed in.
//!
//! - a ConfigMap `shoal-<name>` holding the spec's JSON wire form as `job.json`;
//! - a Secret `shoal-<name>` holding the job secret;
//! - a headless Service `shoal-<name>` over the job's pods, so that rank 0 (which hosts the rendezvous store) is
//!   reachable as `shoal-<name>-0.shoal-<name>.<namespace>.svc`;
//! - one Pod `shoal-<name>-<rank>` per rank running `shoal worker` on the mounted spec, with the environment
//!   contract written by `TaskEnv::vars` (the job secret taken from the Secret) and the job's own `[env]`, and
//!   requests equal to limits from `[resources]`.
//!
//! [`to_yaml`] writes such values as block-style YAML.

use serde_json::{Map, Value, json};
use shoal_comm::env::{TaskEnv, var};
use shoal_spec::{JobSpec, SpecError};

/// The port rank 0 hosts the rendezvous store on.
pub const RENDEZVOUS_PORT: u16 = 29400;
/// Where the spec is mounted in a worker's container, and its file name there.
pub const SPEC_DIR: &str = "/etc/shoal";
pub const SPEC_FILE: &str = "job.json";
/// The worker's output directory (an emptyDir).
pub const RUN_DIR: &str = "/var/lib/shoal/run";
/// The key of the job secret in the job's Secret.
pub const SECRET_KEY: &str = "secret";
/// The longest job part of an object's name (`shoal-<name>-<rank>` stays a 63-character DNS label).
pub const MAX_NAME: usize = 50;

/// What the objects are built from.
#[derive(Debug, Clone, Copy)]
pub struct JobObjects<'a> {
    /// The job's id, written into the contract (`SHOAL_JOB_ID`).
    pub job_id: &'a str,
    pub spec: &'a JobSpec,
    /// The spec's JSON wire form (`serde_json::to_string(spec)`), which the workers read.
    pub spec_json: &'a str,
    pub namespace: &'a str,
    pub image: &'a str,
    /// The number of ranks.
    pub world_size: usize,
    /// The job secret, stored in the Secret (never in a pod's spec).
    pub secret: &'a str,
}

/// A job's name as a DNS-1123 label part: lowercase, `[a-z0-9-]` (anything else becomes `-`), no `-` at either
/// end, at most [`MAX_NAME`] characters; `job` when nothing is left.
pub fn dns_name(name: &str) -> String {
    let mapped: String = name
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_lowercase() || c.is_ascii_digit() { c } else { '-' })
        .collect();
    let cut: String = mapped.trim_matches('-').chars().take(MAX_NAME).collect();
    let cut = cut.trim_end_matches('-');
    if cut.is_empty() { "job".to_owned() } else { cut.to_owned() }
}

/// Whether `s` is a DNS-1123 label (a namespace's name, for one).
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Whether `s` may be a label's value.
fn is_label_value(s: &str) -> bool {
    s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.bytes().next().is_none_or(|b| b.is_ascii_alphanumeric())
        && s.bytes().last().is_none_or(|b| b.is_ascii_alphanumeric())
}

fn spec_error(path: &str, message: String) -> SpecError {
    SpecError { origin: String::new(), path: path.to_owned(), message, line: None, column: None }
}

impl JobObjects<'_> {
    /// `shoal-<name>`: the ConfigMap's, the Secret's and the Service's name.
    pub fn base_name(&self) -> String {
        format!("shoal-{}", dns_name(&self.spec.name))
    }

    /// Rank `rank`'s Pod name (and hostname).
    pub fn pod_name(&self, rank: usize) -> String {
        format!("{}-{rank}", self.base_name())
    }

    /// `host:port` of the rendezvous store: rank 0's name under the headless Service.
    pub fn rendezvous(&self) -> String {
        format!("{}.{}.{}.svc:{RENDEZVOUS_PORT}", self.pod_name(0), self.base_name(), self.namespace)
    }

    fn labels(&self) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("app.kubernetes.io/name".into(), "shoal".into());
        m.insert("app.kubernetes.io/component".into(), "worker".into());
        m.insert("shoal.dev/job".into(), dns_name(&self.spec.name).into());
        m
    }

    fn metadata(&self, name: String) -> Value {
        json!({ "name": name, "namespace": self.namespace, "labels": self.labels() })
    }

    /// Every object, in the order to apply them: ConfigMap, Secret, Service, then the Pods by rank. Errors (with a
    /// key path, no origin) for what a pod cannot ask for: a share of a GPU, a queue that is no label value.
    pub fn objects(&self) -> Result<Vec<Value>, SpecError> {
        let mut out = vec![self.config_map(), self.secret(), self.service()];
        for rank in 0..self.world_size {
            out.push(self.pod(rank)?);
        }
        Ok(out)
    }

    /// The objects that run the job under Kubeflow Trainer v2 instead of as bare Pods: the ConfigMap, the Secret,
    /// and a `TrainJob` (`trainer.kubeflow.org/v1alpha1`) on the `torch-distributed` runtime with one process per
    /// node, whose variables (`PET_NODE_RANK`, `PET_NNODES`, `PET_MASTER_ADDR`, `PET_MASTER_PORT`) the worker reads
    /// in place of Shoal's contract; the spec and an output directory reach the `node` container through
    /// `podSpecOverrides`.
    pub fn trainjob_objects(&self) -> Result<Vec<Value>, SpecError> {
        Ok(vec![self.config_map(), self.secret(), self.train_job()?])
    }

    pub fn train_job(&self) -> Result<Value, SpecError> {
        let mut meta = self.metadata(self.base_name());
        if let Some(q) = self.queue_label()? {
            meta["labels"]["kueue.x-k8s.io/queue-name"] = q.into();
        }
        let c = self.task_env(0);
        let mut vars: Vec<(String, String)> = vec![
            (var::JOB_ID.to_owned(), c.job_id.clone()),
            (var::JOB_SECRET.to_owned(), String::new()),
            (var::RAYON_THREADS.to_owned(), c.threads.unwrap_or(1).to_string()),
            (var::OMP_THREADS.to_owned(), c.threads.unwrap_or(1).to_string()),
        ];
        vars.extend(self.spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
        Ok(json!({
            "apiVersion": "trainer.kubeflow.org/v1alpha1",
            "kind": "TrainJob",
            "metadata": meta,
            "spec": {
                "runtimeRef": { "name": "torch-distributed" },
                "trainer": {
                    "image": self.image,
                    "command": ["shoal", "worker", "--output", RUN_DIR, format!("{SPEC_DIR}/{SPEC_FILE}")],
                    "numNodes": self.world_size,
                    "numProcPerNode": 1,
                    "resourcesPerNode": self.resources()?,
                    "env": env_values(vars, &self.base_name()),
                },
                "podSpecOverrides": [{
                    "targetJobs": [{ "name": "node" }],
                    "volumes": [
                        { "name": "spec", "configMap": { "name": self.base_name() } },
                        { "name": "run", "emptyDir": {} },
                    ],
                    "containers": [{
                        "name": "node",
                        "volumeMounts": [
                            { "name": "spec", "mountPath": SPEC_DIR, "readOnly": true },
                            { "name": "run", "mountPath": RUN_DIR },
                        ],
                    }],
                }],
            },
        }))
    }

    /// Kueue's label value for the job's queue (`None` for `default`).
    fn queue_label(&self) -> Result<Option<String>, SpecError> {
        if self.spec.queue == "default" {
            return Ok(None);
        }
        if !is_label_value(&self.spec.queue) {
            return Err(spec_error(
                "queue",
                format!(
                    "{:?} cannot be a Kubernetes label value (at most 63 characters, starting and ending with a \
                     letter or digit)",
                    self.spec.queue
                ),
            ));
        }
        Ok(Some(self.spec.queue.clone()))
    }

    pub fn config_map(&self) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": self.metadata(self.base_name()),
            "data": { SPEC_FILE: self.spec_json },
        })
    }

    pub fn secret(&self) -> Value {
        secret(self.metadata(self.base_name()), self.secret)
    }

    pub fn service(&self) -> Value {
        let selector = json!({ "shoal.dev/job": dns_name(&self.spec.name) });
        headless_service(self.metadata(self.base_name()), selector)
    }

    /// The contract rank `rank` gets (the secret included; [`JobObjects::pod`] takes it from the Secret instead).
    pub fn task_env(&self, rank: usize) -> TaskEnv {
        let r = &self.spec.resources;
        TaskEnv {
            job_id: self.job_id.to_owned(),
            rank,
            world_size: self.world_size,
            // One rank per pod.
            local_rank: 0,
            local_world_size: 1,
            rendezvous: self.rendezvous(),
            // No store runs beside the pods: rank 0 hosts it.
            host_store: true,
            secret: self.secret.to_owned(),
            master_addr: format!("{}.{}.{}.svc", self.pod_name(0), self.base_name(), self.namespace),
            master_port: RENDEZVOUS_PORT,
            attempt: None,
            exit_file: None,
            server_data: None,
            server: None,
            server_ca: None,
            threads: Some(r.cpus.div_ceil(1000).max(1) as usize),
            // The device plugin says which GPUs a pod that asked for some sees; one that asked none sees none.
            gpus: if r.gpus > 0 { None } else { Some(String::new()) },
            join: None,
        }
    }

    /// Requests (equal to the limits) from `[resources]`.
    pub fn resources(&self) -> Result<Value, SpecError> {
        let r = &self.spec.resources;
        resources(r.cpus, r.memory, r.gpus).map_err(|m| spec_error("resources.gpus", m))
    }

    pub fn pod(&self, rank: usize) -> Result<Value, SpecError> {
        let mut labels = self.labels();
        labels.insert("shoal.dev/rank".into(), rank.to_string().into());
        if let Some(q) = self.queue_label()? {
            labels.insert("kueue.x-k8s.io/queue-name".into(), q.into());
        }
        let job_env: Vec<(String, String)> = self.spec.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let env = env_values(crate::executor::task_env(&self.task_env(rank), &job_env), &self.base_name());
        let name = self.pod_name(rank);
        Ok(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": { "name": name, "namespace": self.namespace, "labels": labels },
            "spec": {
                "hostname": name,
                "subdomain": self.base_name(),
                "restartPolicy": "Never",
                "containers": [{
                    "name": "worker",
                    "image": self.image,
                    "command": ["shoal", "worker", "--output", RUN_DIR, format!("{SPEC_DIR}/{SPEC_FILE}")],
                    "env": env,
                    "ports": [{ "name": "rendezvous", "containerPort": RENDEZVOUS_PORT }],
                    "resources": self.resources()?,
                    "volumeMounts": [
                        { "name": "spec", "mountPath": SPEC_DIR, "readOnly": true },
                        { "name": "run", "mountPath": RUN_DIR },
                    ],
                }],
                "volumes": [
                    { "name": "spec", "configMap": { "name": self.base_name() } },
                    { "name": "run", "emptyDir": {} },
                ],
            },
        }))
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Pieces shared with the Kubernetes executor

/// A Secret holding the job secret under [`SECRET_KEY`].
pub(crate) fn secret(metadata: Value, secret: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": "Opaque",
        "stringData": { SECRET_KEY: secret },
    })
}

/// A headless Service over the Pods `selector` picks, publishing them before they are ready (ranks resolve rank 0
/// while it starts), with the rendezvous port.
pub(crate) fn headless_service(metadata: Value, selector: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": true,
            "selector": selector,
            "ports": [{ "name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT }],
        },
    })
}

/// A container's requests, equal to its limits: CPUs in thousandths, memory in bytes, GPUs in thousandths (whole
/// ones only: `nvidia.com/gpu` counts devices).
pub(crate) fn resources(cpus_milli: u64, memory_bytes: u64, gpus_milli: u64) -> Result<Value, String> {
    let mut m = Map::new();
    m.insert("cpu".into(), format!("{cpus_milli}m").into());
    m.insert("memory".into(), memory_quantity(memory_bytes).into());
    if gpus_milli > 0 {
        if !gpus_milli.is_multiple_of(1000) {
            return Err(format!(
                "{} GPUs: a Kubernetes pod asks for whole GPUs (nvidia.com/gpu); ask for 1 or more",
                gpus_milli as f64 / 1000.0
            ));
        }
        m.insert("nvidia.com/gpu".into(), (gpus_milli / 1000).to_string().into());
    }
    Ok(json!({ "requests": m.clone(), "limits": m }))
}

/// Bytes as a Kubernetes quantity: `Gi` or `Mi` when exact, else a plain number.
pub(crate) fn memory_quantity(bytes: u64) -> String {
    if bytes > 0 && bytes.is_multiple_of(1 << 30) {
        format!("{}Gi", bytes >> 30)
    } else if bytes > 0 && bytes.is_multiple_of(1 << 20) {
        format!("{}Mi", bytes >> 20)
    } else {
        bytes.to_string()
    }
}

/// A container's `env`, in order: every variable by value except the job secret, taken from the Secret
/// `secret_name`.
pub(crate) fn env_values(vars: Vec<(String, String)>, secret_name: &str) -> Vec<Value> {
    vars.into_iter()
        .map(|(name, value)| {
            if name == var::JOB_SECRET {
                json!({
                    "name": name,
                    "valueFrom": { "secretKeyRef": { "name": secret_name, "key": SECRET_KEY } },
                })
            } else {
                json!({ "name": name, "value": value })
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------------------------
// YAML

/// One document in block style: mappings as `key: value`, sequences as `- item`, empty ones as `{}` and `[]`,
/// strings plain unless YAML would read them as something else (then JSON-style double-quoted, which is YAML too).
pub fn to_yaml(v: &Value) -> String {
    let mut out = String::new();
    match v {
        Value::Object(m) if !m.is_empty() => write_map(&mut out, m, 0),
        Value::Array(a) if !a.is_empty() => write_seq(&mut out, a, 0),
        _ => {
            out.push_str(&scalar(v));
            out.push('\n');
        }
    }
    out
}

/// Documents separated by `---` lines.
pub fn to_yaml_stream(docs: &[Value]) -> String {
    docs.iter().map(to_yaml).collect::<Vec<_>>().join("---\n")
}

fn is_block(v: &Value) -> bool {
    matches!(v, Value::Object(m) if !m.is_empty()) || matches!(v, Value::Array(a) if !a.is_empty())
}

fn write_map(out: &mut String, m: &Map<String, Value>, indent: usize) {
    for (i, (k, v)) in m.iter().enumerate() {
        // The first key of a sequence item follows its `- ` (already written).
        if i > 0 || !out.ends_with("- ") {
            out.push_str(&" ".repeat(indent));
        }
        out.push_str(&string(k));
        out.push(':');
        write_value(out, v, indent);
    }
}

fn write_seq(out: &mut String, a: &[Value], indent: usize) {
    for (i, v) in a.iter().enumerate() {
        if i > 0 || !out.ends_with("- ") {
            out.push_str(&" ".repeat(indent));
        }
        out.push('-');
        match v {
            Value::Object(m) if !m.is_empty() => {
                out.push(' ');
                write_map(out, m, indent + 2);
            }
            Value::Array(inner) if !inner.is_empty() => {
                out.push(' ');
                write_seq(out, inner, indent + 2);
            }
            _ => {
                out.push(' ');
                out.push_str(&scalar(v));
                out.push('\n');
            }
        }
    }
}

/// After `key:`: a scalar on the same line, a collection on the lines below, indented by two.
fn write_value(out: &mut String, v: &Value, indent: usize) {
    if is_block(v) {
        out.push('\n');
        match v {
            Value::Object(m) => write_map(out, m, indent + 2),
            Value::Array(a) => write_seq(out, a, indent + 2),
            _ => {}
        }
    } else {
        out.push(' ');
        out.push_str(&scalar(v));
        out.push('\n');
    }
}

fn scalar(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => {
            let s = n.to_string();
            // YAML 1.1 reads `1e-05` as a string: a float needs its dot.
            if n.is_f64() && !s.contains('.') && s.contains('e') { s.replacen('e', ".0e", 1) } else { s }
        }
        Value::String(s) => string(s),
        Value::Object(_) => "{}".into(),
        Value::Array(_) => "[]".into(),
    }
}

/// Words YAML 1.1 reads as booleans or null.
const RESERVED_WORDS: [&str; 11] = ["y", "n", "yes", "no", "true", "false", "on", "off", "null", "~", ""];

/// A string as a YAML scalar: plain when it reads back as the same string, else double-quoted.
pub fn string(s: &str) -> String {
    let first = s.chars().next();
    let needs_quotes = RESERVED_WORDS.contains(&s.to_ascii_lowercase().as_str())
        || s.starts_with(char::is_whitespace)
        || s.ends_with(char::is_whitespace)
        // Numbers (and dates, times, `.inf`, `-1`, `+1`), indicators and anything that starts like them.
        || first.is_some_and(|c| c.is_ascii_digit() || "-+.?:,[]{}#&*!|>'\"%@`=<~".contains(c))
        || s.contains(':')
        || s.contains('#')
        || s.chars().any(|c| c.is_control() || !printable(c) || c == '\\');
    if !needs_quotes {
        return s.to_owned();
    }
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for c in s.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            '\t' => q.push_str("\\t"),
            '\r' => q.push_str("\\r"),
            c if c.is_control() || !printable(c) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    q.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

/// YAML's printable characters, less the line and paragraph separators (escaped too, as breaks in YAML 1.1).
fn printable(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r' | ' '..='~' | '\u{a0}'..='\u{d7ff}' | '\u{e000}'..='\u{fffd}' | '\u{10000}'..)
        && !matches!(c, '\u{2028}' | '\u{2029}' | '\u{feff}')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spec with `toml` (top-level keys, then tables) before its `[train]`.
    fn spec(toml: &str) -> JobSpec {
        let train = "[train]\ndataset = \"digits\"\nglobal_batch = 64\nsteps = 10\nlr = 0.01\n\
                     [train.model]\nkind = \"mlp\"\nhidden = [8]\n";
        match shoal_spec::parse_job(&format!("name = \"My_Job.v2\"\n{toml}\n{train}"), "job.toml") {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        }
    }

    fn objects(spec: &JobSpec, n: usize) -> Result<Vec<Value>, SpecError> {
        let text = serde_json::to_string(spec).unwrap_or_default();
        JobObjects {
            job_id: "my-job-v2",
            spec,
            spec_json: &text,
            namespace: "ml",
            image: "registry.example/shoal:1",
            world_size: n,
            secret: "s3cret",
        }
        .objects()
    }

    fn env_of(pod: &Value) -> Vec<Value> {
        pod["spec"]["containers"][0]["env"].as_array().cloned().unwrap_or_default()
    }

    #[test]
    fn names_are_dns_labels() {
        assert_eq!(dns_name("My_Job.v2"), "my-job-v2");
        assert_eq!(dns_name("--x--"), "x");
        assert_eq!(dns_name("___"), "job");
        let long = dns_name(&format!("{}-b", "a".repeat(49)));
        assert_eq!(long, "a".repeat(49));
        assert!(is_dns_label("ml-team") && !is_dns_label("ML") && !is_dns_label("-x") && !is_dns_label(""));
    }

    #[test]
    fn one_pod_per_rank_with_the_contract_and_the_secret_from_the_secret() {
        let s = spec("queue = \"team-a\"\n[env]\nMY_FLAG = \"on\"\n[resources]\ncpus = 1.5\ngpus = 2");
        let objs = objects(&s, 3).unwrap_or_default();
        let kinds: Vec<&str> = objs.iter().filter_map(|o| o["kind"].as_str()).collect();
        assert_eq!(kinds, ["ConfigMap", "Secret", "Service", "Pod", "Pod", "Pod"]);
        assert!(objs.iter().all(|o| o["metadata"]["namespace"] == "ml"));
        assert_eq!(objs[0]["data"][SPEC_FILE].as_str().and_then(|t| shoal_spec::parse_job_json(t).ok()), Some(s));
        assert_eq!(objs[1]["stringData"][SECRET_KEY], "s3cret");
        assert_eq!(objs[2]["spec"]["clusterIP"], "None");
        for (rank, pod) in objs[3..].iter().enumerate() {
            assert_eq!(pod["metadata"]["name"], format!("shoal-my-job-v2-{rank}"));
            assert_eq!(pod["metadata"]["labels"]["shoal.dev/rank"], rank.to_string());
            assert_eq!(pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"], "team-a");
            assert_eq!(pod["spec"]["subdomain"], "shoal-my-job-v2");
            let env = env_of(pod);
            let get = |k: &str| env.iter().find(|e| e["name"] == k).cloned().unwrap_or_default();
            assert_eq!(get(var::RANK)["value"], rank.to_string());
            assert_eq!(get(var::WORLD_SIZE)["value"], "3");
            assert_eq!(get(var::RENDEZVOUS)["value"], "shoal-my-job-v2-0.shoal-my-job-v2.ml.svc:29400");
            assert_eq!(get(var::RENDEZVOUS_HOST)["value"], "1");
            assert_eq!(get(var::JOB_SECRET)["valueFrom"]["secretKeyRef"]["name"], "shoal-my-job-v2");
            assert!(get(var::JOB_SECRET).get("value").is_none());
            assert_eq!(get("MY_FLAG")["value"], "on");
            let res = &pod["spec"]["containers"][0]["resources"];
            assert_eq!(res["requests"], res["limits"]);
            assert_eq!(res["requests"], json!({ "cpu": "1500m", "memory": "1Gi", "nvidia.com/gpu": "2" }));
            assert!(!to_yaml(pod).contains("s3cret"));
        }
    }

    #[test]
    fn a_trainjob_runs_the_worker_on_kubeflow_trainers_torch_runtime() {
        let s = spec("queue = \"team-a\"\n[env]\nMY_FLAG = \"on\"\n[resources]\ncpus = 2");
        let text = serde_json::to_string(&s).unwrap_or_default();
        let objs = JobObjects {
            job_id: "my-job-v2",
            spec: &s,
            spec_json: &text,
            namespace: "ml",
            image: "registry.example/shoal:1",
            world_size: 4,
            secret: "s3cret",
        }
        .trainjob_objects()
        .unwrap_or_default();
        let kinds: Vec<&str> = objs.iter().filter_map(|o| o["kind"].as_str()).collect();
        assert_eq!(kinds, ["ConfigMap", "Secret", "TrainJob"]);
        let tj = &objs[2];
        assert_eq!(tj["apiVersion"], "trainer.kubeflow.org/v1alpha1");
        assert_eq!(tj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"], "team-a");
        assert_eq!(tj["spec"]["runtimeRef"]["name"], "torch-distributed");
        let t = &tj["spec"]["trainer"];
        assert_eq!((t["numNodes"].as_u64(), t["numProcPerNode"].as_u64()), (Some(4), Some(1)));
        assert_eq!(t["resourcesPerNode"]["limits"]["cpu"], "2000m");
        let env = t["env"].as_array().cloned().unwrap_or_default();
        let get = |k: &str| env.iter().find(|e| e["name"] == k).cloned().unwrap_or_default();
        assert_eq!(get(var::JOB_SECRET)["valueFrom"]["secretKeyRef"]["name"], "shoal-my-job-v2");
        assert_eq!(get("MY_FLAG")["value"], "on");
        assert!(get(var::RANK).is_null(), "the rank comes from the runtime");
        assert!(!to_yaml(tj).contains("s3cret"));
        let o = &tj["spec"]["podSpecOverrides"][0];
        assert_eq!(o["containers"][0]["volumeMounts"][0]["mountPath"], SPEC_DIR);
        assert_eq!(o["volumes"][0]["configMap"]["name"], "shoal-my-job-v2");
    }

    #[test]
    fn the_default_queue_has_no_label_and_a_share_of_a_gpu_is_refused() {
        let objs = objects(&spec(""), 1).unwrap_or_default();
        assert!(objs[3]["metadata"]["labels"].get("kueue.x-k8s.io/queue-name").is_none());
        assert!(objs[3]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu").is_none());
        let e = objects(&spec("[resources]\ngpus = 0.5"), 1).err().map(|e| e.path);
        assert_eq!(e.as_deref(), Some("resources.gpus"));
    }

    #[test]
    fn yaml_quotes_what_would_read_as_something_else() {
        for (s, want) in [
            ("shoal", "shoal"),
            ("ghcr.io/shoal/shoal:0.1.0", "\"ghcr.io/shoal/shoal:0.1.0\""),
            ("", "\"\""),
            ("true", "\"true\""),
            ("No", "\"No\""),
            ("off", "\"off\""),
            ("NULL", "\"NULL\""),
            ("~", "\"~\""),
            ("1", "\"1\""),
            ("1000m", "\"1000m\""),
            ("0x1F", "\"0x1F\""),
            ("-1", "\"-1\""),
            (".5", "\".5\""),
            ("2024-01-01", "\"2024-01-01\""),
            (" lead", "\" lead\""),
            ("trail ", "\"trail \""),
            ("a: b", "\"a: b\""),
            ("a #b", "\"a #b\""),
            ("#x", "\"#x\""),
            ("*ref", "\"*ref\""),
            ("{\"a\":1}", "\"{\\\"a\\\":1}\""),
            ("two\nlines", "\"two\\nlines\""),
            ("tab\there", "\"tab\\there\""),
            ("back\\slash", "\"back\\\\slash\""),
            ("bell\u{7}", "\"bell\\u0007\""),
            ("del\u{7f}", "\"del\\u007f\""),
            ("sep\u{2028}", "\"sep\\u2028\""),
            ("héllo wörld", "héllo wörld"),
            ("shoal.dev/job", "shoal.dev/job"),
        ] {
            assert_eq!(string(s), want, "{s:?}");
        }
    }

    #[test]
    fn yaml_block_style() {
        let v = json!({
            "a": 1,
            "b": [ { "c": "x", "d": [1, 2] }, "y", [], {} ],
            "e": {},
            "f": { "g": null, "h": true, "i": 0.5, "j": 1e-20 },
            "k": [[1, 2], 3],
        });
        let want = "a: 1\n\
                    b:\n  - c: x\n    d:\n      - 1\n      - 2\n  - \"y\"\n  - []\n  - {}\n\
                    e: {}\n\
                    f:\n  g: null\n  h: true\n  i: 0.5\n  j: 1.0e-20\n\
                    k:\n  - - 1\n    - 2\n  - 3\n";
        assert_eq!(to_yaml(&v), want);
        assert_eq!(to_yaml_stream(&[json!({"a": 1}), json!({"b": 2})]), "a: 1\n---\nb: 2\n");
    }
}
