"""Models built on the meta device (no memory, no compute), to check configs, read a
model's structure, or receive a state's tensors; and what to say when that cannot be.

A ``model_fn`` that loads pretrained weights (``load_state_dict``) inside such a build
makes torch warn, once per tensor, that copying into a meta parameter is a no-op:
true there and harmless (the real build loads them), but it reads as if the weights
were dropped, so the builds here silence it.

HuggingFace's ``from_pretrained`` refuses a meta device context; given
``device_map="meta"`` it builds the model there from its saved config, reading no
weights. The builds here give it that map where its caller gave none, so a
``model_fn`` that calls ``from_pretrained`` (peft users' usual one) can be checked,
compared for fusion and receive a state's tensors like any other.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
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
    with warnings.catch_warnings(), _pretrained_on_meta():
        warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter in the checkpoint to a meta")
        with torch.device("meta"):
            yield


@contextlib.contextmanager
def _pretrained_on_meta() -> Iterator[None]:
    """While the block runs, ``from_pretrained`` without a ``device_map``, called under
    the meta device, runs outside that context with ``device_map="meta"`` (where
    transformers is imported: a model_fn that calls it has imported it)."""
    utils = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(utils, "PreTrainedModel", None)
    original = None if pretrained is None else pretrained.__dict__.get("from_pretrained")
    current, popped = (
        getattr(torch.overrides, n, None) for n in ("_get_current_function_mode", "_pop_mode_temporarily")
    )
    try:
        context: Any = importlib.import_module("torch.utils._device").DeviceContext
    except (ImportError, AttributeError):
        context = None
    if not isinstance(original, classmethod) or current is None or popped is None or context is None:
        yield  # no transformers, or a torch without these (private) hooks: as before
        return
    load = original.__func__

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        mode = current()
        on_top = isinstance(mode, context) and torch.device(mode.device).type == "meta"
        if not on_top or kwargs.get("device_map") is not None:
            return load(cls, *args, **kwargs)
        with popped():  # transformers refuses a meta context
            return load(cls, *args, **{**kwargs, "device_map": "meta"})

    setattr(pretrained, "from_pretrained", classmethod(from_pretrained))  # noqa: B010
    try:
        yield
    finally:
        setattr(pretrained, "from_pretrained", original)  # noqa: B010


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
