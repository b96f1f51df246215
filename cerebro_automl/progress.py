"""What a person watching a session sees: the progress bar, the dashboard link
and the counts of running, paused and failed models.

The bar (``tqdm.auto``: a widget in a notebook) counts units, one model's pass
over one partition; its postfix counts models by state::

    cerebro:  42%|████▏     | 151/360 [00:09<00:12, 16.4unit/s, running=8, paused=3, failed=1]
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from typing import Any

__all__ = [
    "make_bar",
    "in_notebook",
    "model_counts",
    "show_counts",
    "close_bar",
    "describe_statuses",
    "dashboard_link",
    "describe_counts",
]


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where stderr is no terminal, but a bar shows)."""
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    try:
        ip = shell.get_ipython()
    except Exception:
        return False
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def make_bar(progress: bool | None) -> Any:  # a tqdm bar (tqdm ships no types)
    """A tqdm bar of units, shown when ``progress`` is True, or, when None, when
    stderr is a terminal or the session runs in a notebook."""
    from tqdm.auto import tqdm

    enabled = (_isatty(sys.stderr) or in_notebook()) if progress is None else bool(progress)
    return tqdm(total=0, unit="unit", desc="cerebro", disable=not enabled, leave=False)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def model_counts(statuses: Iterable[Any]) -> dict[str, int]:
    """Models by state: ``running`` (training or evaluating), ``paused``,
    ``stopped``, ``failed``.

    >>> model_counts(["training", "evaluating", "paused", "failed"])
    {'running': 2, 'paused': 1, 'stopped': 0, 'failed': 1}
    """
    counts = Counter(getattr(s, "value", s) for s in statuses)
    return {
        "running": counts["training"] + counts["evaluating"],
        "paused": counts["paused"],
        "stopped": counts["stopped"],
        "failed": counts["failed"],
    }


def describe_counts(counts: dict[str, int]) -> str:
    """``"8 running, 3 paused, 1 failed"``: the non-zero counts, in a fixed order."""
    return ", ".join(f"{n} {state}" for state, n in counts.items() if n) or "no models"


def show_counts(bar: Any, statuses: Iterable[Any]) -> None:
    """Put the counts of running, paused and failed models in the bar's postfix."""
    if getattr(bar, "disable", True):
        return  # nothing to show: skip the count
    counts = model_counts(statuses)
    # a dict, not keywords: tqdm sorts keywords, and this order reads best
    bar.set_postfix({k: counts[k] for k in ("running", "paused", "failed")}, refresh=False)


def close_bar(bar: Any, statuses: Iterable[Any]) -> None:
    """Show the final counts, drawn even when the last update fell inside tqdm's
    interval, and close the bar."""
    show_counts(bar, statuses)
    if not bar.disable:
        bar.refresh()
    bar.close()


def describe_statuses(statuses: Iterable[Any]) -> str:
    """The models' statuses counted: ``"8 running, 3 paused, 1 failed"``."""
    return describe_counts(model_counts(statuses))


def dashboard_link(executor: Any) -> str | None:
    """The Dask dashboard's URL of the executor's cluster, or None (no Dask, no dashboard)."""
    client = getattr(executor, "client", None)
    try:
        link = getattr(client, "dashboard_link", None) if client is not None else None
    except Exception:  # a cluster without the dashboard's dependencies, or one going away
        return None
    return link or None
