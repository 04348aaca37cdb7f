#!/usr/bin/env bash
# A headless browser for Shoal's dashboard test: Debian's Chromium and
# playwright-core (the library only, no bundled browsers).
#
#   scripts/test-browser.sh     makes sure both are there; prints the
#                               node_modules directory holding playwright-core
#                               (one line) on stdout
#
# Env:
#   SHOAL_PLAYWRIGHT_VERSION  playwright-core version (default below)
#   SHOAL_BROWSER_CACHE       where playwright-core is installed (default
#                             ${XDG_CACHE_HOME:-$HOME/.cache}/shoal), outside
#                             the checkout, one directory per version
#   SHOAL_CHROMIUM            the browser (default /usr/bin/chromium)
#
# If /usr/bin/chromium is missing, installs Debian's `chromium` with apt-get
# (root only), serialised across concurrent callers by flock on
# /tmp/shoal-chromium-install.lock. playwright-core is installed with
# `npm install --prefix DIR playwright-core@VERSION` only when DIR lacks it,
# under a lock in the cache directory.
#
# Use the browser with: --headless --no-sandbox --disable-gpu --disable-quic
# --no-first-run --disable-background-networking --disable-component-update
# --disable-sync and a fresh --user-data-dir (scripts/dashboard-check.mjs does).
# Everything but the path goes to stderr.
set -euo pipefail

readonly INSTALL_LOCK=/tmp/shoal-chromium-install.lock
readonly PW_VERSION=${SHOAL_PLAYWRIGHT_VERSION:-1.65.1}
readonly CHROMIUM=${SHOAL_CHROMIUM:-/usr/bin/chromium}
readonly CACHE=${SHOAL_BROWSER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shoal}
readonly PW_DIR=$CACHE/playwright-core-$PW_VERSION

log() { printf 'test-browser: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }
is_root() { [ "$(id -u)" -eq 0 ]; }

install_chromium() {
  is_root || die "$CHROMIUM is missing and installing Debian's chromium needs root: run as root, or 'apt-get install --no-install-recommends chromium' yourself (or point SHOAL_CHROMIUM at a Chromium)"
  command -v apt-get >/dev/null 2>&1 || die "$CHROMIUM is missing and apt-get is not available to install chromium"
  command -v flock >/dev/null 2>&1 || die "flock (util-linux) is needed to install chromium safely"

  local t0 aptlog
  t0=$(now)
  exec 9>>"$INSTALL_LOCK" || die "cannot open lock file $INSTALL_LOCK"
  log "waiting for the install lock $INSTALL_LOCK"
  flock -w 1200 9 || die "timed out waiting for $INSTALL_LOCK (another install running?)"
  # Another caller may have installed it while we waited.
  if [ ! -x "$CHROMIUM" ]; then
    log "installing chromium with apt-get (takes a minute or two)"
    aptlog=$(mktemp /tmp/shoal-chromium-apt.XXXXXX)
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get -o DPkg::Lock::Timeout=600 update -qq >"$aptlog" 2>&1; then
      log "apt-get update output (tail):"
      tail -n 30 "$aptlog" >&2
      rm -f "$aptlog"
      die "apt-get failed: apt-get update exited non-zero"
    fi
    if ! apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends chromium >"$aptlog" 2>&1; then
      log "apt-get install output (tail):"
      tail -n 30 "$aptlog" >&2
      rm -f "$aptlog"
      die "apt-get failed: apt-get install chromium exited non-zero"
    fi
    rm -f "$aptlog"
    [ -x "$CHROMIUM" ] || die "apt-get installed chromium but $CHROMIUM is still missing"
    log "installed chromium in $(elapsed "$t0")"
  fi
  exec 9>&-
}

install_playwright() {
  command -v npm >/dev/null 2>&1 || die "npm is needed to install playwright-core@$PW_VERSION (install Node.js 18 or newer)"
  mkdir -p "$CACHE" || die "cannot create $CACHE"
  local t0 npmlog
  t0=$(now)
  exec 8>>"$CACHE/.playwright-install.lock" || die "cannot open lock file $CACHE/.playwright-install.lock"
  flock -w 600 8 || die "timed out waiting for $CACHE/.playwright-install.lock"
  if [ ! -f "$PW_DIR/node_modules/playwright-core/package.json" ]; then
    log "installing playwright-core@$PW_VERSION into $PW_DIR"
    npmlog=$(mktemp /tmp/shoal-playwright-npm.XXXXXX)
    if ! npm install --prefix "$PW_DIR" --no-audit --no-fund --no-save "playwright-core@$PW_VERSION" >"$npmlog" 2>&1; then
      log "npm install output (tail):"
      tail -n 30 "$npmlog" >&2
      rm -f "$npmlog"
      die "npm install playwright-core@$PW_VERSION failed"
    fi
    rm -f "$npmlog"
    [ -f "$PW_DIR/node_modules/playwright-core/package.json" ] ||
      die "npm install finished but $PW_DIR/node_modules/playwright-core is missing"
    log "installed playwright-core@$PW_VERSION in $(elapsed "$t0")"
  fi
  exec 8>&-
}

command -v node >/dev/null 2>&1 || die "node is needed (Node.js 18 or newer)"
if [ ! -x "$CHROMIUM" ]; then
  install_chromium
fi
"$CHROMIUM" --version >&2 2>/dev/null || log "warning: '$CHROMIUM --version' failed"
install_playwright
printf '%s\n' "$PW_DIR/node_modules"
