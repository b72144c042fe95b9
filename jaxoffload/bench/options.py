"""The command's flags, checked alone and together before anything is measured.

It imports no jax, nor anything that does: the command refuses a mistyped flag at once,
not after importing jax (seconds on a GPU machine).
"""

from __future__ import annotations

import argparse
from typing import Any

from jaxoffload.bench.catalog import (
    ACCUMULATED_STRATEGIES,
    BLOCK_STRATEGIES,
    CHOSEN_STRATEGIES,
    PLANS,
    TO_HOST,
    check_workload,
    is_nnx,
)

__all__ = [
    "DEFAULT_TIME_LIMIT",
    "SIZE_SEARCHES",
    "STRATEGY_FLAGS",
    "BenchError",
    "check",
    "checked_strategies",
    "dest",
    "searched_axes",
    "workload_fields",
]


# The strategies that --strategies takes: "plan" comes from --budget, and "plan-device",
# given here, plans at each --budget too.
STRATEGY_FLAGS = (
    *BLOCK_STRATEGIES,
    *(s for s in CHOSEN_STRATEGIES if s != "plan"),
    *ACCUMULATED_STRATEGIES,
)


# Seconds that one size search compiles for, unless --time-limit says otherwise.
DEFAULT_TIME_LIMIT = 300.0

# The size searches: each axis of jaxoffload.bench.size_search, its flag, and the speed at the size
# found, as that module names its field, with the speed's unit.
SIZE_SEARCHES = {
    "batch": ("--max-batch", "images_per_s", "images/s"),
    "image_size": ("--max-image-size", "ms_per_megapixel", "ms/MP"),
}


class BenchError(ValueError):
    """A problem with the command's arguments or environment, said in words."""


def check(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Checks every flag, alone and with the others, as the workloads will: no jax is imported.

    Returns:
      ``(strategies, axes)``: ``--strategies`` as a list (:func:`checked_strategies`), and
      the axes of the size searches asked for (:func:`searched_axes`).

    Raises:
      BenchError: naming the flag, the value given, and what to write instead.
    """
    strategies, axes = checked_strategies(args), searched_axes(args)
    for fields in workload_fields(args, strategies):
        try:
            check_workload(**fields)  # as each Workload checks itself
        except ValueError as e:
            raise BenchError(str(e)) from None
    if args.memory_cap is not None and args.memory_cap <= 0:
        raise BenchError(f"--memory-cap must be positive, got {args.memory_cap}")
    return strategies, axes


def checked_strategies(args: argparse.Namespace) -> list[str]:
    """``--strategies`` as a list, checked with ``--steps`` and the flags that depend on it."""
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGY_FLAGS]
    if not strategies:
        raise BenchError(
            f"--strategies {args.strategies!r} names no strategy; choose from "
            f"{', '.join(STRATEGY_FLAGS)}"
        )
    if unknown:
        raise BenchError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGY_FLAGS)}")
    # Each would be measured again in a process of its own, into a second record of one name.
    repeated = list(dict.fromkeys(s for s in strategies if strategies.count(s) > 1))
    if repeated:
        raise BenchError(
            f"--strategies names {', '.join(repeated)} more than once: each strategy is measured "
            "once; --repeat N times each in N processes"
        )
    if args.steps < 1:
        raise BenchError(f"--steps must be at least 1, got {args.steps}")
    if args.repeat < 1:
        raise BenchError(f"--repeat must be at least 1, got {args.repeat}")
    if "plan-device" in strategies and not args.budget:
        raise BenchError(
            "'plan-device' plans at each --budget, beside 'plan': give --budget, e.g. 0.5,0.35"
        )
    if args.window != 1 and not set(strategies) & set(TO_HOST):
        raise BenchError(
            f"--window {args.window} has no effect on {', '.join(strategies)}: only "
            f"{', '.join(TO_HOST)} take it"
        )
    accumulated = list(ACCUMULATED_STRATEGIES)
    if args.micro_batch is not None and not set(strategies) & set(accumulated):
        raise BenchError(
            f"--micro-batch {args.micro_batch} has no effect on {', '.join(strategies)}: only "
            f"{', '.join(accumulated)} take it"
        )
    # The bench's planners for one batch time their blocks on one device, without the mesh.
    one_device = [
        option
        for option, given in [
            ("--budget", bool(args.budget)),
            ("offload-hidden", "offload-hidden" in strategies),
        ]
        if given and args.devices * args.spatial > 1
    ]
    if one_device:
        raise BenchError(
            f"{' and '.join(one_device)} with --devices or --spatial is not supported yet"
        )
    return strategies


def searched_axes(args: argparse.Namespace) -> list[str]:
    """The axes of the size searches asked for (:data:`SIZE_SEARCHES`), checked with the model."""
    axes = [axis for axis, (flag, *_) in SIZE_SEARCHES.items() if getattr(args, dest(flag))]
    if axes and is_nnx(args.model):
        flags = " and ".join(SIZE_SEARCHES[axis][0] for axis in axes)
        raise BenchError(
            f"{flags} searches the linen models, and {args.model} is an NNX one: not supported yet"
        )
    if args.time_limit <= 0:
        raise BenchError(
            f"--time-limit must be a positive number of seconds, got {args.time_limit}"
        )
    if args.min_speed is not None and not (axes and 0 < args.min_speed <= 1):
        raise BenchError(
            f"--min-speed {args.min_speed:g} is a share of the plain step's speed, in (0, 1], "
            "for the planned model's size search: add --max-batch or --max-image-size"
        )
    if not axes and args.time_limit != DEFAULT_TIME_LIMIT:
        raise BenchError(
            f"--time-limit {args.time_limit:g} has no effect without a size search: add "
            "--max-batch or --max-image-size"
        )
    return axes


def dest(flag: str) -> str:
    """The attribute of the parsed arguments that holds ``flag``: ``--max-batch`` -> ``max_batch``."""
    return flag[2:].replace("-", "_")


def workload_fields(args: argparse.Namespace, strategies: list[str]) -> list[dict[str, Any]]:
    """The fields of the command's workloads: one per strategy, then one plan per ``--budget``."""
    common = {
        "model": args.model, "batch": args.batch, "image_size": args.image_size,
        "dtype": args.dtype, "num_devices": args.devices, "spatial": args.spatial,
    }  # fmt: skip
    micro_batch = {s: args.micro_batch if s in ACCUMULATED_STRATEGIES else None for s in strategies}
    return [
        {
            **common,
            "strategy": s,
            "window": args.window,
            "micro_batch": micro_batch[s],
            # offload-hidden's planner costs the blocks as --budget's does.
            **({"block_costs": args.block_costs} if s == "offload-hidden" else {}),
        }
        for s in strategies
        if s not in PLANS
    ] + [
        {**common, "strategy": p, "budget": b, "block_costs": args.block_costs}
        for p in ["plan", *(s for s in strategies if s in PLANS)]
        for b in args.budget
    ]
