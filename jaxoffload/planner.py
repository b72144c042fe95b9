"""Bandwidth-aware partial offload: move only the bytes that compute can hide."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["HiddenPlan", "plan_hidden_offload"]


@dataclasses.dataclass(frozen=True)
class HiddenPlan:
    """Which blocks offload, and the :class:`jaxoffload.schedule` window they need.

    Attributes:
      offload: one flag per block, from the input end.
      window: the schedule window, counted in blocks.
      offloaded_bytes: the bytes that cross the link each way.
    """

    offload: tuple[bool, ...]
    window: int
    offloaded_bytes: int


def plan_hidden_offload(
    block_bytes: Sequence[int],
    *,
    fwd_ms: float,
    bwd_ms: float,
    d2h_gbps: float,
    h2d_gbps: float,
    block_costs: Sequence[float] | None = None,
    margin: float = 0.8,
    max_window: int = 8,
) -> HiddenPlan:
    """Picks blocks whose transfers fit behind the compute of the blocks next to them.

    In a schedule of window ``w``, a block's host copy runs while it and the
    next ``w - 1`` blocks compute their forward pass, and its fetch while the
    ``w - 1`` blocks after it compute their backward pass. A block is chosen
    when both transfers fit in ``margin`` of that compute, and chosen blocks
    are at least ``w`` apart, so that no two transfers share the link. Each
    block's share of the compute time, forward and backward, is its share of
    ``block_costs``, or an equal share without them. Measured times are the
    better costs (:func:`jaxoffload.benchmark.time_offloaded_calls`): FLOPs
    (:attr:`jaxoffload.OffloadedCall.flops`) give every ResNet-50 identity
    bottleneck the same share, though on an H200 a 56² one computes 3.9 times as long as
    a 7² one. The window with the most bytes wins; ties go to the smaller
    window, which holds fewer fetched residuals at once.

    Args:
      block_bytes: residual bytes of each block when it offloads.
      fwd_ms: forward compute time of the whole model, without offload.
      bwd_ms: the rest of a training step's compute time.
      d2h_gbps: device-to-host bandwidth, in 10⁹ bytes per second.
      h2d_gbps: host-to-device bandwidth, likewise.
      block_costs: each block's forward compute, in any unit (milliseconds,
        FLOPs); ``None`` for equal.
      margin: the share of the hiding compute that transfers may use.
      max_window: the largest window tried.

    Returns:
      The plan. It offloads nothing if no block's transfers can hide.

    Example:
      >>> plan = plan_hidden_offload([40e6, 800e6, 150e6, 100e6], fwd_ms=8, bwd_ms=16,
      ...                            d2h_gbps=50, h2d_gbps=50)
      >>> plan.offload, plan.window
      ((True, False, True, False), 2)
    """
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], got {margin}.")
    for name, value in [("fwd_ms", fwd_ms), ("bwd_ms", bwd_ms), ("d2h_gbps", d2h_gbps),
                        ("h2d_gbps", h2d_gbps)]:  # fmt: skip
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}.")
    n = len(block_bytes)
    if block_costs is None:
        block_costs = [1.0] * n
    if len(block_costs) != n or min(block_costs, default=0) < 0 or not sum(block_costs) > 0:
        raise ValueError(
            f"block_costs must give {n} non-negative numbers, not all 0; got {block_costs}."
        )
    share = [c / sum(block_costs) for c in block_costs]
    best = HiddenPlan((False,) * n, 1, 0)
    for window in range(2, min(max_window, n) + 1):
        chosen, i = [False] * n, 0
        # The last window - 1 blocks have no later blocks to hide behind.
        while i <= n - window:
            fwd_bytes = margin * fwd_ms * sum(share[i : i + window]) * d2h_gbps * 1e6
            bwd_bytes = margin * bwd_ms * sum(share[i + 1 : i + window]) * h2d_gbps * 1e6
            if 0 < block_bytes[i] <= min(fwd_bytes, bwd_bytes):
                chosen[i], i = True, i + window
            else:
                i += 1
        total = sum(b for b, c in zip(block_bytes, chosen) if c)
        if total > best.offloaded_bytes:
            best = HiddenPlan(tuple(chosen), window, int(total))
    return best
