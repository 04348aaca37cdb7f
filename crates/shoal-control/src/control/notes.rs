//! What the executor says of a task that runs or waits to (a Pod no node can take, an image that cannot be
//! pulled): recorded in the job's events as a `waiting` event when it changes, once per change, so a job that sits
//! in a cluster's queue says why.

use crate::db::{JobRow, TaskRow};
use crate::error::Result;

use super::state::{Control, handle};

impl Control {
    /// Records the executor's note on `t` when it differs from the last one recorded (a note that clears is
    /// forgotten, so its return is recorded again).
    pub(super) async fn note(&self, job: &JobRow, t: &TaskRow) -> Result<()> {
        let key = (t.job_id.clone(), t.attempt, t.rank);
        let note = self.exec.notes(&handle(t));
        let changed = {
            let mut notes = self.notes.lock().unwrap_or_else(|p| p.into_inner());
            notes.retain(|(j, a, _), _| j != &t.job_id || *a == t.attempt);
            match &note {
                Some(n) if notes.get(&key) != Some(n) => {
                    notes.insert(key, n.clone());
                    true
                }
                Some(_) => false,
                None => {
                    notes.remove(&key);
                    false
                }
            }
        };
        if let (true, Some(n)) = (changed, note) {
            tracing::info!(job = %t.job_id, rank = t.rank, note = %n, "the executor says a task waits");
            self.db.event(&t.job_id, "waiting", job.state, &format!("rank {}: {n}", t.rank)).await?;
        }
        Ok(())
    }
}
