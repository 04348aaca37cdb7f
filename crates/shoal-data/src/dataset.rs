//! Samples, dataset descriptions and the two dataset forms: random access ([`Dataset`]) and streaming
//! ([`IterableDataset`]).

use std::fmt;
use std::sync::Arc;

use crate::{Error, Result};

/// The input half of a sample.
#[derive(Debug, Clone, PartialEq)]
pub enum Features {
    /// Dense real features: pixels of an image (row-major), columns of a table, ...
    Dense(Vec<f32>),
    /// Token ids: a window of text (byte-level tokens are `0..=255`).
    Tokens(Vec<u32>),
}

impl Features {
    /// Number of values (features or tokens).
    pub fn len(&self) -> usize {
        match self {
            Features::Dense(v) => v.len(),
            Features::Tokens(v) => v.len(),
        }
    }

    /// True when there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dense features, if these are dense.
    pub fn as_dense(&self) -> Option<&[f32]> {
        match self {
            Features::Dense(v) => Some(v),
            Features::Tokens(_) => None,
        }
    }

    /// The tokens, if these are tokens.
    pub fn as_tokens(&self) -> Option<&[u32]> {
        match self {
            Features::Tokens(v) => Some(v),
            Features::Dense(_) => None,
        }
    }
}

/// The target half of a sample.
#[derive(Debug, Clone, PartialEq)]
pub enum Label {
    /// No target (unlabelled data).
    None,
    /// A class in `0..classes`.
    Class(u32),
    /// One target token per input position (for language modelling: the next token).
    Tokens(Vec<u32>),
}

/// One example: features and a label. Image/tabular samples are `Dense` + `Class`; a text window is
/// `Tokens` + `Label::Tokens` of the same length.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub features: Features,
    pub label: Label,
}

impl Sample {
    /// A dense sample with a class label.
    pub fn class(features: Vec<f32>, class: u32) -> Self {
        Sample { features: Features::Dense(features), label: Label::Class(class) }
    }

    /// A token window with its per-position targets.
    pub fn tokens(input: Vec<u32>, target: Vec<u32>) -> Self {
        Sample { features: Features::Tokens(input), label: Label::Tokens(target) }
    }

    /// The class, if the label is one.
    pub fn class_label(&self) -> Option<u32> {
        match self.label {
            Label::Class(c) => Some(c),
            _ => None,
        }
    }
}

pub use shoal_spec::data::{DatasetInfo, Kind};

/// A dataset with a known length and random access by index. Implementations are shared between loader
/// threads, hence `Send + Sync`; `get` must be a pure function of `index` (the same sample every call, in every
/// process), which is what makes distributed sampling and exact resume work.
pub trait Dataset: Send + Sync + fmt::Debug {
    /// Describes the dataset.
    fn info(&self) -> DatasetInfo;

    /// Number of samples.
    fn len(&self) -> usize;

    /// True when there are no samples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sample at `index`; [`Error::OutOfRange`] when `index >= len()`.
    fn get(&self, index: usize) -> Result<Sample>;
}

impl<D: Dataset + ?Sized> Dataset for Arc<D> {
    fn info(&self) -> DatasetInfo {
        (**self).info()
    }
    fn len(&self) -> usize {
        (**self).len()
    }
    fn get(&self, index: usize) -> Result<Sample> {
        (**self).get(index)
    }
}

impl<D: Dataset + ?Sized> Dataset for Box<D> {
    fn info(&self) -> DatasetInfo {
        (**self).info()
    }
    fn len(&self) -> usize {
        (**self).len()
    }
    fn get(&self, index: usize) -> Result<Sample> {
        (**self).get(index)
    }
}

pub(crate) fn check_index(name: &str, index: usize, len: usize) -> Result<()> {
    if index < len { Ok(()) } else { Err(Error::OutOfRange { dataset: name.to_owned(), index, len }) }
}

/// A stream of samples.
pub type SampleIter<'a> = Box<dyn Iterator<Item = Result<Sample>> + Send + 'a>;

/// A dataset read front to back, for data too large for random access. Each rank reads its own shard: record
/// `k` of the stream belongs to rank `k % world_size`, so the shards are disjoint and cover the stream.
pub trait IterableDataset: Send + Sync + fmt::Debug {
    /// Describes the dataset (`len` is the number of records when known, else 0).
    fn info(&self) -> DatasetInfo;

    /// The records of shard `rank` of `world_size`, in stream order.
    fn stream(&self, world_size: usize, rank: usize) -> Result<SampleIter<'_>>;
}

/// Every map-style dataset can also be streamed (in index order, shard by `index % world_size`).
#[derive(Debug, Clone)]
pub struct Streamed<D>(pub D);

impl<D: Dataset> IterableDataset for Streamed<D> {
    fn info(&self) -> DatasetInfo {
        self.0.info()
    }

    fn stream(&self, world_size: usize, rank: usize) -> Result<SampleIter<'_>> {
        crate::partition::check_rank(world_size, rank)?;
        Ok(Box::new((rank..self.0.len()).step_by(world_size).map(move |i| self.0.get(i))))
    }
}

