"""The wait for min_workers on a dask-jobqueue cluster, with dask-jobqueue's own
LocalCluster (its jobs are local processes): a job's late worker processes and a job
still being submitted are waited for, a job the queue refused ends the wait at once
with what it said. A real SLURM's answers (sbatch, squeue, a job's output) are tested
in tests/test_slurm.py.

Each runs in a Python process of its own: dask-jobqueue's LocalJob kills its worker
process without reaping it (a zombie child of this process, which other tests list),
closing a cluster whose job never started fails upstream, and importing dask_jobqueue
makes Ctrl-C a SystemExit."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Looked up, not imported: importing dask_jobqueue sets a SIGINT handler of its own
# (sys.exit) in this process, and the interrupt tests after these would get SystemExit.
if importlib.util.find_spec("dask_jobqueue") is None:
    pytest.skip("dask-jobqueue is not installed (pip install -e '.[slurm]')", allow_module_level=True)
HERE = Path(__file__).resolve().parent

PRELUDE = """
import numpy as np, torch
from torch import nn
from dask_jobqueue.local import LocalCluster
from distributed import Client
from cerebro_automl import PartitionedDataset, Session, TrainingSpec


def session(client, n, timeout):
    spec = TrainingSpec(model_fn=lambda config: nn.Linear(4, 2), optimizer_fn=lambda c, p: torch.optim.SGD(p, lr=0.1),
                        loss_fn=nn.functional.cross_entropy, batch_size=16)
    X = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = PartitionedDataset.from_arrays(X, (X[:, 0] > 0).astype(np.int64), num_partitions=2)
    return Session(spec, data, client=client, min_workers=n, no_worker_timeout=timeout)
"""


def _run(body: str, tmp_path: Path, **env: str) -> str:
    """``body`` (after PRELUDE, under a main guard) in a new Python; its stdout and stderr."""
    script = tmp_path / "script.py"
    indented = "\n".join("    " + line for line in body.strip().splitlines())
    script.write_text(PRELUDE + '\nif __name__ == "__main__":\n' + indented + "\n")
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=160,
                          env={**os.environ, "PYTHONPATH": path, **env})  # fmt: skip
    return done.stdout + done.stderr


@pytest.mark.timeout(180)
def test_a_jobs_late_worker_process_is_waited_for(tmp_path):
    """One job of 2 worker processes, the second 8 s late: the wait counted the job as
    joined with its first and raised at once, "only 1 workers joined"."""
    out = _run("""
with LocalCluster(cores=2, processes=2, memory="2GB", worker_extra_args=["--preload", "slow_second_worker"]) as cluster, \\
        Client(cluster) as client:
    cluster.scale(jobs=1)
    with session(client, 2, timeout=120) as s:
        print("WORKERS", len(s.executor.workers()), flush=True)
""", tmp_path, CEREBRO_TEST_LATE="8")
    assert "WORKERS 2" in out, out


@pytest.mark.timeout(180)
def test_a_job_the_queue_refused_ends_the_wait_at_once_saying_so(tmp_path):
    out = _run("""
cluster = LocalCluster(cores=1, processes=1, memory="1GB", python="/opt/no-such/python3")
client = Client(cluster)
cluster.scale(jobs=1)
try:
    session(client, 1, timeout=600)
except TimeoutError as err:
    print("RAISED", err, flush=True)
""", tmp_path)
    [message] = [line for line in out.splitlines() if line.startswith("RAISED")] or [out]
    assert "min_workers is 1, but only 0 workers joined" in message and "within" not in message, message
    assert "1 of its worker jobs were refused by the queue" in message, message


@pytest.mark.timeout(180)
def test_a_job_still_being_submitted_is_waited_for(tmp_path):
    """dask-jobqueue lists a job among its workers only once its submission returned: a
    scale-up under way looked like no worker coming, and the wait raised at once."""
    out = _run("""
with LocalCluster(cores=1, processes=1, memory="1GB") as cluster, Client(cluster) as client:
    cluster.scale(jobs=1)
    client.wait_for_workers(1, timeout=120)
    cluster.scale(jobs=2)
    with session(client, 2, timeout=120) as s:
        print("WORKERS", len(s.executor.workers()), flush=True)
""", tmp_path)
    assert "WORKERS 2" in out, out
