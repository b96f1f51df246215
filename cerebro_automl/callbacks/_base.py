"""The hooks a Session calls, and how it calls them: a callback that raises is
logged with its traceback and disabled; training goes on. Every hook gets a
read-only :class:`~cerebro_automl.reports.SessionView` of the session."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import logging
from collections import deque
from collections.abc import Iterable
from typing import Any

from cerebro_automl.reports import EpochReport, ModelFailed, ModelPaused, SessionView, UnitReport

__all__ = ["Callback", "CallbackList"]

logger = logging.getLogger("cerebro_automl")


class Callback:
    """Code that runs as a session's models train; override the hooks you need.

    Every hook gets a :class:`~cerebro_automl.reports.SessionView`, a read-only
    view of the session, so it can read ``view.model(model_id).config``,
    ``.name``, ``view.status(model_id)``, ``view.history`` or ``view.seed``. Hooks
    run on the driver, between the session's own steps, in the order the events
    happened, once the session has handled the event. They observe: a hook that
    raises is logged with its traceback and disabled for the rest of the session,
    and training goes on with the same results. Tuning decisions (stop, extend,
    add) belong in a tuner's loop over ``session.reports()``; the view offers none.

    Example:
        >>> from cerebro_automl.callbacks import Callback
        >>> class PrintAccuracy(Callback):
        ...     def on_epoch_end(self, view, report):
        ...         print(report.model_id, report.epoch, report.metrics["val_accuracy"])
        >>> # Session(spec, data, callbacks=[PrintAccuracy()])
        >>> # grid_search(spec, data, space, epochs=5, session_callbacks=[PrintAccuracy()])
    """

    def on_session_start(self, view: SessionView) -> None:
        """The session is ready: workers known, partitions resolved, no model yet."""

    def on_model_added(self, view: SessionView, model_id: int) -> None:
        """A model was added (``view.model(model_id)`` has its config and name)."""

    def on_epoch_end(self, view: SessionView, report: EpochReport) -> None:
        """A model finished an epoch; ``report.metrics`` holds that epoch's metrics."""

    def on_unit_end(self, view: SessionView, report: UnitReport) -> None:
        """With ``Session(report_every="unit")``: a model was evaluated after a unit
        inside its epoch; ``report.metrics`` holds its metrics then."""

    def on_model_paused(self, view: SessionView, report: ModelPaused) -> None:
        """A model spent its epoch budget and is paused with its state kept
        (``session.extend`` resumes it; most searches end a model here)."""

    def on_model_stopped(self, view: SessionView, model_id: int) -> None:
        """A tuner stopped the model for good (pruned, or not promoted)."""

    def on_model_failed(self, view: SessionView, report: ModelFailed) -> None:
        """User code failed for this model; ``report.error`` holds the traceback."""

    def on_exception(self, view: SessionView, error: BaseException) -> None:
        """The code using the session raised ``error``; ``on_session_end`` follows."""

    def on_session_end(self, view: SessionView) -> None:
        """The session is closing; its history and statuses are final."""


class CallbackList:
    """The session's callbacks, called in order; a raising one is disabled.

    Hooks are queued while the session handles an event and run when it is
    consistent again (:meth:`flush`), so a hook sees the same session a tuner's
    loop would.
    """

    def __init__(self, callbacks: Iterable[Callback] | None) -> None:
        if callbacks is None:
            callbacks = []
        if (
            isinstance(callbacks, Callback)
            or not isinstance(callbacks, Iterable)
            or isinstance(callbacks, (str, bytes))
        ):
            raise TypeError(
                f"callbacks is {callbacks!r}, but must be a list of cerebro_automl.callbacks.Callback objects"
            )
        self.active: list[Callback] = list(callbacks)
        for i, cb in enumerate(self.active):
            if not isinstance(cb, Callback):
                hint = (
                    (" (a function callback(study, trial) is an Optuna callback: pass it to optimize(callbacks=...))")
                    if callable(cb)
                    else ""
                )
                raise TypeError(f"callbacks[{i}] is {cb!r}, but must be a cerebro_automl.callbacks.Callback{hint}")
            _warn_unknown_hooks(cb)
        self.disabled: list[Callback] = []
        self._pending: deque[tuple[str, tuple[Any, ...]]] = deque()
        self._flushing = False

    def defer(self, hook: str, *args: Any) -> None:
        """Queue ``hook(*args)`` for every active callback; :meth:`flush` runs it."""
        if self.active:
            self._pending.append((hook, args))

    def call(self, hook: str, *args: Any) -> None:
        """Run ``hook(*args)`` now (after any queued hooks)."""
        self.defer(hook, *args)
        self.flush()

    def flush(self) -> None:
        """Run the queued hooks, in order."""
        if self._flushing:  # a hook caused more events: the running flush takes them
            return
        self._flushing = True
        try:
            while self._pending:
                hook, args = self._pending.popleft()
                for cb in list(self.active):
                    self._run(cb, hook, tuple(map(_own_copy, args)))
        finally:
            self._flushing = False

    def _run(self, cb: Callback, hook: str, args: tuple[Any, ...]) -> None:
        try:
            getattr(cb, hook)(*args)
        except Exception:
            # training must not stop for a broken logger: report it once and drop it
            logger.error(
                "callback %s raised in %s and is disabled for the rest of the session; training goes on",
                _name(cb),
                hook,
                exc_info=True,
            )
            self.active.remove(cb)
            self.disabled.append(cb)


def _name(cb: Callback) -> str:
    return type(cb).__qualname__


def flatten_config(config: Any, prefix: str = "") -> dict[str, bool | int | float | str]:
    """A config as flat scalars for trackers: nested dicts become ``outer.inner``
    keys; lists, None and other values become their JSON text.

    >>> flatten_config({"lr": 0.1, "opt": {"name": "adam", "betas": [0.9, 0.99]}, "x": None})
    {'lr': 0.1, 'opt.name': 'adam', 'opt.betas': '[0.9, 0.99]', 'x': 'null'}
    """
    import json

    flat: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_config(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, sort_keys=True, default=str)
    return flat


HOOKS = frozenset(name for name in vars(Callback) if name.startswith("on_"))


def _warn_unknown_hooks(cb: Callback) -> None:
    """A method named almost like a hook (a typo: ``on_epoch_ended``) is never called:
    say so once, when the session takes the callback. Read without running anything (a
    property stays unread); a helper of another name (``on_improvement``) is its own."""
    unknown = []
    for name in dir(type(cb)):
        if not name.startswith("on_") or name in HOOKS:
            continue
        if inspect.isfunction(inspect.getattr_static(type(cb), name, None)) and difflib.get_close_matches(
            name, HOOKS, n=1, cutoff=0.8
        ):
            unknown.append(name)
    if unknown:
        logger.warning(
            "callback %s defines %s, which no session calls: the hooks are %s", _name(cb), unknown, sorted(HOOKS)
        )


def _own_copy(arg: Any) -> Any:
    """``arg`` for one callback: a report whose dicts are copies, so that a callback
    that changes them changes neither the tuner's report nor another callback's. A
    value that cannot be deep-copied (a lock in a config) is copied one level deep."""
    if not dataclasses.is_dataclass(arg) or isinstance(arg, type):
        return arg
    changed = {
        f.name: _copied(value) for f in dataclasses.fields(arg) if isinstance(value := getattr(arg, f.name), dict)
    }
    return dataclasses.replace(arg, **changed) if changed else arg


def _copied(value: dict) -> dict:
    try:
        return copy.deepcopy(value)
    except Exception:
        return dict(value)
