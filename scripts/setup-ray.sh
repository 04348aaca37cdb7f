#!/usr/bin/env bash
# Creates (once) a virtualenv with a pinned Ray and numpy for scripts/ps-ray.py, the Ray parameter-server baseline,
# and prints that venv's python on the last line of stdout (pip's chatter goes to stderr).
#
#   PY=$(scripts/setup-ray.sh | tail -n1) && "$PY" scripts/ps-ray.py --json
#
# The venv lives at ${SHOAL_CACHE:-$HOME/.cache/shoal}/ray-venv-<ray version>; a second run that finds it complete
# installs nothing. PYTHON picks the interpreter the venv is made from (default python3; it must be a CPython for
# which PyPI has a ray wheel of this version).
set -euo pipefail
RAY_VERSION=2.60.0
PYTHON=${PYTHON:-python3}
VENV="${SHOAL_CACHE:-$HOME/.cache/shoal}/ray-venv-$RAY_VERSION"
PY="$VENV/bin/python"

# Complete already: the pinned ray and numpy import.
ready() {
    [ -x "$PY" ] && "$PY" -c "import sys, numpy, ray; sys.exit(ray.__version__ != '$RAY_VERSION')" >/dev/null 2>&1
}

if ! ready; then
    echo "setup-ray: installing ray==$RAY_VERSION and numpy into $VENV" >&2
    mkdir -p "$(dirname "$VENV")"
    [ -x "$PY" ] || "$PYTHON" -m venv "$VENV" >&2
    "$PY" -m pip install --quiet --disable-pip-version-check "ray==$RAY_VERSION" numpy >&2
    ready || { echo "setup-ray: ray $RAY_VERSION still does not import from $PY" >&2; exit 1; }
fi
echo "$PY"
