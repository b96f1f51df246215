"""Models built on the meta device (no memory, no compute), to check configs, read a
model's structure, or receive a state's tensors; and what to say when that cannot be.

A ``model_fn`` that loads pretrained weights (``load_state_dict``) inside such a build
makes torch warn, once per tensor, that copying into a meta parameter is a no-op:
true there and harmless (the real build loads them), but it reads as if the weights
were dropped, so the builds here silence it.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["on_meta", "tell_unchecked"]

logger = logging.getLogger("cerebro_automl")
_UNCHECKED: weakref.WeakSet = weakref.WeakSet()  # model_fns told once that their configs go unchecked


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build on the meta device, without torch's per-tensor no-op warnings of a
    ``load_state_dict`` into it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter in the checkpoint to a meta")
        with torch.device("meta"):
            yield


def tell_unchecked(model_fn: Any, config: Mapping[str, Any], err: Exception) -> None:
    """Warn, once per ``model_fn``, that its configs are not all checked before
    training: building ``config`` on the meta device raised ``err``."""
    try:
        if model_fn in _UNCHECKED:
            return
        _UNCHECKED.add(model_fn)
    except TypeError:  # not weakly referable: told every time
        pass
    first = (str(err).splitlines() or [""])[0][:200]
    logger.warning(
        "configs of %s are not all checked before training: the model, optimizer or scheduler of %s "
        "could not be built on the meta device (%s: %s); a config that cannot be built (one that lacks a key, "
        "say) fails its own model on a worker instead",
        getattr(model_fn, "__qualname__", repr(model_fn)), dict(config), type(err).__name__, first,
    )  # fmt: skip
