//! `shoal k8s manifests JOB.toml [-n N] [--namespace NS] [--image IMAGE] [--format pods|trainjob] [--json]`: the
//! Kubernetes objects that run a job (bare Pods, or a Kubeflow Trainer v2 TrainJob), built by `shoal_exec::k8s` (what a Kubernetes executor would create), printed as YAML documents
//! separated by `---`, or one JSON array with `--json`, for `kubectl apply -f -` or a GitOps repository. A fresh
//! job secret is drawn each time; it is only in the Secret.

use std::io::Write;
use std::path::Path;

use anyhow::{Result, anyhow, bail};
use shoal_exec::k8s::{self, JobObjects};

#[derive(Debug, clap::Subcommand)]
pub enum K8sCmd {
    /// Print the objects that run a job (ConfigMap with the spec, Secret with a fresh job secret, headless
    /// Service, one Pod per rank) as YAML, for `kubectl apply -f -` or a GitOps repository.
    Manifests {
        job: std::path::PathBuf,
        /// Ranks (default: the spec's `workers.count`, its `workers.min`, else 1).
        #[arg(short = 'n', long = "workers", value_parser = clap::value_parser!(u32).range(1..=i64::from(shoal_spec::MAX_WORKERS)))]
        workers: Option<u32>,
        /// The namespace of every object.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// The workers' image (default `ghcr.io/shoal/shoal:<this version>`).
        #[arg(long)]
        image: Option<String>,
        /// One JSON array of the objects instead of YAML.
        #[arg(long)]
        json: bool,
        /// `pods`: a headless Service and a Pod per rank; `trainjob`: a Kubeflow Trainer v2 TrainJob on the
        /// `torch-distributed` runtime in their place (for clusters that run Kubeflow Trainer).
        #[arg(long, value_enum, default_value_t = Format::Pods)]
        format: Format,
    },
}

/// What runs the job's ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Pods,
    Trainjob,
}

pub fn run(cmd: &K8sCmd) -> Result<bool> {
    match cmd {
        K8sCmd::Manifests { job, workers, namespace, image, json, format } => {
            manifests(job, *workers, namespace, image.as_deref(), *json, *format)
        }
    }
}

fn manifests(
    job: &Path,
    workers: Option<u32>,
    namespace: &str,
    image: Option<&str>,
    json: bool,
    format: Format,
) -> Result<bool> {
    if !k8s::is_dns_label(namespace) {
        bail!(
            "--namespace {namespace:?} is not a Kubernetes namespace name (lowercase letters, digits and '-', at most 63)"
        );
    }
    let default_image = format!("ghcr.io/shoal/shoal:{}", env!("CARGO_PKG_VERSION"));
    let image = image.unwrap_or(&default_image);
    if image.trim().is_empty() || image.contains(char::is_whitespace) {
        bail!("--image {image:?} is not an image reference");
    }
    let origin = job.display().to_string();
    let spec = shoal_spec::load_job(job).map_err(|e| anyhow!("{e}"))?;
    let world_size = workers.unwrap_or(spec.workers.range().0) as usize;
    spec.validate_world(world_size).map_err(|e| anyhow!("{}", e.with_origin(&origin)))?;
    let spec_json = serde_json::to_string(&spec)?;
    let secret = shoal_exec::launch::new_secret()?;
    let job_id = k8s::dns_name(&spec.name);
    let objs = JobObjects {
        job_id: &job_id,
        spec: &spec,
        spec_json: &spec_json,
        namespace,
        image,
        world_size,
        secret: &secret,
    };
    let objects = match format {
        Format::Pods => objs.objects(),
        Format::Trainjob => objs.trainjob_objects(),
    }
    .map_err(|e| anyhow!("{}", e.with_origin(&origin)))?;
    let text = if json { serde_json::to_string_pretty(&objects)? + "\n" } else { k8s::to_yaml_stream(&objects) };
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes()).and_then(|()| out.flush()).map_err(|e| anyhow!("writing to stdout: {e}"))?;
    Ok(true)
}
