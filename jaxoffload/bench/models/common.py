"""What the reference models share: per-block strategy values and how a block is wrapped."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.linen as nn

from jaxoffload import linen as offload_linen
from jaxoffload.strategies import Lean, Offload, Store, Strategy, check_strategy

__all__ = ["CONV_NAME", "check_strategies", "uses_lean_layers", "wrap_block"]

# Blocks name their convolution outputs so that jax's own offload policy can find them.
CONV_NAME = "conv"


def uses_lean_layers(strategy: Strategy) -> bool:
    """Whether a reference block under ``strategy`` is built from :mod:`jaxoffload.layers`."""
    return isinstance(strategy, Lean | Offload)


def wrap_block(
    block: type[nn.Module],
    strategy: Strategy,
    static_argnums: Sequence[int] = (),
    device_argnums: Sequence[int] = (),
) -> type[nn.Module]:
    """``jaxoffload.linen.wrap(block, strategy)``, with the block's own offload names.

    A block class with an ``offload_names`` attribute keeps only its inputs
    and the values of those :func:`~jax.ad_checkpoint.checkpoint_name` names
    when it offloads with no names of its own (``Offload(names=...)``).
    """
    names = getattr(block, "offload_names", None)
    if (
        isinstance(strategy, Offload)
        and names
        and strategy.names is None
        and not strategy.recompute
    ):
        strategy = dataclasses.replace(strategy, names=names)
    device_argnums = device_argnums if isinstance(strategy, Offload) else ()
    return offload_linen.wrap(
        block, strategy, static_argnums=static_argnums, device_argnums=device_argnums
    )


def check_strategies(strategies: Sequence[Strategy], num_blocks: int) -> tuple[Strategy, ...]:
    """Validates one strategy value per block; an empty sequence means all ``Store()``."""
    strategies = tuple(strategies) or (Store(),) * num_blocks
    if len(strategies) != num_blocks:
        raise ValueError(
            f"block_strategies has {len(strategies)} entries, but the model has {num_blocks} blocks."
        )
    return tuple(check_strategy(s) for s in strategies)
