#!/usr/bin/env bash
# A throwaway PostgreSQL server on 127.0.0.1 for Shoal's tests.
#
#   scripts/test-postgres.sh start   fresh cluster; prints its URL (one line) on stdout
#   scripts/test-postgres.sh stop    stops the cluster and removes its directory
#   scripts/test-postgres.sh url     prints the URL of the cluster
#
# Env:
#   SHOAL_PG_PORT  TCP port (start: default a free port picked here;
#                  stop/url: default read from SHOAL_PG_DIR)
#   SHOAL_PG_DIR   cluster directory (default /tmp/shoal-pg-$SHOAL_PG_PORT)
#   SHOAL_PG_BIN   directory holding initdb/pg_ctl/psql (default: the newest
#                  /usr/lib/postgresql/*/bin, else initdb's directory on PATH)
#
# If PostgreSQL is missing, `start` installs Debian's postgresql and
# postgresql-client with apt-get (root only), serialised across concurrent
# callers by flock on /tmp/shoal-pg-install.lock.
#
# The URL is postgres://postgres:postgres@127.0.0.1:PORT/shoal. The cluster
# runs with fsync, synchronous_commit and full_page_writes off: test data only.
# Everything but the URL goes to stderr.
set -euo pipefail

readonly INSTALL_LOCK=/tmp/shoal-pg-install.lock
readonly MARKER=.shoal-test-postgres
readonly DB=shoal
readonly PASSWORD=postgres

# Connection settings from the caller's environment must not redirect our
# own psql/pg_ctl calls to some other server.
unset PGHOST PGHOSTADDR PGPORT PGUSER PGPASSWORD PGPASSFILE PGDATABASE \
  PGSERVICE PGSERVICEFILE PGOPTIONS PGSSLMODE PGDATA PGTZ

