//! The platform's part of a job spec: where it queues, how many workers it needs and what each one asks for.
//!
//! ```toml
//! queue = "default"          # default "default"
//! priority = 0               # higher runs first and may preempt lower
//!
//! [workers]
//! count = 2                  # or min = 1 and max = 4 for an elastic job (not both)
//! spread = false             # pack on as few hosts as possible (default) or spread one per host
//!
//! [resources]                # per worker
//! cpus = "500m"              # a number of CPUs (1, 0.5) or Kubernetes milli-CPUs ("500m"); default 1
//! memory = "2GiB"            # bytes as an integer or with a unit (KiB MiB GiB TiB, KB MB GB TB); default 1GiB
//! gpus = 0.5                 # whole or fractional GPUs; default 0
//! gpu_memory = "10GiB"       # GPU memory per worker; default: none asked
//!
//! [fault_tolerance]          # what happens when a worker dies, stops sending heartbeats or the job hangs
//! policy = "restart"         # restart (default) | elastic | none
//! max_restarts = 3           # times the job is started again before it fails
//! backoff = "2s"             # wait before a restart; doubled while attempts complete no step
//! heartbeat_timeout = "10s"  # a worker whose heartbeats stop this long is taken for dead
//! hang_timeout = "60s"       # no step completed this long while every worker lives: a hang
//! replace_stragglers = false # (elastic) replace a persistent straggler
//! ```
//!
//! `[restart]`, the table this one replaced, is refused with a message naming `[fault_tolerance]`.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// The most workers a job may ask for (`workers.count`, `min`, `max`).
pub const MAX_WORKERS: u32 = 65536;
/// The largest byte quantity a spec may hold (1 EiB), so that sums over many workers stay far from `u64::MAX`.
pub const MAX_BYTES: u64 = 1 << 60;
/// The largest CPU or GPU quantity, in thousandths (a billion CPUs).
pub const MAX_MILLI: u64 = 1_000_000_000_000;

/// `[workers]`: a fixed `count`, or `min..=max` for an elastic job.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkersSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 65536))]
    pub count: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 65536))]
    pub min: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 65536))]
    pub max: Option<u32>,
    /// One worker per host instead of packing.
    #[serde(default)]
    pub spread: bool,
}

impl WorkersSpec {
    /// `(min, max)` workers; a fixed count gives `(count, count)`, nothing given gives `(1, 1)`.
    pub fn range(&self) -> (u32, u32) {
        match (self.count, self.min, self.max) {
            (Some(n), _, _) => (n, n),
            (None, Some(lo), Some(hi)) => (lo, hi),
            (None, Some(lo), None) => (lo, lo),
            (None, None, Some(hi)) => (1, hi),
            (None, None, None) => (1, 1),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), (String, String)> {
        let err = |p: &str, m: String| Err((p.to_owned(), m));
        if self.count.is_some() && (self.min.is_some() || self.max.is_some()) {
            return err("workers.count", "give either `count` or `min`/`max`, not both".into());
        }
        for (key, v) in [("workers.count", self.count), ("workers.min", self.min), ("workers.max", self.max)] {
            match v {
                Some(0) => return err(key, "must be at least 1".into()),
                Some(n) if n > MAX_WORKERS => {
                    return err(key, format!("{n} workers is more than the limit of {MAX_WORKERS}"));
                }
                _ => {}
            }
        }
        if let (Some(lo), Some(hi)) = (self.min, self.max)
            && lo > hi
        {
            return err("workers.min", format!("min {lo} is greater than max {hi}"));
        }
        Ok(())
    }
}

/// One of `[[phases]]`: a stretch of training with its own `[workers]` and `[resources]` (each, when given,
/// replacing the job's), e.g. pre-training on many workers and fine-tuning on few. Phase `i` runs from the step the
/// one before ended at up to `until_step`; the last may leave it out and runs to `train.steps`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhaseSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1))]
    pub until_step: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workers: Option<WorkersSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourcesSpec>,
}

impl PhaseSpec {
    /// Checks phase `i` of `count` against the one before (it ended at `after`) and the run's `steps`.
    pub(crate) fn validate(&self, i: usize, count: usize, after: usize, steps: usize) -> Result<(), (String, String)> {
        let key = |k: &str| format!("phases[{i}].{k}");
        match self.until_step {
            None if i + 1 < count => {
                return Err((key("until_step"), "is needed on every phase but the last".into()));
            }
            Some(u) if u <= after => {
                return Err((key("until_step"), format!("{u} is not after the previous phase's end ({after})")));
            }
            Some(u) if u >= steps => {
                return Err((key("until_step"), format!("{u} is not before train.steps ({steps})")));
            }
            _ => {}
        }
        if let Some(w) = &self.workers {
            w.validate().map_err(|(k, m)| (format!("phases[{i}].{k}"), m))?;
        }
        if let Some(r) = &self.resources {
            r.validate().map_err(|(k, m)| (format!("phases[{i}].{k}"), m))?;
        }
        Ok(())
    }
}

