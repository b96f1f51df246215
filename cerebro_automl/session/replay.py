"""What a resumed search need not train again: each model's reports, journaled.

With a ``checkpoint_dir``, every report a model makes is appended to
``<dir>/<name>/reports.jsonl`` (its epoch, metrics and visit order, and with gang
units the epoch's width; JSON keeps floats exact). A session that resumes
(``resume=True``) and is asked for a model of that name finds, besides its
checkpoints, the reports the dead driver's run received. Where both the
checkpoint after epoch *r* and the reports up to *r* are there, the model starts
after epoch *r* without training, and its reports up to *r* are handed to the
tuner again, as they came then: a tuner run again with the same call makes the
same decisions from them (bitwise with ``reproducible=True``, whose decisions do
not depend on timing) and asks for the same models, which go on from their
checkpoints. So a search killed at any point continues its rungs,
promotions, population or trials, and trains only what was not trained yet:

* a model added for ``epochs`` it had already reached starts paused at ``epochs``;
* a paused model that is extended jumps to the furthest epoch the journal and its
  checkpoints reach within its new budget (:meth:`Replay.furthest`).

With ``report_every="unit"`` the reports inside each epoch are journaled too (with
their ``unit``), and an epoch counts as journaled only with all of them.

Example:
    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> journal = Replay(folder)
    >>> journal.record("model-0", 1, {"val_loss": 0.5}, (1, 0))
    >>> journal.reports("model-0")
    {1: ({'val_loss': 0.5}, (1, 0))}
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint import load_checkpoint

__all__ = ["Replay", "Replayed", "JOURNAL"]

logger = logging.getLogger("cerebro_automl")

JOURNAL = "reports.jsonl"
_Entry = tuple[dict[str, Any], tuple[int, ...], int | None]  # a journaled report: metrics, order, gang width


@dataclass(frozen=True)
class Replayed:
    """A report the run before made, handed to the tuner again: epoch ``epoch``'s, or,
    with ``unit``, the one after that many of its units."""

    epoch: int
    metrics: dict[str, Any]
    order: tuple[int, ...]
    unit: int | None = None
    gang: int | None = None  # the epoch's gang width (the history's ``gang``), if it had one


class Replay:
    """The reports journal of a checkpoint directory, and the resume points it gives."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        self._warned = False

    def record(
        self,
        name: str,
        epoch: int,
        metrics: Mapping[str, Any],
        order: tuple[int, ...],
        unit: int | None = None,
        gang: int | None = None,
    ) -> None:
        """Append a report (one line, flushed: a driver killed after it keeps it); ``gang``:
        the epoch's gang width, if it had one. The journal only spares a resume work: a
        write that fails is logged, once, and the search goes on."""
        entry: dict[str, Any] = {"epoch": epoch, "metrics": dict(metrics), "order": list(order)}
        entry.update((key, value) for key, value in (("unit", unit), ("gang", gang)) if value is not None)
        line = json.dumps(entry, sort_keys=True)
        try:
            folder = self.directory / name
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / JOURNAL, "a+b") as f:
                if f.seek(0, os.SEEK_END):
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        f.write(b"\n")  # a line cut short by a kill stays alone, unread
                f.write(line.encode() + b"\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:
            if not self._warned:
                self._warned = True
                logger.warning("the reports journal in %s could not be written (%r): a resume will train "
                               "those epochs again", self.directory, err)  # fmt: skip

    def first_epochs(self) -> dict[str, int]:
        """The first epoch each model's journal holds, for every journal in the directory
        (read when a session that resumes starts, before it writes any)."""
        out = {}
        for path in sorted(self.directory.glob(f"*/{JOURNAL}")):
            epochs = [epoch for epoch, _ in self._entries(path.parent.name)]
            if epochs:
                out[path.parent.name] = min(epochs)
        return out

    def reports(self, name: str) -> dict[int, tuple[dict[str, Any], tuple[int, ...]]]:
        """``epoch -> (metrics, order)`` of the model's journaled epochs (a line cut short
        by a kill is left out)."""
        return {e: found[:2] for (e, unit), found in self._entries(name).items() if unit is None}

    def _entries(self, name: str) -> dict[tuple[int, int | None], _Entry]:
        """``(epoch, unit) -> (metrics, order, gang)`` of every journaled report; ``unit``
        None for an epoch's."""
        path = self.directory / name / JOURNAL
        out: dict[tuple[int, int | None], _Entry] = {}
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return out
        for line in lines:
            try:
                entry = json.loads(line)
                unit = None if entry.get("unit") is None else int(entry["unit"])
                gang = None if entry.get("gang") is None else int(entry["gang"])
                out[int(entry["epoch"]), unit] = (entry["metrics"], tuple(entry["order"]), gang)
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill
        return out

    def replayed(self, name: str, after: int, upto: int, units: int = 1) -> tuple[Replayed, ...] | None:
        """The reports of epochs ``after + 1`` to ``upto``, in the order they came, with
        the ``units - 1`` reports inside each epoch when ``units`` > 1; None when the
        journal lacks one."""
        return _in_order(self._entries(name), after, upto, units)

    def furthest(self, name: str, after: int, upto: int, units: int = 1) -> tuple[int, dict, dict] | None:
        """The furthest epoch in ``(after, upto]`` that the model can start after
        without training, with its checkpoint ``(epoch, state, meta)``: that checkpoint
        passes its checksum, and the journal holds every report from ``after + 1`` on
        to it (with ``units`` > 1, the reports inside each epoch too; see
        :meth:`replayed`). None: none is (a corrupt checkpoint is passed over for an
        earlier one)."""
        entries, reach = self._entries(name), after
        while reach + 1 <= upto and _in_order(entries, reach, reach + 1, units) is not None:
            reach += 1
        for epoch in range(reach, after, -1):
            try:
                state, meta = load_checkpoint(self.directory, name, epoch)
            except (ValueError, OSError, RuntimeError):
                continue
            return epoch, state, meta
        return None


def _in_order(
    entries: Mapping[tuple[int, int | None], _Entry], after: int, upto: int, units: int
) -> tuple[Replayed, ...] | None:
    out = []
    for epoch in range(after + 1, upto + 1):
        for unit in [*range(1, units), None]:
            found = entries.get((epoch, unit))
            if found is None:
                return None
            out.append(Replayed(epoch, found[0], found[1], unit, found[2]))
    return tuple(out)
