//! The built-in datasets a job can name, as facts and rules: their kinds, shapes and lengths ([`catalogue`]),
//! the options of `[train.data]` ([`Options`]) and what each dataset accepts ([`check`]). Nothing is loaded
//! here: `shoal-data` builds every dataset from the result of the same [`check`], so a spec that validates is
//! one whose datasets will build, and no dataset is built to validate a spec.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Which part of a built-in dataset to load.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Everything (for `synthetic`: the training samples).
    #[default]
    All,
    /// All but the held-out part.
    Train,
    /// The held-out part (`eval_fraction` of the data).
    Eval,
}

/// Options of a built-in dataset (`[train.data]`); each applies to some datasets only, and setting one that does
/// not apply is an error. Unknown keys are rejected.
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Options {
    /// All datasets.
    pub split: Split,
    /// All datasets: the held-out fraction for `split` (default 0.1).
    pub eval_fraction: Option<f64>,
    /// `digits`: seed of the train/eval split (default 0); `synthetic`: seed of the data (default 0).
    pub seed: Option<u64>,
    /// Text: tokens per window (default 64).
    pub context: Option<usize>,
    /// Text: bytes between the starts of consecutive windows (default 1).
    pub stride: Option<usize>,
    /// `synthetic`: features per sample (default 784).
    pub features: Option<usize>,
    /// `synthetic`: number of classes (default 10).
    pub classes: Option<usize>,
    /// `synthetic`: training samples (default 60,000).
    pub samples: Option<usize>,
    /// A dataset in a data lake ([`is_lake`]): the files' format, `parquet`, `csv` or `jsonl` (default: from the
    /// extension).
    pub format: Option<String>,
    /// A lake dataset: the columns that are a sample's features, in order (numbers or booleans).
    pub feature_columns: Option<Vec<String>>,
    /// A lake dataset: the column of a sample's class, an integer in `0..classes` (`classes` required with it).
    pub label_column: Option<String>,
    /// A lake dataset: a second location holding the held-out data (instead of `eval_fraction` of the first).
    pub eval: Option<String>,
    /// A lake dataset: the streams every global batch draws from in equal parts (default 8; see shoal-data's
    /// sampler). Each worker reads its part of them, so workers read different row groups.
    pub lanes: Option<usize>,
    /// A lake dataset: how blocks (row groups, byte ranges) reach the workers (default `static`).
    pub sharding: Option<Sharding>,
    /// A lake dataset for language modelling: the column of text whose bytes are the tokens (instead of
    /// `feature_columns`, `label_column` and `classes`); windows of `context` tokens, as `cicero`'s.
    pub text_column: Option<String>,
}

/// How a lake dataset's blocks reach the workers (`train.data.sharding`).
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Sharding {
    /// Every global batch is fixed by the seed and the step: the same at any world size, bit for bit on resume.
    #[default]
    Static,
    /// Blocks are handed out on demand by a coordinator every worker reaches, so a worker that reads faster takes
    /// more; a block left unfinished by a worker that died goes to the others. Every row is trained on exactly once
    /// an epoch, through restarts (the checkpoint records what was consumed); the order is no longer a function of
    /// the seed alone.
    Dynamic,
}

/// Whether `train.dataset` names data in a data lake (a URL such as `s3://bucket/prefix/` or `file:///data/x.parquet`,
/// or a local path starting with `/` or `.`) rather than a built-in dataset.
pub fn is_lake(dataset: &str) -> bool {
    dataset.contains("://") || dataset.starts_with('/') || dataset.starts_with('.')
}

/// The formats a lake dataset may be in.
pub const LAKE_FORMATS: [&str; 3] = ["parquet", "csv", "jsonl"];

/// The default of `context` (tokens a text window gives as input).
pub const DEFAULT_CONTEXT: usize = 64;

/// The default of `lanes`.
pub const DEFAULT_LANES: usize = 8;

/// The lanes of a micro-batch when `train.data.lanes` is not given: the largest divisor of it up to
/// [`DEFAULT_LANES`].
pub fn default_lanes(micro_batch: usize) -> usize {
    (1..=DEFAULT_LANES).rev().find(|l| micro_batch.is_multiple_of(*l)).unwrap_or(1)
}

/// What a dataset holds, for choosing a model and for listings (`shoal datasets --json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Image,
    Tabular,
    Text,
    Synthetic,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Image => "image",
            Kind::Tabular => "tabular",
            Kind::Text => "text",
            Kind::Synthetic => "synthetic",
        })
    }
}