/// `[resources]`, per worker. CPUs and GPUs are kept in thousandths, memory in bytes.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourcesSpec {
    #[serde(default = "one_cpu", deserialize_with = "milli_de", serialize_with = "cpus_ser")]
    #[cfg_attr(feature = "openapi", schema(value_type = crate::schema::Quantity))]
    pub cpus: u64,
    #[serde(default = "one_gib", deserialize_with = "bytes_de")]
    #[cfg_attr(feature = "openapi", schema(value_type = crate::schema::Bytes))]
    pub memory: u64,
    #[serde(default, deserialize_with = "milli_de", serialize_with = "gpus_ser")]
    #[cfg_attr(feature = "openapi", schema(value_type = crate::schema::Quantity))]
    pub gpus: u64,
    #[serde(default, deserialize_with = "bytes_de")]
    #[cfg_attr(feature = "openapi", schema(value_type = crate::schema::Bytes))]
    pub gpu_memory: u64,
}

fn one_cpu() -> u64 {
    1000
}
fn one_gib() -> u64 {
    1 << 30
}

impl Default for ResourcesSpec {
    fn default() -> Self {
        ResourcesSpec { cpus: one_cpu(), memory: one_gib(), gpus: 0, gpu_memory: 0 }
    }
}

impl ResourcesSpec {
    pub(crate) fn validate(&self) -> Result<(), (String, String)> {
        if self.cpus == 0 {
            return Err(("resources.cpus".into(), "must be more than 0".into()));
        }
        if self.memory == 0 {
            return Err(("resources.memory".into(), "must be more than 0".into()));
        }
        if self.gpu_memory > 0 && self.gpus == 0 {
            return Err((
                "resources.gpu_memory".into(),
                format!(
                    "{} bytes of GPU memory asked with resources.gpus = 0; ask for a GPU (or a share of one) or \
                     leave gpu_memory out",
                    self.gpu_memory
                ),
            ));
        }
        if self.gpus > 1000 && !self.gpus.is_multiple_of(1000) {
            return Err((
                "resources.gpus".into(),
                format!(
                    "{} GPUs: a share of a GPU must be less than one; more than one must be whole",
                    milli(self.gpus)
                ),
            ));
        }
        Ok(())
    }
}

/// What the platform does when a job's worker fails, is lost or the job hangs (`fault_tolerance.policy`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultPolicy {
    /// Stop every rank together, wait the backoff, start the gang again (the same number of workers) from the
    /// newest valid checkpoint.
    #[default]
    Restart,
    /// Stop every rank together and start again at once at the number of workers the free capacity allows within
    /// `[workers] min..max`, from the newest valid checkpoint (the global batch and the sampler's position carry
    /// over to the new world size).
    Elastic,
    /// Fail the job with the reason.
    None,
}

impl FaultPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            FaultPolicy::Restart => "restart",
            FaultPolicy::Elastic => "elastic",
            FaultPolicy::None => "none",
        }
    }
}

/// A length of time as a spec writes it (`"2s"`, `"500ms"`, `"5m"`, `"1h"`, or a number of seconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Seconds(pub Duration);

impl Seconds {
    pub fn from_secs(s: u64) -> Seconds {
        Seconds(Duration::from_secs(s))
    }
}

impl fmt::Display for Seconds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        if ms.is_multiple_of(1000) { write!(f, "{}s", ms / 1000) } else { write!(f, "{ms}ms") }
    }
}

