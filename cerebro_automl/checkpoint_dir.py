"""A checkpoint directory's owner: one live session at a time.

When a session with ``checkpoint_dir`` starts, :class:`CheckpointDirectory`
checks that the path is a directory this process can write (creating it if
missing) and takes its lock, ``<dir>/.lock``: a file created atomically (linked
into place, so it is never seen half-written) that holds the run's identity
(a run id, the host, the pid and when the run started). A second live session
on the directory is refused, naming the run that holds it. The lock is removed
when the session closes, however it ends; a later session may then resume from
the directory's checkpoints.

A lock whose holder is gone without removing it (a driver killed with SIGKILL,
a node that crashed) is taken over, with a log line: on the holder's host as
soon as its process has ended; from another host (a job resubmitted to another
node of a shared file system) once its lease has lapsed. The holder renews the
lease by touching the lock every ``lease / 6`` seconds; a lock untouched for
``lease`` seconds (60 by default), by the file system's clock, is stale.

Taking the lock, or taking over a stale one, happens under an ``flock`` of
``<dir>/.lock.guard``, so two sessions starting at once cannot both take it.

Example:
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> first = CheckpointDirectory(folder)
    >>> CheckpointDirectory(folder)  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    CheckpointDirInUse: checkpoint_dir '/tmp/...' is in use by run ... (pid ... on host ...)
    >>> first.release()
    >>> CheckpointDirectory(folder).release()
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["CheckpointDirectory", "CheckpointDirInUse", "RunIdentity", "check_writable_dir"]

logger = logging.getLogger("cerebro_automl")

LOCK = ".lock"
GUARD = ".lock.guard"
LEASE = 60.0  # seconds without a renewal after which another host may take a lock over


class CheckpointDirInUse(RuntimeError):
    """Another live session holds the checkpoint directory's lock."""


