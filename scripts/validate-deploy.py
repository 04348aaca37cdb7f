#!/usr/bin/env python3
"""Checks deploy/: the Helm chart linted and rendered by Helm's own engine (helm-python-sdk: Helm v4's Go SDK)
under several sets of values, what each render holds (the server's arguments, probes, references between the
objects), every rendered manifest validated strictly against a pinned Kubernetes version's schemas
(kubernetes-validate --strict), values that contradict each other refused, and the Dockerfile linted (hadolint).
With SHOAL_BIN naming a shoal binary, the objects `shoal k8s manifests` prints for the examples are validated the
same way, and what they hold checked (a Pod per rank, rank 0 hosting the rendezvous store, the job secret taken
from the Secret, requests equal to limits), their YAML read back equal to their JSON.

Run by scripts/validate-deploy.sh inside its virtual environment; prints what it checked and exits non-zero
naming every failure.
"""

import base64
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "shoal"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
KUBE_VERSION = os.environ.get("SHOAL_VALIDATE_KUBE_VERSION", "1.30.0")
RELEASE = "shoal"
NAMESPACE = "ml"
# Every verb the Kubernetes executor may use on each resource it manages.
VERBS = {"create", "get", "list", "watch", "delete", "patch"}

# Sets of values rendered and validated, between them turning every option of the chart on.
SCENARIOS = {
    "defaults": {},
    "kubernetes-executor": {"executor": "kubernetes"},
    "local-executor": {"executor": "local", "persistence": {"enabled": False}},
    "postgresql-tls": {
        "postgresql": {"enabled": True},
        "tls": {"secretName": "shoal-tls"},
        "image": {"repository": "registry.example/shoal", "tag": "1.2.3"},
        "extraArgs": ["--allow-loader-env"],
        "extraEnv": [{"name": "SHOAL_LOG", "value": "debug"}],
        "nodeSelector": {"kubernetes.io/os": "linux"},
    },
    "existing-database": {
        "database": {"existingSecret": "shoal-db", "secretKey": "uri"},
        "persistence": {"existingClaim": "shoal-old-state"},
        "serviceAccount": {"create": False, "name": "shoal-runner"},
        "executor": "kubernetes",
        "workerImage": "registry.example/shoal-worker:1.2.3",
        "postgresql": {"auth": {"password": "Abc123"}},
    },
}

# Values the chart must refuse, with a part of the message it must refuse them with.
REFUSED = {
    "two databases": ({"postgresql": {"enabled": True}, "database": {"existingSecret": "x"}}, "choose one"),
    "an unknown executor": ({"executor": "slurm"}, "executor must be kubernetes or local"),
    "a password that is not URL-safe": (
        {"postgresql": {"enabled": True, "auth": {"password": "p@ss:word"}}},
        "letters and digits only",
    ),
    "the Kubernetes executor without a state volume": (
        {"executor": "kubernetes", "persistence": {"enabled": False}},
        "executor kubernetes needs persistence.enabled",
    ),
    "the Kubernetes executor without RBAC": (
        {"executor": "kubernetes", "rbac": {"create": False}, "serviceAccount": {"create": False}},
        "executor kubernetes needs rbac.create",
    ),
}

# Job specs `shoal k8s manifests` is run on (with SHOAL_BIN): the -n given (None: the spec's count), the ranks.
K8S_JOBS = {"platform_digits": (None, 2), "mlp_digits": (2, 2)}
K8S_NAMESPACE = "ml"

failures: list[str] = []


def fail(msg: str) -> None:
    failures.append(msg)
    print(f"FAIL: {msg}", flush=True)


def check(cond: bool, msg: str) -> bool:
    if not cond:
        fail(msg)
    return cond


def flag(args: list[str], name: str) -> str | None:
    """The value after `name` in an argument list, if it is there."""
    for i, a in enumerate(args[:-1]):
        if a == name:
            return args[i + 1]
    return None


