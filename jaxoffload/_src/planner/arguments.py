"""What :func:`jaxoffload.plan` and :func:`jaxoffload.largest_size` are given, checked first.

Planning traces, compiles and times for minutes on a GPU; a size search compiles
at every size it probes. An argument written wrong is refused here, before any of
that, with what to write instead: not after the search, where it would cost the
result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jaxoffload._src import checks
from jaxoffload._src import nnx as offload_nnx
from jaxoffload._src.argnums import check_argnums
from jaxoffload._src.planner.apply import check_model
from jaxoffload._src.strategies import Strategy, check_strategy

__all__ = [
    "BLOCK_COSTS",
    "check_donated",
    "check_min_speed",
    "check_planning",
    "check_progress",
    "check_search",
    "check_step",
    "check_takes",
]

# How the planners call the training step, and what to write where it cannot take that.
_STEP_CALL = "step(model, *args), here with the model and the {} arguments given after the step"
_STEP_FIX = (
    "give the step's other arguments after the step, as in jaxoffload.plan(model, step, *state, "
    "x, labels, budget=...); the step takes the model first, as step(model, *args)."
)

# How a planner costs its blocks: each distinct block program compiled and timed alone, or
# its traced FLOPs at the plain step's measured ms per FLOP.
BLOCK_COSTS = ("timed", "traced")


def check_step(step: Any, called: str) -> None:
    """Raises unless ``step`` is a function that is not jitted yet: ``called`` jits it."""
    if isinstance(step, jax.stages.Wrapped):
        name = getattr(getattr(step, "__wrapped__", None), "__name__", "step")
        raise TypeError(
            f"{called} takes the training step unjitted, but got a jitted one "
            f"(jax.jit({name}) or nnx.jit({name})): it compiles the step itself, with the "
            f"model under each plan it checks. Pass {name} itself, and jit it in your "
            "training loop."
        )
    if not callable(step):
        raise TypeError(
            f"{called} takes the training step as a function step(model, *args), got "
            f"{checks.written(step)}."
        )


def check_takes(fun: Callable, args: Sequence[Any], called: str, how: str, fix: str) -> None:
    """Raises unless ``fun`` takes ``args``, as ``called`` calls it (``how``)."""
    why = checks.cannot_take(fun, tuple(args))
    if why:
        raise TypeError(f"{called} calls {how}, but {why}: {fix}")


def check_planning(
    called: str,
    model: Any,
    step: Any,
    args: Sequence[Any] | None,
    *,
    blocks: Any,
    options: Sequence[Strategy] | None,
    runs: Any,
    donate_argnums: Any,
    block_costs: Any,
    progress: Any,
    planned: bool = True,
) -> tuple[tuple[Strategy, ...] | None, int]:
    """Raises unless the arguments that planning shares are well formed; returns ``options``
    checked (``None`` for the default ones) and ``runs`` as an int.

    ``planned``: whether the model is planned (``largest_size(plan=False)`` is not, and
    takes no ``blocks`` or ``options``).

    The model's blocks are found here too where no trace is needed: an NNX model's
    ``blocks`` selection is walked, and a linen model takes none.
    """
    check_model(model, called)
    check_step(step, called)
    given = " and ".join(n for n, v in (("blocks", blocks), ("options", options)) if v is not None)
    if not planned and given:
        raise ValueError(
            f"{given} choose what a plan may do, but plan=False measures the model as given: "
            f"write plan=True to plan it at each size, or leave {given} out."
        )
    if planned and isinstance(model, nnx.Module):
        offload_nnx.block_paths(model, blocks)  # walks the graph: no trace
    elif planned and blocks is not None:
        raise TypeError(
            "blocks= selects the blocks of an NNX model; a linen model's blocks are those whose "
            "class is jaxoffload.linen.plannable (block_cls=jaxoffload.linen.plannable(Block)), "
            f"so leave blocks out; got blocks={blocks!r}."
        )
    if options is not None:
        if isinstance(options, Strategy) or not isinstance(options, Sequence):
            raise TypeError(
                f"options is a sequence of strategies, got {checks.written(options)}; write "
                "options=(Store(), Lean(), Remat()), or leave it out for the default ones."
            )
        options = tuple(check_strategy(s) for s in options)
        if not options:
            raise ValueError("options is empty: a block needs at least one strategy to take.")
    runs = checks.integer("runs", runs, minimum=1, example=5)
    check_donated(donate_argnums, args)
    if block_costs not in BLOCK_COSTS:
        raise ValueError(f"block_costs is one of {BLOCK_COSTS}, got {block_costs!r}.")
    check_progress(progress)
    if args is not None:  # each argument alone first, then how they meet
        check_takes(step, (model, *args), called, _STEP_CALL.format(len(args)), _STEP_FIX)
    return options, runs


def check_donated(donate_argnums: Any, args: Sequence[Any] | None) -> tuple[int, ...]:
    """``donate_argnums`` as a tuple, if each names one of ``args`` (any, where ``None``)."""
    donate = check_argnums("donate_argnums", donate_argnums)
    beyond = [i for i in donate if args is not None and not -len(args) <= i < len(args)]
    if beyond:
        raise ValueError(
            f"donate_argnums={donate} names positions {beyond}, but the step takes "
            f"{len(args)} arguments after the model (counted from 0)."
        )
    return donate


def check_search(
    start: Any,
    limit: Any,
    multiple_of: Any,
    smallest: Any,
    tolerance: Any,
    exponent: Any,
    time_limit_s: Any,
) -> tuple[int, int, int, int, float, float, float]:
    """A size search's bounds and model, as numbers, if some size lies within the bounds."""
    start = checks.integer("start", start, minimum=1, example=8)
    limit = checks.integer("limit", limit, minimum=1, example=4096)
    multiple_of = checks.integer("multiple_of", multiple_of, minimum=1)
    smallest = checks.integer("smallest", smallest, minimum=1)
    if not smallest <= start <= limit:
        raise ValueError(
            f"start must be in [smallest={smallest}, limit={limit}], got {start}: the search "
            f"compiles it first. Write start={min(max(start, smallest), limit)}."
        )
    first = -(-smallest // multiple_of) * multiple_of
    if first > limit:
        raise ValueError(
            f"no size in [smallest={smallest}, limit={limit}] is a multiple of "
            f"multiple_of={multiple_of}, so there is nothing to search: write limit={first} or "
            "more, or a smaller multiple_of."
        )
    tolerance = checks.real("tolerance", tolerance, above=0, below=1, example=0.02)
    exponent = checks.real(
        "exponent", exponent, above=0, example=1.0, meaning="1 for a batch, 2 for an image's side"
    )
    # inf: no time limit.
    time_limit_s = checks.real(
        "time_limit_s", time_limit_s, minimum=0, finite=False, example=600.0, meaning="seconds"
    )
    return start, limit, multiple_of, smallest, tolerance, exponent, time_limit_s


def check_min_speed(min_speed: Any, plan: bool) -> float | None:
    """``min_speed`` as a float in (0, 1], or ``None``; only with ``plan=True``."""
    if min_speed is None:
        return None
    min_speed = checks.real(
        "min_speed", min_speed, above=0, maximum=1, example=0.7,
        meaning="a share of the plain step's speed per item",
    )  # fmt: skip
    if not plan:
        raise ValueError(
            f"min_speed is a share of the plain step's speed in (0, 1], with plan=True; got "
            f"{min_speed!r} without plan=True: write plan=True, or leave min_speed out."
        )
    return min_speed


def check_progress(progress: Any) -> bool | Callable[[str], None]:
    """``progress`` as given, if it is a bool or a function of a line."""
    if isinstance(progress, bool) or callable(progress):
        return progress
    raise TypeError(
        f"progress must be True (print to stderr), False, or a function that takes each line, "
        f"got {checks.written(progress)}; write progress=print or progress=lines.append."
    )
