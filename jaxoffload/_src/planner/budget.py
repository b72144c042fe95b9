"""Budgets as users write them and read them: bytes or a share, what they are measured against.

:func:`jaxoffload.plan` and :func:`jaxoffload.largest_size` read budgets the same
way: an int (or a whole number above 1, such as ``16e9``) is device bytes, a
float in (0, 1] is a share (of the plain step's memory for a plan, of the
device's for a size search). Both refuse a budget below the step's own
arguments before anything compiles: no plan can fit it, and ``budget=50`` was
meant as a share.

A plan's budget is what the device holds as the user's process sees it: the
compiled step (its arguments and temporaries) and what the process holds on
the device besides the step's arguments (:func:`held_bytes`: an undonated copy
of the initial state, an evaluation batch). So ``budget=16 * 2**30`` means that
many bytes of the device, and ``budget=0.35`` is 0.35 of the plain step's peak as the
process would see it at runtime, not of its compiled bytes alone
(:func:`plan_budget`, :func:`measured_against`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jaxoffload._src import checks
from jaxoffload._src.jaxprs import format_bytes, nbytes

__all__ = [
    "argument_bytes",
    "check_budget",
    "check_budgets",
    "check_room",
    "device_budget",
    "devices_of",
    "held_bytes",
    "measured_against",
    "plan_budget",
]


def check_budgets(budget: Any, of: str) -> tuple[list[int | float], bool]:
    """``(budgets, many)``: each budget checked (:func:`check_budget`), and whether a
    sequence of them was given."""
    # A string is a Sequence too, but one budget written wrong, not a list of them; an
    # array of one dimension is a list of budgets.
    many = (isinstance(budget, Sequence) and not isinstance(budget, str | bytes)) or (
        getattr(budget, "ndim", None) == 1
    )
    if many and not len(budget):
        raise ValueError(
            f"budget={budget!r} holds no budget: give one, budget=0.5 (a share of {of}) or "
            "budget=8 * 2**30 (bytes), or several, budget=[0.75, 0.5]."
        )
    return [check_budget(b, of) for b in (budget if many else [budget])], many


def check_budget(budget: Any, of: str = "the plain step's memory") -> int | float:
    """``budget`` as bytes (an ``int``) or a share ``of`` something (a ``float`` in (0, 1]).

    Any number counts, NumPy scalars and 0-d arrays included: an integer is bytes,
    a real number in (0, 1] a share, and a whole one above 1 (``16e9``) bytes.

    Example:
      >>> check_budget(0.5), check_budget(2**30), check_budget(16e9)
      (0.5, 1073741824, 16000000000)
    """
    kinds = f"budget must be bytes (an int) or a share of {of} (a float in (0, 1])"
    if isinstance(budget, str):
        raise TypeError(f"{kinds}, got the string {budget!r}; {_budget_hint(budget)}.")
    number = checks.as_number(budget)
    if number is None:
        raise TypeError(
            f"{kinds}, got {checks.written(budget)}; write budget=0.5 for half, or "
            "budget=8 * 2**30 for 8 GiB."
        )
    if not math.isfinite(number) or number <= 0:
        raise ValueError(
            f"budget must be positive: bytes, or a share in (0, 1]; got {number}"
            + (" bytes" if isinstance(number, int) else "")
            + ". Write budget=0.5 for half, or budget=8 * 2**30 for 8 GiB."
        )
    if isinstance(number, int) or number > 1 and number.is_integer():
        return int(number)
    if number > 1:
        raise ValueError(
            f"a budget given as a float is a share of {of}, in (0, 1], or a whole number of "
            f"bytes; got {number}. Write budget={int(number)} for bytes."
        )
    return number


def device_budget(budget: Any) -> int:
    """``budget`` in bytes: as given, or its share of the first device's memory limit."""
    budget = check_budget(budget, "the device's memory")
    if isinstance(budget, int):
        return budget
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    if not limit:
        raise ValueError(
            f"budget={budget} is a share of the device's memory, but this "
            f"{jax.default_backend()} device reports no memory limit: give bytes, such as "
            "budget=8 * 2**30 for 8 GiB."
        )
    return int(budget * limit)


def argument_bytes(args: Sequence[Any]) -> int:
    """One device's bytes of the arrays among ``args`` that are not NNX Modules.

    A Module's variables that a step never reads are not in its compiled program,
    so only the other arguments (a training state, a batch) are counted.
    """
    leaves = jax.tree.leaves([a for a in args if not nnx.graph.is_graph_node(a)])
    return sum(nbytes(leaf, per_device=True) for leaf in leaves)


def check_room(budgets: Sequence[int | float], args: Sequence[Any], of: str, held: int = 0) -> None:
    """Raises if a budget in bytes is below the step's own arguments and ``held`` (what the
    process holds besides them, :func:`held_bytes`): no plan fits it.

    Such a budget was most likely meant as a share (``budget=50`` for 50%, or
    ``budget=1`` for all of it), so the error suggests one.
    """
    least = argument_bytes(args) + held
    for budget in budgets:
        if isinstance(budget, int) and budget < least:
            if budget == 1:
                meant = f"; a share of {of} is a float: did you mean budget=1.0?"
            elif budget <= 100:
                meant = f"; a share of {of} is a float: did you mean budget={budget / 100!r}?"
            else:
                meant = ". Give bytes as an int (budget=8 * 2**30 for 8 GiB)."
            what = (
                "the step's arguments alone"
                if not held
                else f"the step's arguments and the {format_bytes(held)} held on the device "
                "besides them (held_bytes)"
            )
            said = format_bytes(least)
            if not said.endswith(" B"):  # in MiB or GiB: the exact bytes too
                said += f" ({least:,} bytes)"
            raise ValueError(
                f"budget={budget} bytes is less than {what}, {said}, so nothing can fit it{meant}"
            )


