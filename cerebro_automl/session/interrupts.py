"""Ctrl-C and SIGTERM between two consistent states.

A ``KeyboardInterrupt`` that lands while the executor hands completions over, or
while the engine handles them, would lose finished units (the executor has let go
of them, the engine never heard) and stall the session. Within :func:`deferred`,
SIGINT is only noted; it is raised when the block ends, so the executor and the
engine agree again first.

SIGTERM is what SLURM sends at a job's wall-time limit, and what ``scancel``,
Kubernetes evictions and preemption send. While a session is open
(:func:`terminate_as_interrupt`) it stops the driver as Ctrl-C does: it raises
:class:`Terminated` (a ``KeyboardInterrupt``), deferred the same way, so the
session closes as usual: the checkpoints queued are written, the cluster's work
is cancelled and the checkpoint directory's lock released, within the seconds
SLURM leaves before SIGKILL (``KillWait``, 30 s by default).

A step of the event loop is short (its poll waits ``poll_interval``, 0.5 s by
default), so either signal stops a session at once, to a person.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Terminated", "deferred", "interrupted", "terminate_as_interrupt"]


class Terminated(KeyboardInterrupt):
    """The driver received SIGTERM (a wall-time limit, ``scancel``, an eviction)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated("SIGTERM")


def terminate_as_interrupt() -> Callable[[], None]:
    """Make SIGTERM raise :class:`Terminated` in the main thread; return what undoes
    it. Outside the main thread, or under a SIGTERM handler of the user's own, a
    no-op (signals reach only the main thread; a custom handler is left alone)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) not in (
        signal.SIG_DFL,
        None,
    ):
        return lambda: None
    signal.signal(signal.SIGTERM, _raise_terminated)

    def restore() -> None:
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _raise_terminated
        ):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    return restore


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT (and SIGTERM while :func:`terminate_as_interrupt` holds) back until
    the block ends, then raise ``KeyboardInterrupt`` (or :class:`Terminated`) if one
    came; a second of the same signal acts at once (a block that hangs can still be
    left). Outside the main thread, or for a signal under a handler of the user's
    own, a no-op (signals reach only the main thread; a custom handler is left alone).

    >>> with deferred():
    ...     pass
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: _raise_terminated}
    held = [s for s, handler in ours.items() if signal.getsignal(s) is handler]
    received: list[int] = []

    def record(signum: int, frame: Any) -> None:
        received.append(signum)
        signal.signal(signum, ours[signal.Signals(signum)])  # the next one acts at once

    for s in held:
        signal.signal(s, record)
    try:
        yield
    finally:
        for s in reversed(held):  # SIGTERM's first: a SIGINT now lands on its own handler
            signal.signal(s, ours[s])
        # Raised even while the block's own exception propagates: a signal comes once.
        if signal.SIGTERM in received:
            raise Terminated("SIGTERM")
        if received:
            raise KeyboardInterrupt


def interrupted(exc: KeyboardInterrupt, checkpoint_dir: Any) -> str:
    """What a person reads when a session stops for ``exc``: what is kept, and how to go on.

    >>> interrupted(Terminated("SIGTERM"), "ckpt")[:60]
    'stopped by SIGTERM: the session closed, and the checkpoints '
    """
    cause = "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"
    if checkpoint_dir is None:
        return (
            f"stopped by {cause}: the session closed; with no checkpoint_dir nothing was kept "
            "(pass checkpoint_dir= to continue a search after an interruption)"
        )
    return (
        f"stopped by {cause}: the session closed, and the checkpoints written so far are in "
        f"{checkpoint_dir!r}. To continue, run the same call again: a Session or a tuner with "
        "resume=True added, Optuna's optimize as it was (the same study and checkpoint_dir)"
    )