/// Takes every `world_size`-th record of a stream starting at `rank`: the sharding rule of [`IterableDataset`].
pub fn shard_stream<'a, T: Send + 'a>(
    stream: impl Iterator<Item = T> + Send + 'a,
    world_size: usize,
    rank: usize,
) -> Result<Box<dyn Iterator<Item = T> + Send + 'a>> {
    crate::partition::check_rank(world_size, rank)?;
    Ok(Box::new(stream.skip(rank).step_by(world_size)))
}

/// A view of some indices of another dataset (a train or eval split, one rank's partition, ...).
#[derive(Debug, Clone)]
pub struct Subset<D> {
    inner: D,
    indices: Arc<[usize]>,
    name: String,
}

impl<D: Dataset> Subset<D> {
    /// The samples `indices[0], indices[1], ...` of `inner`; every index must be in range.
    pub fn new(inner: D, indices: Vec<usize>) -> Result<Self> {
        let len = inner.len();
        let name = inner.info().name;
        if let Some(&bad) = indices.iter().find(|&&i| i >= len) {
            return Err(Error::OutOfRange { dataset: name, index: bad, len });
        }
        Ok(Subset { inner, indices: indices.into(), name })
    }

    /// The indices into the inner dataset.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }
}

impl<D: Dataset> Dataset for Subset<D> {
    fn info(&self) -> DatasetInfo {
        DatasetInfo { len: self.indices.len(), ..self.inner.info() }
    }
    fn len(&self) -> usize {
        self.indices.len()
    }
    fn get(&self, index: usize) -> Result<Sample> {
        check_index(&self.name, index, self.indices.len())?;
        self.inner.get(self.indices[index])
    }
}

/// Splits `0..len` into (train, eval) index lists with a seeded shuffle; `eval_fraction` in `[0, 1)`, at least one
/// eval index when the fraction is positive and `len > 1`.
pub fn train_eval_split(len: usize, eval_fraction: f64, seed: u64) -> Result<(Vec<usize>, Vec<usize>)> {
    if !(0.0..1.0).contains(&eval_fraction) {
        return Err(crate::error::invalid("eval_fraction", format!("{eval_fraction} is not in [0, 1)")));
    }
    let n_eval = shoal_spec::data::eval_count(len, eval_fraction);
    let perm = crate::rng::permutation(len, &[seed, 0xE7A1]);
    let (eval, train) = perm.split_at(n_eval);
    let (mut train, mut eval) = (train.to_vec(), eval.to_vec());
    train.sort_unstable();
    eval.sort_unstable();
    Ok((train, eval))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Count(usize);
    impl Dataset for Count {
        fn info(&self) -> DatasetInfo {
            DatasetInfo {
                name: "count".into(),
                kind: Kind::Tabular,
                len: self.0,
                features: 1,
                classes: 0,
                description: String::new(),
            }
        }
        fn len(&self) -> usize {
            self.0
        }
        fn get(&self, index: usize) -> Result<Sample> {
            check_index("count", index, self.0)?;
            Ok(Sample { features: Features::Dense(vec![index as f32]), label: Label::None })
        }
    }

    #[test]
    fn subset_maps_and_checks() {
        let s = Subset::new(Count(10), vec![3, 7]).expect("in range");
        assert_eq!(s.len(), 2);
        assert_eq!(s.get(1).expect("ok").features.as_dense(), Some(&[7.0f32][..]));
        assert!(matches!(s.get(2), Err(Error::OutOfRange { index: 2, len: 2, .. })));
        assert!(matches!(Subset::new(Count(3), vec![3]), Err(Error::OutOfRange { index: 3, .. })));
    }

    #[test]
    fn streams_shard_disjointly() {
        let d = Streamed(Count(10));
        let mut all: Vec<f32> = Vec::new();
        for r in 0..3 {
            for s in d.stream(3, r).expect("valid rank") {
                all.push(s.expect("ok").features.as_dense().expect("dense")[0]);
            }
        }
        all.sort_by(f32::total_cmp);
        assert_eq!(all, (0..10).map(|i| i as f32).collect::<Vec<_>>());
        assert!(d.stream(3, 3).is_err());
        let shard: Vec<i32> = shard_stream(0..7, 2, 1).expect("ok").collect();
        assert_eq!(shard, vec![1, 3, 5]);
    }

    #[test]
    fn split_is_disjoint_and_covering() {
        let (train, eval) = train_eval_split(100, 0.2, 5).expect("ok");
        assert_eq!((train.len(), eval.len()), (80, 20));
        let mut all = [train.clone(), eval].concat();
        all.sort_unstable();
        assert_eq!(all, (0..100).collect::<Vec<_>>());
        assert_eq!(train_eval_split(100, 0.2, 5).expect("ok").0, train);
        assert!(train_eval_split(10, 1.0, 0).is_err());
        assert_eq!(train_eval_split(1, 0.5, 0).expect("ok"), (vec![0], vec![]));
    }

    #[test]
    fn kind_serialises_lowercase() {
        assert_eq!(serde_json::to_string(&Kind::Synthetic).expect("json"), "\"synthetic\"");
        assert_eq!(Kind::Image.to_string(), "image");
    }
}
