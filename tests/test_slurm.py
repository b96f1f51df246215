"""A search on a real SLURM: the driver's job cancelled, resubmitted, resumed.

``make slurm-test`` starts a one-node SLURM on this machine (scripts/slurm/start.sh:
slurmctld, slurmd and munge from Debian's slurm-wlm), runs this test and stops it.
The driver (docs/snippets/slurm_search.py, submitted with scripts/slurm/search.sbatch)
runs as a SLURM job, starts a dask-jobqueue ``SLURMCluster`` of 2 worker jobs and runs
an Optuna search with ``reproducible=True``, a sqlite storage and a checkpoint_dir.

The test submits the driver twice at once, in two folders: one run is the reference,
left alone; the other is cancelled with ``scancel`` (SLURM sends SIGTERM) once two
trials are told and a running trial has a checkpoint. The cancelled job must say
"stopped by SIGTERM", leave no lock in its checkpoint_dir and no worker job in the
queue (the driver closes its SLURMCluster, which cancels them). The same job is
submitted again; it resumes trials from their checkpoints and ends with the
reference's study: the same trials, states, params and values, bit for bit.

Skipped where no SLURM answers (``make test`` needs none); under ``make slurm-test``
(``CEREBRO_SLURM_TEST=1``) a missing SLURM fails it instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "search.sbatch"
REQUIRED = os.environ.get("CEREBRO_SLURM_TEST") == "1"
# A job in one of these states may still run processes (a cancelled job is COMPLETING
# until its processes have ended).
LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
        "STAGE_OUT", "STOPPED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}
TOLD = re.compile(r"^trial (\d+) (\w+) value=", re.M)
# The driver is cancelled once this many trials are told (and a running trial has a checkpoint).
CANCEL_AFTER = int(os.environ.get("CEREBRO_SLURM_CANCEL_AFTER", "2"))

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]


def _environment() -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable)
    # where scripts/slurm/start.sh writes it (scripts/slurm/env.sh)
    env.setdefault("SLURM_CONF", str(Path(env.get("CEREBRO_SLURM_DIR", "/tmp/cerebro-slurm")) / "slurm.conf"))
    return env


def _missing(env: dict[str, str]) -> str | None:
    """Why this test cannot run here, or None."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "SLURM is not installed (no sinfo): make slurm-test installs and starts one"
    if importlib.util.find_spec("dask_jobqueue") is None:
        return "dask-jobqueue is not installed (pip install -e '.[slurm]')"
    if not Path(env["SLURM_CONF"]).exists():
        return f"no SLURM configured at {env['SLURM_CONF']}: make slurm-test starts one"
    done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or not done.stdout.strip():
        return f"SLURM does not answer: {done.stderr.strip()[-300:]}"
    return None


@pytest.fixture
def slurm() -> dict[str, str]:
    env = _environment()
    why = _missing(env)
    if why is not None:
        if REQUIRED:
            pytest.fail(why)
        pytest.skip(why)
    return env


