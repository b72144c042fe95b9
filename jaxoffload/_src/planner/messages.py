"""What the planner says: its progress lines, a choice counted, a block's note, and why no plan fits."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import jax

from jaxoffload._src.planner.costs import BlockCost
from jaxoffload._src.strategies import brief

__all__ = ["note", "progress_printer", "summary", "where_it_stops"]


def where_it_stops(offloads: bool) -> str:
    """What might go below the least plan reached; ``offloads`` says whether an option
    moves residuals to host memory."""
    if jax.default_backend() != "cpu":
        return " A smaller batch, or a smaller image, is the next step down."
    if offloads:
        return (
            " On CPU, offloading to host memory saves nothing: host memory is the device's "
            "memory, so Offload() frees none of it, and XLA:CPU keeps what it keeps whatever "
            "the strategy: plan on a GPU."
        )
    return (
        " On CPU, compiled memory barely moves with the strategy (XLA:CPU keeps what it "
        "keeps, and nothing can move to a host): plan on a GPU."
    )


def note(cost: BlockCost) -> str:
    """What the planner measured of a block's choice: what it keeps and moves, and its time."""
    parts = [f"keeps {cost.device_bytes + cost.input_bytes + cost.output_bytes:,} B"]
    if cost.host_bytes:
        parts.append(f"moves {cost.host_bytes:,} B")
    parts.append(f"{cost.forward_ms + cost.backward_ms:.2f} ms")
    return ", ".join(parts)


def summary(choice) -> str:
    """A choice of strategies, counted: ``"Lean() x10, Remat() x6"``."""
    counts: dict[str, int] = {}
    for s in choice:
        counts[brief(s)] = counts.get(brief(s), 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in counts.items())


def progress_printer(progress, label: str = "plan") -> Callable[[str], None]:
    """``progress`` as a function of a line: itself, nothing, or a timed print to stderr."""
    if callable(progress):
        return progress
    if not progress:
        return lambda line: None
    start = time.perf_counter()
    return lambda line: print(
        f"[{label} {time.perf_counter() - start:6.1f} s] {line}", file=sys.stderr, flush=True
    )
