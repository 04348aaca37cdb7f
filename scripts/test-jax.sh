#!/usr/bin/env bash
# A Python with JAX (CPU) for Shoal's tests of jobs that run their own program
# (`train.command`): a virtual environment built once from PyPI and reused.
#
#   scripts/test-jax.sh     prints the environment's python (one line, an
#                           absolute path) on stdout, building it first if needed
#
# The platform runs tasks as an unprivileged user (`shoal`) when its server runs
# as root, so as root the environment is built from the system's python
# (/usr/bin/python3, not one under root's home) into /var/cache/shoal, readable
# by every user; otherwise into ${XDG_CACHE_HOME:-$HOME/.cache}/shoal. Its
# directory is py-jax-VERSION (about 620 MB; 25 s to build here), keyed by the
# pinned versions; concurrent callers are serialised by flock on
# /tmp/shoal-jax-install.lock so only one of them builds it. Everything but the
# path goes to stderr.
set -euo pipefail

readonly JAX_VERSION=0.10.2
readonly NUMPY_SPEC='numpy<3'
if [ "$(id -u)" = 0 ]; then
  readonly CACHE=/var/cache/shoal
else
  readonly CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/shoal"
fi
if [ -x /usr/bin/python3 ]; then readonly BASE=/usr/bin/python3; else readonly BASE=python3; fi
readonly VENV="$CACHE/py-jax-$JAX_VERSION"
readonly LOCK=/tmp/shoal-jax-install.lock

log() { printf 'test-jax: %s\n' "$*" >&2; }

mkdir -p "$CACHE"
exec 9>"$LOCK"
flock 9
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import jax, numpy" >/dev/null 2>&1; then
  log "building $VENV (jax $JAX_VERSION from PyPI)"
  # Built aside and moved into place whole: a build cut short leaves nothing that looks ready. (Only the
  # environment's python is used, which finds its packages wherever the directory lies.)
  rm -rf "$VENV.partial" "$VENV"
  "$BASE" -m venv "$VENV.partial" >&2
  "$VENV.partial/bin/python" -m pip install --quiet --disable-pip-version-check "jax==$JAX_VERSION" "$NUMPY_SPEC" >&2
  chmod -R a+rX "$VENV.partial"
  mv "$VENV.partial" "$VENV"
fi
"$VENV/bin/python" -c "import jax; assert jax.__version__ == '$JAX_VERSION', jax.__version__" >&2
echo "$VENV/bin/python"
