#!/usr/bin/env bash
# Makes Prometheus' `promtool` available for the tests and prints its path (one line on stdout).
# Installs Debian's `prometheus` package (which ships promtool) when it is missing; needs root for that.
# Concurrent runs wait for each other on a lock instead of running apt twice.
set -euo pipefail

found() { command -v promtool 2>/dev/null || { [ -x /usr/bin/promtool ] && echo /usr/bin/promtool; } || true; }

p=$(found)
if [ -n "$p" ]; then echo "$p"; exit 0; fi
if [ "$(id -u)" != 0 ]; then
  echo "promtool is not installed and installing it (Debian package prometheus) needs root" >&2
  exit 1
fi
exec 9>/tmp/shoal-promtool-install.lock
flock 9
p=$(found)
if [ -z "$p" ]; then
  export DEBIAN_FRONTEND=noninteractive
  log=$(mktemp)
  t0=$(date +%s)
  # The package's post-install tries to start a service; in a container without an init that is skipped.
  if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus; } >"$log" 2>&1; then
    tail -20 "$log" >&2
    echo "apt-get failed: could not install prometheus (for promtool)" >&2
    exit 1
  fi
  # Never leave a Prometheus server running on the test machine.
  pkill -x prometheus 2>/dev/null || true
  echo "installed promtool in $(( $(date +%s) - t0 ))s" >&2
  p=$(found)
fi
[ -n "$p" ] || { echo "promtool still missing after installing prometheus" >&2; exit 1; }
echo "$p"
