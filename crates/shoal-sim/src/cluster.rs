//! The simulated cluster: a nodes file, or `n` identical nodes.
//!
//! A nodes file is the Alibaba trace's node list, `sn,cpu_milli,memory_mib,gpu,model`: one node a row, its id,
//! CPU in thousandths of a core, memory in MiB, its number of GPUs and their model. GPU memory comes from the
//! model where it is known (P100, T4, V100M16: 16 GiB; V100M32: 32 GiB; A10: 24 GiB; A100: 80 GiB; other
//! models: 0, which no job of a trace asks for since traces carry no GPU-memory request).

use std::collections::BTreeMap;
use std::path::Path;

use shoal_sched::{Gpu, Node};

use crate::csv::{Row, Table};
use crate::error::{Result, SimError, read};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Device memory of a GPU model, 0 when unknown.
fn gpu_memory(model: &str) -> u64 {
    match model {
        "P100" | "T4" | "V100M16" => 16 * GIB,
        "V100M32" => 32 * GIB,
        "A10" => 24 * GIB,
        "A100" | "H100" => 80 * GIB,
        _ => 0,
    }
}

/// Reads a nodes file.
pub fn read_cluster(path: &Path) -> Result<Vec<Node>> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string());
    parse_cluster(&name, &read(path)?)
}

/// Parses a nodes file; `name` names it in errors.
pub fn parse_cluster(name: &str, text: &str) -> Result<Vec<Node>> {
    let t = Table::parse(name, text)?;
    let c = t.columns(&["sn", "cpu_milli", "memory_mib", "gpu", "model"], &[])?;
    let mut nodes = Vec::with_capacity(t.rows.len());
    let mut seen = std::collections::HashSet::new();
    for (line, fields) in &t.rows {
        let row = Row { file: t.file, line: *line, fields };
        let id = row.text(c[0]);
        if id.is_empty() {
            return Err(row.error("sn", "empty"));
        }
        if !seen.insert(id) {
            return Err(row.error("sn", format!("{id} appears twice")));
        }
        let gpus = row.uint("gpu", c[3], None)?;
        if gpus > 1024 {
            return Err(row.error("gpu", format!("more than 1024 GPUs on one node: '{gpus}'")));
        }
        let model = row.text(c[4]);
        nodes.push(Node {
            id: id.to_owned(),
            host: id.to_owned(),
            cpus_milli: row.uint("cpu_milli", c[1], None)?,
            memory_bytes: row.uint("memory_mib", c[2], None)?.saturating_mul(MIB),
            gpus: (0..gpus as u32)
                .map(|index| Gpu { index, memory_bytes: gpu_memory(model), kind: model.to_owned() })
                .collect(),
            labels: BTreeMap::new(),
        });
    }
    if nodes.is_empty() {
        return Err(SimError::Empty { what: format!("{name}: the cluster") });
    }
    Ok(nodes)
}

/// `nodes` identical nodes of `gpus_per_node` GPUs each: shoal-sched's synthetic node (128 cores, 2 TiB of
/// memory, 80 GiB GPUs).
pub fn homogeneous(nodes: usize, gpus_per_node: usize) -> Result<Vec<Node>> {
    if nodes == 0 {
        return Err(SimError::Empty { what: "the cluster (--nodes 0)".into() });
    }
    Ok(shoal_sched::synthetic_cluster(nodes, gpus_per_node))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alibaba_nodes_with_their_gpus() -> Result<()> {
        let nodes =
            parse_cluster("n.csv", "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,1024,2,P100\nn1,96000,2048,0,\n")?;
        assert_eq!(nodes.len(), 2);
        assert_eq!((nodes[0].cpus_milli, nodes[0].memory_bytes, nodes[0].gpus.len()), (64_000, 1 << 30, 2));
        assert_eq!(nodes[0].gpus[1].memory_bytes, 16 * GIB);
        assert!(nodes[1].gpus.is_empty());
        Ok(())
    }

    #[test]
    fn bad_nodes_are_refused_with_their_line() {
        for (text, want) in [
            ("sn,cpu_milli,memory_mib,gpu,model\nn0,x,1,1,T4\n", "n.csv line 2: cpu_milli: not a whole number: 'x'"),
            ("sn,cpu_milli,memory_mib,gpu,model\nn0,1,1,1,T4\nn0,1,1,1,T4\n", "n.csv line 3: sn: n0 appears twice"),
            (
                "sn,cpu_milli,memory_mib,gpu,model,rack\n",
                "n.csv line 1: unknown column(s) rack; expected sn,cpu_milli,memory_mib,gpu,model",
            ),
            ("sn,cpu_milli,memory_mib,gpu,model\n", "n.csv: the cluster is empty"),
        ] {
            let got = parse_cluster("n.csv", text).map(|_| ()).map_err(|e| e.to_string());
            assert_eq!(got, Err(want.to_owned()));
        }
    }
}