def _submit(env: dict[str, str], folder: Path, output: Path) -> str:
    done = subprocess.run(["sbatch", "--parsable", "--output", str(output), str(SBATCH), str(folder)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


def _state(env: dict[str, str], job: str) -> str:
    """The job's state; "GONE" once slurmctld has forgotten it (MinJobAge after its end)."""
    done = subprocess.run(["squeue", "-h", "-j", job, "-t", "all", "-o", "%T"], env=env, capture_output=True,
                          text=True, timeout=60)
    return (done.stdout.strip() or "GONE") if done.returncode == 0 else "GONE"


def _live_jobs(env: dict[str, str]) -> set[str]:
    done = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return {job for job, state in (line.split() for line in done.stdout.splitlines()) if state in LIVE}


def _wait_ended(env: dict[str, str], jobs: list[str], timeout: float) -> dict[str, str]:
    """Wait until every job in ``jobs`` has ended; return their final states."""
    ended: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(jobs) and time.monotonic() < deadline:
        for job in jobs:
            if job not in ended and (state := _state(env, job)) not in LIVE:
                ended[job] = state
        time.sleep(1)
    assert len(ended) == len(jobs), f"jobs still live after {timeout} s: {set(jobs) - set(ended)}"
    return ended


def _worker_jobs(folder: Path) -> set[str]:
    """The worker jobs a driver's SLURMCluster submitted (their output files, in log_directory)."""
    return {m.group(1) for p in (folder / "workers").glob("dask-worker-*.*")
            if (m := re.fullmatch(r"dask-worker-(\d+)\.(?:out|err)", p.name))}


def _handled_time(folder: Path) -> int:
    """The last logical time the reproducible search in ``folder`` handled in full (-1: none yet)."""
    import optuna

    if not (folder / "study.db").exists():
        return -1
    try:
        study = optuna.load_study(study_name="search", storage=f"sqlite:///{folder}/study.db")
    except Exception:  # not created yet, or the driver holds sqlite's lock: ask again later
        return -1
    return int(study.user_attrs.get("cerebro_canonical_done", -1))


def _study(folder: Path) -> list[tuple]:
    import optuna

    study = optuna.load_study(study_name="search", storage=f"sqlite:///{folder}/study.db")
    return [(t.number, t.state.name, t.params, t.value, sorted(t.intermediate_values.items())) for t in study.trials]


def test_a_cancelled_driver_job_is_resubmitted_and_ends_with_the_uninterrupted_study(slurm, tmp_path):
    from cerebro_automl.checkpoint import latest_checkpoint

    env, start = slurm, time.monotonic()
    reference, run = tmp_path / "reference", tmp_path / "run"
    for folder in (reference, run):
        folder.mkdir()
    ref_job = _submit(env, reference, tmp_path / "reference.out")
    first = _submit(env, run, tmp_path / "run-1.out")
    checkpoints = run / "checkpoints"

    # Mid-run: CANCEL_AFTER trials told, logical time 1 handled in full (so a resume
    # keeps the first epoch of the trials started at time 0: a cancel in the middle of
    # time 1 would leave none to keep), and a trial not told yet has a checkpoint on disk.
    deadline = time.monotonic() + 300
    while True:
        text = (tmp_path / "run-1.out").read_text() if (tmp_path / "run-1.out").exists() else ""
        told = {int(n) for n, _ in TOLD.findall(text)}
        midway = [p.name for p in checkpoints.glob("trial-*") if int(p.name.split("-")[1]) not in told
                  and latest_checkpoint(checkpoints, p.name) is not None]
        if len(told) >= CANCEL_AFTER and midway and _handled_time(run) >= 1:
            break
        assert _state(env, first) in LIVE, f"the driver ended before it could be cancelled:\n{text}"
        assert time.monotonic() < deadline, f"no trial midway after 300 s:\n{text}"
        time.sleep(0.5)
    subprocess.run(["scancel", first], env=env, check=True, timeout=60)
    cancelled_at = time.monotonic()
    assert _wait_ended(env, [first], timeout=90) == {first: "CANCELLED"}
    stopped_in = time.monotonic() - cancelled_at
    out = (tmp_path / "run-1.out").read_text()
    assert "stopped by SIGTERM" in out, out
    assert "interrupted: submit the same job again to resume" in out, out
    assert not (checkpoints / ".lock").exists(), "the checkpoint_dir's lock was left behind"
    # Closing the SLURMCluster cancelled the run's worker jobs: none left in the queue.
    workers = _worker_jobs(run)
    assert len(workers) == 2, workers
    _wait_ended(env, sorted(workers), timeout=30)
    assert not (_live_jobs(env) - {ref_job} - _worker_jobs(reference)), (_live_jobs(env), workers)

    # The same job again: it resumes, and ends with the reference's study.
    second = _submit(env, run, tmp_path / "run-2.out")
    states = _wait_ended(env, [second, ref_job], timeout=600)
    resumed, ref_out = (tmp_path / "run-2.out").read_text(), (tmp_path / "reference.out").read_text()
    assert states == {second: "COMPLETED", ref_job: "COMPLETED"}, (states, resumed[-3000:], ref_out[-3000:])
    assert re.search(r"trial \d+ resumes after epoch [1-9]", resumed), resumed  # work kept, not redone
    _wait_ended(env, sorted(_worker_jobs(run) | _worker_jobs(reference)), timeout=60)  # cancelled at close

    expected, got = _study(reference), _study(run)
    assert len(expected) >= 10 and not [t for t in expected if t[1] == "RUNNING"]
    assert got == expected
    print(f"\nSLURM test: reference job {ref_job}; job {first} cancelled at {len(told)} trials told "
          f"(midway: {', '.join(sorted(midway))}), ended {stopped_in:.1f} s after scancel; job {second} "
          f"resumed it; the same {len(got)} trials, bitwise; {time.monotonic() - start:.0f} s in all")
    for name, text in (("cancelled job " + first, out), ("resubmitted job " + second, resumed)):
        print(f"\n----- {name} -----\n{text.rstrip()}")


# What dask-jobqueue's options get wrong, as a user writes them, and what the queue
# must be seen to say of it in the min_workers error.
BAD_WORKER_JOBS = {
    "a partition that does not exist": ({"queue": "no-such-partition"}, "invalid partition specified"),
    "more cores than any node has": ({"cores": 512}, "PENDING (PartitionConfig: it asks for more than its partition"),
    "a python the nodes lack": ({"python": "/opt/no-such/python3"}, "/opt/no-such/python3: No such file"),
}


@pytest.mark.parametrize("mistake", list(BAD_WORKER_JOBS))
def test_worker_jobs_that_never_join_are_explained_by_the_queue(slurm, tmp_path, monkeypatch, mistake):
    """A refused submission fails at once with sbatch's own error, a job that ended
    at once with its output; a job the queue holds is named with squeue's reason when
    the wait ends. Without these, each was "only 0 workers joined" after the timeout."""
    import numpy as np
    import torch
    from dask_jobqueue import SLURMCluster
    from distributed import Client
    from torch import nn

    from cerebro_automl import PartitionedDataset, Session, TrainingSpec

    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    monkeypatch.chdir(tmp_path)
    options, said = BAD_WORKER_JOBS[mistake]
    held = "cores" in options
    spec = TrainingSpec(model_fn=lambda config: nn.Linear(4, 2), optimizer_fn=lambda c, p: torch.optim.SGD(p, lr=0.1),
                        loss_fn=nn.functional.cross_entropy, batch_size=16)  # fmt: skip
    X = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = PartitionedDataset.from_arrays(X, (X[:, 0] > 0).astype(np.int64), num_partitions=2)
    timeout = 8.0 if held else 600.0  # a refused or ended job must not be waited for
    kwargs = dict(cores=1, processes=1, memory="1GB", walltime="00:05:00", log_directory=str(tmp_path / "logs"))
    cluster = SLURMCluster(**{**kwargs, **options})
    try:
        with Client(cluster) as client:
            cluster.scale(2)
            with pytest.raises(TimeoutError) as raised:
                Session(spec, data, client=client, min_workers=2, no_worker_timeout=timeout)
    finally:
        # distributed asserts, on closing, that every job it created started or
        # closed; a job sbatch refused did neither (upstream, not ours to hide).
        with contextlib.suppress(AssertionError):
            cluster.close()
    message = str(raised.value)
    assert "min_workers is 2, but only 0 workers joined" in message and said in message, message
    assert (f"within {timeout} s" in message) is held, message
    assert not _live_jobs(slurm), "closing the SLURMCluster cancels its held jobs"
