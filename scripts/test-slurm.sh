#!/usr/bin/env bash
# A real two-node Slurm cluster on this machine for the Slurm executor's tests.
#
#   scripts/test-slurm.sh start   installs, configures and starts it (idempotent: a healthy cluster of the same
#                                 configuration is kept); prints one line `OK SLURM_CONF=... nodes=n1,n2 ...` on
#                                 stdout once `srun -N2 hostname` answers from both nodes
#   scripts/test-slurm.sh stop    stops every daemon it started and removes the namespaces and links
#
# Env:
#   SHOAL_SLURM_DIR   configuration, state and logs (default /tmp/shoal-slurm), outside the checkout
#   SHOAL_SLURM_CPUS  CPUs each node advertises (default 4; may exceed the machine's)
#   SHOAL_SLURM_NET   the /24 the hosts live on, as its first three octets (default 10.214.0)
#
# The layout: three hosts on a bridge (`shoalbr0`) in the root network namespace, which has .254 on it and is the
# login node (sbatch, squeue and the Shoal server run there; nothing listens there): the controller `ctl` (.253,
# slurmctld) and two nodes, n1 (.1) and n2 (.2) (slurmd), each in its own network namespace (`shoal-ctl`,
# `shoal-n1`, `shoal-n2`, a veth pair into the bridge) and its own UTS namespace (its hostname): separate hosts as
# far as Slurm and the tasks can tell, whose traffic crosses a real link, on one filesystem (as a cluster's shared
# filesystem). One munged (one key) serves every daemon through its socket in SHOAL_SLURM_DIR. No systemd and no cgroups here: processes are tracked
# through /proc (`proctrack/linuxproc`), nothing is bound or confined (`task/none`), no accounting daemon (no
# `sacct`; `scontrol show job` remembers a job for MinJobAge).
#
# If Slurm or munge is missing, `start` installs Debian's slurm-wlm, slurmctld, slurmd, slurm-client and munge
# with apt-get (root only), serialised by flock on /tmp/shoal-slurm-install.lock; concurrent starts are serialised
# by flock on /tmp/shoal-slurm.lock. Everything but the OK line goes to stderr.
set -euo pipefail

readonly DIR=${SHOAL_SLURM_DIR:-/tmp/shoal-slurm}
readonly CPUS=${SHOAL_SLURM_CPUS:-4}
readonly NET=${SHOAL_SLURM_NET:-10.214.0}
readonly BRIDGE=shoalbr0
readonly NODES=(n1 n2)
# Every host in its own namespaces: the nodes and the controller.
readonly HOSTS=(n1 n2 ctl)
readonly CONF=$DIR/etc/slurm.conf
readonly MUNGE_SOCKET=$DIR/munge/munge.socket.2
readonly CTLD_PORT=6917
readonly SLURMD_PORT=6918

