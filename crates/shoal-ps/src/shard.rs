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

    /// Where each server's values lie in the flat run of all the tensors' values (server `s` holds `cuts()[s]`).
    pub fn cuts(&self) -> Vec<Range<usize>> {
        let mut at = 0;
        self.sizes()
            .into_iter()
            .map(|n| {
                let r = at..at + n;
                at += n;
                r
            })
            .collect()
    }

    /// Sends runs of the flat values to their servers: `runs` (start and length in the flat run of all the
    /// tensors' values, in order and apart) become each server's [`Span`]s in its own values, a run crossing a cut
    /// split in two, with the range of the runs' values (laid one after another) that goes to that server. A
    /// server no run reaches gets no spans and an empty range.
    pub fn route(&self, runs: &[(usize, usize)]) -> Result<Vec<(Vec<Span>, Range<usize>)>> {
        let cuts = self.cuts();
        let mut out: Vec<(Vec<Span>, Range<usize>)> = cuts.iter().map(|_| (Vec::new(), 0..0)).collect();
        let (mut end, mut at, mut s) = (0usize, 0usize, 0usize);
        for &(start, len) in runs {
            if start < end || cuts.last().is_none_or(|c| start + len > c.end) {
                return Err(PsError::InvalidArgument(format!(
                    "run {start}..+{len} is out of order, overlaps the one before, or reaches past the model's \
                     values"
                )));
            }
            end = start + len;
            let mut pos = start;
            while pos < end {
                while cuts[s].end <= pos {
                    s += 1;
                }
                let stop = end.min(cuts[s].end);
                let n = stop - pos;
                let len = u32::try_from(n)
                    .map_err(|_| PsError::InvalidArgument(format!("run {start}..+{len} is too long for one span")))?;
                let (spans, range) = &mut out[s];
                if spans.is_empty() {
                    *range = at..at;
                }
                spans.push(Span { start: (pos - cuts[s].start) as u64, len });
                range.end = at + n;
                at += n;
                pos = stop;
            }
        }
        Ok(out)
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
    fn runs_are_routed_to_their_servers_split_at_the_cuts() -> Result<()> {
        let tensors = [t("emb", 1000, 8), t("w", 8, 4), t("b", 4, 1)];
        let plan = ShardPlan::new(&tensors, 2)?;
        assert_eq!(plan.cuts(), vec![0..4016, 4016..8036]);
        // Row 3 of the table, row 600, and then the dense weight and bias together.
        let routed = plan.route(&[(24, 8), (4800, 8), (8000, 36)])?;
        assert_eq!(routed[0], (vec![Span { start: 24, len: 8 }], 0..8));
        assert_eq!(routed[1], (vec![Span { start: 784, len: 8 }, Span { start: 3984, len: 36 }], 8..52));
        // A run across the cut is split; a server no run reaches gets nothing.
        let routed = plan.route(&[(4008, 16)])?;
        assert_eq!(routed[0], (vec![Span { start: 4008, len: 8 }], 0..8));
        assert_eq!(routed[1], (vec![Span { start: 0, len: 8 }], 8..16));
        assert_eq!(plan.route(&[(0, 8)])?[1], (vec![], 0..0));
        assert!(plan.route(&[(16, 8), (8, 8)]).is_err());
        assert!(plan.route(&[(8030, 8)]).is_err());
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
