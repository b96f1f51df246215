"""What a session remembers of its models: their records, the history (one row
per model-epoch), the best model, and handles on single models.

Example:
    >>> h = History()
    >>> h.add(ModelInfo({"lr": 0.1}, seed=7, offset=0, name="model-0"))
    0
    >>> h.check_id(3)
    Traceback (most recent call last):
    ValueError: model id 3 is unknown; known ids are 0..0
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import pandas as pd
import torch

from ..checkpoint import folder_name_problem
from ..training import TrainingSpec, whole_model

__all__ = ["ModelInfo", "History", "ModelHandle", "ModelSource"]

# The columns after the metrics, in this order; the optional ones only when a row has them.
_TAIL = [
    "error",
    "config",
    "name",
    "seed",
    "offset",
    "parent",
    "parent_epoch",
    "warm_start",
    "order",
    "num_partitions",
    "threads",
    "device",
    "deterministic",
    "fuse",
    "cyclic",
    "session_seed",
]
_OPTIONAL = {"error", "parent", "parent_epoch", "warm_start", "fuse", "cyclic"}


@dataclass
class ModelInfo:
    """One model as the session knows it: what it trains, and what it reported."""

    config: dict[str, Any]
    seed: int
    offset: int
    name: str
    epochs: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    lineage: dict[str, Any] = field(default_factory=dict)  # history columns of a fork or warm start


class History:
    """The models' records, by id (ids count from 0 in the order added), and the rows.
    ``metrics``: the columns every frame has, whether or not a row holds them (so that a
    history whose models all failed still has ``val_loss``); None: those rows hold."""

    def __init__(self, metrics: Sequence[str] | None = None) -> None:
        self.models: dict[int, ModelInfo] = {}
        self.rows: list[dict[str, Any]] = []
        self.metrics = list(metrics or [])

    @property
    def next_id(self) -> int:
        """The id the next model added gets."""
        return len(self.models)

    def add(self, info: ModelInfo) -> int:
        """Record a new model; return its id."""
        model_id = self.next_id
        self.models[model_id] = info
        return model_id

    def check_id(self, model_id: Any) -> None:
        """Raise ValueError unless ``model_id`` is a known model's id."""
        if model_id not in self.models:
            known = f"0..{len(self.models) - 1}" if self.models else "none yet"
            raise ValueError(f"model id {model_id!r} is unknown; known ids are {known}")

    def check_name(self, name: str) -> str:
        """``name``, unless a model of this session already has it or it cannot name
        the model's folders (ValueError)."""
        problem = folder_name_problem(name)
        if problem is not None:
            usable = name.replace("/", "_").replace("\\", "_").replace("\0", "").lstrip(".")[:64]
            raise ValueError(
                f"name is {name!r}, but {problem}: it names the model's folder under checkpoint_dir "
                "and in the trackers' logs" + (f" (e.g. {usable!r})" if usable else "")
            )
        if any(info.name == name for info in self.models.values()):
            raise ValueError(f"name is {name!r}, but a model of this session already has it")
        return name

    def record_epoch(self, model_id: int, epoch: int, metrics: dict[str, float], keys: Mapping[str, Any]) -> None:
        """Epoch ``epoch`` of the model reported ``metrics``: its row, and its latest metrics."""
        info = self.models[model_id]
        info.epochs, info.metrics = epoch, dict(metrics)  # not the report's dict, which its reader may change
        self.rows.append({"model_id": model_id, "epoch": epoch, **metrics, **keys})

    def record_failure(self, model_id: int, error: str, keys: Mapping[str, Any]) -> None:
        """The model failed: one row at the epoch that failed, no metrics, the reason's first line."""
        info = self.models[model_id]
        info.error = error
        self.rows.append({"model_id": model_id, "epoch": info.epochs + 1, "error": error.splitlines()[0], **keys})

    def frame(self) -> pd.DataFrame:
        """The rows as a DataFrame: ``model_id``, ``epoch``, the metrics (sorted), then the rest."""
        return pd.DataFrame(self.rows, columns=_columns(self.rows, self.metrics))

    def best_id(self, metric: str, mode: str, stopped: Callable[[int], bool]) -> int:
        """The id of the model whose latest ``metric`` is best (``mode`` "min" or
        "max"), among those that did not fail and are not ``stopped``; ties go to
        the lowest id."""
        if mode not in ("min", "max"):
            raise ValueError(f"mode is {mode!r}, but must be 'min' or 'max'")
        scored = [
            (info.metrics[metric], mid)
            for mid, info in self.models.items()
            if metric in info.metrics
            and info.error is None
            and not math.isnan(info.metrics[metric])  # NaN would corrupt the order
            and not stopped(mid)
        ]
        if not scored:
            nan = [
                mid
                for mid, info in self.models.items()
                if metric in info.metrics
                and info.error is None
                and math.isnan(info.metrics[metric])
                and not stopped(mid)
            ]
            if nan:
                raise ValueError(
                    f"no model has a number for metric {metric!r}: models {nan} reported it as "
                    "NaN (non-finite validation data, or a metric that divides by zero); "
                    "best() skips NaN"
                )
            known = sorted({k for info in self.models.values() for k in info.metrics})
            raise ValueError(f"no model has reported metric {metric!r}; reported metrics: {known}")
        scored.sort(key=lambda t: (t[0] if mode == "min" else -t[0], t[1]))
        return scored[0][1]


