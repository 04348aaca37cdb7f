//! What a team's job may touch on this server, checked once at submission: where its checkpoints live and which
//! environment variables it may set.
//!
//! - **Storage is confined to the job's owner.** A local `checkpoint.url` must lie under the job's own directory
//!   or under the team's directory of the server's storage root (`--storage-root DIR`: `DIR/TEAM/...`); an
//!   object-store URL must start with a prefix configured for the team (`--storage-config FILE`), whose
//!   credentials the server gives that team's tasks; a location another job already uses is refused, so a job
//!   resumes only its own checkpoints.
//! - **No loader tricks.** Dynamic-loader variables (`LD_*`) in `[env]` are refused unless the server allows them
//!   (`--allow-loader-env`); the environment contract's own names are refused by the spec itself.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use shoal_spec::JobSpec;

use crate::error::{ControlError, Result};

/// Per-team object-store access, from `--storage-config FILE`:
///
/// ```toml
/// [teams.alpha]
/// urls = ["s3://alpha-checkpoints/"]        # prefixes the team's checkpoint.url may use
/// env = { AWS_ACCESS_KEY_ID = "...", AWS_SECRET_ACCESS_KEY = "...", AWS_ENDPOINT = "http://10.0.0.5:9000" }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StorageConfig {
    #[serde(default)]
    pub teams: BTreeMap<String, TeamStorage>,
}

/// One team's object stores.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TeamStorage {
    /// URL prefixes (`s3://bucket/path/`) the team's jobs may keep checkpoints under.
    #[serde(default)]
    pub urls: Vec<String>,
    /// Credentials and endpoint given to the team's tasks (override the job's own `[env]`).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
}

impl StorageConfig {
    /// Parses the file's text; errors name the key.
    pub fn parse(text: &str) -> Result<StorageConfig> {
        let mut cfg: StorageConfig = toml::from_str(text).map_err(|e| ControlError::Config(e.to_string()))?;
        for (team, t) in &mut cfg.teams {
            for u in &mut t.urls {
                if !u.contains("://") || u.ends_with("://") {
                    return Err(ControlError::Config(format!(
                        "teams.{team}.urls: {u:?} is not an object-store URL prefix (s3://bucket/path/)"
                    )));
                }
                // A prefix is a directory: `s3://alpha` must not admit `s3://alphabet/...`.
                if !u.ends_with('/') {
                    u.push('/');
                }
            }
        }
        Ok(cfg)
    }
}

/// The server's rules for what jobs may touch.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    /// `--storage-root DIR`: teams may keep checkpoints under `DIR/TEAM/`.
    pub storage_root: Option<PathBuf>,
    pub storage: StorageConfig,
    /// `--allow-loader-env`: `LD_*` variables in `[env]` are accepted.
    pub allow_loader_env: bool,
}

/// Where a job's checkpoints will be, once admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointPlace {
    /// The job's own run directory (no `checkpoint.url`).
    Own,
    /// A local directory under the job's directory or the team's storage root.
    Local(PathBuf),
    /// An object-store URL under one of the team's prefixes.
    Remote(String),
}

impl CheckpointPlace {
    /// The location as other jobs' specs would name it (for the one-job-per-location rule).
    pub fn key(&self) -> Option<String> {
        match self {
            CheckpointPlace::Own => None,
            CheckpointPlace::Local(p) => Some(p.display().to_string()),
            CheckpointPlace::Remote(u) => Some(u.trim_end_matches('/').to_owned()),
        }
    }
}

impl Policy {
    /// Checks `spec` of team `team`, to run in `job_dir`: the `[env]` names and where its checkpoints go.
    pub fn admit(&self, team: &str, job_dir: &Path, spec: &JobSpec) -> Result<CheckpointPlace> {
        if !self.allow_loader_env
            && let Some(k) = spec.env.keys().find(|k| k.starts_with("LD_"))
        {
            return Err(ControlError::bad_field(
                format!("env.{k}"),
                "dynamic-loader variables (LD_*) are refused on this server: they run code inside every task \
                 (a server started with --allow-loader-env accepts them)",
            ));
        }
        let Some(url) = spec.checkpoint.url.as_deref() else { return Ok(CheckpointPlace::Own) };
        let field = "checkpoint.url";
        if let Some(path) = local_path(url) {
            let path = normalize(path).ok_or_else(|| {
                ControlError::bad_field(field, format!("{url:?}: must be an absolute path without '..'"))
            })?;
            if path.starts_with(job_dir) {
                return Ok(CheckpointPlace::Local(path));
            }
            if let Some(root) = &self.storage_root {
                let team_root = root.join(team);
                if path.starts_with(&team_root) && path != team_root {
                    return Ok(CheckpointPlace::Local(path));
                }
                return Err(ControlError::bad_field(
                    field,
                    format!(
                        "{}: outside your storage; local checkpoints go under {} (or leave checkpoint.url out \
                         to keep them with the job)",
                        path.display(),
                        team_root.display()
                    ),
                ));
            }
            return Err(ControlError::bad_field(
                field,
                format!(
                    "{}: outside the job's own directory, and this server has no --storage-root for teams' \
                     checkpoints; leave checkpoint.url out to keep them with the job",
                    path.display()
                ),
            ));
        }
        let prefixes = self.storage.teams.get(team).map(|t| t.urls.as_slice()).unwrap_or_default();
        if prefixes.iter().any(|p| url.starts_with(p.as_str())) && !url.contains("/../") {
            return Ok(CheckpointPlace::Remote(url.to_owned()));
        }
        Err(ControlError::bad_field(
            field,
            if prefixes.is_empty() {
                format!(
                    "{url}: no object store is configured for team {team} on this server (shoal server \
                     --storage-config)"
                )
            } else {
                format!("{url}: team {team} may keep checkpoints under {} only", prefixes.join(", "))
            },
        ))
    }

