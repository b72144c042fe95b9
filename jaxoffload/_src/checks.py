"""Arguments as users write them: numbers, shares and flags, checked once, in one way.

Every number that jaxoffload takes (a strategy's field, a budget, a search's
bound) is read here. A number is a number: a Python ``int`` or ``float``, a
NumPy scalar, or a 0-d array, as ``numbers.Integral`` and ``numbers.Real`` say;
a bool is not, where a number is meant. Each is returned as a Python ``int`` or
``float``, so that values made from it stay hashable, compare equal, save to
JSON and print as written (``window=2``, not ``window=np.int64(2)``). A refusal
names the argument, shows the value and says what to write instead.
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = [
    "as_number",
    "cannot_take",
    "flag",
    "integer",
    "real",
    "share",
    "unknown_field",
    "written",
]


def as_number(value: Any) -> int | float | None:
    """``value`` as a Python ``int`` or ``float``, or ``None`` if it is no number.

    NumPy scalars and 0-d arrays (NumPy's or jax's, not traced) count, by their
    dtype; bools, strings and arrays of more than one element do not.

    Example:
      >>> as_number(np.int64(2)), as_number(np.array(0.5)), as_number(np.float32(0.03))
      (2, 0.5, 0.03)
      >>> as_number(True), as_number("2"), as_number([2])
      (None, None, None)
    """
    if isinstance(value, bool | np.bool_ | str | bytes):
        return None
    if isinstance(value, numbers.Number):
        dtype = getattr(value, "dtype", None)
    else:  # a 0-d array, NumPy's or jax's
        dtype = getattr(value, "dtype", None)
        if dtype is None or getattr(value, "shape", None) != ():
            return None
    kind = np.dtype(dtype).kind if dtype is not None else None
    try:
        if isinstance(value, numbers.Integral) or kind in ("i", "u"):
            return int(value)
        if kind == "f" and np.dtype(dtype).itemsize < 8:
            # np.float32(0.03) is 0.029999999329447746 as a Python float; as written, 0.03.
            return float(str(np.asarray(value)[()]))
        if isinstance(value, numbers.Real) or kind == "f":
            return float(value)
    except Exception:  # a traced 0-d array has no value yet
        return None
    return None


def written(value: Any) -> str:
    """``value`` as a user wrote it, for an error: ``2``, ``'2'``, ``True (a bool)``, or, for
    a value that prints long, its kind: ``a float32 array of shape (2, 3)``, ``a dict``."""
    if isinstance(value, bool | np.bool_):
        return f"{value!r} (a bool)"
    if value is None or isinstance(value, str) or as_number(value) is not None:
        return repr(value)
    shown = repr(value)
    if len(shown) <= 60 and "\n" not in shown:
        return f"{shown} of type {type(value).__name__}"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"a {dtype} array of shape {tuple(shape)}"
    return f"a {type(value).__name__}"


def integer(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    none: bool = False,
    example: int | None = None,
    meaning: str = "",
) -> int | None:
    """``value`` as a Python ``int`` of at least ``minimum``; ``None`` too if ``none``.

    Args:
      name: the argument, as the user writes it.
      value: what was given.
      minimum: the least value allowed.
      none: whether ``None`` is allowed (and returned).
      example: the value suggested where no close one is (``minimum`` by default).
      meaning: what the number is, for the error (``"bytes"``).

    Raises:
      TypeError: if ``value`` is no whole number (a bool, a string, ``2.5``).
      ValueError: if it is below ``minimum``.

    Example:
      >>> integer("window", np.int64(2), minimum=1)
      2
    """
    if value is None and none:
        return None
    number = as_number(value)
    what = {None: "an int", 0: "a non-negative int"}.get(minimum, f"an int of at least {minimum}")
    what += (f" ({meaning})" if meaning else "") + (", or None" if none else "")
    if not isinstance(number, int):
        if isinstance(number, float) and math.isfinite(number) and number.is_integer():
            fix = f"write {name}={int(number)}"
        elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
            fix = f"write {name}={int(value)}, without quotes"
        else:
            least = 1 if minimum is None else minimum
            fix = f"write an int such as {name}={least if example is None else example}"
        raise TypeError(f"{name} must be {what}, got {written(value)}; {fix}.")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be {what}, got {number}; write {name}={minimum} or more.")
    return number


def real(
    name: str,
    value: Any,
    *,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    below: float | None = None,
    finite: bool = True,
    none: bool = False,
    example: float = 1.0,
    meaning: str = "",
) -> float | None:
    """``value`` as a Python ``float`` within the bounds; ``None`` too if ``none``.

    Args:
      name: the argument, as the user writes it.
      value: what was given: any real number, NumPy's and 0-d arrays included.
      minimum: the least value allowed.
      above: a bound that the value must exceed.
      maximum: the largest value allowed.
      below: a bound that the value must stay under.
      finite: whether ``inf`` is refused (NaN always is).
      none: whether ``None`` is allowed (and returned).
      example: the value suggested where no close one is.
      meaning: what the number is, for the error (``"seconds"``).

    Raises:
      TypeError: if ``value`` is no real number.
      ValueError: if it is NaN, infinite where ``finite``, or out of bounds.

    Example:
      >>> real("exponent", np.float32(2), above=0)
      2.0
    """
    if value is None and none:
        return None
    number = as_number(value)
    bounds = [
        f"{words} {bound:g}"
        for words, bound in (
            ("above", above),
            ("of at least", minimum),
            ("of at most", maximum),
            ("below", below),
        )
        if bound is not None
    ]
    what = " ".join(["a finite number" if finite else "a number", *bounds])
    what += (f" ({meaning})" if meaning else "") + (", or None" if none else "")
    suggested = f"a number such as {name}={example!r}"
    if number is None:
        fix = f"{name}={float(value)!r}, without quotes" if _is_float_text(value) else suggested
        raise TypeError(f"{name} must be {what}, got {written(value)}; write {fix}.")
    number = float(number)
    if math.isnan(number):
        raise ValueError(f"{name} must be {what}, got nan; write {suggested}.")
    if math.isinf(number) and finite:
        fix = "None" if none else suggested
        raise ValueError(f"{name} must be {what}, got {number}; write {fix}.")
    if (
        (above is not None and not number > above)
        or (minimum is not None and number < minimum)
        or (maximum is not None and number > maximum)
        or (below is not None and not number < below)
    ):
        raise ValueError(f"{name} must be {what}, got {number:g}; write {suggested}.")
    return number


def share(name: str, value: Any, *, of: str, low: str = "", high: str = "") -> float:
    """``value`` as a float from 0 to 1: a share ``of`` something.

    ``low`` and ``high`` say what 0 and 1 mean, for the error that suggests them.

    Example:
      >>> share("max_recompute", np.float32(0.5), of="the block's forward FLOPs")
      0.5
    """
    number = as_number(value)
    if number is not None and 0 <= number <= 1:
        return float(number)
    if number is not None and number > 1:
        fix = f"write {name}=1.0" + (f" {high}" if high else "")
    elif number is not None and number < 0:
        fix = f"write {name}=0.0" + (f" {low}" if low else "")
    elif _is_float_text(value):
        fix = f"write {name}={float(value)!r}, without quotes"
    else:
        fix = f"write a number such as {name}=0.25"
    shown = written(value) if number is None else repr(number)
    raise ValueError(
        f"{name} is a share of {of}, a non-negative number of at most 1, got {shown}; {fix}."
    )


def flag(name: str, value: Any) -> bool:
    """``value`` as a Python bool: ``True`` or ``False``, NumPy's too, and nothing else.

    Example:
      >>> flag("recompute", np.bool_(True))
      True
    """
    if isinstance(value, bool | np.bool_):
        return bool(value)
    number = as_number(value)
    fix = f"{name}={bool(number)}" if number in (0, 1) else f"{name}=True or {name}=False"
    raise TypeError(f"{name} must be a bool, got {written(value)}; write {fix}.")


def _is_float_text(value: Any) -> bool:
    """Whether ``value`` is a string that reads as a finite number: ``'0.5'``."""
    if not isinstance(value, str):
        return False
    try:
        return math.isfinite(float(value))
    except ValueError:
        return False


def unknown_field(kind: str, known: Iterable[str], given: Iterable[str], error=TypeError) -> None:
    """Raises ``error`` naming the first of ``given`` that ``kind`` has no field of, with the
    field it likely meant.

    Example:
      >>> unknown_field("Lean", ["max_recompute", "max_slowdown"], ["max_recompte"])
      Traceback (most recent call last):
      ...
      TypeError: Lean has no field 'max_recompte' (did you mean 'max_recompute'?); its fields are max_recompute, max_slowdown.
    """
    known = sorted(known)
    unknown = [name for name in given if name not in known]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), known, n=1)
        meant = f" (did you mean {close[0]!r}?)" if close else ""
        raise error(
            f"{kind} has no field {unknown[0]!r}{meant}; its fields are {', '.join(known)}."
        )


def cannot_take(fun: Any, args: tuple) -> str | None:
    """Why ``fun`` cannot be called with ``args``, as ``name(signature) ...: Python's reason``,
    or ``None`` where it can, or has no signature to check (a builtin, say).

    Checked before a trace calls ``fun``, where Python's own error would name only it."""
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args)
    except TypeError as e:
        return (
            f"{getattr(fun, '__name__', type(fun).__name__)}{signature} cannot be called so ({e})"
        )
    return None