def check_render(scenario: str, merged: dict, docs: list[dict]) -> None:
    where = f"[{scenario}]"
    objs: dict[tuple[str, str], dict] = {}
    for d in docs:
        key = (d.get("kind", "?"), d.get("metadata", {}).get("name", "?"))
        check(key not in objs, f"{where} {key[0]}/{key[1]} is rendered twice")
        objs[key] = d

    full = RELEASE  # the release's name already contains the chart's, so the full name is the release's
    pg = f"{full}-postgresql"
    kubernetes = merged["executor"] == "kubernetes"
    expected = {("Deployment", full), ("Service", full)}
    if merged["serviceAccount"]["create"]:
        expected.add(("ServiceAccount", merged["serviceAccount"]["name"] or full))
    if merged["rbac"]["create"] and kubernetes:
        nodes = f"{full}-{NAMESPACE}-nodes"
        expected |= {("Role", full), ("RoleBinding", full), ("ClusterRole", nodes), ("ClusterRoleBinding", nodes)}
    if merged["persistence"]["enabled"] and not merged["persistence"]["existingClaim"]:
        expected.add(("PersistentVolumeClaim", f"{full}-state"))
    if merged["postgresql"]["enabled"]:
        expected |= {("StatefulSet", pg), ("Service", pg), ("Secret", pg)}
    check(set(objs) == expected, f"{where} rendered {sorted(objs)}, expected {sorted(expected)}")

    for (kind, name), d in objs.items():
        meta = d.get("metadata", {})
        if kind in ("ClusterRole", "ClusterRoleBinding"):
            check("namespace" not in meta, f"{where} {kind}/{name} is cluster-scoped but names a namespace")
        else:
            check(meta.get("namespace") == NAMESPACE, f"{where} {kind}/{name} is not in the release's namespace")
        labels = meta.get("labels", {})
        for label in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by"):
            check(label in labels, f"{where} {kind}/{name} has no label {label}")

    dep = objs.get(("Deployment", full))
    if not dep:
        return
    spec = dep["spec"]
    pod = spec["template"]["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    check(spec.get("replicas") == 1, f"{where} the Deployment runs {spec.get('replicas')} replicas, not 1")
    check(spec.get("strategy", {}).get("type") == "Recreate", f"{where} the Deployment's strategy is not Recreate")
    check(
        all(pod_labels.get(k) == v for k, v in spec["selector"]["matchLabels"].items()),
        f"{where} the Deployment's selector does not match its pods",
    )
    check(pod.get("securityContext", {}).get("runAsNonRoot") is True, f"{where} the server may run as root")
    server = next((c for c in pod["containers"] if c["name"] == "server"), None)
    if not check(server is not None, f"{where} no container named server"):
        return
    args = server.get("args", [])
    image = f"{merged['image']['repository']}:{merged['image']['tag'] or '0.1.0'}"
    check(server.get("image") == image, f"{where} the server's image is {server.get('image')}, expected {image}")
    check(args[:1] == ["server"], f"{where} the container does not run `shoal server`: {args}")
    check(flag(args, "--listen") == "0.0.0.0:7733", f"{where} --listen is {flag(args, '--listen')}")
    check(flag(args, "--data-dir") == "/var/lib/shoal/data", f"{where} --data-dir is {flag(args, '--data-dir')}")
    envs = {e["name"]: e for e in server.get("env", [])}
    check(
        envs.get("SHOAL_DATA_DIR", {}).get("value") == "/var/lib/shoal/data",
        f"{where} SHOAL_DATA_DIR is not the data directory",
    )
    if kubernetes:
        worker = merged["workerImage"] or image
        check(flag(args, "--executor") == "kubernetes", f"{where} --executor is {flag(args, '--executor')}")
        check(flag(args, "--namespace") == NAMESPACE, f"{where} --namespace is {flag(args, '--namespace')}")
        check(flag(args, "--image") == worker, f"{where} --image is {flag(args, '--image')}, expected {worker}")
        claim = merged["persistence"]["existingClaim"] or f"{full}-state"
        check(flag(args, "--data-pvc") == claim, f"{where} --data-pvc is {flag(args, '--data-pvc')}, expected {claim}")
        check(flag(args, "--data-pvc-mount") == "/var/lib/shoal", f"{where} --data-pvc-mount is not the state mount")
        check(pod.get("automountServiceAccountToken") is True, f"{where} the executor's pod mounts no token")
    else:
        check("--executor" not in args and "--image" not in args, f"{where} local executor given {args}")
        check(pod.get("automountServiceAccountToken") is False, f"{where} a local executor's pod mounts a token")
    sa = pod.get("serviceAccountName")
    want_sa = merged["serviceAccount"]["name"] or (full if merged["serviceAccount"]["create"] else "default")
    check(sa == want_sa, f"{where} the pod's service account is {sa}, expected {want_sa}")

    db_secret = pg if merged["postgresql"]["enabled"] else merged["database"]["existingSecret"]
    if db_secret:
        check(flag(args, "--database") == "$(SHOAL_DATABASE_URL)", f"{where} --database is {flag(args, '--database')}")
        ref = envs.get("SHOAL_DATABASE_URL", {}).get("valueFrom", {}).get("secretKeyRef", {})
        key = "url" if merged["postgresql"]["enabled"] else merged["database"]["secretKey"]
        check(
            ref.get("name") == db_secret and ref.get("key") == key,
            f"{where} SHOAL_DATABASE_URL comes from {ref}, expected {db_secret}/{key}",
        )
    else:
        check("--database" not in args and "SHOAL_DATABASE_URL" not in envs, f"{where} a database with none named")

    tls = bool(merged["tls"]["secretName"])
    if tls:
        check(flag(args, "--tls-cert") == "/etc/shoal/tls/tls.crt", f"{where} --tls-cert is {flag(args, '--tls-cert')}")
        check(flag(args, "--tls-key") == "/etc/shoal/tls/tls.key", f"{where} --tls-key is {flag(args, '--tls-key')}")
        vol = next((v for v in pod["volumes"] if v["name"] == "tls"), {})
        check(vol.get("secret", {}).get("secretName") == merged["tls"]["secretName"], f"{where} no TLS volume")
    else:
        check("--tls-cert" not in args and "--tls-key" not in args, f"{where} TLS arguments without a secret")
    extra = merged["extraArgs"]
    check(not extra or args[-len(extra):] == extra, f"{where} extraArgs {extra} are not at the end of {args}")

    ports = {p["name"]: p["containerPort"] for p in server.get("ports", [])}
    check(ports == {"api": 7733}, f"{where} the server's ports are {ports}")
    for probe in ("livenessProbe", "readinessProbe"):
        get = server.get(probe, {}).get("httpGet", {})
        want = {"path": "/healthz", "port": "api", "scheme": "HTTPS" if tls else "HTTP"}
        check(get == want, f"{where} {probe} is {get}, expected {want}")
    check(server.get("resources", {}).get("requests"), f"{where} the server requests no resources")
    check(
        server.get("securityContext", {}).get("allowPrivilegeEscalation") is False,
        f"{where} the server may escalate privileges",
    )

    mounts = {m["name"]: m["mountPath"] for m in server.get("volumeMounts", [])}
    check(mounts.get("state") == "/var/lib/shoal", f"{where} the state volume is mounted at {mounts.get('state')}")
    state = next((v for v in pod["volumes"] if v["name"] == "state"), {})
    if merged["persistence"]["enabled"]:
        claim = merged["persistence"]["existingClaim"] or f"{full}-state"
        got = state.get("persistentVolumeClaim", {}).get("claimName")
        check(got == claim, f"{where} the state volume is claim {got}, expected {claim}")
    else:
        check("emptyDir" in state, f"{where} without persistence the state volume is {state}")
    check(("dshm" in mounts) == (not kubernetes), f"{where} /dev/shm is mounted with executor {merged['executor']}")
    if merged["postgresql"]["enabled"]:
        inits = [c["name"] for c in pod.get("initContainers", [])]
        check(inits == ["wait-for-postgresql"], f"{where} init containers {inits}")

    svc = objs.get(("Service", full))
    if svc:
        s = svc["spec"]
        check(s.get("type") == "ClusterIP", f"{where} the Service is of type {s.get('type')}")
        check(
            all(pod_labels.get(k) == v for k, v in s["selector"].items()),
            f"{where} the Service's selector {s['selector']} does not select the server's pods",
        )
        check(
            [(p["port"], p["targetPort"]) for p in s["ports"]] == [(7733, "api")],
            f"{where} the Service's ports are {s['ports']}",
        )

    role = objs.get(("Role", full))
    if role:
        granted: dict[tuple[str, str], set[str]] = {}
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for res in rule["resources"]:
                    granted.setdefault((group, res), set()).update(rule["verbs"])
        for group, res in (("", "pods"), ("", "services"), ("", "secrets")):
            got = granted.get((group, res), set())
            check(VERBS <= got, f"{where} the Role grants {sorted(got)} on {res}, missing {sorted(VERBS - got)}")
        check("*" not in {v for vs in granted.values() for v in vs}, f"{where} the Role grants every verb")
        rb = objs.get(("RoleBinding", full), {})
        check(rb.get("roleRef", {}).get("name") == full, f"{where} the RoleBinding binds {rb.get('roleRef')}")
        subjects = [(s["kind"], s["name"], s.get("namespace")) for s in rb.get("subjects", [])]
        check(
            subjects == [("ServiceAccount", want_sa, NAMESPACE)],
            f"{where} the RoleBinding's subjects are {subjects}",
        )

    nodes_role = f"{full}-{NAMESPACE}-nodes"
    cr = objs.get(("ClusterRole", nodes_role))
    check((cr is not None) == (kubernetes and merged["rbac"]["create"]), f"{where} ClusterRole {nodes_role}: {cr}")
    if cr:
        check(
            cr["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}],
            f"{where} the ClusterRole grants {cr['rules']}, not only reading Nodes",
        )
        crb = objs.get(("ClusterRoleBinding", nodes_role), {})
        subjects = [(s["kind"], s["name"], s.get("namespace")) for s in crb.get("subjects", [])]
        check(subjects == [("ServiceAccount", want_sa, NAMESPACE)], f"{where} the ClusterRoleBinding binds {subjects}")

    if merged["postgresql"]["enabled"]:
        sts = objs.get(("StatefulSet", pg), {})
        pg_svc = objs.get(("Service", pg), {})
        secret = objs.get(("Secret", pg), {})
        check(sts.get("spec", {}).get("serviceName") == pg, f"{where} the StatefulSet's service is not {pg}")
        check(pg_svc.get("spec", {}).get("clusterIP") == "None", f"{where} PostgreSQL's Service is not headless")
        pg_labels = sts.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
        check(
            all(pg_labels.get(k) == v for k, v in pg_svc.get("spec", {}).get("selector", {"-": "-"}).items()),
            f"{where} PostgreSQL's Service does not select its pod",
        )
        check(
            not all(pod_labels.get(k) == v for k, v in pg_svc.get("spec", {}).get("selector", {}).items()),
            f"{where} PostgreSQL's Service also selects the server's pods",
        )
        data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
        auth = merged["postgresql"]["auth"]
        password = data.get("password", "")
        check(password.isalnum() and len(password) >= 16 or password == auth["password"], f"{where} weak password")
        url = f"postgres://{auth['username']}:{password}@{pg}.{NAMESPACE}.svc:5432/{auth['database']}"
        check(data.get("url") == url, f"{where} the database URL in the Secret is not {url}")
        pg_env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
        ref = pg_env.get("POSTGRES_PASSWORD", {}).get("valueFrom", {}).get("secretKeyRef")
        check(ref == {"name": pg, "key": "password"}, f"{where} PostgreSQL's password comes from {ref}")


def check_job_manifests(job: str, n: int, docs: list[dict]) -> None:
    where = f"[k8s manifests {job}]"
    cm = next((d for d in docs if d["kind"] == "ConfigMap"), {})
    spec = json.loads(cm.get("data", {}).get("job.json", "{}"))
    check(spec.get("train", {}).get("dataset") == "digits", f"{where} the ConfigMap holds no job.json of the job")
    base = "shoal-" + spec.get("name", "?").lower()
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    want = sorted([("ConfigMap", base), ("Secret", base), ("Service", base)] + [("Pod", f"{base}-{r}") for r in range(n)])
    check(kinds == want, f"{where} objects {kinds}, expected {want}")
    for d in docs:
        check(d["metadata"].get("namespace") == K8S_NAMESPACE, f"{where} {d['kind']} is not in {K8S_NAMESPACE}")
    svc = next((d for d in docs if d["kind"] == "Service"), {})
    check(svc.get("spec", {}).get("clusterIP") == "None", f"{where} the Service is not headless")
    secret = next((d for d in docs if d["kind"] == "Secret"), {})
    keys = list(secret.get("stringData", {}))
    check(len(keys) == 1 and len(secret["stringData"][keys[0]]) == 32, f"{where} the Secret holds {keys}")
    rendezvous = f"{base}-0.{base}.{K8S_NAMESPACE}.svc:29400"
    pods = sorted((d for d in docs if d["kind"] == "Pod"), key=lambda d: int(d["metadata"]["labels"]["shoal.dev/rank"]))
    for rank, pod in enumerate(pods):
        p = f"{where} pod {rank}"
        check(pod["metadata"]["labels"].get("shoal.dev/rank") == str(rank), f"{p} is labelled rank {pod['metadata']}")
        check(
            all(pod["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items()),
            f"{p} is not selected by the Service",
        )
        check(pod["spec"].get("subdomain") == base and pod["spec"].get("hostname") == f"{base}-{rank}", f"{p} DNS")
        check(pod["spec"].get("restartPolicy") == "Never", f"{p} restarts")
        (c,) = pod["spec"]["containers"]
        env = {e["name"]: e for e in c.get("env", [])}
        check(env.get("SHOAL_RANK", {}).get("value") == str(rank), f"{p} SHOAL_RANK is {env.get('SHOAL_RANK')}")
        check(env.get("SHOAL_WORLD_SIZE", {}).get("value") == str(n), f"{p} SHOAL_WORLD_SIZE is wrong")
        check(env.get("SHOAL_RENDEZVOUS", {}).get("value") == rendezvous, f"{p} SHOAL_RENDEZVOUS is wrong")
        if rank == 0:
            check(env.get("SHOAL_RENDEZVOUS_HOST", {}).get("value") == "1", f"{p} does not host the store")
        ref = env.get("SHOAL_JOB_SECRET", {})
        check(
            "value" not in ref and ref.get("valueFrom", {}).get("secretKeyRef") == {"name": base, "key": keys[0]},
            f"{p} SHOAL_JOB_SECRET is {ref}, not from the Secret",
        )
        res = c.get("resources", {})
        check(res.get("requests") and res.get("requests") == res.get("limits"), f"{p} requests != limits: {res}")
        check(c.get("command", [])[:2] == ["shoal", "worker"], f"{p} runs {c.get('command')}")


def k8s_manifests(shoal: str, out: Path) -> list[Path]:
    """Runs `shoal k8s manifests` on the examples, checks what it prints; the YAML files to validate."""
    files = []
    for job, (workers, ranks) in K8S_JOBS.items():
        args = [shoal, "k8s", "manifests", str(ROOT / "examples" / f"{job}.toml"), "--namespace", K8S_NAMESPACE]
        args += ["-n", str(workers)] if workers else []
        texts = []
        for extra in ([], ["--json"]):
            r = subprocess.run(args + extra, capture_output=True, text=True)
            if not check(r.returncode == 0, f"{' '.join(args + extra)} failed: {r.stderr}"):
                return files
            texts.append(r.stdout)
        try:
            docs = [d for d in yaml.safe_load_all(texts[0]) if d]
        except yaml.YAMLError as e:
            fail(f"[k8s manifests {job}] the output is not YAML: {e}")
            continue
        # Each run draws its own secret; all else is the same, the YAML read back as the JSON.
        as_json, as_yaml = json.loads(texts[1]), json.loads(json.dumps(docs))
        for d in as_yaml + as_json:
            d.get("stringData", {}).update({k: "-" for k in d.get("stringData", {})})
        check(as_yaml == as_json, f"[k8s manifests {job}] the YAML does not read back as the JSON")
        check_job_manifests(job, ranks, docs)
        f = out / f"k8s-{job}.yaml"
        f.write_text(texts[0])
        files.append(f)
        kinds = ", ".join(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
        print(f"shoal k8s manifests [{job}]: {kinds}", flush=True)
    return files


def render(values: dict) -> tuple[dict, dict[str, str]]:
    with helm.Chart.load(str(CHART)) as chart:
        merged = chart.merge_values(values)
        return merged, chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def main() -> int:
    out = Path(tempfile.mkdtemp(prefix="shoal-deploy-validate-"))
    files: list[Path] = []

    for scenario, values in SCENARIOS.items():
        report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}")
        problems = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2] + [
            {"error": e} for e in report.get("errors", [])
        ]
        check(not problems, f"[{scenario}] helm lint --strict: {problems}")
        try:
            merged, manifests = render(values)
        except helm.HelmError as e:
            fail(f"[{scenario}] the chart does not render: {e}")
            continue
        text = "\n---\n".join(
            body.strip() for path, body in sorted(manifests.items()) if path.endswith(".yaml") and body.strip()
        )
        try:
            docs = [d for d in yaml.safe_load_all(text) if d]
        except yaml.YAMLError as e:
            fail(f"[{scenario}] the render is not YAML: {e}")
            continue
        check_render(scenario, merged, docs)
        f = out / f"{scenario}.yaml"
        f.write_text(text + "\n")
        files.append(f)
        kinds = ", ".join(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
        print(f"helm lint + render [{scenario}]: {kinds}", flush=True)

    for what, (values, message) in REFUSED.items():
        try:
            render(values)
            fail(f"the chart renders {what}: {values}")
        except helm.HelmError as e:
            check(message in str(e), f"the chart refuses {what} with {e!s}, not naming {message!r}")
    print(f"refused as they should be: {', '.join(REFUSED)}", flush=True)

    shoal = os.environ.get("SHOAL_BIN")
    if shoal:
        files += k8s_manifests(shoal, out)

    # The validator itself must catch a wrong field, or a pass means nothing.
    bad = out / "negative-control.yaml"
    bad.write_text("apiVersion: v1\nkind: Service\nmetadata:\n  name: x\nspec:\n  prots:\n    - port: 1\n")
    r = subprocess.run(
        ["kubernetes-validate", "--strict", "--quiet", "-k", KUBE_VERSION, str(bad)], capture_output=True, text=True
    )
    check(r.returncode != 0, f"kubernetes-validate --strict accepted an unknown field: {r.stdout}{r.stderr}")
    r = subprocess.run(
        ["kubernetes-validate", "--strict", "--quiet", "-k", KUBE_VERSION, *map(str, files)],
        capture_output=True,
        text=True,
    )
    said = (r.stdout + r.stderr).strip()
    if check(r.returncode == 0 and "ERROR" not in said, f"kubernetes-validate --strict -k {KUBE_VERSION}:\n{said}"):
        count = sum(1 for f in files for d in yaml.safe_load_all(f.read_text()) if d)
        print(f"kubernetes-validate --strict -k {KUBE_VERSION}: {count} manifests in {len(files)} renders valid")

    bad_dockerfile = "FROM debian\nRUN apt-get install curl\n"
    r = subprocess.run(["hadolint", "-"], input=bad_dockerfile, capture_output=True, text=True)
    check(r.returncode != 0, "hadolint accepted an unpinned image and apt-get without -y")
    version = subprocess.run(["hadolint", "--version"], capture_output=True, text=True).stdout.strip()
    r = subprocess.run(["hadolint", "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    said = (r.stdout + r.stderr).strip()
    if check(r.returncode == 0 and not said, f"hadolint {DOCKERFILE.relative_to(ROOT)}:\n{said}"):
        print(f"{version}: {DOCKERFILE.relative_to(ROOT)} clean", flush=True)

    if failures:
        print(f"\n{len(failures)} deploy check(s) failed; the renders are in {out}", flush=True)
        return 1
    for f in [*files, bad]:
        f.unlink()
    out.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