log() { printf 'test-postgres: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }

is_root() { [ "$(id -u)" -eq 0 ]; }

# as_owner CMD...: run CMD as the cluster's owner (initdb, pg_ctl and the
# server refuse to run as root).
as_owner() {
  if is_root; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

# find_bin: print the directory with initdb, pg_ctl and psql, or nothing.
find_bin() {
  local dir candidates=()
  if [ -n "${SHOAL_PG_BIN:-}" ]; then
    candidates+=("$SHOAL_PG_BIN")
  else
    local d
    for d in /usr/lib/postgresql/*/bin; do
      [ -d "$d" ] && candidates+=("$d")
    done
    if [ "${#candidates[@]}" -gt 1 ]; then
      mapfile -t candidates < <(printf '%s\n' "${candidates[@]}" | sort -rV)
    fi
    if command -v initdb >/dev/null 2>&1; then
      candidates+=("$(dirname "$(command -v initdb)")")
    fi
  fi
  for dir in "${candidates[@]}"; do
    if [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ] && [ -x "$dir/psql" ]; then
      printf '%s\n' "$dir"
      return 0
    fi
  done
  return 0
}

# install_postgres: apt-get install postgresql, once at a time machine-wide.
install_postgres() {
  is_root || die "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb) and installing it needs root: run as root, or install postgresql and postgresql-client yourself"
  command -v apt-get >/dev/null 2>&1 || die "PostgreSQL is not installed and apt-get is not available to install it"
  command -v flock >/dev/null 2>&1 || die "flock (util-linux) is needed to install PostgreSQL safely"

  local t0 aptlog
  t0=$(now)
  exec 9>>"$INSTALL_LOCK" || die "cannot open lock file $INSTALL_LOCK"
  log "waiting for the install lock $INSTALL_LOCK"
  flock -w 1200 9 || die "timed out waiting for $INSTALL_LOCK (another install running?)"
  # Another caller may have installed it while we waited.
  if [ -z "$(find_bin)" ]; then
    log "installing postgresql and postgresql-client with apt-get (takes a minute or two)"
    aptlog=$(mktemp /tmp/shoal-pg-apt.XXXXXX)
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get -o DPkg::Lock::Timeout=600 update -qq >"$aptlog" 2>&1; then
      log "apt-get update output (tail):"
      tail -n 30 "$aptlog" >&2
      rm -f "$aptlog"
      die "apt-get failed: apt-get update exited non-zero"
    fi
    if ! apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
      postgresql postgresql-client >"$aptlog" 2>&1; then
      log "apt-get install output (tail):"
      tail -n 30 "$aptlog" >&2
      rm -f "$aptlog"
      die "apt-get failed: apt-get install postgresql postgresql-client exited non-zero"
    fi
    rm -f "$aptlog"
    log "installed PostgreSQL in $(elapsed "$t0")"
  fi
  exec 9>&-
}

# port_in_use PORT: true if something accepts connections on 127.0.0.1:PORT.
port_in_use() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# pick_port: print a TCP port that is free on 127.0.0.1 right now.
pick_port() {
  local p
  if command -v python3 >/dev/null 2>&1 &&
    p=$(python3 -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])' 2>/dev/null) && [ -n "$p" ]; then
    printf '%s\n' "$p"
    return 0
  fi
  for ((p = 55432; p < 56432; p++)); do
    if ! port_in_use "$p" && [ ! -e "/tmp/shoal-pg-$p" ]; then
      printf '%s\n' "$p"
      return 0
    fi
  done
  die "no free port found in 55432-56431; set SHOAL_PG_PORT"
}

check_port() {
  if ! [[ "$1" =~ ^[0-9]+$ ]] || [ "$1" -lt 1 ] || [ "$1" -gt 65535 ]; then
    die "SHOAL_PG_PORT must be a TCP port number, got '$1'"
  fi
}

url_for() { printf 'postgres://postgres:%s@127.0.0.1:%s/%s\n' "$PASSWORD" "$1" "$DB"; }

# resolve_dir_and_port: set DIR and PORT for stop/url from the environment.
resolve_dir_and_port() {
  PORT=${SHOAL_PG_PORT:-}
  if [ -n "${SHOAL_PG_DIR:-}" ]; then
    DIR=$(realpath -m -- "$SHOAL_PG_DIR")
  elif [ -n "$PORT" ]; then
    DIR=/tmp/shoal-pg-$PORT
  else
    die "set SHOAL_PG_DIR or SHOAL_PG_PORT to say which cluster"
  fi
  if [ -z "$PORT" ] && [ -r "$DIR/port" ]; then
    PORT=$(<"$DIR/port")
  fi
}

# postmaster_alive PID: true if PID is a running (not zombie) postgres
# process. After a stop, the exited postmaster can linger as a zombie until
# PID 1 reaps it, which some container inits do only every second or so.
postmaster_alive() {
  local pid=$1 stat comm
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  if [ -r "/proc/$pid/stat" ]; then
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    comm=${stat#*(}
    comm=${comm%)*}
    stat=${stat##*) }
    case "$comm" in
    postgres | postmaster) ;;
    *) return 1 ;;
    esac
    [ "${stat%% *}" != Z ]
  else
    kill -0 "$pid" 2>/dev/null
  fi
}

# stop_cluster DIR: stop the server of DIR if it runs; never fails.
stop_cluster() {
  local dir=$1 pid="" bin i
  [ -f "$dir/data/postmaster.pid" ] || return 0
  pid=$(head -n 1 "$dir/data/postmaster.pid" 2>/dev/null || true)
  bin=$(find_bin)
  if [ -n "$bin" ]; then
    # The data is thrown away, so no shutdown checkpoint is needed.
    (cd / && as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate -w -t 30 stop) >&2 || true
  fi
  # If pg_ctl was unavailable or failed, make sure the postmaster is gone.
  if postmaster_alive "$pid"; then
    kill -QUIT "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
      postmaster_alive "$pid" || return 0
      sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
  fi
}

# remove_cluster_dir DIR: remove DIR, but only if this script made it.
remove_cluster_dir() {
  local dir=$1
  [ -e "$dir" ] || return 0
  if [ -e "$dir/$MARKER" ]; then
    rm -rf -- "$dir"
  else
    log "not removing $dir: it was not made by this script (no $MARKER)"
  fi
}

cmd_stop() {
  resolve_dir_and_port
  stop_cluster "$DIR"
  remove_cluster_dir "$DIR"
  [ ! -e "$DIR" ] || die "could not remove $DIR"
  log "stopped and removed $DIR"
}

cmd_url() {
  resolve_dir_and_port
  [ -n "$PORT" ] || die "no port: set SHOAL_PG_PORT, or SHOAL_PG_DIR of a started cluster"
  check_port "$PORT"
  url_for "$PORT"
}

# Set by cmd_start once the cluster directory is ours, for cleanup on failure.
STARTED_DIR=""
on_start_exit() {
  local rc=$?
  if [ "$rc" -ne 0 ] && [ -n "$STARTED_DIR" ]; then
    if [ -s "$STARTED_DIR/server.log" ]; then
      log "server.log (tail):"
      tail -n 20 "$STARTED_DIR/server.log" >&2 || true
    fi
    stop_cluster "$STARTED_DIR"
    remove_cluster_dir "$STARTED_DIR"
    log "start failed; cleaned up $STARTED_DIR"
  fi
  exit "$rc"
}

cmd_start() {
  local t0 t1 bin pwfile url check
  t0=$(now)

  bin=$(find_bin)
  if [ -z "$bin" ] && [ -n "${SHOAL_PG_BIN:-}" ]; then
    die "SHOAL_PG_BIN=$SHOAL_PG_BIN does not hold initdb, pg_ctl and psql"
  fi
  if [ -z "$bin" ]; then
    install_postgres
    bin=$(find_bin)
    [ -n "$bin" ] || die "PostgreSQL still not found after installing it (no /usr/lib/postgresql/*/bin/initdb)"
  fi
  if is_root; then
    id -u postgres >/dev/null 2>&1 || die "running as root but there is no 'postgres' user to own the cluster"
  fi

  PORT=${SHOAL_PG_PORT:-}
  if [ -z "$PORT" ]; then
    PORT=$(pick_port)
  fi
  check_port "$PORT"
  DIR=$(realpath -m -- "${SHOAL_PG_DIR:-/tmp/shoal-pg-$PORT}")
  [ "$DIR" != / ] || die "SHOAL_PG_DIR must not be /"
  # Unix socket paths are limited to 107 bytes.
  [ "${#DIR}" -le 80 ] || die "SHOAL_PG_DIR is too long for a unix socket path: $DIR"

  # Fresh cluster: wipe an earlier one of ours, refuse to touch anything else.
  if [ -e "$DIR" ]; then
    if [ -e "$DIR/$MARKER" ]; then
      stop_cluster "$DIR"
      rm -rf -- "$DIR"
    elif [ -d "$DIR" ] && [ -z "$(ls -A -- "$DIR")" ]; then
      rmdir -- "$DIR"
    else
      die "$DIR exists and was not made by this script; choose another SHOAL_PG_DIR"
    fi
  fi
  if port_in_use "$PORT"; then
    die "port $PORT on 127.0.0.1 is already in use"
  fi

  trap on_start_exit EXIT
  mkdir -p -- "$DIR"
  STARTED_DIR=$DIR
  touch "$DIR/$MARKER"
  printf '%s\n' "$PORT" >"$DIR/port"
  pwfile="$DIR/pwfile"
  printf '%s\n' "$PASSWORD" >"$pwfile"
  chmod 700 "$DIR"
  if is_root; then
    chown -R postgres: "$DIR"
  fi
  # The owner must be able to reach the directory (e.g. not under /root).
  as_owner test -w "$DIR" || die "user postgres cannot write $DIR (is a parent directory private?)"

  log "initdb in $DIR/data ($bin)"
  if ! (cd / && as_owner "$bin/initdb" -D "$DIR/data" -U postgres --pwfile="$pwfile" \
    --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --no-locale \
    --no-sync) >"$DIR/initdb.log" 2>&1; then
    log "initdb.log (tail):"
    tail -n 20 "$DIR/initdb.log" >&2 || true
    die "initdb failed"
  fi
  rm -f -- "$pwfile"

  # Test-speed settings: never use them for data that matters.
  cat >>"$DIR/data/postgresql.conf" <<EOF

# --- scripts/test-postgres.sh ---
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$DIR'
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = 32MB
max_connections = 100
EOF

  t1=$(now)
  log "starting server on 127.0.0.1:$PORT"
  if ! (cd / && as_owner "$bin/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -w -t 60 start) >&2; then
    die "pg_ctl start failed (port $PORT)"
  fi

  "$bin/psql" -h "$DIR" -p "$PORT" -U postgres -d postgres -X -q -v ON_ERROR_STOP=1 \
    -c "CREATE DATABASE $DB" >&2 || die "could not create database $DB"
  url=$(url_for "$PORT")
  # Check the URL itself works: TCP, password, scram-sha-256.
  check=$("$bin/psql" "$url" -X -qAt -c 'select 1' 2>&1) || true
  [ "$check" = 1 ] || die "the server does not accept $url: $check"

  log "ready in $(elapsed "$t0") (server start $(elapsed "$t1")); stop with SHOAL_PG_DIR=$DIR $0 stop"
  STARTED_DIR=""
  trap - EXIT
  printf '%s\n' "$url"
}

main() {
  case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  url) cmd_url ;;
  *)
    printf 'usage: %s start|stop|url\n' "$0" >&2
    exit 2
    ;;
  esac
}

main "$@"
