"""Argument positions: which arguments of a wrapped call are static, and which stay on the device."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxoffload._src import checks

__all__ = [
    "MODULE_RNGS",
    "MODULE_VARIABLES",
    "NAMED",
    "Argnums",
    "check_argnums",
    "check_positions",
    "is_static",
    "named_after",
    "positional_names",
]

# Why an argument stays on the device, as saved_residuals says it: the user named it,
NAMED = "argument in device_argnums"
# or linen and NNX pass a Module's variables (and linen its RNG keys) as arguments of their own.
MODULE_VARIABLES = "a Module's variable"
MODULE_RNGS = "a Module's RNG key"


@dataclasses.dataclass(frozen=True)
class Argnums:
    """The positions of a wrapped function's static arguments, and of those kept on the device.

    Attributes:
      device: the positions kept on the device.
      static: the positions that are not arrays.
      reasons: why each of ``device`` stays there, in words; :data:`NAMED`
        (the user named it in ``device_argnums``) for each by default.
    """

    device: tuple[int, ...]
    static: tuple[int, ...]
    reasons: tuple[str, ...] = ()

    def __post_init__(self):
        check_disjoint(set(self.static), set(self.device))  # negative ones at the call
        if not self.reasons:
            object.__setattr__(self, "reasons", (NAMED,) * len(self.device))
        if len(self.reasons) != len(self.device):
            raise ValueError(f"{len(self.device)} device positions but {len(self.reasons)} reasons")

    def split(self, args: tuple, kwargs: dict, names: Sequence[str] = ()):
        """``(dynamic, rebuild, device)``: the array arguments, a function of them, and
        the positions among them of ``device_argnums``, each with its reason.

        ``names`` are the function's positional parameters, for the errors.
        """
        n = len(args)
        for what, argnums in (("static_argnums", self.static), ("device_argnums", self.device)):
            check_positions(what, argnums, n, kwargs, names)
        static = {i % n for i in self.static}
        check_disjoint(static, {i % n for i in self.device})
        check_untraced(sorted(static), args, names)
        positions = [i for i in range(n) if i not in static]
        dynamic = tuple(args[i] for i in positions)
        device = {positions.index(i % n): why for i, why in zip(self.device, self.reasons)}

        def rebuild(dynamic, kwargs):
            values = dict(zip(positions, dynamic))
            return [values[i] if i in values else args[i] for i in range(n)], kwargs

        return dynamic, rebuild, device

    def with_static_values(self, args: tuple) -> Argnums:
        """These positions, and those of the positional arguments that :func:`is_static`
        takes, as static.

        A Python value passed positionally (``f(x, True)``) is static, as a
        keyword one is: traced, a bool could not steer the function. Positions
        in ``device_argnums`` are left as they are.
        """
        n = len(args)
        named = {i % n for i in (*self.static, *self.device) if -n <= i < n}
        values = tuple(i for i in range(n) if i not in named and is_static(args[i]))
        return dataclasses.replace(self, static=(*self.static, *values)) if values else self


def check_untraced(static: Sequence[int], args: tuple, names: Sequence[str] = ()) -> None:
    """Raises if a static argument holds a traced value: a strategy's ``custom_vjp`` cannot
    close over one (jax would say only that a tracer leaked, after tracing the block)."""
    traced = [
        i for i in static if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args[i]))
    ]
    if traced:
        which = ", ".join(repr(names[i]) if i < len(names) else f"at position {i}" for i in traced)
        raise TypeError(
            f"static_argnums names the argument {which}, which holds a traced array here (the "
            "call is under jit, grad or another transform). A static argument is a Python value, "
            "such as a flag or a shape, that the block's code branches on; pass arrays as "
            "ordinary arguments: leave it out of static_argnums."
        )


def check_disjoint(static: set[int], device: set[int]) -> None:
    both = sorted(static & device)
    if both:
        raise ValueError(
            f"arguments {both} are in both static_argnums and device_argnums; a static argument "
            "is not an array, so it cannot be kept on the device: leave "
            f"{'it' if len(both) == 1 else 'them'} out of device_argnums."
        )


def check_positions(
    what: str,
    argnums: Sequence[int],
    n: int,
    kwargs: dict,
    names: Sequence[str] = (),
    first: int = 0,
) -> None:
    """Raises if ``argnums`` names a position that a call with ``n`` positional arguments lacks.

    ``names`` are the function's positional parameters: one that ``argnums``
    names but the call passes by keyword is named. Positions count from
    ``first``: linen's count ``self`` as 0, and the first argument as 1.
    """
    bad = [i for i in argnums if not -n <= i - first < n]
    if not bad:
        return
    by_keyword = [names[i] for i in bad if 0 <= i < len(names) and names[i] in kwargs]
    if by_keyword:
        fix = f"; pass {', '.join(map(repr, by_keyword))} positionally"
    else:
        fix = "; pass those arguments positionally" if kwargs else ""
    counted = {0: "and there are none", 1: f"here only {first}"}.get(
        n, f"here {first} to {first + n - 1}"
    )
    raise ValueError(
        f"{what}={tuple(argnums)} names positions {bad} that this call does not have: it passes "
        f"{n} positional argument{'s' * (n != 1)}"
        + (" after self" if first else "")
        + (f" and the keywords {sorted(kwargs)}" if kwargs else "")
        + f". {what} counts the arguments passed positionally, {counted}{fix}."
    )


def positional_names(fun: Callable[..., Any]) -> tuple[str, ...]:
    """The names of ``fun``'s positional parameters, or none where it has no signature."""
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds)


