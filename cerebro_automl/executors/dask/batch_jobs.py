"""Why a dask-jobqueue cluster's workers have not joined, as its batch queue says.

dask-jobqueue submits each worker as a batch job (``sbatch``, ``qsub``, ...). A
submission the queue refuses is only logged by the cluster's event loop, and a job
the queue holds (its partition's limits, say) never starts: without these answers
a session would wait ``no_worker_timeout`` and then say only that no worker joined.
Everything here is best effort: a question the queue does not answer in time adds
nothing to the message.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

from .cluster import scheduler_workers
from .failures import TIMEOUTS

__all__ = ["wait_for_workers", "jobs_report"]

QUEUE_TIMEOUT = 10.0  # seconds a queue command (sbatch --test-only, squeue) may take
WAIT_SLICE = 2.0  # seconds between looks at the cluster's jobs while workers are awaited
QUEUE_EVERY = 15.0  # seconds between questions to the queue (squeue) while workers are awaited

# squeue's reasons that a job's own request causes; it may never start with them.
SLURM_REASONS = {
    "PartitionConfig": "it asks for more than its partition has (cores, memory or nodes)",
    "PartitionTimeLimit": "its walltime is over its partition's time limit",
    "PartitionNodeLimit": "it asks for more nodes than its partition allows",
    "PartitionDown": "its partition is down",
    "PartitionInactive": "its partition is inactive",
    "ReqNodeNotAvail": "the nodes it asks for are not available",
    "AssocMaxWallDurationPerJobLimit": "its walltime is over your account's limit",
    "QOSMaxWallDurationPerJobLimit": "its walltime is over its QOS's limit",
    "Resources": "it waits for free nodes",
    "Priority": "jobs of higher priority are ahead of it",
}


def wait_for_workers(client: Any, n: int, timeout: float | None) -> None:
    """Wait until ``n`` workers joined ``client``'s cluster, up to ``timeout`` seconds.

    Raises TimeoutError naming what the batch queue says of the workers' jobs; at
    once when no worker is on its way any more: every job that has not brought all
    its workers was refused, or has ended (asked of the queue every ``QUEUE_EVERY`` s)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    asked = time.monotonic()
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is None or left > 0:  # distributed waits for ever when told 0
            try:
                client.wait_for_workers(n, timeout=WAIT_SLICE if left is None else min(WAIT_SLICE, left))
                return
            except TIMEOUTS:
                pass
        timed_out = deadline is not None and time.monotonic() >= deadline
        ask = time.monotonic() - asked >= QUEUE_EVERY
        if ask:
            asked = time.monotonic()
        if timed_out or not _on_their_way(client, ask):
            if len(scheduler_workers(client)) >= n:  # they joined since the slice ended
                return
            report = jobs_report(client)
            raise TimeoutError(
                f"min_workers is {n}, but only {len(scheduler_workers(client))} workers joined the cluster at "
                f"{client.scheduler.address}"
                + (f" within {timeout} s" if timed_out else "")
                + (f". {report}" if report else "")
            ) from None


def jobs_report(client: Any) -> str:
    """What the queue says of the cluster's worker jobs whose workers have not
    joined: refused submissions with the queue's error, waiting jobs with its
    reason, ended jobs with their output's last lines; when every job's workers
    joined, that more must be asked for. Empty when ``client``'s cluster is not a
    dask-jobqueue cluster."""
    jobs = batch_jobs(client)
    if not jobs:
        return ""
    absent = [job for job in jobs if not _joined(job, _worker_names(client))]
    if not absent:
        return f"all {len(jobs)} of its jobs joined: ask for more (cluster.scale(jobs=...), or adapt(minimum_jobs=...))"
    refused = [job for job in absent if job.job_id is None]
    submitted = [job for job in absent if job.job_id is not None]
    parts = []
    if refused:
        parts.append(f"{len(refused)} of its worker jobs were refused by the queue: {_refusal(refused[0])}")
    if submitted:
        parts.append(_queue_states(submitted))
    return "; ".join(parts)


def batch_jobs(client: Any) -> list[Any]:
    """The dask-jobqueue jobs of ``client``'s cluster (empty for any other cluster)."""
    workers = getattr(getattr(client, "cluster", None), "workers", None)
    if not isinstance(workers, dict):
        return []
    return [job for job in list(workers.values()) if hasattr(job, "job_id") and hasattr(job, "submit_command")]


def _on_their_way(client: Any, ask_queue: bool) -> bool:
    """Whether a worker may still come: True unless the cluster is a dask-jobqueue one
    whose jobs without all their workers were all refused, or (``ask_queue``: squeue
    is asked) all have ended."""
    jobs = batch_jobs(client)
    if not jobs or _being_submitted(client):
        return True
    names = _worker_names(client)
    waiting = [job for job in jobs if job.job_id is not None and not _joined(job, names)]
    if not waiting:  # each job was refused or brought all its workers: no more come
        return False
    if not ask_queue or _submit_tool(waiting[0]) != "sbatch":
        return True
    held = _squeue([job.job_id for job in waiting])
    return held is None or bool(held)  # a queue that cannot be asked may still bring them


