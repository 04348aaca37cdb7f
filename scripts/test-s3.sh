#!/usr/bin/env bash
# A throwaway S3-compatible server on 127.0.0.1 for Shoal's tests: s3s-fs, a
# file-system backed S3 server built from crates.io.
#
#   scripts/test-s3.sh start   fresh server; prints its endpoint (one line,
#                              http://127.0.0.1:PORT) on stdout
#   scripts/test-s3.sh stop    stops the server and removes its directory
#
# Env:
#   SHOAL_S3_PORT     TCP port on 127.0.0.1 (required; the caller picks a free one)
#   SHOAL_S3_DIR      server directory (default /tmp/shoal-s3-$SHOAL_S3_PORT);
#                     objects live in $SHOAL_S3_DIR/data/BUCKET/KEY, one plain
#                     file each ('/' in a key makes nested directories)
#   SHOAL_S3_BUCKETS  space-separated buckets to create on start (default checkpoints)
#
# Credentials are fixed: access key `testkey`, secret key `testsecret`; any
# region name is accepted (use us-east-1). Requests must be signed (SigV4).
#
# The s3s-fs binary is built once with `cargo install` (about 5 minutes on two
# cores) into ${XDG_CACHE_HOME:-$HOME/.cache}/shoal/s3s-fs-VERSION and reused
# from there; concurrent callers are serialised by flock on
# /tmp/shoal-s3s-install.lock so only one of them builds it.
#
# Everything but the endpoint goes to stderr.
set -euo pipefail

readonly S3S_VERSION=0.14.1 # newest s3s-fs whose rust-version fits rustc 1.95
readonly INSTALL_LOCK=/tmp/shoal-s3s-install.lock
readonly MARKER=.shoal-test-s3
readonly ACCESS_KEY=testkey
readonly SECRET_KEY=testsecret
readonly READY_TIMEOUT_S=30
# s3s rejects requests without x-amz-content-sha256 (curl does not add it).
readonly EMPTY_SHA256=e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855