impl Serialize for Seconds {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Seconds;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration such as \"2s\", \"500ms\" or \"5m\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Seconds, E> {
                if v.trim_start().starts_with('-') {
                    return Err(E::custom(format!("{v:?} is negative")));
                }
                let d = shoal_comm::env::parse_duration(v).map_err(|e| E::custom(e.to_string()))?;
                if d > MAX_DURATION {
                    return Err(E::custom(format!("{v:?} is too long: at most 7 days")));
                }
                // Whole milliseconds, so that the spec reads back the same.
                Ok(Seconds(Duration::from_millis(d.as_millis() as u64)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seconds, E> {
                if v > MAX_DURATION.as_secs() {
                    return Err(E::custom(format!("{v} s is too long: at most 7 days")));
                }
                Ok(Seconds::from_secs(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seconds, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::custom(format!("{v} is negative"))),
                }
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Seconds, E> {
                if !v.is_finite() || v < 0.0 {
                    return Err(E::custom(format!("{v} is not a duration >= 0")));
                }
                if v > MAX_DURATION.as_secs_f64() {
                    return Err(E::custom(format!("{v} s is too long: at most 7 days")));
                }
                Ok(Seconds(Duration::from_millis((v * 1000.0).round() as u64)))
            }
        }
        d.deserialize_any(V)
    }
}

/// The longest duration a spec may give.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);

/// `[fault_tolerance]`.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultToleranceSpec {
    /// `restart` (default), `elastic` or `none`.
    #[serde(default)]
    pub policy: FaultPolicy,
    /// How many times the job is started again after a failure, a lost worker or a hang (default 3).
    #[serde(default = "three")]
    pub max_restarts: u32,
    /// The wait before a restart (default `"2s"`), doubled for each restart in a row whose attempt completed no
    /// step (a crash loop) and back to this after one that trained; `elastic` starts again at once.
    #[serde(default = "two_seconds")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "2s"))]
    pub backoff: Seconds,
    /// A worker whose heartbeats stop for this long while its process runs is taken for dead (default `"10s"`).
    #[serde(default = "ten_seconds")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "10s"))]
    pub heartbeat_timeout: Seconds,
    /// No training step completed for this long while every worker lives is a hang (default `"60s"`).
    #[serde(default = "sixty_seconds")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, example = "60s"))]
    pub hang_timeout: Seconds,
    /// With `elastic`: replace a worker that is persistently the straggler — named by the diagnosis, the rank the
    /// others wait for, for 30 s — by restarting the job without it (default false).
    #[serde(default)]
    pub replace_stragglers: bool,
}

fn three() -> u32 {
    3
}
fn two_seconds() -> Seconds {
    Seconds::from_secs(2)
}
fn ten_seconds() -> Seconds {
    Seconds::from_secs(10)
}
fn sixty_seconds() -> Seconds {
    Seconds::from_secs(60)
}

impl Default for FaultToleranceSpec {
    fn default() -> Self {
        FaultToleranceSpec {
            policy: FaultPolicy::default(),
            max_restarts: three(),
            backoff: two_seconds(),
            heartbeat_timeout: ten_seconds(),
            hang_timeout: sixty_seconds(),
            replace_stragglers: false,
        }
    }
}

impl FaultToleranceSpec {
    /// The wait before a restart: `backoff` for the first one and after an attempt that trained (completed a
    /// step); after an attempt that completed none (a crash loop), twice the `previous` wait, at most an hour.
    pub fn next_backoff(&self, previous: Option<Duration>, progressed: bool) -> Duration {
        match previous {
            Some(p) if !progressed => p.saturating_mul(2).max(self.backoff.0).min(Duration::from_secs(3600)),
            _ => self.backoff.0,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), (String, String)> {
        let err = |p: &str, m: String| Err((p.to_owned(), m));
        if self.heartbeat_timeout.0 < Duration::from_secs(1) {
            return err(
                "fault_tolerance.heartbeat_timeout",
                format!("{} is too short: at least 1s (workers beat twice a second)", self.heartbeat_timeout),
            );
        }
        if self.hang_timeout.0 < Duration::from_secs(1) {
            return err("fault_tolerance.hang_timeout", format!("{} is too short: at least 1s", self.hang_timeout));
        }
        if self.backoff.0 > Duration::from_secs(3600) {
            return err("fault_tolerance.backoff", format!("{} is too long: at most 1h", self.backoff));
        }
        Ok(())
    }
}

fn milli(v: u64) -> String {
    if v.is_multiple_of(1000) { (v / 1000).to_string() } else { format!("{}", v as f64 / 1000.0) }
}

fn cpus_ser<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v}m"))
}

fn gpus_ser<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(*v as f64 / 1000.0)
}

/// Parses a quantity of CPUs or GPUs into thousandths: `2`, `0.5`, `"1.5"`, `"500m"`; at most [`MAX_MILLI`].
pub fn parse_milli(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let bad = || format!("{s:?} is not a quantity (e.g. 2, 0.5 or \"500m\")");
    if let Some(m) = t.strip_suffix('m') {
        if m.is_empty() || !m.chars().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        // All digits: the only way `parse` fails now is overflow.
        let v = m.parse::<u64>().unwrap_or(u64::MAX);
        return milli_within(v, &format!("{s:?}"));
    }
    let f: f64 = t.parse().map_err(|_| bad())?;
    float_milli(f)
}

