"""The reference models' hidden offload: which blocks' transfers the compute can hide.

``bench --strategies offload-hidden`` chooses it so on the reference models, whose blocks
each move all or nothing, at one window. On the plain-Flax models the choice is a
:class:`jaxoffload.Plan` made with the library's link timeline instead
(:func:`jaxoffload.bench.planning.hidden_plan`), which caps what each block moves and gives
each its windows. :func:`jaxoffload.plan` is the library's planner, for every strategy and
any model; this is no planner, and what it chooses is no plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["HiddenOffload", "choose_hidden_offload"]


@dataclasses.dataclass(frozen=True)
class HiddenOffload:
    """Which blocks offload, and the ``Offload`` window they need.

    Attributes:
      offload: one flag per block, from the input end.
      window: the ``Offload`` window, counted in blocks.
      offloaded_bytes: the bytes that cross the link each way.
      freed_bytes: the device bytes that the offloading blocks free, as estimated.
      extra_ms: the recomputation that they add, as estimated.
    """

    offload: tuple[bool, ...]
    window: int
    offloaded_bytes: int
    freed_bytes: int = 0
    extra_ms: float = 0.0


def choose_hidden_offload(
    block_bytes: Sequence[int],
    *,
    fwd_ms: float,
    bwd_ms: float,
    d2h_gbps: float,
    h2d_gbps: float,
    block_costs: Sequence[float] | None = None,
    freed_bytes: Sequence[int] | None = None,
    extra_ms: Sequence[float] | None = None,
    max_extra_ms: float = math.inf,
    margin: float = 0.8,
    max_window: int = 8,
) -> HiddenOffload:
    """Picks blocks whose transfers fit behind the compute of the blocks next to them.

    With an ``Offload`` window ``w``, a block's host copy runs while the next
    ``w - 1`` blocks compute their forward pass (its residuals exist only
    once it has run), and its fetch while they compute their backward pass. A block can be
    chosen when both transfers fit in ``margin`` of that compute, and chosen
    blocks are at least ``w`` apart, so that no two transfers share the link.
    Each block's share of the compute time, forward and backward, is its share
    of ``block_costs``, or an equal share without them. Measured times are the
    better costs (:func:`jaxoffload.bench.planning.time_offloaded_calls`): FLOPs
    (:attr:`jaxoffload.OffloadedCall.flops`) give every ResNet-50 identity
    bottleneck the same share, though the wide ones take several times as long as
    the narrow ones (measured for commit d3bc458, which timed the blocks instead).

    Among those, the choice frees the most device bytes whose recomputation
    (``extra_ms``) stays within ``max_extra_ms``; it is exact (a dynamic
    programme over the blocks). The window that frees the most wins; ties go
    to the smaller window, which holds fewer fetched residuals at once.

    Args:
      block_bytes: residual bytes that each block moves when it offloads.
      fwd_ms: forward compute time of the whole model, without offload.
      bwd_ms: the rest of a training step's compute time.
      d2h_gbps: device-to-host bandwidth, in 10⁹ bytes per second.
      h2d_gbps: host-to-device bandwidth, likewise.
      block_costs: each block's forward compute, in any unit (milliseconds,
        FLOPs); ``None`` for equal.
      freed_bytes: the device bytes that each block frees when it offloads;
        ``None`` for ``block_bytes``. A block that recomputes what it does not
        move frees more than it moves, and one whose neighbours keep its
        input or output frees less.
      extra_ms: the time that each block adds when it offloads, such as its
        recomputation; ``None`` for none.
      max_extra_ms: the most time that the chosen blocks may add together.
      margin: the share of the hiding compute that transfers may use.
      max_window: the largest window tried.

    Returns:
      The choice. It offloads nothing if no block's transfers can hide.

    Example:
      >>> chosen = choose_hidden_offload([40e6, 800e6, 60e6, 100e6], fwd_ms=8, bwd_ms=16,
      ...                               d2h_gbps=50, h2d_gbps=50)
      >>> chosen.offload, chosen.window
      ((True, False, True, False), 2)
      >>> choose_hidden_offload([40e6, 800e6, 60e6, 100e6], fwd_ms=8, bwd_ms=16, d2h_gbps=50,
      ...                       h2d_gbps=50, extra_ms=[0.1, 0, 0.5, 0], max_extra_ms=0.2).offload
      (True, False, False, False)
    """
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], got {margin}.")
    for name, value in [("fwd_ms", fwd_ms), ("bwd_ms", bwd_ms), ("d2h_gbps", d2h_gbps),
                        ("h2d_gbps", h2d_gbps)]:  # fmt: skip
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}.")
    if not max_extra_ms >= 0:
        raise ValueError(f"max_extra_ms must be non-negative, got {max_extra_ms}.")
    n = len(block_bytes)
    block_costs = _per_block("block_costs", block_costs, n, 1.0)
    if not sum(block_costs) > 0:
        raise ValueError(f"block_costs must give {n} non-negative numbers, not all 0.")
    freed = (
        list(block_bytes) if freed_bytes is None else _per_block("freed_bytes", freed_bytes, n, 0)
    )
    extra = _per_block("extra_ms", extra_ms, n, 0.0)
    share = [c / sum(block_costs) for c in block_costs]
    best = HiddenOffload((False,) * n, 1, 0)
    for window in range(2, min(max_window, n) + 1):
        hidden = set()
        # The last window - 1 blocks have no later blocks to hide behind.
        for i in range(n - window + 1):
            later = sum(share[i + 1 : i + window])
            fwd_bytes = margin * fwd_ms * later * d2h_gbps * 1e6
            bwd_bytes = margin * bwd_ms * later * h2d_gbps * 1e6
            if 0 < block_bytes[i] <= min(fwd_bytes, bwd_bytes) and freed[i] > 0:
                hidden.add(i)
        chosen = _most_freed(hidden, freed, extra, window, max_extra_ms)
        choice = HiddenOffload(
            tuple(i in chosen for i in range(n)),
            window,
            int(sum(block_bytes[i] for i in chosen)),
            int(sum(freed[i] for i in chosen)),
            float(sum(extra[i] for i in chosen)),
        )
        if choice.freed_bytes > best.freed_bytes:
            best = choice
    return best


def _per_block(name, values, n, default) -> list:
    if values is None:
        return [default] * n
    values = list(values)
    if len(values) != n or min(values, default=0) < 0:
        raise ValueError(f"{name} must give {n} non-negative numbers; got {values}.")
    return values


def _most_freed(candidates, freed, extra, window, budget) -> tuple[int, ...]:
    """The candidates, at least ``window`` apart, that free the most within ``budget``.

    From the last block back, each block keeps the choices for the blocks
    after it that no other choice beats on both freed bytes and added time.
    """
    n = len(freed)
    # after[i]: (added time, freed bytes, chosen blocks) for blocks i..n-1.
    after = {i: [(0.0, 0, ())] for i in range(n, n + window + 1)}
    for i in reversed(range(n)):
        options = list(after[i + 1])
        if i in candidates:
            options += [
                (spent + extra[i], total + freed[i], (i, *chosen))
                for spent, total, chosen in after[i + window]
                if spent + extra[i] <= budget
            ]
        options.sort(key=lambda o: (o[0], -o[1]))
        after[i] = [o for k, o in enumerate(options) if all(o[1] > p[1] for p in options[:k])]
    return max(after[0], key=lambda o: (o[1], -o[0]))[2]
