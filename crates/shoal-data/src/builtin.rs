//! The built-in datasets, which need no download: `digits`, `cicero` (text) and `synthetic`.

use std::sync::{Arc, OnceLock};

use shoal_spec::data::{
    CICERO_DESCRIPTION, DIGITS_FEATURES, DIGITS_SAMPLES, Options, SYNTHETIC_DESCRIPTION, Split, catalogue, check,
    eval_count,
};

use crate::dataset::check_index;
use crate::rng::SplitMix64;
use crate::{Dataset, DatasetInfo, Error, Kind, Result, Sample, Subset};

fn bad(dataset: &str, option: &'static str, reason: impl Into<String>) -> Error {
    Error::BadOption { dataset: dataset.to_owned(), option, reason: reason.into() }
}

/// Loads a built-in dataset by name; see [`catalogue`] for the names. The options are checked by the spec's own
/// rules ([`shoal_spec::data::check`]), so what validates there builds here.
pub fn builtin(name: &str, options: &Options) -> Result<Box<dyn Dataset>> {
    let c = check(name, options)?;
    match name {
        "digits" => {
            let all = Digits::load()?;
            if c.split == Split::All {
                return Ok(Box::new(all));
            }
            let (train, eval) = crate::train_eval_split(all.len(), c.eval_fraction, c.seed)?;
            let pick = if c.split == Split::Train { train } else { eval };
            Ok(Box::new(Subset::new(all, pick)?))
        }
        "cicero" => {
            let text = lipsum::LIBER_PRIMUS.as_bytes();
            let cut = text.len() - eval_count(text.len(), c.eval_fraction);
            let bytes = match c.split {
                Split::All => text,
                Split::Train => &text[..cut],
                Split::Eval => &text[cut..],
            };
            Ok(Box::new(ByteText::new(name, CICERO_DESCRIPTION, Arc::from(bytes), c.context, c.stride)?))
        }
        // `synthetic`: `check` refused every name it does not know.
        _ => {
            let offset = if c.split == Split::Eval { c.samples } else { 0 };
            Ok(Box::new(Synthetic::new(c.features, c.classes, c.len, c.seed)?.with_offset(offset)))
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// digits

/// The 8×8 handwritten digits: 1,797 images of 64 pixels in `[0, 1]` (row-major), classes 0–9.
#[derive(Debug, Clone)]
pub struct Digits {
    data: Arc<DigitsData>,
}

#[derive(Debug)]
struct DigitsData {
    pixels: Vec<f32>,
    labels: Vec<u32>,
}

impl Digits {
    /// Decodes the data shipped by `smartcore` (once per process).
    pub fn load() -> Result<Self> {
        static DATA: OnceLock<std::result::Result<Arc<DigitsData>, String>> = OnceLock::new();
        let data = DATA.get_or_init(|| {
            let raw = smartcore::dataset::digits::load_dataset();
            if raw.num_samples != DIGITS_SAMPLES
                || raw.num_features != DIGITS_FEATURES
                || raw.data.len() != DIGITS_SAMPLES * DIGITS_FEATURES
                || raw.target.len() != DIGITS_SAMPLES
            {
                return Err(format!(
                    "expected {DIGITS_SAMPLES} x {DIGITS_FEATURES}, found {} x {} ({} values, {} labels)",
                    raw.num_samples,
                    raw.num_features,
                    raw.data.len(),
                    raw.target.len()
                ));
            }
            if let Some(v) = raw.data.iter().find(|v| !(0.0..=16.0).contains(*v)) {
                return Err(format!("pixel value {v} outside 0..=16"));
            }
            let labels = raw
                .target
                .iter()
                .map(|&t| if t.fract() == 0.0 && (0.0..10.0).contains(&t) { Ok(t as u32) } else { Err(t) })
                .collect::<std::result::Result<Vec<u32>, f32>>()
                .map_err(|t| format!("label {t} is not a digit"))?;
            Ok(Arc::new(DigitsData { pixels: raw.data.iter().map(|v| v / 16.0).collect(), labels }))
        });
        match data {
            Ok(data) => Ok(Digits { data: Arc::clone(data) }),
            Err(reason) => Err(Error::Malformed { what: "smartcore's digits data".into(), reason: reason.clone() }),
        }
    }
}

impl Dataset for Digits {
    fn info(&self) -> DatasetInfo {
        catalogue().swap_remove(0)
    }
    fn len(&self) -> usize {
        self.data.labels.len()
    }
    fn get(&self, index: usize) -> Result<Sample> {
        check_index("digits", index, self.len())?;
        let row = &self.data.pixels[index * DIGITS_FEATURES..(index + 1) * DIGITS_FEATURES];
        Ok(Sample::class(row.to_vec(), self.data.labels[index]))
    }
}

// ---------------------------------------------------------------------------------------------------------------
// text

/// Byte-level language-modelling windows over a text: window `i` starts at byte `i * stride`; its input is the
/// `context` bytes there and its target the `context` bytes one further (the next byte at every position).
#[derive(Debug, Clone)]
pub struct ByteText {
    name: String,
    description: String,
    bytes: Arc<[u8]>,
    context: usize,
    stride: usize,
}

impl ByteText {
    /// Windows over `bytes`; an error when `context` or `stride` is 0.
    pub fn new(name: &str, description: &str, bytes: Arc<[u8]>, context: usize, stride: usize) -> Result<Self> {
        if context == 0 {
            return Err(bad(name, "context", "must be at least 1"));
        }
        if stride == 0 {
            return Err(bad(name, "stride", "must be at least 1"));
        }
        Ok(ByteText { name: name.to_owned(), description: description.to_owned(), bytes, context, stride })
    }

    /// The whole text.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Tokens per window.
    pub fn context(&self) -> usize {
        self.context
    }
}

impl Dataset for ByteText {
    fn info(&self) -> DatasetInfo {
        DatasetInfo {
            name: self.name.clone(),
            kind: Kind::Text,
            len: self.len(),
            features: self.context,
            classes: 256,
            description: self.description.clone(),
        }
    }
    fn len(&self) -> usize {
        match self.bytes.len().checked_sub(self.context + 1) {
            Some(room) => room / self.stride + 1,
            None => 0,
        }
    }
    fn get(&self, index: usize) -> Result<Sample> {
        check_index(&self.name, index, self.len())?;
        let start = index * self.stride;
        let w = &self.bytes[start..start + self.context + 1];
        Ok(Sample::tokens(
            w[..self.context].iter().map(|&b| u32::from(b)).collect(),
            w[1..].iter().map(|&b| u32::from(b)).collect(),
        ))
    }
}

// ---------------------------------------------------------------------------------------------------------------
// synthetic

/// Normal values in the noise pool of `synthetic`: a sample copies a window of it,
/// so serving a sample costs a copy, not one normal draw per feature.
const NOISE_POOL: usize = 1 << 20;

/// Seeded Gaussian blobs, generated on access: sample `id` has class `id % classes` and features
/// `centre[class] + N(0, 1)`; the centres are drawn from `seed`. The noise is the window of a pool of
/// `NOISE_POOL` standard normals (drawn once from `seed`) that starts at an offset drawn from `(seed, id)`:
/// each sample's noise is i.i.d. N(0, 1), and two samples share values only if their windows overlap.
/// (With more features than a quarter of the pool, each value is drawn per sample instead.)
#[derive(Debug, Clone)]
pub struct Synthetic {
    features: usize,
    classes: usize,
    samples: usize,
    seed: u64,
    offset: usize,
    centres: Arc<[f32]>,
    pool: Option<Arc<[f32]>>,
}

impl Synthetic {
    pub fn new(features: usize, classes: usize, samples: usize, seed: u64) -> Result<Self> {
        for (option, v) in [("features", features), ("classes", classes), ("samples", samples)] {
            if v == 0 {
                return Err(bad("synthetic", option, "must be at least 1"));
            }
        }
        if u32::try_from(classes).is_err() {
            return Err(bad("synthetic", "classes", "must fit in 32 bits"));
        }
        let mut rng = SplitMix64::from_key(&[seed, 0xCE27]);
        let spread = 3.0 / (features as f64).sqrt();
        let centres = (0..features * classes).map(|_| (rng.normal() * spread) as f32).collect();
        let pool = (features <= NOISE_POOL / 4).then(|| {
            let mut rng = SplitMix64::from_key(&[seed, 0x9001]);
            (0..NOISE_POOL).map(|_| rng.normal() as f32).collect()
        });
        Ok(Synthetic { features, classes, samples, seed, offset: 0, centres, pool })
    }

    /// The same distribution, with sample ids starting at `offset` (disjoint held-out samples).
    pub fn with_offset(mut self, offset: usize) -> Self {
        self.offset = offset;
        self
    }
}

impl Dataset for Synthetic {
    fn info(&self) -> DatasetInfo {
        DatasetInfo {
            name: "synthetic".into(),
            kind: Kind::Synthetic,
            len: self.samples,
            features: self.features,
            classes: self.classes,
            description: SYNTHETIC_DESCRIPTION.into(),
        }
    }
    fn len(&self) -> usize {
        self.samples
    }
    fn get(&self, index: usize) -> Result<Sample> {
        check_index("synthetic", index, self.samples)?;
        let id = (self.offset + index) as u64;
        let class = (id % self.classes as u64) as usize;
        let mut rng = SplitMix64::from_key(&[self.seed, id, 0x5A3F]);
        let centre = &self.centres[class * self.features..(class + 1) * self.features];
        let features = match &self.pool {
            Some(pool) => {
                let start = rng.below(pool.len() - self.features + 1);
                centre.iter().zip(&pool[start..start + self.features]).map(|(&c, &z)| c + z).collect()
            }
            None => centre.iter().map(|&c| c + rng.normal() as f32).collect(),
        };
        Ok(Sample::class(features, class as u32))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_match_the_catalogue_and_are_normalised() {
        let d = builtin("digits", &Options::default()).expect("digits");
        assert_eq!(d.len(), 1797);
        let mut seen = [0usize; 10];
        for i in 0..d.len() {
            let s = d.get(i).expect("in range");
            let px = s.features.as_dense().expect("dense");
            assert_eq!(px.len(), 64);
            assert!(px.iter().all(|v| (0.0..=1.0).contains(v)));
            seen[s.class_label().expect("class") as usize] += 1;
        }
        assert!(seen.iter().all(|&n| (170..=190).contains(&n)), "{seen:?}");
        assert!(matches!(d.get(1797), Err(Error::OutOfRange { index: 1797, .. })));
        assert_eq!(d.info(), catalogue()[0]);
    }

    #[test]
    fn splits_are_disjoint_and_cover() {
        for name in ["digits", "cicero"] {
            let all = builtin(name, &Options::default()).expect("all").len();
            let train = builtin(name, &Options { split: Split::Train, ..Options::default() }).expect("train");
            let eval = builtin(name, &Options { split: Split::Eval, ..Options::default() }).expect("eval");
            assert!(!eval.is_empty() && train.len() > eval.len() * 5, "{name}");
            // Text windows cannot straddle the cut, so a few are lost there.
            assert!(train.len() + eval.len() <= all && train.len() + eval.len() + 2 * 64 >= all, "{name}");
        }
        let o = |split| Options { split, samples: Some(100), features: Some(3), ..Options::default() };
        let train = builtin("synthetic", &o(Split::Train)).expect("train");
        let eval = builtin("synthetic", &o(Split::Eval)).expect("eval");
        assert_eq!((train.len(), eval.len()), (100, 10));
        assert_ne!(train.get(0).expect("ok"), eval.get(0).expect("ok"));
    }

    #[test]
    fn text_windows_are_next_byte_targets() {
        let o = Options { context: Some(8), stride: Some(3), ..Options::default() };
        let t = builtin("cicero", &o).expect("cicero");
        assert_eq!(t.len(), (lipsum::LIBER_PRIMUS.len() - 9) / 3 + 1);
        let s = t.get(2).expect("ok");
        let bytes = lipsum::LIBER_PRIMUS.as_bytes();
        let want: Vec<u32> = bytes[6..15].iter().map(|&b| u32::from(b)).collect();
        assert_eq!(s.features.as_tokens(), Some(&want[..8]));
        assert_eq!(s.label, crate::Label::Tokens(want[1..].to_vec()));
        let last = t.get(t.len() - 1).expect("last window fits");
        assert_eq!(last.features.len(), 8);
        assert!(t.get(t.len()).is_err());
        assert_eq!(t.info().kind, Kind::Text);
    }

    #[test]
    fn synthetic_is_deterministic_and_learnable_by_nearest_centre() {
        let o =
            Options { features: Some(16), classes: Some(4), samples: Some(400), seed: Some(7), ..Options::default() };
        let a = builtin("synthetic", &o).expect("a");
        let b = builtin("synthetic", &o).expect("b");
        assert_eq!(a.get(123).expect("ok"), b.get(123).expect("ok"));
        let c = builtin("synthetic", &Options { seed: Some(8), ..o.clone() }).expect("c");
        assert_ne!(a.get(123).expect("ok"), c.get(123).expect("ok"));
        // Class means are well apart: nearest class mean (estimated on half) classifies the other half well.
        let rows: Vec<(Vec<f32>, u32)> = (0..400)
            .map(|i| {
                let s = a.get(i).expect("ok");
                (s.features.as_dense().expect("dense").to_vec(), s.class_label().expect("class"))
            })
            .collect();
        let mut means = vec![vec![0f32; 16]; 4];
        for (x, y) in &rows[..200] {
            for (m, v) in means[*y as usize].iter_mut().zip(x) {
                *m += v / 50.0;
            }
        }
        let dist = |x: &[f32], m: &[f32]| x.iter().zip(m).map(|(a, b)| (a - b) * (a - b)).sum::<f32>();
        let correct = rows[200..]
            .iter()
            .filter(|(x, y)| {
                (0..4).min_by(|&i, &j| dist(x, &means[i]).total_cmp(&dist(x, &means[j]))) == Some(*y as usize)
            })
            .count();
        assert!(correct > 160, "{correct}/200");
    }

    #[test]
    fn synthetic_noise_is_standard_normal_and_differs_between_samples() {
        for features in [784, NOISE_POOL / 4 + 1] {
            let s = Synthetic::new(features, 10, 64, 3).expect("synthetic");
            let noise: Vec<Vec<f64>> = (0..64)
                .map(|i| {
                    let x = s.get(i).expect("sample");
                    let c = (i % 10) * features;
                    let centre = &s.centres[c..c + features];
                    x.features.as_dense().expect("dense").iter().zip(centre).map(|(&v, &m)| f64::from(v - m)).collect()
                })
                .collect();
            let all: Vec<f64> = noise.iter().flatten().copied().collect();
            let n = all.len() as f64;
            let mean = all.iter().sum::<f64>() / n;
            let var = all.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
            assert!(mean.abs() < 0.01, "{features} features: mean {mean}");
            assert!((var - 1.0).abs() < 0.02, "{features} features: variance {var}");
            // Sample noises are not shifted copies of each other at lag 0.
            let same = noise.windows(2).filter(|w| w[0] == w[1]).count();
            assert_eq!(same, 0);
        }
    }

    #[test]
    fn bad_names_and_options_are_named() {
        let err = builtin("mnist", &Options::default()).expect_err("unknown");
        assert!(err.to_string().contains("mnist") && err.to_string().contains("digits"), "{err}");
        let err = builtin("digits", &Options { context: Some(3), ..Options::default() }).expect_err("n/a");
        assert!(matches!(err, Error::BadOption { option: "context", .. }), "{err}");
        let err = builtin("synthetic", &Options { features: Some(0), ..Options::default() }).expect_err("zero");
        assert!(matches!(err, Error::BadOption { option: "features", .. }), "{err}");
        let err = builtin("cicero", &Options { context: Some(1 << 20), ..Options::default() }).expect_err("big");
        assert!(matches!(err, Error::BadOption { option: "context", .. }), "{err}");
        let o = Options { split: Split::Eval, eval_fraction: Some(1.5), ..Options::default() };
        assert!(matches!(builtin("digits", &o), Err(Error::BadOption { option: "eval_fraction", .. })));
        assert!(serde_json::from_str::<Options>(r#"{"contxt": 3}"#).is_err());
        let o: Options = serde_json::from_str(r#"{"split": "train", "context": 32}"#).expect("valid");
        assert_eq!((o.split, o.context), (Split::Train, Some(32)));
    }

    #[test]
    fn the_specs_rules_give_the_length_every_built_dataset_has() {
        let sets = [
            ("digits", Options::default()),
            ("digits", Options { seed: Some(3), eval_fraction: Some(0.25), ..Options::default() }),
            ("cicero", Options::default()),
            ("cicero", Options { context: Some(100), stride: Some(7), eval_fraction: Some(0.3), ..Options::default() }),
            ("synthetic", Options { samples: Some(999), features: Some(5), classes: Some(3), ..Options::default() }),
            ("synthetic", Options { samples: Some(10), eval_fraction: Some(0.05), ..Options::default() }),
        ];
        for (name, o) in sets {
            for split in [Split::All, Split::Train, Split::Eval] {
                if split == Split::All && o.eval_fraction.is_some() {
                    continue;
                }
                let o = Options { split, ..o.clone() };
                let want = check(name, &o).map(|c| c.len);
                let built = builtin(name, &o).map(|d| d.len());
                assert_eq!(want.ok(), built.ok(), "{name} {o:?}");
            }
        }
    }

    #[test]
    fn catalogue_lists_every_builtin_with_name_and_kind() {
        let cat = catalogue();
        assert_eq!(cat.iter().map(|i| i.name.as_str()).collect::<Vec<_>>(), shoal_spec::data::NAMES);
        assert_eq!(lipsum::LIBER_PRIMUS.len(), shoal_spec::data::CICERO_BYTES, "the spec's facts about cicero");
        for info in &cat {
            let d = builtin(&info.name, &Options::default()).expect("loads");
            assert_eq!(&d.info(), info);
        }
        let json = serde_json::to_value(&cat).expect("json");
        for obj in json.as_array().expect("array") {
            assert!(obj["name"].is_string() && obj["kind"].is_string());
        }
    }
}