fn milli_within(v: u64, shown: &str) -> Result<u64, String> {
    if v > MAX_MILLI {
        return Err(format!("{shown} is too large: at most {}", milli(MAX_MILLI)));
    }
    Ok(v)
}

fn float_milli(f: f64) -> Result<u64, String> {
    if !f.is_finite() || f < 0.0 {
        return Err(format!("{f} must be a finite number >= 0"));
    }
    if f * 1000.0 > MAX_MILLI as f64 {
        return Err(format!("{f:?} is too large: at most {}", milli(MAX_MILLI)));
    }
    let m = (f * 1000.0).round();
    if (m - f * 1000.0).abs() > 1e-6 {
        return Err(format!("{f} is finer than a thousandth"));
    }
    Ok(m as u64)
}

/// The multiplier of a byte unit as written after the number.
fn byte_unit(unit: &str) -> Option<u64> {
    Some(match unit {
        "" | "B" => 1,
        "K" | "Ki" | "KiB" => 1 << 10,
        "M" | "Mi" | "MiB" => 1 << 20,
        "G" | "Gi" | "GiB" => 1 << 30,
        "T" | "Ti" | "TiB" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        _ => return None,
    })
}

/// `num` (decimal digits with at most one `.`) times `mult`, rounded to the nearest integer, computed exactly;
/// `None` when `num` is not such a number, `u128::MAX` when the product does not fit (it is then far above any
/// limit). Decimals past the 18th are ignored (they cannot move the result by a byte).
fn scaled_decimal(num: &str, mult: u64) -> Option<u128> {
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    let digits = |d: &str| d.chars().all(|c| c.is_ascii_digit());
    if (int.is_empty() && frac.is_empty()) || !digits(int) || !digits(frac) {
        return None;
    }
    let frac = &frac[..frac.len().min(18)];
    let accumulate =
        |acc: Option<u128>, c: char| acc?.checked_mul(10)?.checked_add(u128::from(c.to_digit(10).unwrap_or(0)));
    let scale = 10u128.pow(frac.len() as u32);
    let value = int
        .chars()
        .chain(frac.chars())
        .fold(Some(0u128), accumulate)
        .and_then(|v| v.checked_mul(u128::from(mult)))
        .and_then(|v| v.checked_add(scale / 2));
    Some(value.map_or(u128::MAX, |v| v / scale))
}

fn bytes_within(v: u128, shown: &str) -> Result<u64, String> {
    match u64::try_from(v) {
        Ok(b) if b <= MAX_BYTES => Ok(b),
        _ => Err(format!("{shown} is too large: at most 1 EiB ({MAX_BYTES} bytes)")),
    }
}

/// Parses a byte size: an integer, or a number with a unit (`KiB`, `MiB`, `GiB`, `TiB`, `KB`, `MB`, `GB`, `TB`,
/// `K`, `M`, `G`, `T` as binary, `Ki`, `Mi`, `Gi`, `Ti` as in Kubernetes); exact (no floating point), rounded to
/// whole bytes, at most [`MAX_BYTES`]. The one byte-size parser of the workspace.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let Some(mult) = byte_unit(unit.trim()) else {
        return Err(format!("{s:?}: unknown unit {:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)", unit.trim()));
    };
    let bytes = scaled_decimal(num, mult).ok_or_else(|| format!("{s:?} is not a size (e.g. 512MiB, 2GiB)"))?;
    bytes_within(bytes, &format!("{s:?}"))
}

struct QuantityVisitor {
    bytes: bool,
}

impl Visitor<'_> for QuantityVisitor {
    type Value = u64;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.bytes {
            f.write_str("a size in bytes (an integer) or a string with a unit such as \"2GiB\"")
        } else {
            f.write_str("a number (1, 0.5) or a string such as \"500m\"")
        }
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        let shown = v.to_string();
        if self.bytes {
            bytes_within(u128::from(v), &shown).map_err(E::custom)
        } else {
            milli_within(v.saturating_mul(1000), &shown).map_err(E::custom)
        }
    }
    /// TOML hands integers past `i64` over as 128-bit ones.
    fn visit_u128<E: de::Error>(self, v: u128) -> Result<u64, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) if self.bytes => bytes_within(v, &v.to_string()).map_err(E::custom),
            Err(_) => milli_within(u64::MAX, &v.to_string()).map_err(E::custom),
        }
    }
    fn visit_i128<E: de::Error>(self, v: i128) -> Result<u64, E> {
        match u128::try_from(v) {
            Ok(v) => self.visit_u128(v),
            Err(_) => Err(E::custom(format!("{v} is negative; must be >= 0"))),
        }
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        if v < 0 {
            return Err(E::custom(format!("{v} is negative; must be >= 0")));
        }
        self.visit_u64(v as u64)
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<u64, E> {
        if self.bytes {
            if v < 0.0 || !v.is_finite() || v.fract() != 0.0 {
                return Err(E::custom(format!("{v} is not a whole number of bytes >= 0")));
            }
            // Beyond the limit (2^60, exact in an f64) before converting: `as` would saturate silently.
            if v > MAX_BYTES as f64 {
                return Err(E::custom(format!("{v} is too large: at most 1 EiB ({MAX_BYTES} bytes)")));
            }
            return Ok(v as u64);
        }
        float_milli(v).map_err(E::custom)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
        if v.trim_start().starts_with('-') {
            return Err(E::custom(format!("{v:?} is negative; must be >= 0")));
        }
        if self.bytes { parse_bytes(v) } else { parse_milli(v) }.map_err(E::custom)
    }
}

fn milli_de<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    d.deserialize_any(QuantityVisitor { bytes: false })
}

fn bytes_de<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    d.deserialize_any(QuantityVisitor { bytes: true })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(parse_milli("500m"), Ok(500));
        assert_eq!(parse_milli("1.5"), Ok(1500));
        assert_eq!(parse_milli("2"), Ok(2000));
        assert!(parse_milli("abc").is_err());
        assert!(parse_milli("0.0001").is_err());
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("512Mi"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("2 parsecs").is_err());
    }

    #[test]
    fn quantities_are_exact_and_never_saturate() {
        // Exact where an f64 is not.
        assert_eq!(parse_bytes("9007199254740993"), Ok(9_007_199_254_740_993));
        assert_eq!(parse_bytes("0.5KiB"), Ok(512));
        assert_eq!(parse_bytes("0.3KiB"), Ok(307));
        assert_eq!(parse_bytes("1.0000000000000000000000001GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes(".5K"), Ok(512));
        // The limit, and past it however far.
        assert_eq!(parse_bytes(&MAX_BYTES.to_string()), Ok(MAX_BYTES));
        assert_eq!(parse_bytes("1048576TiB"), Ok(MAX_BYTES));
        for big in [
            (MAX_BYTES + 1).to_string(),
            "18446744073709551616".to_string(),
            "1048577TiB".to_string(),
            format!("{}TB", "9".repeat(60)),
        ] {
            let e = parse_bytes(&big).expect_err("too large");
            assert!(e.contains("too large"), "{big}: {e}");
        }
        for bad in ["", ".", "1.2.3", "GiB", "1,5GiB", "-1"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_milli(&format!("{MAX_MILLI}m")), Ok(MAX_MILLI));
        for big in ["18446744073709551616m", "1000000001", "1e300"] {
            let e = parse_milli(big).expect_err("too large");
            assert!(e.contains("too large"), "{big}: {e}");
        }
        assert!(parse_milli("m").is_err());
        assert!(parse_milli("-5m").is_err());
    }

    #[test]
    fn worker_counts_are_bounded() {
        let w = |count, min, max| WorkersSpec { count, min, max, spread: false }.validate();
        assert!(w(Some(MAX_WORKERS), None, None).is_ok());
        let e = w(Some(u32::MAX), None, None).expect_err("too many");
        assert_eq!(e.0, "workers.count");
        assert_eq!(w(None, Some(1), Some(MAX_WORKERS + 1)).expect_err("too many").0, "workers.max");
        assert_eq!(w(None, Some(MAX_WORKERS + 1), None).expect_err("too many").0, "workers.min");
    }

    #[test]
    fn worker_ranges() {
        assert_eq!(WorkersSpec::default().range(), (1, 1));
        assert_eq!(WorkersSpec { count: Some(4), ..Default::default() }.range(), (4, 4));
        assert_eq!(WorkersSpec { min: Some(2), max: Some(6), ..Default::default() }.range(), (2, 6));
        assert!(WorkersSpec { min: Some(3), max: Some(2), ..Default::default() }.validate().is_err());
        assert!(WorkersSpec { count: Some(2), max: Some(2), ..Default::default() }.validate().is_err());
    }
}
