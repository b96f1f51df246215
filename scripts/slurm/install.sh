#!/usr/bin/env bash
# Install Debian's SLURM (slurmctld, slurmd, the client commands) and munge, unless
# they are there already. Needs root and apt-get (Debian 12: slurm-wlm 22.05).
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sinfo >/dev/null \
        && command -v munged >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install.sh: SLURM is not installed; as root on Debian: apt-get install slurm-wlm munge" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q slurm-wlm munge
