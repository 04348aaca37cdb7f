//! Ingestion: new lines of every rank's metrics file copied into the store, whole lines only, steps already stored
//! skipped (a resumed run rewrites its files shorter).

use std::path::PathBuf;

use crate::db::MetricRow;

use super::state::Control;

impl Control {
    /// Copies new lines of every rank's metrics file (and rank 0's `eval.jsonl`, stored as rank -1) into the store.
    pub(super) async fn ingest_metrics(&self, id: &str, world: i64) {
        let dir = self.run_dir(id);
        for rank in -1..world.max(1) {
            let path = match rank {
                -1 => dir.join("eval.jsonl"),
                0 => dir.join("metrics.jsonl"),
                r => dir.join(format!("metrics.rank-{r}.jsonl")),
            };
            self.ingest_file(id, rank, &path).await;
        }
    }

    pub(super) async fn ingest_file(&self, id: &str, rank: i64, path: &std::path::Path) {
        let key = (id.to_owned(), rank);
        let known = self.ingested.lock().unwrap_or_else(|p| p.into_inner()).get(&key).copied();
        let (start, min_step) = match known {
            Some(k) => k,
            // First look (or after a restart or a new attempt): read from the top, skipping steps already stored.
            None => (0, self.db.last_metric_step(id, rank).await.unwrap_or(-1)),
        };
        let Ok((tail, len)) = read_from_async(path.to_path_buf(), start, usize::MAX).await else {
            return;
        };
        // A file rewritten shorter (a resumed run drops the steps it redoes) is read again from where it ends now.
        let start = start.min(len) as usize;
        let tail = tail.as_slice();
        // Only whole lines.
        let Some(end) = tail.iter().rposition(|&b| b == b'\n') else {
            self.ingested.lock().unwrap_or_else(|p| p.into_inner()).insert(key, (start as u64, min_step));
            return;
        };
        let mut rows = Vec::new();
        for line in tail[..end].split(|&b| b == b'\n') {
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(line) else { continue };
            let Some(step) = v.get("step").and_then(serde_json::Value::as_i64) else { continue };
            if step <= min_step {
                continue;
            }
            rows.push(MetricRow { rank, step, time_ms: self.db.now(), data: v });
        }
        if !rows.is_empty()
            && let Err(e) = self.db.insert_metrics(id, &rows).await
        {
            tracing::warn!(job = id, error = %e, "storing metrics failed");
            return;
        }
        let last = rows.last().map_or(min_step, |r| r.step.max(min_step));
        self.ingested.lock().unwrap_or_else(|p| p.into_inner()).insert(key, ((start + end + 1) as u64, last));
    }
}

/// Reads at most `max` bytes of `path` from byte `from` on ([`shoal_exec::procfs::read_from`]) on a blocking-I/O
/// thread, for async code (a log read from its start can be large).
pub async fn read_from_async(path: PathBuf, from: u64, max: usize) -> std::io::Result<(Vec<u8>, u64)> {
    tokio::task::spawn_blocking(move || shoal_exec::procfs::read_from(&path, from, max))
        .await
        .map_err(std::io::Error::other)?
}
