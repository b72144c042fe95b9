"""What the reference models share: per-block strategy values and how a block is wrapped."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import flax.linen as nn

from jaxoffload import Store, Strategy
from jaxoffload import linen as offload_linen
from jaxoffload.strategies import check_strategy

__all__ = ["CONV_NAME", "check_strategies", "is_lean", "uses_lean_layers", "wrap_block"]

# Blocks name their convolution outputs so that jax's own offload policy can find them.
CONV_NAME = "conv"


def uses_lean_layers(strategy: Strategy) -> bool:
    """Whether a reference block under ``strategy`` is built from the hand-made lean layers.

    They pay where the residuals are the cheapest cut (``Lean``) or cross the
    link (every ``Offload``, whatever it moves): there they keep or move fewer
    bytes than flax's layers.
    """
    return strategy.cuts or strategy.to_host


def is_lean(strategy: Strategy) -> bool:
    """Whether ``strategy`` keeps the cheapest cut on the device (``Lean()``).

    A reference block keeps its output there, where the next block shares it,
    and fuses its tail (``fuse_tail``).
    """
    return strategy.cuts and not strategy.to_host


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
    # An Offload that cuts is one given neither names nor recompute=True.
    if names and strategy.to_host and strategy.cuts:
        strategy = dataclasses.replace(strategy, names=names)
    device_argnums = device_argnums if strategy.to_host else ()
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
