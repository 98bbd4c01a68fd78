#!/usr/bin/env bash
# A one-node SLURM cluster on localhost, for tests/test_slurm.py and for trying profiles/slurm.
#
#   sudo bash tests/slurm/cluster.sh install     # Debian's slurmctld, slurmd, slurm-client, munge, if missing
#   sudo bash tests/slurm/cluster.sh start DIR   # starts munged, slurmctld, slurmd; prints the env to source
#   sudo bash tests/slurm/cluster.sh stop DIR    # stops exactly the daemons it started (by PID)
#
# The tests never run `install` or `start` themselves (a test run leaves the machine as it found
# it): tests/test_slurm.py uses a cluster that is up (SLURM_CONF exported) and skips otherwise.
# .ci/run installs, starts and stops one around the test command.
#
# DIR (a new or empty directory) holds everything: munge key and socket, slurm.conf, state,
# spool, logs, PID files. The node is sized from `nproc` and /proc/meminfo;
# proctrack/linuxproc, task/none, no cgroups, no accounting (AccountingStorageType=none, so
# Snakemake's status command must be `squeue`: profiles/slurm sets it). MinJobAge=3600, so a
# finished job stays visible to squeue (and to the test's checks) for an hour.
#
# SLURM_CONF: the jobstep plugin (snakemake-executor-plugin-slurm-jobstep 0.6.1) removes every
# SLURM_* variable but the job id ones before its nested `srun`, SLURM_CONF included, so
# `srun` inside a job reads only the default path. The script therefore links
# /etc/slurm/slurm.conf to DIR/slurm.conf (and refuses to start if another file is there).
#
# Needs root (apt-get, daemons running as root). Every wait is bounded; on any failure the
# daemons started so far are stopped and the logs are printed.
set -euo pipefail
ACTION=${1:?usage: cluster.sh install | start DIR | stop DIR}
if [ "$ACTION" = install ]; then DIR=; else DIR=${2:?usage: cluster.sh install | start DIR | stop DIR}; fi
DEFAULT_CONF=/etc/slurm/slurm.conf
CTLD_PORT=${SLURM_TEST_CTLD_PORT:-16817}
SLURMD_PORT=${SLURM_TEST_SLURMD_PORT:-16818}

