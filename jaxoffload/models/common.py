"""Per-block memory strategies shared by the reference models."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn

from jaxoffload import linen as offload_linen

__all__ = ["BLOCK_STRATEGIES", "wrap_block", "first_k"]

# How a block keeps what its backward pass needs:
# "none" stores its residuals on the device, as plain Flax does;
# "remat" stores nothing and recomputes them (nn.remat);
# "offload" moves them to pinned host memory (jaxoffload.linen.offload).
BLOCK_STRATEGIES: dict[str, Callable[[type[nn.Module]], type[nn.Module]]] = {
    "none": lambda block: block,
    "remat": nn.remat,
    "offload": offload_linen.offload,
}


def wrap_block(block: type[nn.Module], strategy: str) -> type[nn.Module]:
    """Returns ``block`` transformed by the named strategy.

    Args:
      block: a Module class.
      strategy: one of ``BLOCK_STRATEGIES``.

    Returns:
      A Module class with the same variables as ``block``.
    """
    try:
        return BLOCK_STRATEGIES[strategy](block)
    except KeyError:
        raise ValueError(
            f"Unknown block strategy {strategy!r}; choose one of {sorted(BLOCK_STRATEGIES)}."
        ) from None


def first_k(strategy: str, k: int, num_blocks: int) -> tuple[str, ...]:
    """``strategy`` for the first ``k`` of ``num_blocks`` blocks, ``"none"`` after.

    Example:
      >>> first_k("offload", 2, 4)
      ('offload', 'offload', 'none', 'none')
    """
    if not 0 <= k <= num_blocks:
        raise ValueError(f"k must be between 0 and {num_blocks}, got {k}.")
    return (strategy,) * k + ("none",) * (num_blocks - k)


def check_strategies(strategies: Sequence[str], num_blocks: int) -> tuple[str, ...]:
    """Validates one strategy per block; an empty sequence means all ``"none"``."""
    strategies = tuple(strategies) or ("none",) * num_blocks
    if len(strategies) != num_blocks:
        raise ValueError(
            f"block_strategies has {len(strategies)} entries, but the model has {num_blocks} blocks."
        )
    for s in strategies:
        if s not in BLOCK_STRATEGIES:
            raise ValueError(
                f"Unknown block strategy {s!r}; choose one of {sorted(BLOCK_STRATEGIES)}."
            )
    return strategies