/// A description of a dataset. Serialises to a JSON object with at least `name` and `kind`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DatasetInfo {
    /// Name as given to `shoal_data::builtin`.
    pub name: String,
    pub kind: Kind,
    /// Number of samples (windows, for text).
    pub len: usize,
    /// Features per sample (for text: the context length, i.e. tokens per sample).
    pub features: usize,
    /// Number of classes (for text: the vocabulary size); 0 when unlabelled.
    pub classes: usize,
    /// Where the data comes from, and its licence where it has one.
    pub description: String,
}

/// The built-in datasets' names.
pub const NAMES: [&str; 3] = ["digits", "cicero", "synthetic"];

/// `digits`: images and pixels per image.
pub const DIGITS_SAMPLES: usize = 1797;
pub const DIGITS_FEATURES: usize = 64;
pub const DIGITS_DESCRIPTION: &str = "UCI optical recognition of handwritten digits: 8x8 images (1,797), 10 classes, \
    pixels scaled from 0..16 to [0, 1]; shipped by the smartcore crate (Apache-2.0)";

/// `cicero`: bytes of book I of *De finibus* as the `lipsum` crate ships it (`shoal-data` checks the two agree).
pub const CICERO_BYTES: usize = 49_068;
pub const CICERO_DESCRIPTION: &str = "Cicero, De finibus bonorum et malorum, book I (Latin, public domain), 49,068 \
    bytes of ASCII, as shipped by the lipsum crate 0.9 (MIT) in lipsum::LIBER_PRIMUS; byte-level tokens, \
    target = next byte";

pub const SYNTHETIC_DESCRIPTION: &str = "Gaussian blobs: class c = sample id mod classes, features = centre of c + \
    N(0, 1) noise; centres N(0, 9/features) per coordinate; generated on the fly from (seed, id), identical in every \
    process; the noise is a window of a seeded pool of 2^20 N(0, 1) values at an offset drawn from (seed, id) \
    (options: features, classes, samples, seed)";

/// The built-in datasets with their default options (for `shoal datasets --json`).
pub fn catalogue() -> Vec<DatasetInfo> {
    vec![
        DatasetInfo {
            name: "digits".into(),
            kind: Kind::Image,
            len: DIGITS_SAMPLES,
            features: DIGITS_FEATURES,
            classes: 10,
            description: DIGITS_DESCRIPTION.into(),
        },
        DatasetInfo {
            name: "cicero".into(),
            kind: Kind::Text,
            len: CICERO_BYTES - 64,
            features: 64,
            classes: 256,
            description: CICERO_DESCRIPTION.into(),
        },
        DatasetInfo {
            name: "synthetic".into(),
            kind: Kind::Synthetic,
            len: 60_000,
            features: 784,
            classes: 10,
            description: SYNTHETIC_DESCRIPTION.into(),
        },
    ]
}

/// Why a dataset cannot be built with some options.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DataError {
    #[error("unknown dataset {name:?} (known: {known})")]
    Unknown { name: String, known: String },
    #[error("dataset {dataset}: option {option}: {reason}")]
    BadOption { dataset: String, option: &'static str, reason: String },
}

/// A dataset's options after its rules, with every default filled in: what building it takes.
#[derive(Debug, Clone, PartialEq)]
pub struct Checked {
    pub split: Split,
    pub eval_fraction: f64,
    pub seed: u64,
    /// Text only (else 0).
    pub context: usize,
    pub stride: usize,
    /// `synthetic` only (else the dataset's own).
    pub features: usize,
    pub classes: usize,
    pub samples: usize,
    /// Samples of the chosen split (windows, for text); 0 for a lake dataset, whose rows are counted when its
    /// files are opened.
    pub len: usize,
    /// A lake dataset's lanes (else 0).
    pub lanes: usize,
}

fn bad(dataset: &str, option: &'static str, reason: impl Into<String>) -> DataError {
    DataError::BadOption { dataset: dataset.to_owned(), option, reason: reason.into() }
}

