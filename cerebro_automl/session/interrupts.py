"""Ctrl-C between two consistent states: a ``KeyboardInterrupt`` that lands while
the executor hands completions over, or while the engine handles them, would lose
finished units (the executor has let go of them, the engine never heard) and stall
the session. Within :func:`deferred`, SIGINT is only noted; it is raised when the
block ends, so the executor and the engine agree again first.

A step of the event loop is short (its poll waits ``poll_interval``, 0.5 s by
default), so Ctrl-C still stops a session at once, to a person.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["deferred"]


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold SIGINT back until the block ends, then raise ``KeyboardInterrupt`` if one
    came. Outside the main thread, or under a SIGINT handler of the user's own, a
    no-op (signals reach only the main thread; a custom handler is left alone).

    >>> with deferred():
    ...     pass
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt
