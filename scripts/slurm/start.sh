#!/usr/bin/env bash
# Start a one-node SLURM on this machine: munged, slurmctld and slurmd, all state in
# $CEREBRO_SLURM_DIR (default /tmp/cerebro-slurm), then wait until `sinfo` shows the
# node idle. Needs root and Debian's slurm-wlm and munge (apt-get install slurm-wlm).
# Afterwards, point the SLURM commands at it:  source scripts/slurm/env.sh
# Stop it with scripts/slurm/stop.sh.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
state="$CEREBRO_SLURM_DIR"

for tool in munged slurmctld slurmd sinfo; do
    command -v "$tool" >/dev/null || { echo "start.sh: $tool not found (apt-get install slurm-wlm munge)" >&2; exit 1; }
done
if [ -e "$state/slurmctld.pid" ] && kill -0 "$(cat "$state/slurmctld.pid")" 2>/dev/null; then
    echo "start.sh: a SLURM already runs from $state (stop it with $here/stop.sh)" >&2
    exit 1
fi

rm -rf "$state"
mkdir -p "$state"/{munge,ctld,slurmd,log,jobs}
chmod 700 "$state/munge"

# munge: a key of our own, a socket in the state folder
dd if=/dev/urandom of="$state/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$state/munge/munge.key"
munged --force --socket="$state/munge/munge.socket" --key-file="$state/munge/munge.key" \
    --pid-file="$state/munge/munged.pid" --log-file="$state/log/munged.log" \
    --seed-file="$state/munge/munged.seed"
for _ in $(seq 50); do [ -S "$state/munge/munge.socket" ] && break; sleep 0.1; done
munge --socket="$state/munge/munge.socket" -n | unmunge --socket="$state/munge/munge.socket" >/dev/null

# slurm.conf: this host, its CPUs, and its memory less 2 GB for the rest of the machine
host="$(hostname -s)"
cpus="$(nproc)"
memory=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) - 2048 ))
sed -e "s|@HOST@|$host|g" -e "s|@CPUS@|$cpus|g" -e "s|@MEMORY@|$memory|g" -e "s|@STATE@|$state|g" \
    -e "s|@CTLD_PORT@|$CEREBRO_SLURMCTLD_PORT|g" -e "s|@SLURMD_PORT@|$CEREBRO_SLURMD_PORT|g" \
    "$here/slurm.conf.in" > "$SLURM_CONF"
: > "$state/cgroup.conf"  # slurmd reads it if present; no cgroup plugin is configured

# The daemons in the foreground (-D), in the background of this shell, detached
setsid slurmctld -D -i -f "$SLURM_CONF" > "$state/log/slurmctld.out" 2>&1 < /dev/null &
echo $! > "$state/slurmctld.pid"
setsid slurmd -D -f "$SLURM_CONF" -N "$host" > "$state/log/slurmd.out" 2>&1 < /dev/null &
echo $! > "$state/slurmd.pid"

for _ in $(seq 120); do
    if [ "$(sinfo -h -N -o '%T' 2>/dev/null)" = "idle" ]; then
        echo "SLURM is up: $(sinfo -h -N -o '%N %T cpus=%c memory=%mMB')  (state in $state)"
        exit 0
    fi
    for daemon in slurmctld slurmd; do
        if ! kill -0 "$(cat "$state/$daemon.pid")" 2>/dev/null; then
            echo "start.sh: $daemon exited; its log:" >&2
            tail -n 30 "$state/log/$daemon.log" "$state/log/$daemon.out" >&2 || true
            "$here/stop.sh" || true
            exit 1
        fi
    done
    sleep 0.5
done
echo "start.sh: the node is not idle after 60 s: $(sinfo -N 2>&1)" >&2
tail -n 20 "$state/log/slurmctld.log" "$state/log/slurmd.log" >&2 || true
"$here/stop.sh" || true
exit 1