@dataclass(frozen=True)
class RunIdentity:
    """Who holds a checkpoint directory: a run id, the host, the pid, when it started,
    and the process's start time (Linux: a pid reused by another process is not it)."""

    run_id: str
    host: str
    pid: int
    started: str
    process_start: str | None = None

    @classmethod
    def of_this_process(cls) -> RunIdentity:
        now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        return cls(uuid.uuid4().hex[:12], socket.gethostname(), os.getpid(), now, _process_start(os.getpid()))

    def describe(self) -> str:
        return f"run {self.run_id} (pid {self.pid} on host {self.host}, started {self.started})"

    def gone(self) -> bool:
        """True only when this host can tell that the run's process has ended."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return self.process_start is not None and _process_start(self.pid) not in (None, self.process_start)


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # the command name may hold spaces and ')'


def check_writable_dir(path: str | os.PathLike, name: str = "checkpoint_dir") -> Path:
    """Create ``path`` if missing; ValueError naming it unless it is a directory this
    process can create files in (tried, not guessed from its permission bits)."""
    folder = Path(path)
    try:
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{name} {str(folder)!r} is a file, but must be a directory (created if missing)")
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        os.unlink(probe)
    except OSError as err:
        raise ValueError(
            f"{name} {str(folder)!r} is not a directory this process can write "
            f"({type(err).__name__}: {err.strerror or err}): every model's state is written "
            "there at each epoch end"
        ) from None
    return folder


class CheckpointDirectory:
    """This session's hold on a checkpoint directory (see the module docstring);
    :meth:`release` gives it up (also done when the object is collected, or at exit)."""

    def __init__(self, path: str | os.PathLike, lease: float = LEASE, resume: bool = False) -> None:
        existed = Path(path).is_dir()
        self.path = check_writable_dir(path)
        if resume and not existed:  # a mistyped path would resume nothing, and say nothing
            logger.warning(
                "resume=True, but checkpoint_dir %s did not exist (created now): nothing to resume, every "
                "model starts from its first epoch",
                self.path,
            )
        self.run = RunIdentity.of_this_process()
        self.lease = lease
        lock = self.path / LOCK
        with _guard(self.path / GUARD):
            self._take(lock)
        stop = threading.Event()
        threading.Thread(
            target=_renew, args=(lock, self.run.run_id, lease / 6, stop), name="cerebro-lock-lease", daemon=True
        ).start()
        self._release = weakref.finalize(self, _remove_lock, lock, self.run.run_id, stop)

    def release(self) -> None:
        """Remove the lock, if it is still this run's, and stop renewing it."""
        self._release()

    @property
    def held(self) -> bool:
        return self._release.alive

    def _take(self, lock: Path) -> None:
        """Create the lock; a stale one (its process gone, on this host) is replaced.
        An owner releasing its lock meanwhile (without the guard) means one more try."""
        for _ in range(3):
            if _create(lock, self.run):
                return
            owner = _read(lock)
            if owner is None and not lock.exists():
                continue  # released just now
            if owner is None or not (owner.gone() or self._lapsed(lock, owner)):
                raise CheckpointDirInUse(self._in_use(lock, owner))
            why = "whose process is gone" if owner.gone() else f"whose lease lapsed ({self.lease:g} s unrenewed)"
            logger.warning("checkpoint_dir %s: taking over the lock of %s, %s", self.path, owner.describe(), why)
            lock.unlink(missing_ok=True)
        raise CheckpointDirInUse(self._in_use(lock, _read(lock)))

    def _lapsed(self, lock: Path, owner: RunIdentity) -> bool:
        """Whether another host's lock went unrenewed for the lease, by the file system's
        clock (hosts' clocks may differ; the guard, just touched, tells its now)."""
        if owner.host == socket.gethostname():
            return False  # its process is asked directly
        try:
            guard = self.path / GUARD
            os.utime(guard)
            return guard.stat().st_mtime - lock.stat().st_mtime > self.lease
        except OSError:
            return False

    def _in_use(self, lock: Path, owner: RunIdentity | None) -> str:
        who = owner.describe() if owner is not None else f"another run (its lock {lock} is unreadable)"
        text = (
            f"checkpoint_dir {str(self.path)!r} is in use by {who}: one live session at a time may "
            "write a checkpoint directory (a later one may resume from it). Wait for that run to end, "
            "or pass another checkpoint_dir"
        )
        if owner is None:
            text += f"; if no session uses it any more, delete {lock}"
        elif owner.host != socket.gethostname():
            renewed = f"its lock is renewed every {self.lease / 6:g} s"
            text += f" ({renewed}; it is taken over once {self.lease:g} s pass unrenewed)"
        return text


@contextlib.contextmanager
def _guard(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing, never deleted)."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _create(lock: Path, run: RunIdentity) -> bool:
    """Write ``run`` to a temporary file and link it into place: False if a lock exists."""
    tmp = lock.with_name(f"{lock.name}.{run.run_id}.tmp")
    tmp.write_text(json.dumps(asdict(run), sort_keys=True))
    try:
        os.link(tmp, lock)
        return True
    except FileExistsError:
        return False
    except OSError as err:  # a file system without hard links: exclusive create, then write
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(tmp.read_text())
        return True
    finally:
        tmp.unlink()


def _read(lock: Path) -> RunIdentity | None:
    try:
        return RunIdentity(**json.loads(lock.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _renew(lock: Path, run_id: str, every: float, stop: threading.Event) -> None:
    """Touch the lock every ``every`` seconds while it is this run's (the lease)."""
    while not stop.wait(every):
        owner = _read(lock)
        if owner is None or owner.run_id != run_id:
            logger.error(
                "checkpoint_dir %s: the lock of run %s was taken over by %s (this driver was "
                "suspended or cut off longer than its lease); its checkpoints may now be overwritten",
                lock.parent,
                run_id,
                owner.describe() if owner is not None else "nobody",
            )
            return
        with contextlib.suppress(OSError):
            os.utime(lock)


def _remove_lock(lock: Path, run_id: str, stop: threading.Event) -> None:
    stop.set()
    owner = _read(lock)
    if owner is not None and owner.run_id == run_id:
        with contextlib.suppress(OSError):
            lock.unlink()
