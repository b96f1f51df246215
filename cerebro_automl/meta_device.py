"""Models built on the meta device (no memory, no compute), to check configs, read a
model's structure, or receive a state's tensors; and what to say when that cannot be.

A ``model_fn`` that loads pretrained weights (``load_state_dict``) inside such a build
makes torch warn, once per tensor, that copying into a meta parameter is a no-op:
true there and harmless (the real build loads them), but it reads as if the weights
were dropped, so the builds here silence it.

HuggingFace's ``from_pretrained`` refuses a meta device context; given
``device_map="meta"`` it builds the model there from the checkpoint's config and
tensor headers, reading no tensor data. Inside :func:`on_meta` (and only there, in
the thread that entered it), a ``from_pretrained`` called without a ``device_map``
gets that map and ``local_files_only=True`` (a checkpoint not on this machine then
fails as before, and is built for real where it trains, instead of downloaded
here), so a ``model_fn`` that calls it (peft users' usual one) can be checked,
compared for fusion and receive a state's tensors like any other.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch

__all__ = ["on_meta", "meta_build", "tell_unchecked"]

logger = logging.getLogger("cerebro_automl")
_UNCHECKED: weakref.WeakSet = weakref.WeakSet()  # model_fns told once that their configs go unchecked
_HF = "transformers.modeling_utils"
T = TypeVar("T")


class _Depth(threading.local):
    """How deep this thread is inside :func:`on_meta` (the from_pretrained wrapper acts at > 0)."""

    value = 0


_depth = _Depth()
_install_lock = threading.Lock()


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build on the meta device, without torch's per-tensor no-op warnings of a
    ``load_state_dict`` into it, and with ``from_pretrained`` loading there."""
    _wrap_from_pretrained()
    _depth.value += 1
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r".*copying from a non-meta parameter in the checkpoint to a meta"
            )
            with torch.device("meta"):
                yield
    finally:
        _depth.value -= 1


def meta_build(build: Callable[[], T]) -> T:
    """``build()`` inside :func:`on_meta`; once more when the first try imported
    transformers (a ``model_fn`` that imports it inside itself: ``from_pretrained``
    is made to load on the meta device only once transformers is imported)."""
    loaded = _HF in sys.modules
    try:
        with on_meta():
            return build()
    except Exception:
        if loaded or _HF not in sys.modules:
            raise
    with on_meta():
        return build()


def _wrap_from_pretrained() -> None:
    """Wrap ``PreTrainedModel.from_pretrained`` once per process, where transformers is
    imported and torch has the (private) hooks the wrapper needs; outside
    :func:`on_meta` the wrapper calls the original unchanged."""
    pretrained = getattr(sys.modules.get(_HF), "PreTrainedModel", None)
    if pretrained is None or getattr(pretrained, "_cerebro_meta_wrapped", False):
        return
    current, popped = (
        getattr(torch.overrides, n, None) for n in ("_get_current_function_mode", "_pop_mode_temporarily")
    )
    try:
        context: Any = importlib.import_module("torch.utils._device").DeviceContext
    except (ImportError, AttributeError):
        return
    original = pretrained.__dict__.get("from_pretrained")
    if not isinstance(original, classmethod) or current is None or popped is None:
        return
    load = original.__func__

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        mode = current() if _depth.value else None
        on_top = isinstance(mode, context) and torch.device(mode.device).type == "meta"
        if not on_top or kwargs.get("device_map") is not None:
            return load(cls, *args, **kwargs)
        with popped():  # transformers refuses a meta context
            return load(cls, *args, **{"local_files_only": True, **kwargs, "device_map": "meta"})

    with _install_lock:
        if not getattr(pretrained, "_cerebro_meta_wrapped", False):
            setattr(pretrained, "from_pretrained", classmethod(from_pretrained))  # noqa: B010
            pretrained._cerebro_meta_wrapped = True


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
