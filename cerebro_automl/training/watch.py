"""How an executor watches a running unit: its deadline, whether its result is
still wanted, and how far it has come. A unit calls :func:`check_deadline` after
every batch; the executor sets what it checks with :func:`abandon_when` and
:func:`progress_to`, per thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from .errors import UnitAbandoned, UnitTimeout

__all__ = ["abandon_when", "progress_to", "check_deadline"]

# .fn: the running unit's "is my result still wanted?" test; .progress: where it says how far it is
_unit_watch = threading.local()


@contextlib.contextmanager
def abandon_when(check: Callable[[], bool]) -> Iterator[None]:
    """Within the block, :func:`check_deadline` in this thread also raises
    :class:`UnitAbandoned` once ``check()`` is true (an executor's way to stop a
    unit whose result it has discarded, rather than let it run to its end)."""
    _unit_watch.fn = check
    try:
        yield
    finally:
        _unit_watch.fn = None


@contextlib.contextmanager
def progress_to(report: Callable[[float], None]) -> Iterator[None]:
    """Within the block, :func:`check_deadline` in this thread passes the unit's
    ``fraction`` done to ``report`` (an executor's way to see how far a unit has come;
    a unit reports 0.0 as its first batch begins)."""
    _unit_watch.progress = report
    try:
        yield
    finally:
        _unit_watch.progress = None


def check_deadline(deadline: float | None, fraction: float | None = None) -> None:
    """Raise :class:`UnitTimeout` once ``time.perf_counter()`` is past ``deadline``, and
    :class:`UnitAbandoned` once the executor no longer wants the unit's result.
    Units call it after every batch, with the ``fraction`` of their rows trained so
    far (and with 0.0 before the first): a single batch that never returns is not
    interrupted."""
    report = getattr(_unit_watch, "progress", None)
    if report is not None and fraction is not None:
        report(fraction)
    if deadline is not None and time.perf_counter() > deadline:
        raise UnitTimeout(
            f"the unit ran {time.perf_counter() - deadline:.1f} s past its unit_timeout (checked after every batch)"
        )
    check = getattr(_unit_watch, "fn", None)
    if check is not None and check():
        raise UnitAbandoned("the unit's result is no longer wanted; it stopped after a batch")