def devices_of(args: Any) -> list[Any]:
    """The devices that the step's arguments are placed on (the default device where none
    is): they share the host link at once, and a budget is each one's."""
    found = {}
    for leaf in jax.tree.leaves(args):
        for device in getattr(getattr(leaf, "sharding", None), "device_set", ()):
            found[device.id] = device
    return [found[i] for i in sorted(found)] or jax.devices()[:1]


def held_bytes(
    model: Any, args: Sequence[Any], in_use: Callable[[Any], int | None] | None = None
) -> int | None:
    """What this process holds on the step's devices besides the step's own arrays: the most,
    over those devices, of ``in_use(device)`` (by default ``memory_stats()["bytes_in_use"]``)
    less the bytes there of the arrays among ``model`` (an NNX Module's variables) and ``args``.

    Those arrays are the compiled step's arguments, counted in its compiled bytes, so
    they are not counted twice; what is left (an undonated copy of the initial state,
    an evaluation batch, arrays that nothing frees yet) stays on the device while the
    step runs, beside it. ``None`` where a device reports no bytes in use, as a CPU
    does. Arguments given as :class:`jax.ShapeDtypeStruct` hold nothing yet: whatever
    the process holds counts, the arrays that the training loop will pass included.
    ``in_use`` stands in for the device's count where a test has none to read.
    """
    in_use = in_use or _bytes_in_use
    arrays = {}
    for a in [model, *args]:
        for leaf in jax.tree.leaves(nnx.state(a) if nnx.graph.is_graph_node(a) else a):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                arrays[id(leaf)] = leaf  # an array passed twice is held once
    held = []
    for device in devices_of(args):
        used = in_use(device)
        if used is None:
            return None
        own = sum(
            shard.data.nbytes
            for a in arrays.values()
            for shard in a.addressable_shards
            if shard.device == device
        )
        held.append(max(0, int(used) - own))
    return max(held)


def _bytes_in_use(device) -> int | None:
    return (device.memory_stats() or {}).get("bytes_in_use")


def plan_budget(budget: int | float, plain_bytes: int | None, held: int | None) -> int:
    """A plan's budget in device bytes: as given, or its share of the plain step's peak as
    the process sees it, the compiled step's ``plain_bytes`` and ``held`` (``None``: not
    known, the compiled step alone). The compiled step must fit it less ``held``."""
    if isinstance(budget, int):
        return budget
    return int(budget * (plain_bytes + (held or 0)))


def measured_against(
    budget: int | float, device_bytes: int, plain_bytes: int | None, held: int | None
) -> str:
    """What a budget is measured against, as the planner says it: for a share, ``"0.35 of
    the plain step's peak as the process sees it, P = compiled C + held H besides the step's
    arguments: B, the compiled step within B - H"``, each a size in bytes as
    :func:`~jaxoffload._src.jaxprs.format_bytes` writes it."""
    if held is None:  # not known (a CPU reports none) or not asked for: the step alone
        if isinstance(budget, int):
            return f"{format_bytes(device_bytes)} for the compiled step alone"
        # A share as written (0.35, 1.0), and what it is a share of.
        return (
            f"{budget} of the plain step's compiled {format_bytes(plain_bytes)}, the compiled "
            f"step alone: {format_bytes(device_bytes)}"
        )
    held_text = f"held {format_bytes(held)} besides the step's arguments"
    step = f"the compiled step within {format_bytes(device_bytes - held)}"
    if isinstance(budget, int):
        return f"{format_bytes(device_bytes)} of the device = {step} + {held_text}"
    return (
        f"{budget} of the plain step's peak as the process sees it, "
        f"{format_bytes(plain_bytes + held)} = compiled {format_bytes(plain_bytes)} + "
        f"{held_text}: {format_bytes(device_bytes)}, {step}"
    )


# Units that a budget written as a string may end with, as Python writes them.
_UNITS = {"%": "/ 100", "gib": "* 2**30", "mib": "* 2**20", "gb": "* 10**9", "mb": "* 10**6"}


def _budget_hint(text: str) -> str:
    """What to write instead of a budget given as a string: ``'0.5'``, ``'50%'``, ``'8 GiB'``."""
    number = text.strip()
    unit = next((u for u in _UNITS if number.lower().endswith(u)), None)
    number = number[: -len(unit)].strip() if unit else number
    try:
        value = float(number)
    except ValueError:
        return (
            "write bytes as an int (budget=8 * 2**30 for 8 GiB) or a share as a float (budget=0.5)"
        )
    if unit == "%":
        return f"write budget={value / 100!r}, a share"
    if unit:
        scaled = f"{number} {_UNITS[unit]}"
        return f"write budget={scaled if value.is_integer() else f'int({scaled})'}, in bytes"
    if number.isdigit() or value > 1:
        return f"write budget={int(value)}, in bytes"
    return f"write budget={value!r}, a share"
