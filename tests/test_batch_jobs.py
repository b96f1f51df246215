"""The wait for min_workers on a dask-jobqueue cluster, with dask-jobqueue's own
LocalCluster (its jobs are local processes): a job's late worker processes are waited
for, a job the queue refused ends the wait at once with what it said. A real SLURM's
answers (sbatch, squeue, a job's output) are tested in tests/test_slurm.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from cerebro_automl import PartitionedDataset, Session, TrainingSpec

jobqueue = pytest.importorskip("dask_jobqueue.local")
HERE = Path(__file__).resolve().parent


def _session(client, n, timeout):
    spec = TrainingSpec(model_fn=lambda config: nn.Linear(4, 2), optimizer_fn=lambda c, p: torch.optim.SGD(p, lr=0.1),
                        loss_fn=nn.functional.cross_entropy, batch_size=16)  # fmt: skip
    X = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = PartitionedDataset.from_arrays(X, (X[:, 0] > 0).astype(np.int64), num_partitions=2)
    return Session(spec, data, client=client, min_workers=n, no_worker_timeout=timeout)


@pytest.mark.timeout(180)
def test_a_jobs_late_worker_process_is_waited_for(monkeypatch):
    """One job of 2 worker processes, the second 8 s late: the wait counted the job as
    joined with its first and raised at once, "only 1 workers joined"."""
    from distributed import Client

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("CEREBRO_TEST_LATE", "8")
    with jobqueue.LocalCluster(cores=2, processes=2, memory="2GB", worker_extra_args=["--preload", "slow_second_worker"]) \
            as cluster, Client(cluster) as client:  # fmt: skip
        cluster.scale(jobs=1)
        with _session(client, 2, timeout=120) as s:
            assert len(s.executor.workers()) == 2


REFUSED = """
import sys
from dask_jobqueue.local import LocalCluster
from distributed import Client
from test_batch_jobs import _session

if __name__ == "__main__":
    cluster = LocalCluster(cores=1, processes=1, memory="1GB", python="/opt/no-such/python3")
    client = Client(cluster)
    cluster.scale(jobs=1)
    try:
        _session(client, 1, timeout=600)
    except TimeoutError as err:
        print("RAISED", err, flush=True)
"""


@pytest.mark.timeout(180)
def test_a_job_the_queue_refused_ends_the_wait_at_once_saying_so(tmp_path):
    """In a process of its own: closing a cluster whose job never started fails upstream
    (distributed and dask-jobqueue), and its loop would stay behind in this one."""
    script = tmp_path / "refused.py"
    script.write_text(REFUSED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=150, env=env)
    [message] = [line for line in done.stdout.splitlines() if line.startswith("RAISED")] or [done.stdout + done.stderr]
    assert "min_workers is 1, but only 0 workers joined" in message and "within" not in message, message
    assert "1 of its worker jobs were refused by the queue" in message, message


@pytest.mark.timeout(180)
def test_a_job_still_being_submitted_is_waited_for():
    """dask-jobqueue lists a job among its workers only once its submission returned: a
    scale-up under way looked like no worker coming, and the wait raised at once."""
    from distributed import Client

    with jobqueue.LocalCluster(cores=1, processes=1, memory="1GB") as cluster, Client(cluster) as client:
        cluster.scale(jobs=1)
        client.wait_for_workers(1, timeout=120)
        cluster.scale(jobs=2)
        with _session(client, 2, timeout=120) as s:
            assert len(s.executor.workers()) == 2
