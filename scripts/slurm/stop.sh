#!/usr/bin/env bash
# Stop what scripts/slurm/start.sh started: cancel the jobs left, stop slurmd,
# slurmctld and munged (by the process ids start.sh recorded), remove the state folder.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/env.sh"
state="$CEREBRO_SLURM_DIR"
[ -d "$state" ] || exit 0

if [ -e "$state/slurmctld.pid" ] && kill -0 "$(cat "$state/slurmctld.pid")" 2>/dev/null; then
    scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 40); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.5; done
fi
stop() {  # stop PIDFILE: SIGTERM, then SIGKILL after 10 s
    [ -e "$1" ] || return 0
    local pid; pid="$(cat "$1")"
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}
stop "$state/slurmd.pid"
stop "$state/slurmctld.pid"
stop "$state/munge/munged.pid"
if [ -n "${CEREBRO_SLURM_KEEP:-}" ]; then
    echo "SLURM stopped; its state and logs kept in $state"
else
    rm -rf "$state"
    echo "SLURM stopped; $state removed"
fi
