"""Per-block memory strategies shared by the reference models."""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax

from jaxoffload import linen as offload_linen

__all__ = [
    "BLOCK_STRATEGIES",
    "CONV_NAME",
    "check_strategies",
    "first_k",
    "LEAN_STRATEGIES",
    "OFFLOAD_STRATEGIES",
    "PLANNED_STRATEGIES",
    "SCHEDULED_STRATEGIES",
    "uses_lean_layers",
    "wrap_block",
]

# Blocks name their convolution outputs so that jax's own offload policy can find them.
CONV_NAME = "conv"

# How a block keeps what its backward pass needs:
BLOCK_STRATEGIES = {
    "none": "store the residuals on the device, as plain Flax does",
    "lean": "store only what the backward pass needs (jaxoffload.layers), on the device, "
    "with the backward pass ordered as under offload (to_host=False)",
    "lean-unordered": "the 'lean' layers, with XLA's own backward order",
    "remat": "store nothing and recompute (nn.remat)",
    "remat-dots": "store conv and matmul outputs, recompute the rest (nn.remat, dots_saveable)",
    "jax-offload": "jax's save_and_offload_only_these_names on the named conv outputs",
    "offload-plain": "the plain layers, with their residuals in pinned host memory (scheduled)",
    "offload": "the 'lean' layers, with their residuals in pinned host memory (scheduled); "
    "a block with offload_names keeps only those values and its input, and recomputes the rest",
}
# Model-wide strategies whose block strategies a planner picks (see
# jaxoffload.benchmark.hidden_offload_workload).
PLANNED_STRATEGIES = {
    "offload-hidden": "'offload' only the blocks whose transfers the compute can hide "
    "(jaxoffload.planner), the others 'lean'",
}
# Blocks under these use jaxoffload.layers' lean rules (see uses_lean_layers).
LEAN_STRATEGIES = ("lean", "lean-unordered", "offload")
# Blocks under these move their residuals with jaxoffload.linen.offload.
OFFLOAD_STRATEGIES = ("offload-plain", "offload")
# Blocks under these take a jaxoffload.schedule turn (see wrap_block).
SCHEDULED_STRATEGIES = ("lean", *OFFLOAD_STRATEGIES)


def wrap_block(
    block: type[nn.Module],
    strategy: str,
    static_argnums: Sequence[int] = (),
    device_argnums: Sequence[int] = (),
) -> type[nn.Module]:
    """Returns ``block`` transformed by the named strategy.

    Under ``"offload"``, a block class with an ``offload_names`` attribute
    keeps only its inputs and the values of those
    :func:`~jax.ad_checkpoint.checkpoint_name` names, and recomputes the rest
    in its backward pass (``jaxoffload.linen.offload``'s ``names``): fewer
    bytes cross the link, for some recomputation.

    Args:
      block: a Module class.
      strategy: a key of ``BLOCK_STRATEGIES``.
      static_argnums: non-array arguments of ``block.__call__``, counting
        ``self`` as 0, as in ``nn.remat``.
      device_argnums: arguments that an offloading block keeps on the device
        (``jaxoffload.linen.offload``'s ``device_argnums``).

    Returns:
      A Module class with the same variables as ``block``.
    """
    static_argnums = tuple(static_argnums)
    if strategy in OFFLOAD_STRATEGIES:
        # Only the lean blocks recompute; "offload-plain" moves every residual.
        names = getattr(block, "offload_names", None) if strategy == "offload" else None
        return offload_linen.offload(
            block, names=names, static_argnums=static_argnums, device_argnums=device_argnums
        )
    if strategy == "lean":
        # Moves nothing, but computes each block's weight gradients before the
        # next block's backward pass, as offloading blocks do.
        return offload_linen.offload(block, static_argnums=static_argnums, to_host=False)
    if strategy in ("none", "lean-unordered"):  # lean layers: see uses_lean_layers
        return block
    if strategy == "remat":
        return nn.remat(block, static_argnums=static_argnums)
    if strategy == "remat-dots":
        policy = jax.checkpoint_policies.dots_saveable
        return nn.remat(block, static_argnums=static_argnums, policy=policy)
    if strategy == "jax-offload":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[CONV_NAME],
            offload_src="device",
            offload_dst="pinned_host",
        )
        return nn.remat(block, static_argnums=static_argnums, policy=policy)
    raise ValueError(
        f"Unknown block strategy {strategy!r}; choose one of {sorted(BLOCK_STRATEGIES)}."
    )


def uses_lean_layers(strategy: str) -> bool:
    """Whether a block under ``strategy`` uses :mod:`jaxoffload.layers`' lean rules."""
    return strategy in LEAN_STRATEGIES


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
