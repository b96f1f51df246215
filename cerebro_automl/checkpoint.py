"""On-disk checkpoints of model states: atomic, checksummed, never unpickled.

A checkpoint is ``<dir>/<key>/epoch-<n>.pt`` (the state, written with
``torch.save`` and read with ``torch.load(weights_only=True)``) beside
``epoch-<n>.json`` (config, the state file's SHA-256 and, once the epoch is
reported and retention asks for them, its metrics). Both are written to a
temporary file first and renamed, so a reader never sees half a file. A
checkpoint counts only while its ``.json`` is there: :func:`remove_checkpoint`
removes that first, so a removal cut short leaves no half checkpoint behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "save_checkpoint",
    "folder_name_problem",
    "load_checkpoint",
    "latest_checkpoint",
    "newest_epochs",
    "checkpoint_epochs",
    "record_metrics",
    "remove_checkpoint",
    "orphan_states",
    "sync_folder",
    "CheckpointWriter",
    "CheckpointError",
]

logger = logging.getLogger("cerebro_automl")


def _atomic_write(path: Path, payload: bytes) -> None:
    """Write ``payload`` to a temporary file beside ``path``, then rename it; on any
    failure (a full disk, say) the temporary file is removed and the error raised."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def folder_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a folder of its own inside another (a model's, under
    checkpoint_dir or a tracker's log folder), or None when it can.

    Example:
        >>> folder_name_problem("model-3") is None, folder_name_problem("../up")
        (True, "must not hold a slash or a backslash, nor start with '.'")
    """
    if not name:
        return "must not be empty"
    if any(c in name for c in ("/", "\\", os.sep, "\0")) or name.startswith("."):
        return "must not hold a slash or a backslash, nor start with '.'"
    if len(name.encode()) > 255:
        return f"is {len(name.encode())} bytes long, but a folder's name may have at most 255"
    return None


def save_checkpoint(directory: str | os.PathLike, key: str, epoch: int, state: dict, meta: dict[str, Any]) -> Path:
    """Write the state after ``epoch`` epochs of ``key``; return the state file's path."""
    problem = folder_name_problem(key)
    if problem is not None:
        raise ValueError(f"checkpoint key is {key!r}, but {problem}")
    folder = Path(directory) / key
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    state_path = folder / f"epoch-{epoch}.pt"
    _atomic_write(state_path, payload)
    record = dict(meta, key=key, epoch=epoch, sha256=hashlib.sha256(payload).hexdigest())
    _atomic_write(folder / f"epoch-{epoch}.json", json.dumps(record, sort_keys=True).encode())
    return state_path


def load_checkpoint(directory: str | os.PathLike, key: str, epoch: int) -> tuple[dict, dict]:
    """Read a checkpoint; raise ValueError when it is missing or fails its checksum."""
    folder = Path(directory) / key
    meta_path, state_path = folder / f"epoch-{epoch}.json", folder / f"epoch-{epoch}.pt"
    if not meta_path.exists() or not state_path.exists():
        raise ValueError(f"no checkpoint of {key!r} after epoch {epoch} in {folder}")
    meta = json.loads(meta_path.read_text())
    payload = state_path.read_bytes()
    if hashlib.sha256(payload).hexdigest() != meta["sha256"]:
        raise ValueError(f"checkpoint {state_path} fails its checksum: truncated or corrupt")
    state = torch.load(io.BytesIO(payload), weights_only=True)
    return state, meta


def latest_checkpoint(directory: str | os.PathLike, key: str, before: int | None = None) -> tuple[dict, dict] | None:
    """The newest checkpoint of ``key`` that passes its checksum (after fewer than
    ``before`` epochs, if given), or None."""
    folder = Path(directory) / key
    epochs = sorted((int(p.stem.split("-")[1]) for p in folder.glob("epoch-*.json")), reverse=True)
    for epoch in epochs:
        if before is not None and epoch >= before:
            continue
        try:
            return load_checkpoint(directory, key, epoch)
        except (ValueError, OSError, RuntimeError, json.JSONDecodeError) as err:
            logger.warning(
                "the checkpoint of %s after epoch %d in %s cannot be read (%s: %s); it is passed over for an "
                "earlier one (with none, the model starts from its first epoch)",
                key, epoch, directory, type(err).__name__, str(err).splitlines()[0] if str(err) else "",
            )  # fmt: skip
            continue
    return None


