# Source this to point sinfo, sbatch, squeue and scancel at the SLURM that
# scripts/slurm/start.sh starts (its state folder, its slurm.conf and its ports).
export CEREBRO_SLURM_DIR="${CEREBRO_SLURM_DIR:-/tmp/cerebro-slurm}"
export SLURM_CONF="$CEREBRO_SLURM_DIR/slurm.conf"
export CEREBRO_SLURMCTLD_PORT="${CEREBRO_SLURMCTLD_PORT:-16817}"
export CEREBRO_SLURMD_PORT="${CEREBRO_SLURMD_PORT:-16818}"
