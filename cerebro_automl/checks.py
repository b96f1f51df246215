"""Argument checks shared by the Session and the tuners: each error names the value and the rule."""

from __future__ import annotations

from typing import Any

__all__ = ["check_int", "check_timeout"]


def check_int(name: str, value: Any, least: int = 1, *, optional: bool = False) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) >= ``least``; None passes if ``optional``.

    >>> check_int("epochs", 0)
    Traceback (most recent call last):
    ValueError: epochs is 0, but must be an int >= 1
    """
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} is {value!r}, but must be an int >= {least}")


def check_timeout(timeout: Any, name: str = "timeout") -> None:
    """Raise ValueError unless ``timeout`` is None or a positive number of seconds (NaN is not)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
        raise ValueError(f"{name} is {timeout!r}, but must be a positive number of seconds")