def checkpoint_epochs(directory: str | os.PathLike, key: str) -> list[int]:
    """The epochs ``key`` has a checkpoint of in ``directory`` (both files there; not
    read, so not checksummed), in order."""
    folder = Path(directory) / key
    return sorted(
        int(p.stem.split("-")[1])
        for p in folder.glob("epoch-*.json")
        if p.stem.split("-")[1].isdigit() and p.with_suffix(".pt").exists()
    )


def newest_epochs(directory: str | os.PathLike, keys: Iterable[str]) -> dict[str, int]:
    """The newest epoch each of ``keys`` has a checkpoint of in ``directory`` (both files
    there; not read, so not checksummed), for those that have one."""
    out = {}
    for key in keys:
        epochs = checkpoint_epochs(directory, key)
        if epochs:
            out[key] = epochs[-1]
    return out


def record_metrics(directory: str | os.PathLike, key: str, epoch: int, metrics: dict[str, Any]) -> bool:
    """Add an epoch's reported ``metrics`` to its checkpoint's record (rewritten
    atomically; the state file is not touched); False when there is no such record."""
    path = Path(directory) / key / f"epoch-{epoch}.json"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return False
    record["metrics"] = {k: _json_number(v) for k, v in metrics.items()}
    _atomic_write(path, json.dumps(record, sort_keys=True).encode())
    return True


def _json_number(value: Any) -> Any:
    """A metric as JSON takes it: a float, or None for NaN and infinities (not JSON)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number and abs(number) != float("inf") else None


def remove_checkpoint(directory: str | os.PathLike, key: str, epoch: int) -> None:
    """Remove a checkpoint: its record (``.json``) first, which is what makes it one
    to every reader, then its state; an interruption between the two leaves a state
    file that no reader takes for a checkpoint (and the next removal takes away)."""
    folder = Path(directory) / key
    (folder / f"epoch-{epoch}.json").unlink(missing_ok=True)
    (folder / f"epoch-{epoch}.pt").unlink(missing_ok=True)


def orphan_states(directory: str | os.PathLike, key: str) -> list[int]:
    """The epochs of ``key`` with a state file but no record: removals cut short."""
    folder = Path(directory) / key
    return sorted(
        int(p.stem.split("-")[1])
        for p in folder.glob("epoch-*.pt")
        if p.stem.split("-")[1].isdigit() and not p.with_suffix(".json").exists()
    )


def sync_folder(directory: str | os.PathLike, key: str) -> None:
    """Make the folder's renames so far durable (fsync of the directory), so that a
    checkpoint removed after a newer one was written cannot outlive it on disk."""
    fd = os.open(Path(directory) / key, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the run would not resume from it."""


class CheckpointWriter:
    """Runs checkpoint jobs (fetch a state, write it) one at a time on a background
    thread, so that neither the state's trip to the driver nor two fsyncs per
    model-epoch hold up the driver's event loop. ``check()`` raises the first job
    error; ``flush()`` waits for the queued jobs; ``close()`` flushes and stops.

    At most ``max_queued`` jobs wait (each holds a state on a worker): past that,
    ``submit`` blocks until the writer catches up.
    """

    def __init__(self, max_queued: int = 64) -> None:
        self._jobs: queue.Queue = queue.Queue(max_queued)
        self._errors: list[tuple[str, BaseException]] = []
        self._thread: threading.Thread | None = None

    def submit(self, what: str, job: Callable[[], None]) -> None:
        """Queue ``job``; ``what`` names it in an error (e.g. "model-3 after epoch 2")."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cerebro-checkpoints", daemon=True)
            self._thread.start()
        self._jobs.put((what, job))

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            try:
                if item is None:
                    return
                what, job = item
                try:
                    job()
                except BaseException as err:  # kept for check(): the driver decides
                    logger.error("checkpoint of %s failed: %r", what, err)
                    self._errors.append((what, err))
            finally:
                self._jobs.task_done()

    def check(self) -> None:
        """Raise :class:`CheckpointError` for the first job that failed (once)."""
        if self._errors:
            what, err = self._errors.pop(0)
            self._errors.clear()
            raise CheckpointError(
                f"the checkpoint of {what} could not be written: {type(err).__name__}: {err}"
            ) from err

    def flush(self) -> None:
        """Wait until every queued job has run."""
        if self._thread is not None:
            self._jobs.join()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
