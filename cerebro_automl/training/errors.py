"""The errors a unit raises, and the message that carries a failure to the driver.

:class:`UnitError` is what leaves a unit: it fails only the model whose unit
raised it. Inside a unit, :class:`NonFiniteLossError`, :class:`UnitTimeout` and
:class:`UnitAbandoned` say why the pass stopped.
"""

from __future__ import annotations

import traceback

__all__ = ["UnitError", "NonFiniteLossError", "UnitTimeout", "UnitAbandoned", "describe_failure"]


class UnitError(RuntimeError):
    """User code failed inside a unit; the message holds the error and its traceback.

    Raised on the worker, it fails only the model whose unit raised it.
    """


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


class UnitTimeout(RuntimeError):
    """A train unit ran past the session's ``unit_timeout``."""


class UnitAbandoned(RuntimeError):
    """The unit's result is no longer wanted (its model stopped or rolled back, or a
    speculative copy of it finished first): it stopped after a batch."""


def describe_failure(err: BaseException) -> str:
    """``"<type>: <message>"`` and the last frames of the traceback, the text of a :class:`UnitError`.

    >>> describe_failure(ValueError("bad")).splitlines()[0]
    'ValueError: bad'
    """
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__, limit=-3))
    message = str(err)
    if isinstance(err, RuntimeError) and "does not have a deterministic implementation" in message:
        # torch's message names the operation; say the way out in our terms
        first = message.splitlines()[0].split(", but you set")[0]
        return (
            f"NondeterministicOperationError: {first}, and this session runs CUDA units with "
            "deterministic kernels only; pass deterministic=False to the Session to allow it "
            f"(results are then not bitwise reproducible; the history records it)\n{tb}"
        )
    if isinstance(err, RuntimeError) and message.startswith("expected target dtype to be Long"):
        # cross_entropy and nll_loss on labels stored as int32 (a Parquet column, say): the data keeps dtypes
        return (
            f"RuntimeError: {message.splitlines()[0]}: the loss takes class indices as int64 (torch.long), "
            "and the data keeps the labels' dtype: store them as int64 (y.astype('int64'), or cast the "
            f"Parquet column), or give a loss_fn that casts them\n{tb}"
        )
    return f"{type(err).__name__}: {_detail_on_first_line(message)}\n{tb}"


def _detail_on_first_line(message: str) -> str:
    """``message`` with a first line that ends in a colon joined to the first line of
    detail under it: the log and the history keep only the first line, and torch's
    ``load_state_dict`` says what differs (``size mismatch for w: ...``) below
    ``Error(s) in loading state_dict for Linear:``.

    >>> _detail_on_first_line("Error(s) in loading:\\n\\tsize mismatch for w: a\\n\\tsize mismatch for b: c")
    'Error(s) in loading: size mismatch for w: a\\n\\tsize mismatch for b: c'
    """
    first, _, rest = message.partition("\n")
    lines = rest.splitlines()
    detail = next((i for i, line in enumerate(lines) if line.strip()), None)
    if not first.rstrip().endswith(":") or detail is None:
        return message
    return "\n".join([f"{first.rstrip()} {lines[detail].strip()}", *lines[detail + 1 :]])
