"""The library's log: visible by default, out of the way once you configure logging.

Everything the library says goes to the ``cerebro_automl`` logger: the session
start (workers, partitions, order, the Dask dashboard link), failed models with
their config and the first line of the error, each tuner decision (a trial
pruned or finished, a rung promoted), warnings about the cluster, and a
summary at the end. Per-epoch lines are at DEBUG. A Dask worker's own
"Compute Failed" block for a unit whose user code raised is dropped: the
session's one line says it, and the traceback is kept in
``session.model(model_id).error`` and ``ModelFailed.error``.

As in Optuna, the logger has a default handler that prints to stderr at INFO,
so a script that configures nothing still sees those lines. Unlike Optuna's,
the default handler steps aside by itself once the record would reach any
other handler: a user's ``logging.basicConfig(...)``, ``dictConfig`` or a
handler on this logger takes over, with no line printed twice, and pytest's
``caplog`` sees the records (the logger propagates to the root logger).

Example:
    >>> import cerebro_automl.log as cl
    >>> cl.set_verbosity(cl.WARNING)      # only warnings and errors
    >>> cl.get_verbosity() == cl.WARNING
    True
    >>> cl.set_verbosity(cl.INFO)
    >>> cl.disable_default_handler()      # silence it whatever else is configured
    >>> cl.enable_default_handler()
"""

from __future__ import annotations

import logging
import sys
import threading
from logging import CRITICAL, DEBUG, ERROR, FATAL, INFO, WARN, WARNING
from typing import Any, TextIO

__all__ = [
    "CRITICAL",
    "DEBUG",
    "ERROR",
    "FATAL",
    "INFO",
    "WARN",
    "WARNING",
    "get_logger",
    "get_verbosity",
    "set_verbosity",
    "disable_default_handler",
    "enable_default_handler",
]

LIBRARY_LOGGER = "cerebro_automl"
FORMAT = "[%(levelname)1.1s %(asctime)s cerebro] %(message)s"
DATE_FORMAT = "%H:%M:%S"

_lock = threading.Lock()


class _DefaultHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (pytest, a notebook or a
    redirect may replace it), through tqdm so a progress bar is redrawn below the
    line instead of broken by it, and only when no other handler gets the record."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it; the property wins
        pass

    def filter(self, record: logging.LogRecord) -> bool:
        return super().filter(record) and not _someone_else_handles(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            from tqdm import tqdm

            tqdm.write(message, file=self.stream)
        except RecursionError:  # as logging.StreamHandler.emit does
            raise
        except Exception:
            self.handleError(record)


def _someone_else_handles(record: logging.LogRecord) -> bool:
    """True when a handler other than ours (and other than a NullHandler) would see
    ``record`` on its way up the logger tree: the user configured logging."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None:
        for handler in logger.handlers:
            if handler is not _default_handler and not isinstance(handler, logging.NullHandler):
                return True
        logger = logger.parent if logger.propagate else None
    return False


_default_handler: logging.Handler = _DefaultHandler()


def _drop_reported_unit_errors(record: logging.LogRecord) -> bool:
    """A filter for Dask's ``distributed.worker`` logger: drop its "Compute Failed"
    block (task repr, traceback) for our units whose user code raised (UnitError).
    The session reports those itself, as one line with the model's config, and
    keeps the traceback; every other worker error still shows."""
    args = record.args if isinstance(record.args, tuple) else ()
    return not (
        isinstance(record.msg, str)
        and record.msg.startswith("Compute Failed")
        and len(args) >= 4
        and str(args[0]).startswith("cerebro-")
        and str(args[3]).startswith("UnitError(")
    )


def get_logger() -> logging.Logger:
    """The library's logger, ``logging.getLogger("cerebro_automl")``."""
    return logging.getLogger(LIBRARY_LOGGER)


def _configure() -> None:
    """Attach the default handler, once (called on import of the package), and set
    INFO unless the user set a level on the logger before importing us."""
    with _lock:
        logger = get_logger()
        if getattr(logger, "_cerebro_configured", False):
            return
        logger.addHandler(_default_handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(INFO)
        # runs in Dask workers too, which import this package to run our units
        logging.getLogger("distributed.worker").addFilter(_drop_reported_unit_errors)
        logger._cerebro_configured = True  # type: ignore[attr-defined]


def get_verbosity() -> int:
    """The library logger's level (``cerebro_automl.log.INFO`` by default)."""
    return get_logger().getEffectiveLevel()


def set_verbosity(level: int | str) -> None:
    """Show the library's messages at ``level`` and above.

    Example:
        >>> import cerebro_automl.log as cl
        >>> cl.set_verbosity("DEBUG")   # per-epoch lines too
        >>> cl.set_verbosity(cl.INFO)
    """
    if isinstance(level, str):
        named = logging.getLevelName(level.upper())
        if not isinstance(named, int):
            raise ValueError(f"level is {level!r}, but must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL or an int")
        level = named
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(f"level is {level!r}, but must be an int such as cerebro_automl.log.INFO")
    get_logger().setLevel(level)


def disable_default_handler() -> None:
    """Stop the default stderr handler. Records still propagate to your handlers;
    with none anywhere, Python's last resort prints WARNING and above, plain."""
    get_logger().removeHandler(_default_handler)


def enable_default_handler() -> None:
    """Print to stderr again, where no other handler takes the library's records."""
    get_logger().addHandler(_default_handler)  # addHandler ignores a handler already there
