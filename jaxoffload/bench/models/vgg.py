"""VGG networks (Simonyan and Zisserman, 2014) in Flax linen, NHWC."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxoffload import Strategy
from jaxoffload.bench import layers
from jaxoffload.bench.models.common import CONV_NAME, check_strategies, uses_lean_layers, wrap_block
from jaxoffload.internal import max_pool, relu, relu_max_pool

__all__ = ["VGG", "ConvBlock", "VGG11", "VGG13", "VGG16", "VGG19", "num_conv_blocks"]

# Channel counts of the 3x3 convolutions; "M" is a 2x2 max-pool.
VGG11 = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
VGG13 = (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")
VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")
VGG19 = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M")  # fmt: skip


class ConvBlock(nn.Module):
    """3x3 convolution, BatchNorm if ``norm``, ReLU, and a 2x2 max-pool if ``pool``.

    The pool belongs to the block before it, so that a block's strategy also
    covers the pool's residuals. ``lean_pool`` picks
    :func:`jaxoffload._src.layers.max_pool` over ``flax.linen.max_pool``: same
    values and gradients, without the int32 index tensors that XLA:GPU makes
    for the latter's backward pass.

    ``lean`` blocks use the lean layers (:mod:`jaxoffload.bench.layers`) and move the ReLU (and pool)
    to the start of the *next* block: a lean block applies ``incoming`` (the
    activation the block before it owes) to its input, and returns its
    convolution's (or BatchNorm's) output. The ReLU's output is then both its
    own mask and the convolution's input, one residual in one block, so a
    per-block offload moves each tensor once. A lean block keeps that tensor,
    a one-byte pool index, and with ``norm`` its BatchNorm's input.
    """

    features: int
    pool: bool = False
    dtype: Any = jnp.float32
    _: dataclasses.KW_ONLY
    lean_pool: bool = True
    norm: bool = False
    lean: bool = False
    incoming: str = ""

    @nn.compact
    def __call__(self, x, train: bool = True):
        if self.lean:
            x = activate(x, self.incoming)
        elif self.incoming:
            raise ValueError("only lean blocks take an incoming activation")
        x = nn.Conv(self.features, (3, 3), padding="SAME", dtype=self.dtype)(x)
        x = checkpoint_name(x, CONV_NAME)
        if self.lean:
            if self.norm:
                x = layers.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)(
                    x
                )
            return x
        if self.norm:
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)(x)
        x = nn.relu(x)
        if self.pool:
            pool = max_pool if self.lean_pool else nn.max_pool
            x = pool(x, (2, 2), strides=(2, 2))
        return x


def activate(x, activation: str):
    """Applies a lean block's deferred activation: ``""``, ``"relu"`` or ``"relu_pool"``."""
    if activation == "relu_pool":
        return relu_max_pool(x, (2, 2), strides=(2, 2))
    if activation == "relu":
        return relu(x)
    if activation:
        raise ValueError(f"unknown activation {activation!r}")
    return x


def num_conv_blocks(config: Sequence[int | str]) -> int:
    """How many convolution blocks a VGG configuration has."""
    return sum(1 for v in config if v != "M")


class VGG(nn.Module):
    """VGG with the ImageNet classifier (no dropout: the benchmarks are deterministic).

    Attributes:
      config: channel counts and "M" pools, e.g. ``VGG19``.
      num_classes: classifier outputs.
      dtype: compute dtype; parameters are float32.
      block_strategies: one strategy value per conv block, or empty for all
        ``Store()``. Blocks under ``Lean`` and ``Offload`` are built from
        :mod:`jaxoffload.bench.layers`.
      classifier_width: width of the classifier's two inner dense layers.
      lean_pool: use :func:`jaxoffload._src.layers.max_pool` in blocks that are not
        lean (see ``ConvBlock``); lean blocks always pool leanly.
      norm: BatchNorm after every convolution (the ``vgg*_bn`` models).
    """

    config: Sequence[int | str] = VGG19
    num_classes: int = 1000
    dtype: Any = jnp.float32
    block_strategies: Sequence[Strategy] = ()
    classifier_width: int = 4096
    lean_pool: bool = False
    norm: bool = False

    @nn.compact
    def __call__(self, x, train: bool = True):
        strategies = check_strategies(self.block_strategies, num_conv_blocks(self.config))
        convs = [v for v in self.config if v != "M"]
        pools = [i + 1 < len(self.config) and self.config[i + 1] == "M"
                 for i, v in enumerate(self.config) if v != "M"]  # fmt: skip
        owed = ""  # the activation a lean block left for whoever reads its output
        for n, (features, pool, strategy) in enumerate(zip(convs, pools, strategies)):
            lean = uses_lean_layers(strategy)
            if owed and not lean:
                x, owed = activate(x, owed), ""
            block = wrap_block(ConvBlock, strategy, static_argnums=(2,))
            x = block(
                features, pool, self.dtype, lean_pool=self.lean_pool, norm=self.norm, lean=lean,
                incoming=owed, name=f"block{n}",
            )(x, train)  # fmt: skip
            owed = ("relu_pool" if pool else "relu") if lean else ""
        x = activate(x, owed)
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(self.classifier_width, dtype=self.dtype, name="fc0")(x))
        x = nn.relu(nn.Dense(self.classifier_width, dtype=self.dtype, name="fc1")(x))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)
