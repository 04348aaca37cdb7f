//! How a model's parameters are spread over `S` servers: the tensors, in order, read as one flat run of values
//! cut into `S` contiguous parts as equal as rows allow. A tensor larger than a server's share is split across
//! servers; small ones share a server; every cut falls on a row boundary of the tensor it cuts, so a row of an
//! embedding table — what a sparse push or pull moves — always lives on one server.

use std::ops::Range;

use crate::error::{PsError, Result};

/// A named parameter as the plan sees it: its number of values and the length of one of its rows (the product of
/// its dimensions after the first; 1 for a vector).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    pub name: String,
    pub len: usize,
    pub row: usize,
}

/// A run of `len` values of a server's shard from value `start`: what a sparse push or pull moves (rows of an
/// embedding table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Span {
    pub start: u64,
    pub len: u32,
}

/// A contiguous part of one tensor (by index among the plan's tensors): the values `range` of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub tensor: usize,
    pub range: Range<usize>,
}

/// Which server holds which pieces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    /// Per server, its pieces in the tensors' order.
    pub servers: Vec<Vec<Piece>>,
}

impl ShardPlan {
    /// The plan for `tensors` over `servers` servers: server `s` holds the values from the `s`-th to the
    /// `(s+1)`-th cut of the flat run, each cut the ideal `s · total / servers` moved to the nearest row boundary.
    pub fn new(tensors: &[Tensor], servers: usize) -> Result<ShardPlan> {
        if servers == 0 {
            return Err(PsError::InvalidArgument("a parameter server needs at least one server".into()));
        }
        for t in tensors {
            if t.row == 0 || t.len % t.row != 0 {
                return Err(PsError::InvalidArgument(format!(
                    "tensor {} has {} values, not whole rows of {}",
                    t.name, t.len, t.row
                )));
            }
        }
        let starts: Vec<usize> = tensors
            .iter()
            .scan(0usize, |at, t| {
                let start = *at;
                *at += t.len;
                Some(start)
            })
            .collect();
        let total: usize = tensors.iter().map(|t| t.len).sum();
        // The cuts, the first at 0 and the last at the end.
        let mut cuts = Vec::with_capacity(servers + 1);
        cuts.push(0);
        for s in 1..servers {
            let ideal = (total as u128 * s as u128 / servers as u128) as usize;
            let cut = match starts.partition_point(|&st| st <= ideal).checked_sub(1) {
                Some(k) => {
                    let (start, t) = (starts[k], &tensors[k]);
                    let rows = ((ideal - start) as f64 / t.row as f64).round() as usize;
                    start + (rows * t.row).min(t.len)
                }
                None => 0,
            };
            let last = cuts.last().copied().unwrap_or(0);
            cuts.push(cut.max(last));
        }
        cuts.push(total);
        let servers = cuts
            .windows(2)
            .map(|w| {
                tensors
                    .iter()
                    .enumerate()
                    .filter_map(|(k, t)| {
                        let (a, b) = (w[0].max(starts[k]), w[1].min(starts[k] + t.len));
                        (a < b).then(|| Piece { tensor: k, range: a - starts[k]..b - starts[k] })
                    })
                    .collect()
            })
            .collect();
        Ok(ShardPlan { servers })
    }

    /// How many values each server holds.
    pub fn sizes(&self) -> Vec<usize> {
        self.servers.iter().map(|p| p.iter().map(|p| p.range.len()).sum()).collect()
    }

    /// The server holding value `offset` of tensor `tensor`, and where in that server's run of values it is.
    pub fn locate(&self, tensor: usize, offset: usize) -> Option<(usize, usize)> {
        self.servers.iter().enumerate().find_map(|(s, pieces)| {
            let mut at = 0;
            for p in pieces {
                if p.tensor == tensor && p.range.contains(&offset) {
                    return Some((s, at + offset - p.range.start));
                }
                at += p.range.len();
            }
            None
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn t(name: &str, rows: usize, row: usize) -> Tensor {
        Tensor { name: name.into(), len: rows * row, row }
    }

    #[test]
    fn a_large_table_is_split_on_row_boundaries_and_small_tensors_share_a_server() -> Result<()> {
        // An embedding table of 1000 rows of 8, then a 8 × 4 weight and a bias of 4: 8036 values over 2 servers.
        let tensors = [t("emb", 1000, 8), t("w", 8, 4), t("b", 4, 1)];
        let plan = ShardPlan::new(&tensors, 2)?;
        // The ideal cut, 4018, falls in row 502.25 of the table: it moves to row 502.
        assert_eq!(plan.servers[0], vec![Piece { tensor: 0, range: 0..4016 }]);
        assert_eq!(
            plan.servers[1],
            vec![
                Piece { tensor: 0, range: 4016..8000 },
                Piece { tensor: 1, range: 0..32 },
                Piece { tensor: 2, range: 0..4 }
            ]
        );
        assert_eq!(plan.sizes(), vec![4016, 4020]);
        assert_eq!(plan.locate(0, 4015), Some((0, 4015)));
        assert_eq!(plan.locate(0, 4016), Some((1, 0)));
        assert_eq!(plan.locate(2, 3), Some((1, 3984 + 32 + 3)));
        assert_eq!(plan.locate(2, 4), None);
        Ok(())
    }

    #[test]
    fn bad_plans_are_refused_naming_the_tensor() {
        assert!(ShardPlan::new(&[t("a", 2, 2)], 0).is_err());
        let odd = Tensor { name: "odd".into(), len: 7, row: 2 };
        let e = ShardPlan::new(&[odd], 2).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("odd") && e.contains("rows of 2"), "{e}");
        assert_eq!(ShardPlan::new(&[], 3).map(|p| p.sizes()).ok(), Some(vec![0, 0, 0]));
    }

    proptest! {
        /// Every value lies on exactly one server, in order; every cut is on a row boundary; and each server holds
        /// its share of the values to within a row.
        #[test]
        fn every_value_once_on_row_boundaries_and_balanced(
            shapes in prop::collection::vec((1usize..300, 1usize..20), 1..12),
            servers in 1usize..7,
        ) {
            let tensors: Vec<Tensor> =
                shapes.iter().enumerate().map(|(k, &(rows, row))| t(&format!("t{k}"), rows, row)).collect();
            let plan = ShardPlan::new(&tensors, servers).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let flat: Vec<(usize, usize)> = plan
                .servers
                .iter()
                .flatten()
                .flat_map(|p| p.range.clone().map(move |i| (p.tensor, i)))
                .collect();
            let want: Vec<(usize, usize)> =
                tensors.iter().enumerate().flat_map(|(k, t)| (0..t.len).map(move |i| (k, i))).collect();
            prop_assert_eq!(flat, want);
            for p in plan.servers.iter().flatten() {
                let row = tensors[p.tensor].row;
                prop_assert!(p.range.start % row == 0 && p.range.end % row == 0);
            }
            let total: usize = tensors.iter().map(|t| t.len).sum();
            let widest = tensors.iter().map(|t| t.row).max().unwrap_or(1);
            for size in plan.sizes() {
                let share = total as f64 / servers as f64;
                prop_assert!((size as f64 - share).abs() <= widest as f64 + 1.0, "{size} against {share}");
            }
        }
    }
}
