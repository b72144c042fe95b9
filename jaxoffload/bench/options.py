"""The command's flags, checked together before anything is measured."""

from __future__ import annotations

import argparse
from typing import Any

from jaxoffload.bench import models
from jaxoffload.bench.workload import (
    ACCUMULATED_STRATEGIES,
    PLANNED_STRATEGIES,
    STRATEGIES,
    Workload,
)

__all__ = [
    "DEFAULT_TIME_LIMIT",
    "SIZE_SEARCHES",
    "STRATEGY_FLAGS",
    "BenchError",
    "checked_strategies",
    "dest",
    "searched_axes",
    "workloads_of",
]


# The strategies that --strategies takes: "plan" comes from --budget.
STRATEGY_FLAGS = (
    *STRATEGIES,
    *(s for s in PLANNED_STRATEGIES if s != "plan"),
    *ACCUMULATED_STRATEGIES,
)


# Seconds that one size search compiles for, unless --time-limit says otherwise.
DEFAULT_TIME_LIMIT = 300.0

# The size searches: each axis of jaxoffload.bench.fit, its flag, and the speed at the size
# found, as that module names its field, with the speed's unit.
SIZE_SEARCHES = {
    "batch": ("--max-batch", "images_per_s", "images/s"),
    "image_size": ("--max-image-size", "ms_per_megapixel", "ms/MP"),
}


class BenchError(ValueError):
    """A problem with the command's arguments or environment, said in words."""


def checked_strategies(args: argparse.Namespace) -> list[str]:
    """``--strategies`` as a list, checked with ``--steps`` and the flags that depend on it."""
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGY_FLAGS]
    if unknown or not strategies:
        raise BenchError(
            f"unknown strategies {unknown or strategies}; choose from {', '.join(STRATEGY_FLAGS)}"
        )
    if args.steps < 1:
        raise BenchError(f"--steps must be at least 1, got {args.steps}")
    windowed = [s for s, value in STRATEGIES.items() if value.to_host]
    if args.window != 1 and not set(strategies) & set(windowed):
        raise BenchError(
            f"--window {args.window} has no effect on {', '.join(strategies)}: only "
            f"{', '.join(windowed)} take it"
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
    if axes and models.is_nnx(args.model):
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


def workloads_of(args: argparse.Namespace, strategies: list[str]) -> list[Workload]:
    """One workload per strategy, then one plan per ``--budget``."""

    def workload(strategy: str, **fields: Any) -> Workload:
        return Workload(
            args.model, args.batch, args.image_size, args.dtype, strategy,
            num_devices=args.devices, spatial=args.spatial, **fields,
        )  # fmt: skip

    try:
        return [
            workload(
                s,
                window=args.window,
                micro_batch=args.micro_batch if s in ACCUMULATED_STRATEGIES else None,
            )
            for s in strategies
        ] + [workload("plan", budget=b, block_costs=args.block_costs) for b in args.budget]
    except ValueError as e:
        raise BenchError(str(e)) from None
