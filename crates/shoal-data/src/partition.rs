//! Static partitioning of a dataset across ranks: by samples (random or contiguous shards) or by feature columns
//! (for model-parallel layouts where every rank sees every sample but only some of its columns).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::invalid;
use crate::{Error, Result};

/// How a dataset is split across `world_size` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Partition {
    /// A seeded permutation of all indices, cut into contiguous pieces: balanced and class-mixed.
    Random { seed: u64 },
    /// Contiguous shards in index order: rank `r` gets the `r`-th block (the first `len % world_size` ranks one
    /// more sample than the others).
    Contiguous,
    /// Every rank gets every sample, but only a contiguous range of the feature columns (see
    /// [`Partition::columns`]).
    FeatureColumns,
}

pub(crate) fn check_rank(world_size: usize, rank: usize) -> Result<()> {
    if world_size == 0 {
        return Err(invalid("world_size", "must be at least 1"));
    }
    if rank >= world_size {
        return Err(invalid("rank", format!("{rank} is not below the world size {world_size}")));
    }
    Ok(())
}

/// The `part`-th of `parts` near-equal contiguous pieces of `0..len`: sizes differ by at most one, the larger
/// pieces first.
pub fn block(len: usize, parts: usize, part: usize) -> Range<usize> {
    let (base, extra) = (len / parts, len % parts);
    let start = part * base + part.min(extra);
    start..start + base + usize::from(part < extra)
}

impl Partition {
    /// The sample indices of `rank` out of `world_size` for a dataset of `len` samples. Over all ranks, `Random`
    /// and `Contiguous` give every index exactly once; `FeatureColumns` gives every rank all indices.
    pub fn indices(&self, len: usize, world_size: usize, rank: usize) -> Result<Vec<usize>> {
        check_rank(world_size, rank)?;
        Ok(match *self {
            Partition::Contiguous => block(len, world_size, rank).collect(),
            Partition::Random { seed } => {
                let perm = crate::rng::permutation(len, &[seed, 0x9A27]);
                perm[block(len, world_size, rank)].to_vec()
            }
            Partition::FeatureColumns => (0..len).collect(),
        })
    }

    /// The feature columns of `rank`: for `FeatureColumns`, its contiguous share of `0..features`; for the
    /// sample-wise partitions, all of them. An error when there are fewer columns than ranks.
    pub fn columns(&self, features: usize, world_size: usize, rank: usize) -> Result<Range<usize>> {
        check_rank(world_size, rank)?;
        match self {
            Partition::FeatureColumns if features < world_size => Err(Error::Invalid {
                what: "feature partition",
                reason: format!("{features} feature columns cannot be split over {world_size} ranks"),
            }),
            Partition::FeatureColumns => Ok(block(features, world_size, rank)),
            _ => Ok(0..features),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn assert_exactly_once(p: Partition, len: usize, world: usize) {
        let mut seen = vec![0u8; len];
        let mut sizes = Vec::new();
        for r in 0..world {
            let idx = p.indices(len, world, r).expect("valid");
            sizes.push(idx.len());
            for i in idx {
                seen[i] += 1;
            }
        }
        assert!(seen.iter().all(|&c| c == 1), "{p:?} len {len} world {world}");
        let (min, max) = (sizes.iter().min().copied(), sizes.iter().max().copied());
        assert!(max.unwrap_or(0) - min.unwrap_or(0) <= 1, "unbalanced {sizes:?}");
    }

    proptest! {
        #[test]
        fn random_and_contiguous_cover_every_index_once(len in 0usize..600, world in 1usize..12, seed: u64) {
            assert_exactly_once(Partition::Contiguous, len, world);
            assert_exactly_once(Partition::Random { seed }, len, world);
        }

        #[test]
        fn feature_columns_tile_the_features(features in 1usize..300, world in 1usize..12) {
            prop_assume!(features >= world);
            let mut next = 0;
            for r in 0..world {
                let c = Partition::FeatureColumns.columns(features, world, r).expect("valid");
                prop_assert_eq!(c.start, next);
                prop_assert!(!c.is_empty());
                next = c.end;
            }
            prop_assert_eq!(next, features);
        }
    }

    #[test]
    fn random_depends_on_seed_and_contiguous_is_ordered() {
        let a = Partition::Random { seed: 1 }.indices(100, 4, 0).expect("ok");
        let b = Partition::Random { seed: 2 }.indices(100, 4, 0).expect("ok");
        assert_ne!(a, b);
        assert_eq!(a, Partition::Random { seed: 1 }.indices(100, 4, 0).expect("ok"));
        assert_eq!(Partition::Contiguous.indices(10, 3, 0).expect("ok"), vec![0, 1, 2, 3]);
        assert_eq!(Partition::Contiguous.indices(10, 3, 2).expect("ok"), vec![7, 8, 9]);
        assert_eq!(Partition::FeatureColumns.indices(3, 2, 1).expect("ok"), vec![0, 1, 2]);
        assert_eq!(Partition::Contiguous.columns(64, 4, 3).expect("ok"), 0..64);
        assert_eq!(Partition::FeatureColumns.columns(64, 3, 2).expect("ok"), 43..64);
    }

    #[test]
    fn bad_ranks_and_too_few_columns_are_errors() {
        assert!(Partition::Contiguous.indices(10, 0, 0).is_err());
        assert!(Partition::Contiguous.indices(10, 2, 2).is_err());
        assert!(Partition::FeatureColumns.columns(3, 4, 0).is_err());
    }
}