    /// Where `checkpoint.resume_from` may point: inside the job's own directory or the team's storage (then
    /// `Ok(None)`), or inside another job's directory under `jobs_dir` (then `Ok(Some(id))`: the caller must check
    /// that the job is the team's own). Anything else is refused naming `checkpoint.resume_from`.
    pub fn resume_source(&self, team: &str, job_dir: &Path, jobs_dir: &Path, spec: &JobSpec) -> Result<Option<String>> {
        let (Some(from), Some(local)) = (spec.checkpoint.resume_from.as_deref(), spec.checkpoint.resume_path()) else {
            return Ok(None);
        };
        let field = "checkpoint.resume_from";
        let path = normalize(local).ok_or_else(|| {
            ControlError::bad_field(field, format!("{from:?}: must be an absolute path without '..'"))
        })?;
        if path.starts_with(job_dir) || self.storage_root.as_ref().is_some_and(|r| path.starts_with(r.join(team))) {
            return Ok(None);
        }
        if let Ok(rest) = path.strip_prefix(jobs_dir)
            && let Some(Component::Normal(id)) = rest.components().next()
        {
            return Ok(Some(id.to_string_lossy().into_owned()));
        }
        Err(ControlError::bad_field(
            field,
            format!("{}: not a checkpoint of your team's jobs or storage", path.display()),
        ))
    }

    /// Variables the server gives every task of `team` (its object-store credentials).
    pub fn team_env(&self, team: &str) -> Vec<(String, String)> {
        self.storage
            .teams
            .get(team)
            .map(|t| t.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }
}

/// The path of a local checkpoint URL (`file:///x` or a bare path), `None` for an object store.
fn local_path(url: &str) -> Option<&str> {
    match url.strip_prefix("file://") {
        Some(p) => Some(p),
        None if !url.contains("://") => Some(url),
        None => None,
    }
}

/// An absolute path with `.` removed; `None` when relative or when it climbs with `..`.
fn normalize(p: &str) -> Option<PathBuf> {
    let path = Path::new(p);
    if !path.is_absolute() {
        return None;
    }
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::RootDir => out.push("/"),
            Component::CurDir => {}
            Component::Normal(n) => out.push(n),
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(extra: &str) -> JobSpec {
        let text = format!(
            "name = \"t\"\n{extra}\n[train]\nmodel = \"mlp\"\ndataset = \"digits\"\nglobal_batch = 8\nsteps = 2\nlr = 0.01\n"
        );
        shoal_spec::parse_job(&text, "t.toml").expect("valid spec")
    }

    fn field(r: Result<CheckpointPlace>) -> String {
        match r {
            Err(ControlError::BadRequest { field, .. }) => field.unwrap_or_default(),
            other => format!("{other:?}"),
        }
    }

    #[test]
    fn checkpoints_stay_with_their_owner() {
        let job = Path::new("/data/jobs/j-0000000b");
        let p = Policy { storage_root: Some("/store".into()), ..Policy::default() };
        assert_eq!(p.admit("beta", job, &spec("")).ok(), Some(CheckpointPlace::Own));
        let own = spec("[checkpoint]\nurl = \"/data/jobs/j-0000000b/ck\"");
        assert_eq!(p.admit("beta", job, &own).ok(), Some(CheckpointPlace::Local("/data/jobs/j-0000000b/ck".into())));
        let team = spec("[checkpoint]\nurl = \"file:///store/beta/run1\"");
        assert_eq!(p.admit("beta", job, &team).ok(), Some(CheckpointPlace::Local("/store/beta/run1".into())));
        for bad in [
            "/data/jobs/j-0000000a/run",
            "/store/alpha/run1",
            "/store/beta/../alpha/x",
            "/store/beta",
            "relative/dir",
            "/etc/cron.d",
            "s3://alpha/x",
        ] {
            let s = spec(&format!("[checkpoint]\nurl = \"{bad}\""));
            assert_eq!(field(p.admit("beta", job, &s)), "checkpoint.url", "{bad}");
        }
    }

    #[test]
    fn object_stores_only_under_the_teams_prefixes() {
        let cfg = StorageConfig::parse("[teams.alpha]\nurls = [\"s3://alpha/\"]\nenv = { AWS_REGION = \"x\" }\n")
            .expect("config");
        let p = Policy { storage: cfg, ..Policy::default() };
        let job = Path::new("/data/jobs/j-0000000a");
        let ok = spec("[checkpoint]\nurl = \"s3://alpha/run\"");
        assert!(p.admit("alpha", job, &ok).is_ok());
        assert_eq!(field(p.admit("beta", job, &ok)), "checkpoint.url");
        assert_eq!(field(p.admit("alpha", job, &spec("[checkpoint]\nurl = \"s3://alphabet/run\""))), "checkpoint.url");
        assert_eq!(p.team_env("alpha"), vec![("AWS_REGION".to_owned(), "x".to_owned())]);
        assert!(p.team_env("beta").is_empty());
        assert!(StorageConfig::parse("[teams.a]\nurls = [\"/local\"]").is_err());
        assert!(StorageConfig::parse("[teams.a]\nbogus = 1").is_err());
    }

    #[test]
    fn loader_variables_are_refused_unless_allowed() {
        let job = Path::new("/data/jobs/j-0000000a");
        let s = spec("[env]\nLD_PRELOAD = \"/tmp/evil.so\"");
        assert_eq!(field(Policy::default().admit("a", job, &s)), "env.LD_PRELOAD");
        let p = Policy { allow_loader_env: true, ..Policy::default() };
        assert!(p.admit("a", job, &s).is_ok());
    }
}