log() { printf 'test-slurm: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }

# Waits (up to $1 tenths of a second) until the command after it succeeds; says what it waited for on failure.
wait_for() {
  local tenths=$1 what=$2
  shift 2
  for _ in $(seq 1 "$tenths"); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  log "gave up after $((tenths / 10)) s waiting for $what"
  return 1
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# The daemons are started with the lock's descriptor (8) closed: they must not hold it.

# Stops the process whose pid file is $1: TERM, up to 5 s, then KILL.
stop_pid() {
  local f=$1 pid
  [ -s "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$f"
}

stop_all() {
  local n pid
  for n in "${NODES[@]}"; do stop_pid "$DIR/run/slurmd-$n.pid"; done
  stop_pid "$DIR/run/slurmctld.pid"
  for n in "${HOSTS[@]}"; do
    # What the node's slurmd left running (job steps, their tasks) lives in its namespace.
    if ip netns list 2>/dev/null | grep -qw "shoal-$n"; then
      for pid in $(ip netns pids "shoal-$n" 2>/dev/null || true); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns del "shoal-$n" 2>/dev/null || true
    fi
    ip link del "shoal-$n-h" 2>/dev/null || true
  done
  stop_pid "$DIR/munge/munged.pid"
  ip link del "$BRIDGE" 2>/dev/null || true
}

ensure_installed() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null; then
    return 0
  fi
  command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get to install it"
  log "installing Debian's slurm-wlm and munge"
  (
    flock -w 600 9 || die "waited 600 s for the install lock /tmp/shoal-slurm-install.lock"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends slurm-wlm slurmctld slurmd slurm-client munge >&2 \
      || die "apt-get install slurm-wlm munge failed"
  ) 9>/tmp/shoal-slurm-install.lock
}

node_ip() {
  local i
  [ "$1" = ctl ] && echo "$NET.253" && return 0
  for i in "${!NODES[@]}"; do
    if [ "${NODES[$i]}" = "$1" ]; then
      echo "$NET.$((i + 1))"
      return 0
    fi
  done
  die "no host $1"
}

# The configuration, written to stdout (compared with the running one to decide whether to restart).
render_conf() {
  local mem n
  # Each node advertises an equal share of 90% of this machine's memory, in MiB.
  mem=$(awk -v k=${#NODES[@]} '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.9 / k }' /proc/meminfo)
  cat <<EOF
# Written by scripts/test-slurm.sh: two nodes in network namespaces, for Shoal's tests.
ClusterName=shoaltest
SlurmctldHost=ctl($(node_ip ctl))
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SrunPortRange=60001-60200
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No systemd and no cgroup delegation here: processes tracked through /proc, no binding, no accounting.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# The nodes advertise more CPUs than the machine has (tests of placement, not of speed).
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
# Finished jobs stay known to scontrol for an hour (no accounting daemon to ask later).
MinJobAge=3600
Waittime=0
EOF
  for n in "${NODES[@]}"; do
    echo "NodeName=$n NodeHostname=$n NodeAddr=$(node_ip "$n") CPUs=$CPUS RealMemory=$mem State=UNKNOWN"
  done
  echo "PartitionName=shoal Nodes=$(
    IFS=,
    echo "${NODES[*]}"
  ) Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
}

# Whether the cluster described by $CONF runs: every daemon alive and both nodes up.
healthy() {
  local n
  alive "$DIR/munge/munged.pid" && alive "$DIR/run/slurmctld.pid" || return 1
  for n in "${NODES[@]}"; do alive "$DIR/run/slurmd-$n.pid" || return 1; done
  [ "$(SLURM_CONF=$CONF sinfo -h -N -o '%N %T' 2>/dev/null | grep -cE ' (idle|mixed|allocated|completing)$')" = "${#NODES[@]}" ]
}

network() {
  local n ip
  ip link add "$BRIDGE" type bridge
  ip addr add "$NET.254/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for n in "${HOSTS[@]}"; do
    ip=$(node_ip "$n")
    ip netns add "shoal-$n"
    ip link add "shoal-$n-h" type veth peer name eth0 netns "shoal-$n"
    ip link set "shoal-$n-h" master "$BRIDGE" up
    ip -n "shoal-$n" addr add "$ip/24" dev eth0
    ip -n "shoal-$n" link set eth0 up
    ip -n "shoal-$n" link set lo up
  done
}

munge_start() {
  install -d -o munge -g munge -m 0755 "$DIR/munge"
  if [ ! -s "$DIR/munge/munge.key" ]; then
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1 count=1024 status=none
  fi
  chown munge:munge "$DIR/munge/munge.key"
  chmod 0400 "$DIR/munge/munge.key"
  # munged refuses to run as root.
  runuser -u munge -- /usr/sbin/munged --num-threads=4 --socket="$MUNGE_SOCKET" \
    --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
    --seed-file="$DIR/munge/munged.seed" 8>&-
  wait_for 50 "munged's socket $MUNGE_SOCKET" test -S "$MUNGE_SOCKET"
  munge --socket="$MUNGE_SOCKET" -n | unmunge --socket="$MUNGE_SOCKET" >/dev/null || die "munge cannot decode its own credential"
}

cold_start() {
  local n
  stop_all
  rm -rf "${DIR:?}/ctld" "${DIR:?}/spool" "${DIR:?}/run" "${DIR:?}/log" "${DIR:?}/etc"
  mkdir -p "$DIR/etc" "$DIR/ctld" "$DIR/run" "$DIR/log"
  for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/$n"; done
  chmod 0755 "$DIR" "$DIR/etc" "$DIR/log"
  render_conf >"$CONF"
  # Slurm 22.05 reads cgroup.conf beside slurm.conf when present; nothing here uses cgroups.
  printf 'CgroupPlugin=autodetect\nIgnoreSystemd=yes\n' >"$DIR/etc/cgroup.conf"
  network
  munge_start
  # Each host in its own network and UTS namespaces, with its name (nsenter, not `ip netns exec`, which remounts
  # /sys without the cgroup filesystem slurmd looks for).
  nsenter --net=/run/netns/shoal-ctl unshare --uts -- sh -c "hostname ctl && exec /usr/sbin/slurmctld -f $CONF -c -i" 8>&-
  wait_for 200 "slurmctld to answer a ping" sh -c "SLURM_CONF=$CONF scontrol ping | grep -q UP" \
    || { tail -20 "$DIR/log/slurmctld.log" >&2; die "slurmctld did not start"; }
  for n in "${NODES[@]}"; do
    nsenter --net="/run/netns/shoal-$n" unshare --uts -- sh -c "hostname $n && exec /usr/sbin/slurmd -f $CONF -N $n" 8>&-
  done
  wait_for 300 "both nodes to be idle" healthy \
    || { sinfo -N -l >&2 || true; tail -20 "$DIR"/log/*.log >&2; die "the nodes did not come up"; }
}

start() {
  if ! command -v ip >/dev/null || ! command -v unshare >/dev/null || ! command -v nsenter >/dev/null; then
    die "needs ip (iproute2), unshare and nsenter (util-linux)"
  fi
  local t0 how
  t0=$(now)
  ensure_installed
  mkdir -p "$DIR"
  export SLURM_CONF=$CONF
  if [ -s "$CONF" ] && [ "$(render_conf)" = "$(cat "$CONF")" ] && healthy; then
    how=warm
  else
    log "starting munged, slurmctld and the slurmd of ${NODES[*]}"
    cold_start
    how=cold
  fi
  local out
  out=$(timeout 60 srun -N2 -n2 --ntasks-per-node=1 hostname 2>&1) || die "srun -N2 hostname failed: $out"
  [ "$(echo "$out" | sort | tr '\n' ' ')" = "$(printf '%s ' "${NODES[@]}")" ] \
    || die "srun -N2 hostname answered: $out"
  echo "OK SLURM_CONF=$CONF HEAD=$NET.254 nodes=$(
    IFS=,
    echo "${NODES[*]}"
  ) cpus=$CPUS $how $(elapsed "$t0") (logs in $DIR/log)"
}

[ "$(id -u)" = 0 ] || die "must run as root (network namespaces, munged, slurmctld, slurmd)"
case "${1:-}" in
  start)
    (
      flock -w 300 8 || die "waited 300 s for /tmp/shoal-slurm.lock"
      start
    ) 8>/tmp/shoal-slurm.lock
    ;;
  stop)
    (
      flock -w 300 8 || die "waited 300 s for /tmp/shoal-slurm.lock"
      stop_all
      log "stopped"
    ) 8>/tmp/shoal-slurm.lock
    ;;
  *)
    echo "usage: $0 start|stop" >&2
    exit 2
    ;;
esac
