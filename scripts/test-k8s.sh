#!/usr/bin/env bash
# A real Kubernetes control plane on this machine for the Kubernetes executor's tests: Debian's etcd, and
# kube-apiserver, kube-controller-manager (garbage collection of owned objects) and kube-scheduler (binding Pods to
# Nodes, saying why one is unschedulable), built once from Debian's source package `kubernetes` (v1.20.2). There is no
# kubelet: the tests run a stand-in that plays the Nodes' part (crates/shoal/tests/it/kubelet.rs).
#
#   scripts/test-k8s.sh start   builds the binaries when they are not cached, then starts a fresh control plane (any
#                               previous one of this script is stopped and its state wiped); prints one line
#                               `OK KUBECONFIG=... API=... version=...` on stdout once the API server is ready
#   scripts/test-k8s.sh stop    stops it
#
# Env:
#   SHOAL_K8S_DIR    state, certificates and logs (default /tmp/shoal-k8s), outside the checkout
#   SHOAL_K8S_CACHE  where the built binaries are kept (default ~/.cache/shoal/kube-1.20.2/bin; filling it takes
#                    6-10 minutes on 2 cores, once per machine)
#   SHOAL_K8S_PORT   the API server's port on 127.0.0.1 (default 16443; etcd uses 12379 and 12380)
#
# The build: `apt-get source kubernetes` (deb-src entries are derived from the configured Debian sources when
# missing), its vendored reflect2 1.0.1 replaced by Debian's 1.0.2 (1.0.1 makes Go >= 1.18 builds panic at run time
# in JSON decoding), then the tree's own `make WHAT=cmd/...` in GOPATH mode from vendor/ with GOPROXY=off.
# apt-get runs only when a tool is missing; concurrent starts are serialised by flock. Everything but the OK line
# goes to stderr.
set -euo pipefail

readonly VERSION=1.20.2
readonly DIR=${SHOAL_K8S_DIR:-/tmp/shoal-k8s}
readonly CACHE=${SHOAL_K8S_CACHE:-$HOME/.cache/shoal/kube-$VERSION/bin}
readonly PORT=${SHOAL_K8S_PORT:-16443}
readonly ETCD_PORT=12379
readonly ETCD_PEER_PORT=12380
readonly TOKEN=shoal-test-admin
readonly COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler)