fn reject(name: &str, options: &Options, allowed: &[&str]) -> Result<(), DataError> {
    let set: [(&'static str, bool); 13] = [
        ("seed", options.seed.is_some()),
        ("context", options.context.is_some()),
        ("stride", options.stride.is_some()),
        ("features", options.features.is_some()),
        ("classes", options.classes.is_some()),
        ("samples", options.samples.is_some()),
        ("format", options.format.is_some()),
        ("feature_columns", options.feature_columns.is_some()),
        ("label_column", options.label_column.is_some()),
        ("eval", options.eval.is_some()),
        ("lanes", options.lanes.is_some()),
        ("sharding", options.sharding.is_some()),
        ("text_column", options.text_column.is_some()),
    ];
    match set.iter().find(|(opt, on)| *on && !allowed.contains(opt)) {
        Some((opt, _)) => Err(bad(name, opt, "does not apply to this dataset")),
        None => Ok(()),
    }
}

fn positive(
    name: &str,
    option: &'static str,
    value: Option<usize>,
    default: usize,
    max: usize,
) -> Result<usize, DataError> {
    match value.unwrap_or(default) {
        0 => Err(bad(name, option, "must be at least 1")),
        v if v > max => Err(bad(name, option, format!("{v} exceeds the limit of {max}"))),
        v => Ok(v),
    }
}

fn fraction(name: &str, options: &Options) -> Result<f64, DataError> {
    let f = options.eval_fraction.unwrap_or(0.1);
    if options.eval_fraction.is_some() && options.split == Split::All {
        return Err(bad(name, "eval_fraction", "needs split = \"train\" or \"eval\""));
    }
    if !(f > 0.0 && f < 1.0) {
        return Err(bad(name, "eval_fraction", format!("{f} is not in (0, 1)")));
    }
    Ok(f)
}

/// How many of `len` samples a held-out fraction takes (at least one, and never all).
pub fn eval_count(len: usize, eval_fraction: f64) -> usize {
    if eval_fraction <= 0.0 || len < 2 {
        return 0;
    }
    ((len as f64 * eval_fraction).round() as usize).clamp(1, len - 1)
}

/// The held-out part's length and the rest's, of `len` samples.
fn split_len(len: usize, split: Split, eval_fraction: f64) -> usize {
    let eval = eval_count(len, eval_fraction);
    match split {
        Split::All => len,
        Split::Train => len - eval,
        Split::Eval => eval,
    }
}

/// Checks `options` against dataset `name`'s rules and fills in the defaults, without loading anything.
pub fn check(name: &str, options: &Options) -> Result<Checked, DataError> {
    let mut c = Checked {
        split: options.split,
        eval_fraction: 0.1,
        seed: options.seed.unwrap_or(0),
        context: 0,
        stride: 1,
        features: 0,
        classes: 0,
        samples: 0,
        len: 0,
        lanes: 0,
    };
    match name {
        "digits" => {
            reject(name, options, &["seed"])?;
            c.eval_fraction = fraction(name, options)?;
            (c.features, c.classes, c.samples) = (DIGITS_FEATURES, 10, DIGITS_SAMPLES);
            c.len = split_len(DIGITS_SAMPLES, c.split, c.eval_fraction);
        }
        "cicero" => {
            reject(name, options, &["context", "stride"])?;
            c.eval_fraction = fraction(name, options)?;
            let bytes = split_len(CICERO_BYTES, c.split, c.eval_fraction);
            c.context = positive(name, "context", options.context, 64, 1 << 20)?;
            c.stride = positive(name, "stride", options.stride, 1, 1 << 20)?;
            if bytes <= c.context {
                return Err(bad(name, "context", format!("{} leaves no window in {bytes} bytes", c.context)));
            }
            (c.features, c.classes, c.samples) = (c.context, 256, bytes);
            c.len = (bytes - c.context - 1) / c.stride + 1;
        }
        "synthetic" => {
            reject(name, options, &["seed", "features", "classes", "samples"])?;
            c.eval_fraction = fraction(name, options)?;
            c.features = positive(name, "features", options.features, 784, 1 << 24)?;
            c.classes = positive(name, "classes", options.classes, 10, 1 << 24)?;
            c.samples = positive(name, "samples", options.samples, 60_000, 1 << 40)?;
            c.len = match c.split {
                Split::All | Split::Train => c.samples,
                Split::Eval => ((c.samples as f64 * c.eval_fraction).round() as usize).max(1),
            };
        }
        lake if is_lake(lake) => {
            if let Some(text) = &options.text_column {
                reject(name, options, &["format", "eval", "lanes", "sharding", "text_column", "context"]).map_err(
                    |e| match e {
                        DataError::BadOption { dataset, option, .. } => DataError::BadOption {
                            dataset,
                            option,
                            reason: "does not apply to a text column (text_column)".into(),
                        },
                        other => other,
                    },
                )?;
                if text.is_empty() {
                    return Err(bad(name, "text_column", "names no column"));
                }
                c.context = positive(name, "context", options.context, DEFAULT_CONTEXT, 1 << 20)?;
                c.features = c.context;
                c.classes = 256;
            }
            reject(
                name,
                options,
                &[
                    "classes",
                    "format",
                    "feature_columns",
                    "label_column",
                    "eval",
                    "lanes",
                    "sharding",
                    "text_column",
                    "context",
                ],
            )?;
            if let Some(f) = options.format.as_deref().filter(|f| !LAKE_FORMATS.contains(f)) {
                return Err(bad(name, "format", format!("{f:?} is not one of {}", LAKE_FORMATS.join(", "))));
            }
            // A text column's bytes are the tokens; a table's samples are its feature and label columns.
            if options.text_column.is_none() {
                if options.context.is_some() {
                    return Err(bad(name, "context", "applies to a text column (text_column) only"));
                }
                let features = options.feature_columns.as_ref().filter(|f| !f.is_empty()).ok_or_else(|| {
                    bad(name, "feature_columns", "a lake dataset names its feature columns (a list of column names)")
                })?;
                if let Some(dup) = features.iter().enumerate().find(|(i, f)| features[..*i].contains(f)) {
                    return Err(bad(name, "feature_columns", format!("{:?} is named twice", dup.1)));
                }
                let label = options
                    .label_column
                    .as_deref()
                    .filter(|l| !l.is_empty())
                    .ok_or_else(|| bad(name, "label_column", "a lake dataset names the column of its classes"))?;
                if features.iter().any(|f| f == label) {
                    return Err(bad(name, "label_column", format!("{label:?} is a feature column too")));
                }
                c.classes = positive(name, "classes", options.classes, 0, 1 << 24)
                    .map_err(|_| bad(name, "classes", "a lake dataset says how many classes its label column has"))?;
                c.features = features.len();
            }
            c.lanes = positive(name, "lanes", options.lanes, DEFAULT_LANES, 1024)?;
            match (&options.eval, options.eval_fraction) {
                (Some(_), Some(_)) => {
                    return Err(bad(name, "eval", "give either eval (a second location) or eval_fraction, not both"));
                }
                (Some(e), None) if !is_lake(e) => {
                    return Err(bad(name, "eval", format!("{e:?} is not a location (a URL or a path)")));
                }
                (Some(_), None) => c.eval_fraction = 0.0,
                (None, _) => c.eval_fraction = fraction(name, options)?,
            }
            // Rows are counted when the files are opened.
            c.len = 0;
        }
        _ => return Err(DataError::Unknown { name: name.to_owned(), known: NAMES.join(", ") }),
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_fill_in_defaults_and_name_the_option() {
        let c = check("digits", &Options { split: Split::Train, ..Options::default() }).expect("digits");
        assert_eq!(c.len, DIGITS_SAMPLES - eval_count(DIGITS_SAMPLES, 0.1));
        let t = check("cicero", &Options { context: Some(32), ..Options::default() }).expect("cicero");
        assert_eq!((t.features, t.classes, t.len), (32, 256, CICERO_BYTES - 32));
        let s = check("synthetic", &Options { split: Split::Eval, samples: Some(1000), ..Options::default() });
        assert_eq!(s.map(|c| c.len).ok(), Some(100));
        for (name, o, option) in [
            ("digits", Options { context: Some(8), ..Options::default() }, "context"),
            ("cicero", Options { context: Some(0), ..Options::default() }, "context"),
            ("cicero", Options { context: Some(CICERO_BYTES), ..Options::default() }, "context"),
            ("synthetic", Options { eval_fraction: Some(0.5), ..Options::default() }, "eval_fraction"),
        ] {
            match check(name, &o) {
                Err(DataError::BadOption { option: got, .. }) => assert_eq!(got, option, "{name} {o:?}"),
                other => panic!("{name} {o:?}: {other:?}"),
            }
        }
        assert!(matches!(check("mnist", &Options::default()), Err(DataError::Unknown { .. })));
    }
}