log() { echo "cluster.sh: $*" >&2; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.1f", b - a}'; }  # seconds since $1 ($EPOCHREALTIME)
die() { log "ERROR: $*"; exit 1; }

stop_all() {
    # cancel what still runs on this cluster (its job steps would outlive slurmd), then stop the
    # daemons whose PID files are in DIR, newest first; never by name
    if [ -s "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null && [ -f "$DIR/slurm.conf" ]; then
        SLURM_CONF="$DIR/slurm.conf" timeout 10 scancel -u "$(id -un)" 2>/dev/null || true
        for _ in $(seq 50); do
            [ -z "$(SLURM_CONF="$DIR/slurm.conf" timeout 5 squeue -h -t R,CG -o %i 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    for name in slurmd slurmctld munged; do
        pidfile="$DIR/$name.pid"
        [ -s "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            if kill -0 "$pid" 2>/dev/null; then log "$name ($pid) ignored SIGTERM for 5 s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; fi
        fi
        rm -f "$pidfile"
    done
    if [ -L "$DEFAULT_CONF" ] && [ "$(readlink "$DEFAULT_CONF")" = "$DIR/slurm.conf" ]; then rm -f "$DEFAULT_CONF"; fi
}

dump_logs() {
    for f in "$DIR"/munged.log "$DIR"/slurmctld.log "$DIR"/slurmd.log; do
        [ -f "$f" ] && { log "--- tail $f"; tail -n 30 "$f" >&2; }
    done
}

install_packages() {
    local missing=()
    for cmd in munged slurmctld slurmd sbatch squeue scancel sinfo; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
    [ ${#missing[@]} -eq 0 ] && { log "SLURM and munge already installed"; return 0; }
    [ "$(id -u)" = 0 ] || die "missing ${missing[*]}; install as root: apt-get install -y slurmctld slurmd slurm-client munge"
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install SLURM (slurmctld, slurmd, client commands) and munge"
    log "installing Debian's slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
    local t0=$EPOCHREALTIME
    export DEBIAN_FRONTEND=noninteractive
    # another apt may hold the lock: wait for it at most 5 min; the whole install at most 10 min
    timeout 600 apt-get -o DPkg::Lock::Timeout=300 update -qq >&2 || die "apt-get update failed or took over 10 min"
    timeout 600 apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >&2 \
        || die "apt-get install slurmctld slurmd slurm-client munge failed or took over 10 min"
    log "packages installed in $(since "$t0") s"
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2; shift 2
    local end=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $end ] || { dump_logs; stop_all; die "$what not ready after $limit s"; }
        sleep 0.2
    done
}

start() {
    local cmd
    for cmd in munged slurmctld slurmd sbatch squeue scancel sinfo; do
        command -v "$cmd" >/dev/null || die "missing $cmd: run 'sudo bash tests/slurm/cluster.sh install' first"
    done
    local t0=$EPOCHREALTIME
    mkdir -p "$DIR"
    DIR=$(cd "$DIR" && pwd)
    [ -e "$DIR/slurmctld.pid" ] && die "$DIR already holds a cluster (stop it first)"
    if [ -e "$DEFAULT_CONF" ] || [ -L "$DEFAULT_CONF" ]; then
        if [ "$(readlink "$DEFAULT_CONF" || true)" = "$DIR/slurm.conf" ]; then :; 
        elif [ -L "$DEFAULT_CONF" ] && [ ! -e "$(readlink "$DEFAULT_CONF")" ]; then rm -f "$DEFAULT_CONF"  # left by a killed test
        else die "$DEFAULT_CONF exists (a real SLURM installation?): not overwriting it; the test cluster needs that path (see the SLURM_CONF note in this script)"; fi
    fi
    mkdir -p "$DIR/state" "$DIR/spool" /etc/slurm
    chmod 700 "$DIR"
    trap 'rc=$?; if [ $rc -ne 0 ]; then dump_logs; stop_all; fi' EXIT

    # munge: own key, socket and PID file
    dd if=/dev/urandom bs=1 count=1024 of="$DIR/munge.key" 2>/dev/null
    chmod 400 "$DIR/munge.key"
    munged --force --key-file="$DIR/munge.key" --socket="$DIR/munge.sock" --pid-file="$DIR/munged.pid" \
        --log-file="$DIR/munged.log" --seed-file="$DIR/munge.seed"
    wait_for 10 munged munge --socket="$DIR/munge.sock" -n

    local host cpus mem
    host=$(hostname -s)
    cpus=$(nproc)
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)  # MB, 10% left to the OS
    cat > "$DIR/slurm.conf" <<CONF
# written by tests/slurm/cluster.sh
ClusterName=kpcatest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$DIR/munge.sock
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MinJobAge=3600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
    ln -sfn "$DIR/slurm.conf" "$DEFAULT_CONF"
    export SLURM_CONF="$DIR/slurm.conf"
    slurmctld -f "$DIR/slurm.conf" -i
    wait_for 20 slurmctld scontrol ping
    slurmd -f "$DIR/slurm.conf" -N "$host"
    wait_for 30 "slurmd (node $host idle)" bash -c "sinfo -h -N -o %T | grep -qx idle"
    trap - EXIT
    log "cluster up in $(since "$t0") s: node $host, $cpus CPUs, $mem MB; SLURM_CONF=$DIR/slurm.conf"
    echo "export SLURM_CONF=$DIR/slurm.conf"
}

case "$ACTION" in
    install) install_packages ;;
    start) start ;;
    stop) DIR=$(cd "$DIR" 2>/dev/null && pwd) || exit 0; stop_all; log "stopped" ;;
    *) die "usage: cluster.sh install | start DIR | stop DIR" ;;
esac