log() { printf 'test-k8s: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

stop_all() {
  local n pid
  for n in kube-scheduler kube-controller-manager kube-apiserver etcd; do
    [ -s "$DIR/$n.pid" ] || continue
    pid=$(cat "$DIR/$n.pid")
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$DIR/$n.pid"
  done
}

if [ "${1:-start}" = stop ]; then
  stop_all
  exit 0
fi
[ "${1:-start}" = start ] || die "usage: $0 start|stop"
[ "$(id -u)" = 0 ] || die "needs root (apt-get, and a control plane that the stand-in kubelet runs Pods for as root)"

exec 9>/tmp/shoal-k8s.lock
flock -w 1200 9 || die "another start holds /tmp/shoal-k8s.lock"

# 1. tools
need=()
command -v etcd >/dev/null || need+=(etcd-server)
command -v openssl >/dev/null || need+=(openssl)
command -v curl >/dev/null || need+=(curl ca-certificates)
missing=0
for c in "${COMPONENTS[@]}"; do [ -x "$CACHE/$c" ] || missing=1; done
if [ $missing = 1 ]; then
  command -v go >/dev/null || need+=(golang-go)
  for p in make rsync; do command -v "$p" >/dev/null || need+=("$p"); done
  [ -d /usr/share/gocode/src/github.com/modern-go/reflect2 ] || need+=(golang-github-modern-go-reflect2-dev)
fi
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi

# 2. the binaries, built once
if [ $missing = 1 ]; then
  t0=$(date +%s)
  log "building ${COMPONENTS[*]} $VERSION from Debian's source package (once per machine; cached in $CACHE)"
  B=$(mktemp -d /tmp/shoal-k8s-build.XXXXXX)
  trap 'rm -rf "$B"' EXIT
  if [ -z "$(apt-cache showsrc kubernetes 2>/dev/null)" ]; then
    if [ -f /etc/apt/sources.list.d/debian.sources ]; then
      sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources \
        > /etc/apt/sources.list.d/shoal-k8s-src.sources
    else
      grep -h '^deb ' /etc/apt/sources.list | sed 's/^deb /deb-src /' > /etc/apt/sources.list.d/shoal-k8s-src.list
    fi
    apt-get update -qq >&2
  fi
  (cd "$B" && apt-get source --download-only kubernetes >&2) || die "apt-get source kubernetes failed"
  mkdir -p "$B/go/src/k8s.io"
  tar xzf "$B"/kubernetes_*.orig.tar.gz -C "$B/go/src/k8s.io"
  mv "$B"/go/src/k8s.io/kubernetes-* "$B/go/src/k8s.io/kubernetes"
  R=$B/go/src/k8s.io/kubernetes/vendor/github.com/modern-go/reflect2
  find "$R" -maxdepth 1 -name '*.go' -delete
  find /usr/share/gocode/src/github.com/modern-go/reflect2 -maxdepth 1 \( -name '*.go' -o -name '*.s' \) \
    ! -name '*_test.go' -exec cp {} "$R/" \;
  what=""
  for c in "${COMPONENTS[@]}"; do what="$what cmd/$c"; done
  (cd "$B/go/src/k8s.io/kubernetes" && GOPATH="$B/go" GOCACHE="$B/gocache" GOPROXY=off HOME="$B" \
    make WHAT="${what# }" >"$B/build.log" 2>&1) || { tail -30 "$B/build.log" >&2; die "the build failed"; }
  mkdir -p "$CACHE"
  for c in "${COMPONENTS[@]}"; do
    install -m 0755 "$B/go/src/k8s.io/kubernetes/_output/local/bin/linux/amd64/$c" "$CACHE/$c.tmp"
    mv "$CACHE/$c.tmp" "$CACHE/$c"
  done
  log "built in $(( $(date +%s) - t0 )) s"
fi

# 3. fresh state
stop_all
rm -rf "$DIR"
mkdir -p "$DIR/etcd" "$DIR/pki"
chmod 0700 "$DIR"
openssl genrsa -out "$DIR/pki/sa.key" 2048 2>/dev/null
openssl rsa -in "$DIR/pki/sa.key" -pubout -out "$DIR/pki/sa.pub" 2>/dev/null
echo "$TOKEN,admin,admin,system:masters" > "$DIR/pki/tokens.csv"

# 4. etcd, then the API server
ETCD_UNSUPPORTED_ARCH='' setsid etcd --name shoal-test --data-dir "$DIR/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "shoal-test=http://127.0.0.1:$ETCD_PEER_PORT" --listen-metrics-urls '' \
  </dev/null >"$DIR/etcd.log" 2>&1 9>&- &
echo $! > "$DIR/etcd.pid"
ok=0
for _ in $(seq 1 150); do
  if curl -fsS "http://127.0.0.1:$ETCD_PORT/health" 2>/dev/null | grep -q true; then ok=1; break; fi
  sleep 0.2
done
[ $ok = 1 ] || { tail -20 "$DIR/etcd.log" >&2; die "etcd did not become healthy within 30 s"; }

setsid "$CACHE/kube-apiserver" \
  --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$PORT" --insecure-port 0 \
  --cert-dir "$DIR/pki" --token-auth-file "$DIR/pki/tokens.csv" --authorization-mode RBAC \
  --service-account-issuer https://kubernetes.default.svc --service-account-key-file "$DIR/pki/sa.pub" \
  --service-account-signing-key-file "$DIR/pki/sa.key" \
  --service-cluster-ip-range 10.96.0.0/24 --allow-privileged --enable-priority-and-fairness=false \
  --disable-admission-plugins ServiceAccount,TaintNodesByCondition --endpoint-reconciler-type none \
  </dev/null >"$DIR/kube-apiserver.log" 2>&1 9>&- &
echo $! > "$DIR/kube-apiserver.pid"
ok=0
for _ in $(seq 1 300); do
  if [ "$(curl -ksS -H "Authorization: Bearer $TOKEN" "https://127.0.0.1:$PORT/readyz" 2>/dev/null)" = ok ]; then
    ok=1
    break
  fi
  kill -0 "$(cat "$DIR/kube-apiserver.pid")" 2>/dev/null || break
  sleep 0.2
done
[ $ok = 1 ] || { tail -30 "$DIR/kube-apiserver.log" >&2; die "kube-apiserver was not ready within 60 s"; }

# The API server wrote a self-signed serving certificate (SANs 127.0.0.1, kubernetes.default, ...) into --cert-dir.
cat > "$DIR/kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: shoal-test
  cluster: {server: "https://127.0.0.1:$PORT", certificate-authority: "$DIR/pki/apiserver.crt"}
users:
- name: admin
  user: {token: "$TOKEN"}
contexts:
- name: shoal-test
  context: {cluster: shoal-test, user: admin, namespace: default}
current-context: shoal-test
EOF

# 5. the controller manager (garbage collector, PersistentVolume binder, namespaces, ...) and the scheduler
setsid "$CACHE/kube-controller-manager" --kubeconfig "$DIR/kubeconfig" \
  --bind-address 127.0.0.1 --secure-port 0 --port 0 --leader-elect=false \
  --controllers '*,-nodeipam,-nodelifecycle,-attachdetach,-cloud-node-lifecycle' \
  --service-account-private-key-file "$DIR/pki/sa.key" --use-service-account-credentials=false \
  --root-ca-file "$DIR/pki/apiserver.crt" --cert-dir "$DIR/pki/kcm" \
  </dev/null >"$DIR/kube-controller-manager.log" 2>&1 9>&- &
echo $! > "$DIR/kube-controller-manager.pid"
setsid "$CACHE/kube-scheduler" --kubeconfig "$DIR/kubeconfig" \
  --bind-address 127.0.0.1 --secure-port 0 --port 0 --leader-elect=false --cert-dir "$DIR/pki/sched" \
  </dev/null >"$DIR/kube-scheduler.log" 2>&1 9>&- &
echo $! > "$DIR/kube-scheduler.pid"
sleep 1
for n in kube-controller-manager kube-scheduler; do
  kill -0 "$(cat "$DIR/$n.pid")" 2>/dev/null || { tail -20 "$DIR/$n.log" >&2; die "$n exited at start"; }
done

version=$(curl -sS --cacert "$DIR/pki/apiserver.crt" -H "Authorization: Bearer $TOKEN" \
  "https://127.0.0.1:$PORT/version" | sed -n 's/.*"gitVersion": "\([^"]*\)".*/\1/p')
echo "OK KUBECONFIG=$DIR/kubeconfig API=https://127.0.0.1:$PORT version=$version logs=$DIR"