def _columns(rows: list[dict[str, Any]], metrics: Sequence[str] = ()) -> list[str]:
    first = ["model_id", "epoch"]
    present = {k for row in rows for k in row}
    names = sorted((present | set(metrics)) - set(first) - set(_TAIL))
    return first + names + [k for k in _TAIL if k not in _OPTIONAL or k in present]


class ModelSource(Protocol):
    """What a :class:`ModelHandle` reads from its session."""

    spec: TrainingSpec

    @property
    def history(self) -> pd.DataFrame: ...

    def status(self, model_id: int) -> str: ...

    @property
    def closed(self) -> bool: ...

    def fetch_state(self, model_id: int) -> dict: ...


class ModelHandle:
    """One model of a session: ``config``, ``metrics``, ``state()`` and ``build()``.

    The attributes are a snapshot taken when the handle was made; ``status`` and
    ``history`` are read when asked.
    """

    def __init__(self, session: ModelSource, model_id: int, info: ModelInfo) -> None:
        self._session, self.model_id = session, model_id
        self.config: dict[str, Any] = copy.deepcopy(info.config)
        self.seed: int = info.seed
        self.offset: int = info.offset
        self.name: str = info.name
        self.epochs: int = info.epochs
        self.metrics: dict[str, float] = dict(info.metrics)
        self.error: str | None = info.error

    @property
    def status(self) -> str:
        """``training``, ``evaluating``, ``paused``, ``stopped`` or ``failed``."""
        return self._session.status(self.model_id)

    @property
    def history(self) -> pd.DataFrame:
        """This model's rows of the session's history."""
        h = self._session.history
        return h[h["model_id"] == self.model_id].reset_index(drop=True)

    def state(self) -> dict:
        """The model's newest state (model, optimizer and LR-scheduler state dicts); if
        its worker died, it is recomputed first."""
        if self._session.closed:
            raise RuntimeError(
                f"the session is closed, and model {self.model_id}'s state went with its workers: call "
                "build() or state() inside the `with Session(...)` block (a tuner's result.best_model() "
                "was fetched before its session closed)"
            )
        return self._session.fetch_state(self.model_id)

    def build(self) -> torch.nn.Module:
        """``model_fn(config)`` with the model's newest weights, on the CPU: the whole
        model, its frozen base (built here, checked against the digests its units
        recorded) included. With :class:`~cerebro_automl.FrozenFeatures`, what
        ``model_fn`` builds is the part on top of the backbone: it reads the feature
        ``config[layer_key]`` names (pooled as the spec pools it), not the raw input."""
        state = self.state()
        return whole_model(self._session.spec, self.config, state, self.seed)

    def __repr__(self) -> str:
        return f"ModelHandle(model_id={self.model_id}, epochs={self.epochs}, config={self.config})"