def _being_submitted(client: Any) -> bool:
    """Whether the cluster asked for jobs it has not submitted yet: dask-jobqueue adds a
    job to ``cluster.workers`` only once its submission returned (a scale-up under way)."""
    cluster = getattr(client, "cluster", None)
    spec, workers = getattr(cluster, "worker_spec", None), getattr(cluster, "workers", None)
    return isinstance(spec, dict) and isinstance(workers, dict) and bool(set(spec) - set(workers))


def _worker_names(client: Any) -> set[str]:
    try:
        info = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
    except Exception:
        return set()
    return {str(w.get("name")) for w in info.values()}


def _joined(job: Any, names: set[str]) -> bool:
    """Whether all of ``job``'s worker processes joined: one is named ``job.name``, or
    several ``job.name``-0, ``job.name``-1, ..."""
    processes = getattr(job, "worker_processes", 1) or 1
    if processes == 1:  # dask-cuda's worker names its one process job.name-0 too
        return job.name in names or f"{job.name}-0" in names
    return all(f"{job.name}-{i}" in names for i in range(processes))


def _submit_tool(job: Any) -> str:
    return Path(shlex.split(job.submit_command)[0]).name if job.submit_command else ""


def _refusal(job: Any) -> str:
    """The queue's error for ``job``'s script: SLURM's own words from ``sbatch
    --test-only`` (which submits nothing), else how to see them."""
    tool = _submit_tool(job)
    if tool == "sbatch":
        out = _run([*shlex.split(job.submit_command), "--test-only"], job.job_script()) or ""
        errors = [line for line in out.splitlines() if "error" in line.lower() or "fail" in line.lower()]
        if errors:
            return " ".join(errors)
    return f"submit print(cluster.job_script()) with {tool or 'the queue'} by hand to see its error"


def _queue_states(jobs: list[Any]) -> str:
    ids = [str(job.job_id) for job in jobs]
    if _submit_tool(jobs[0]) != "sbatch":
        return f"jobs {', '.join(ids)} were accepted but their workers have not joined (ask the queue about them)"
    states = _squeue(ids)
    if states is None:
        return f"jobs {', '.join(ids)} were accepted but their workers have not joined (squeue did not answer)"
    held: dict[tuple[str, str], list[str]] = {}
    for job_id in ids:
        if job_id in states:
            held.setdefault(states[job_id], []).append(job_id)
    parts = []
    for (state, reason), held_ids in held.items():
        why = SLURM_REASONS.get(reason, "")
        parts.append(f"{_jobs(held_ids, 'is', 'are')} {state} ({reason}{': ' + why if why else ''})")
    ended = [job for job, job_id in zip(jobs, ids, strict=True) if job_id not in states]
    if ended:
        tail = next((text for text in map(_output_tail, ended) if text), "")
        parts.append(f"{_jobs([str(job.job_id) for job in ended], 'has', 'have')} ended without a worker joining{tail}")
    return "; ".join(parts)


def _jobs(ids: list[str], one: str, many: str) -> str:
    return f"job {ids[0]} {one}" if len(ids) == 1 else f"jobs {', '.join(ids)} {many}"


def _squeue(ids: list[Any]) -> dict[str, tuple[str, str]] | None:
    """``{job id: (state, reason)}`` of the jobs the queue still holds; None when
    squeue does not answer."""
    out = _run(["squeue", "-h", "-j", ",".join(map(str, ids)), "-o", "%i|%T|%r"], None)
    if out is None or ("error" in out and "Invalid job id" not in out):  # ended and purged: not held
        return None
    rows = [line.split("|") for line in out.splitlines()]
    return {row[0].strip(): (row[1].strip(), row[2].strip()) for row in rows if len(row) == 3}


def _output_tail(job: Any, lines: int = 5) -> str:
    """The last lines of an ended SLURM job's output, where dask-jobqueue or sbatch put it."""
    folder = Path(job.log_directory) if getattr(job, "log_directory", None) else Path.cwd()
    found = sorted(folder.glob(f"*-{job.job_id}.err")) + sorted(folder.glob(f"*-{job.job_id}.out"))
    for path in found:
        try:
            tail = path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            continue
        if tail:
            return f"; the output of job {job.job_id} ({path}) ends: " + " | ".join(tail)
    return ""


def _run(command: list[str], stdin: str | None) -> str | None:
    """``command``'s stdout and stderr, or None when it cannot run in time."""
    try:
        done = subprocess.run(command, check=False, input=stdin, capture_output=True, text=True, timeout=QUEUE_TIMEOUT)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout + done.stderr
