"""The wire format: how a task's function and inputs travel to a worker.

The Dask scheduler unpickles every task it is sent. Ours name this package and
carry torch objects, so a scheduler without torch (or without this package)
could not read them. A task therefore travels as a runner that the scheduler can
unpickle with cloudpickle alone (a lambda, pickled by value) and a payload of
bytes that only the worker unpickles; the futures it reads stay plain arguments,
so that Dask still moves their data worker to worker.

>>> future = client.submit(RUNNER, *portable(fn, (spec, state_future), {}))  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any

__all__ = ["RUNNER", "Pickled", "with_spec", "cached_value", "portable", "is_future", "unknown_keys"]

_RUN = lambda payload, *inputs, _loads=__import__("pickle").loads: _loads(payload)(*inputs)  # noqa: E731, B008

# Runs on the Dask scheduler: the keys it does not know. A lambda, so that it reaches
# a scheduler without this package by value.
unknown_keys = lambda keys, dask_scheduler=None: [k for k in keys if k not in dask_scheduler.tasks]  # noqa: E731


class _Runner:
    """``_RUN``, pickled by value once: Dask pickles every task it submits, and the
    standard pickler, which it tries first, takes this object as the call that
    rebuilds the lambda from its bytes (cloudpickle would pickle the lambda anew
    for every task)."""

    def __init__(self) -> None:
        import cloudpickle

        self._pickled = cloudpickle.dumps(_RUN)

    def __reduce__(self) -> tuple:
        return pickle.loads, (self._pickled,)

    def __call__(self, payload: bytes, *inputs: Any) -> Any:
        return _RUN(payload, *inputs)


RUNNER = _Runner()


class _Input:
    """Where the ``index``-th input future goes among a task's arguments."""

    def __init__(self, index: int) -> None:
        self.index = index


class Pickled:
    """An argument pickled once on the driver (the spec, a config), not per task.

    ``cached``: a worker keeps the unpickled value for the next task that carries
    the same bytes, so the spec (its model code) is unpickled once per worker, not
    once per task. Configs are not cached: each unit gets its own copy, and user
    code that changes its config changes nothing beyond its unit.
    """

    def __init__(self, value: Any, cached: bool = False) -> None:
        import hashlib

        import cloudpickle

        self.data = cloudpickle.dumps(value)
        self.digest = hashlib.sha1(self.data).hexdigest() if cached else None

    def value(self) -> Any:
        """Run on the worker: the value, from this worker's cache when it has it."""
        if self.digest in _UNPICKLED:
            return _UNPICKLED[self.digest]
        value = pickle.loads(self.data)  # task data, as Dask's own
        if self.digest is not None:
            if len(_UNPICKLED) >= 8:  # the specs of a few sessions at most
                _UNPICKLED.pop(next(iter(_UNPICKLED)))
            _UNPICKLED[self.digest] = value
        return value


# Worker process: the specs of recent tasks, unpickled, by the digest of their bytes.
_UNPICKLED: dict[str, Any] = {}


def with_spec(fn: Callable[[Any], Any], spec: Pickled) -> Any:
    """Run on a worker (by ``client.run``): ``fn`` of the spec ``spec`` holds."""
    return fn(spec.value())


def cached_value(digest: str) -> Any:
    """Run on a worker: the value this worker unpickled from bytes of ``digest``, or None."""
    return _UNPICKLED.get(digest)


def _call(fn: Callable, args: tuple, kwargs: dict, *inputs: Any) -> Any:
    """Run on the worker: ``fn`` with the inputs' values in their places."""
    args = tuple(
        inputs[a.index]
        if isinstance(a, _Input)
        else a.value()
        if isinstance(a, Pickled)
        else a  # task data, as Dask's own
        for a in args
    )
    return fn(*args, **kwargs)


def portable(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """``(payload, *input futures)``, the arguments of ``RUNNER`` that runs ``fn``."""
    inputs = [a for a in args if is_future(a)]
    template = tuple(_Input(inputs.index(a)) if is_future(a) else a for a in args)
    task = functools.partial(_call, fn, template, kwargs)
    try:  # our task functions and their arguments are plain data: the fast pickler takes them
        payload = pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError):
        payload = None
    # pickle names functions (a loader, a transform) by module: one defined in the
    # driver's script is __main__.<name>, which a worker's own __main__ lacks. cloudpickle
    # sends those by value.
    if payload is None or b"__main__" in payload:
        import cloudpickle

        payload = cloudpickle.dumps(task)
    return (payload, *inputs)


def is_future(value: Any) -> bool:
    """Whether ``value`` is a Dask future (a state on a worker), not the driver's own copy."""
    return hasattr(value, "key") and hasattr(value, "status")
