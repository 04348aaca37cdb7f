//! `deploy/`: the Helm chart and the Dockerfile, checked by `scripts/validate-deploy.sh` — the chart linted and
//! rendered by Helm's own engine under several sets of values, what each render holds, every manifest validated
//! strictly against Kubernetes 1.30's schemas, values that contradict each other refused, and the Dockerfile
//! linted by hadolint; and what `shoal k8s manifests` prints for the examples, validated the same way and checked
//! (a Pod per rank, rank 0 hosting the rendezvous store, the job secret from the Secret). The tools come from PyPI into a cache outside the checkout; without PyPI this test fails
//! (saying so) rather than skipping. No Docker engine is involved: the image itself is not built by the tests.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

#[test]
fn the_chart_and_the_dockerfile_validate() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/validate-deploy.sh");
    let t0 = Instant::now();
    let out = Command::new("bash")
        .arg(&script)
        .env("SHOAL_BIN", env!("CARGO_BIN_EXE_shoal"))
        .output()
        .expect("run scripts/validate-deploy.sh");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "scripts/validate-deploy.sh failed ({}):\n{said}", out.status);
    // Every part ran: a script that passed without checking anything would be worse than a failure.
    let parts = [
        "helm lint + render [defaults]",
        "refused as they should be",
        "shoal k8s manifests [platform_digits]",
        "shoal k8s manifests [mlp_digits]",
        "kubernetes-validate --strict",
        "clean",
    ];
    for part in parts {
        assert!(said.contains(part), "scripts/validate-deploy.sh printed no {part:?}:\n{said}");
    }
    eprintln!("{said}validated deploy/ in {:.1} s", t0.elapsed().as_secs_f64());
}