def named_after(
    call: Callable[..., Any],
    fun: Callable[..., Any],
    positions: Sequence[int],
    kwargs: dict,
    leading: Sequence[str] = (),
) -> Callable[..., Any]:
    """``call``, named as ``fun``; its arguments ``leading``, then ``fun``'s at ``positions``,
    then ``kwargs``, each by ``fun``'s name for it.

    jax names a traced function and its arguments in its errors (a traced ``train``
    flag says which argument it came from): they should be the user's, not those of
    the function that jaxoffload traces in their place.
    """
    names = positional_names(fun)
    given = [*leading, *(names[i] if i < len(names) else f"arg{i}" for i in positions)]
    call = functools.wraps(fun)(call)
    if len(set(given) | set(kwargs)) == len(given) + len(kwargs):
        only, keyword = inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.KEYWORD_ONLY
        call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(n, only) for n in given]
            + [inspect.Parameter(k, keyword) for k in kwargs]
        )
    return call


def check_argnums(what: str, argnums) -> tuple[int, ...]:
    """``argnums`` as a tuple of Python ints: one position, or a sequence of them (NumPy's
    integers too, as ``jax.jit`` takes them)."""
    single = isinstance(checks.as_number(argnums), int)
    if not single and (isinstance(argnums, str) or not isinstance(argnums, Sequence)):
        raise TypeError(
            f"{what} must be an int or a sequence of ints, got {checks.written(argnums)}; "
            f"{_hint(what, argnums)}."
        )
    argnums = (argnums,) if single else tuple(argnums)
    bad = [a for a in argnums if not isinstance(checks.as_number(a), int)]
    if bad:
        raise TypeError(f"{what} must be ints, got {bad!r} in {argnums!r}; {_hint(what, argnums)}.")
    return tuple(int(a) for a in argnums)


def _hint(what: str, argnums) -> str:
    """What to write instead: the same positions as ints where they are whole numbers (``1.0``)."""
    many = isinstance(argnums, tuple | list)
    values = tuple(argnums) if many else (argnums,)
    if all(type(a) is int or (isinstance(a, float) and a.is_integer()) for a in values):
        ints = tuple(int(a) for a in values)
        return f"write {what}={ints if many else ints[0]}"
    return f"write an int such as {what}=1, or a tuple such as {what}=(0, 1)"


def holds_arrays(value) -> bool:
    """Whether ``value`` holds arrays (or their shapes): what a traced argument is made of."""
    return any(
        isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)
        for leaf in jax.tree.leaves(value)
    )


def is_static(value) -> bool:
    """Whether an argument of a wrapped call is static: it holds no arrays, or it is a concrete
    NumPy bool (``np.bool_(True)``, or a 0-d bool ``np.ndarray``), a flag that the plain block
    could branch on. The value is passed on as it is: ``bool()`` would make ``~train`` -2."""
    flag = isinstance(value, np.bool_) or (
        isinstance(value, np.ndarray) and value.shape == () and value.dtype == np.bool_
    )
    return flag or not holds_arrays(value)