log() { printf 'test-s3: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }

cache_root() {
  local base=${XDG_CACHE_HOME:-}
  if [ -z "$base" ]; then
    [ -n "${HOME:-}" ] || die "neither XDG_CACHE_HOME nor HOME is set: nowhere to keep the s3s-fs binary"
    base=$HOME/.cache
  fi
  printf '%s/shoal/s3s-fs-%s\n' "$base" "$S3S_VERSION"
}

# bin_ok BIN: true if BIN runs and reports the expected version.
bin_ok() {
  [ -x "$1" ] || return 1
  local v
  v=$("$1" --version 2>/dev/null) || return 1
  [[ "$v" == *"$S3S_VERSION"* ]]
}

# find_cargo: print the cargo to build with.
find_cargo() {
  if command -v cargo >/dev/null 2>&1; then
    command -v cargo
  elif [ -n "${CARGO:-}" ] && [ -x "$CARGO" ]; then
    printf '%s\n' "$CARGO"
  elif [ -n "${HOME:-}" ] && [ -x "$HOME/.cargo/bin/cargo" ]; then
    printf '%s\n' "$HOME/.cargo/bin/cargo"
  else
    die "cargo not found (PATH, \$CARGO, ~/.cargo/bin): it is needed to build s3s-fs"
  fi
}

# ensure_bin: set BIN to a working s3s-fs, building it once if needed.
ensure_bin() {
  local root t0 cargo target buildlog rc
  root=$(cache_root)
  BIN=$root/bin/s3s-fs
  bin_ok "$BIN" && return 0

  command -v flock >/dev/null 2>&1 || die "flock (util-linux) is needed to build s3s-fs safely"
  exec 9>>"$INSTALL_LOCK" || die "cannot open lock file $INSTALL_LOCK"
  log "waiting for the install lock $INSTALL_LOCK"
  flock -w 1800 9 || die "timed out waiting for $INSTALL_LOCK (another s3s-fs build running?)"
  # Another caller may have built it while we waited.
  if ! bin_ok "$BIN"; then
    cargo=$(find_cargo)
    mkdir -p -- "$root" || die "cannot create $root"
    target=$(mktemp -d /tmp/shoal-s3s-target.XXXXXX)
    buildlog=$(mktemp /tmp/shoal-s3s-build.XXXXXX)
    t0=$(now)
    log "building s3s-fs $S3S_VERSION with cargo install into $root (about 5 minutes on 2 cores; once per machine)"
    rc=0
    # From / so that no .cargo/config.toml or rust-toolchain file of the
    # caller's directory applies; with a clean environment for the build.
    (
      cd / &&
        env -u RUSTFLAGS -u CARGO_ENCODED_RUSTFLAGS -u CARGO_BUILD_TARGET -u CARGO_BUILD_RUSTFLAGS \
          -u RUSTC_WRAPPER -u CARGO_BUILD_RUSTC_WRAPPER -u CARGO_INCREMENTAL \
          CARGO_TARGET_DIR="$target" \
          "$cargo" install s3s-fs --version "$S3S_VERSION" --features binary --locked \
          --root "$root" --force
    ) >"$buildlog" 2>&1 || rc=$?
    rm -rf -- "$target"
    if [ "$rc" -ne 0 ]; then
      log "cargo install output (tail):"
      tail -n 40 "$buildlog" >&2 || true
      rm -f -- "$buildlog"
      die "cargo install s3s-fs --version $S3S_VERSION failed (exit $rc)"
    fi
    rm -f -- "$buildlog"
    bin_ok "$BIN" || die "$BIN does not report version $S3S_VERSION after cargo install"
    log "built s3s-fs $S3S_VERSION in $(elapsed "$t0")"
  fi
  exec 9>&-
}

# port_in_use PORT: true if something accepts connections on 127.0.0.1:PORT.
port_in_use() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# resolve: set PORT and DIR from the environment.
resolve() {
  PORT=${SHOAL_S3_PORT:-}
  if [ -n "$PORT" ]; then
    if ! [[ "$PORT" =~ ^[0-9]+$ ]] || [ "$PORT" -lt 1 ] || [ "$PORT" -gt 65535 ]; then
      die "SHOAL_S3_PORT must be a TCP port number, got '$PORT'"
    fi
  fi
  if [ -n "${SHOAL_S3_DIR:-}" ]; then
    DIR=$(realpath -m -- "$SHOAL_S3_DIR")
  elif [ -n "$PORT" ]; then
    DIR=/tmp/shoal-s3-$PORT
  else
    die "set SHOAL_S3_PORT (and optionally SHOAL_S3_DIR)"
  fi
  [ "$DIR" != / ] || die "SHOAL_S3_DIR must not be /"
}

# alive PID: true if PID is a running (not zombie) process.
alive() {
  local pid=$1 stat state
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  state=${stat##*) }
  [ "${state%% *}" != Z ]
}

# server_alive PID: true if PID is a running (not zombie) s3s-fs, so that a
# stale pid file never makes us kill some other process.
server_alive() {
  local pid=$1 exe
  alive "$pid" || return 1
  exe=$(tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | head -n 1) || return 1
  [ "$(basename -- "${exe:-x}")" = s3s-fs ] || return 1
  alive "$pid"
}

# stop_server DIR: stop the server of DIR if it runs; never fails.
stop_server() {
  local dir=$1 pid i
  [ -s "$dir/s3s-fs.pid" ] || return 0
  pid=$(cat "$dir/s3s-fs.pid" 2>/dev/null || true)
  if server_alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
      server_alive "$pid" || break
      sleep 0.1
    done
    if server_alive "$pid"; then
      kill -KILL "$pid" 2>/dev/null || true
      for ((i = 0; i < 20; i++)); do
        server_alive "$pid" || break
        sleep 0.1
      done
    fi
  fi
  rm -f -- "$dir/s3s-fs.pid"
}

# remove_dir DIR: remove DIR, but only if this script made it.
remove_dir() {
  local dir=$1
  [ -e "$dir" ] || return 0
  if [ -e "$dir/$MARKER" ]; then
    rm -rf -- "$dir"
  else
    log "not removing $dir: it was not made by this script (no $MARKER)"
  fi
}

cmd_stop() {
  resolve
  stop_server "$DIR"
  remove_dir "$DIR"
  [ ! -e "$DIR" ] || die "could not remove $DIR"
  log "stopped and removed $DIR"
}

# Set by cmd_start once the server directory is ours, for cleanup on failure.
STARTED_DIR=""
on_start_exit() {
  local rc=$?
  if [ "$rc" -ne 0 ] && [ -n "$STARTED_DIR" ]; then
    stop_server "$STARTED_DIR"
    remove_dir "$STARTED_DIR"
    log "start failed; cleaned up $STARTED_DIR"
  fi
  exit "$rc"
}

# server_log_tail: the end of the server log, for error messages.
server_log_tail() {
  if [ -s "$DIR/server.log" ]; then
    log "server.log (tail):"
    tail -n 20 "$DIR/server.log" >&2 || true
  else
    log "server.log is empty"
  fi
}

# check_bucket NAME: with curl (if it can sign requests), the bucket answers
# a signed HEAD with 200: credentials and bucket layout are right.
check_bucket() {
  local b=$1 code
  code=$(curl -sS -o /dev/null -w '%{http_code}' --max-time 10 -I \
    --aws-sigv4 "aws:amz:us-east-1:s3" --user "$ACCESS_KEY:$SECRET_KEY" \
    -H "x-amz-content-sha256: $EMPTY_SHA256" \
    "http://127.0.0.1:$PORT/$b") || code="curl failed"
  if [ "$code" != 200 ]; then
    server_log_tail
    die "signed HEAD http://127.0.0.1:$PORT/$b answered $code, not 200"
  fi
}

cmd_start() {
  local t0 t1 buckets b pid i ready
  t0=$(now)
  resolve
  [ -n "$PORT" ] || die "SHOAL_S3_PORT is required for start"

  buckets=${SHOAL_S3_BUCKETS-checkpoints}
  for b in $buckets; do
    # S3 bucket names: 3-63 characters, lower-case letters, digits, '.', '-'.
    [[ "$b" =~ ^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$ ]] || die "invalid bucket name '$b' in SHOAL_S3_BUCKETS"
  done

  ensure_bin

  # Fresh server: wipe an earlier one of ours, refuse to touch anything else.
  if [ -e "$DIR" ]; then
    if [ -e "$DIR/$MARKER" ]; then
      stop_server "$DIR"
      rm -rf -- "$DIR"
    elif [ -d "$DIR" ] && [ -z "$(ls -A -- "$DIR")" ]; then
      rmdir -- "$DIR"
    else
      die "$DIR exists and was not made by this script; choose another SHOAL_S3_DIR"
    fi
  fi
  if port_in_use "$PORT"; then
    die "port $PORT on 127.0.0.1 is already in use"
  fi

  trap on_start_exit EXIT
  mkdir -p -- "$DIR"
  STARTED_DIR=$DIR
  touch "$DIR/$MARKER"
  mkdir -p -- "$DIR/data"
  # s3s-fs serves every directory directly under its root as a bucket.
  for b in $buckets; do
    mkdir -p -- "$DIR/data/$b"
  done

  t1=$(now)
  log "starting s3s-fs $S3S_VERSION on 127.0.0.1:$PORT (data $DIR/data)"
  # No inherited stdio: the caller's pipes must close when this script exits.
  nohup "$BIN" --host 127.0.0.1 --port "$PORT" \
    --access-key "$ACCESS_KEY" --secret-key "$SECRET_KEY" \
    "$DIR/data" </dev/null >"$DIR/server.log" 2>&1 &
  pid=$!
  printf '%s\n' "$pid" >"$DIR/s3s-fs.pid"

  # `alive`, not `server_alive`: for a moment the child is still nohup.
  ready=0
  for ((i = 0; i < READY_TIMEOUT_S * 10; i++)); do
    if ! alive "$pid"; then
      server_log_tail
      if grep -qi 'in use' "$DIR/server.log" 2>/dev/null; then
        die "s3s-fs exited during start: port $PORT on 127.0.0.1 is already in use"
      fi
      die "s3s-fs exited during start (port $PORT)"
    fi
    if port_in_use "$PORT"; then
      ready=1
      break
    fi
    sleep 0.1
  done
  if [ "$ready" -ne 1 ]; then
    server_log_tail
    die "s3s-fs did not accept connections on 127.0.0.1:$PORT within ${READY_TIMEOUT_S}s"
  fi
  # Another process may have taken the port just before ours could bind it,
  # and answered the probe above: then ours exits within milliseconds.
  sleep 0.2
  if ! server_alive "$pid"; then
    server_log_tail
    die "s3s-fs exited during start: port $PORT on 127.0.0.1 is already in use?"
  fi

  if command -v curl >/dev/null 2>&1 && curl --help all 2>/dev/null | grep -q -- --aws-sigv4; then
    for b in $buckets; do
      check_bucket "$b"
    done
  fi

  log "ready in $(elapsed "$t0") (server start $(elapsed "$t1")); stop with SHOAL_S3_DIR=$DIR $0 stop"
  STARTED_DIR=""
  trap - EXIT
  printf 'http://127.0.0.1:%s\n' "$PORT"
}

main() {
  case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  *)
    printf 'usage: %s start|stop\n' "$0" >&2
    exit 2
    ;;
  esac
}

main "$@"
