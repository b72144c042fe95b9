"""ConvNeXt in plain Flax, written as a user writes it: the paper's ConvNeXt-T, in torchvision's layout.

Nothing here imports jaxoffload. ``block_cls`` takes any block class, such as
``jaxoffload.linen.wrap(ConvNeXtBlock, jaxoffload.Offload())``. Liu et al.,
"A ConvNet for the 2020s" (2022). Stochastic depth is left out: the
benchmarks compare strategies at the same arithmetic, and it draws a
random mask per block.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any


class ConvNeXtBlock(nn.Module):
    """7x7 depthwise conv, LayerNorm, 1x1 to 4x the width, GELU, 1x1 back, layer scale; the shortcut."""

    features: int
    layer_scale_init: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(
            self.features, (7, 7), padding=3, feature_group_count=self.features, dtype=self.dtype
        )(x)
        y = nn.LayerNorm(epsilon=1e-6, dtype=self.dtype)(y)
        # The 1x1 convolutions, as the paper's code writes them: Dense layers over channels.
        y = nn.Dense(4 * self.features, dtype=self.dtype)(y)
        y = nn.gelu(y, approximate=False)
        y = nn.Dense(self.features, dtype=self.dtype)(y)
        scale = self.param(
            "layer_scale", nn.initializers.constant(self.layer_scale_init), (self.features,)
        )
        return x + jnp.asarray(scale, self.dtype) * y


class ConvNeXt(nn.Module):
    """ConvNeXt: a 4x4 patchify stem, four stages with LayerNorm and 2x2 downsampling, NHWC.

    The stage widths are ``num_filters`` times 1, 2, 4 and 8. ``train`` is
    taken as the other models take it; nothing here depends on it (no
    BatchNorm, no dropout).
    """

    stage_sizes: Sequence[int] = (3, 3, 9, 3)
    block_cls: ModuleDef = ConvNeXtBlock
    num_classes: int = 1000
    num_filters: int = 96
    layer_scale_init: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        del train
        norm = functools.partial(nn.LayerNorm, epsilon=1e-6, dtype=self.dtype)
        x = nn.Conv(self.num_filters, (4, 4), (4, 4), padding="VALID", dtype=self.dtype)(x)
        x = norm(name="stem_norm")(x)
        for i, size in enumerate(self.stage_sizes):
            features = self.num_filters * 2**i
            if i > 0:
                x = norm(name=f"downsample_norm{i}")(x)
                x = nn.Conv(
                    features, (2, 2), (2, 2), padding="VALID", dtype=self.dtype,
                    name=f"downsample_conv{i}",
                )(x)  # fmt: skip
            for _ in range(size):
                x = self.block_cls(features, self.layer_scale_init, dtype=self.dtype)(x)
        x = norm(name="head_norm")(jnp.mean(x, axis=(1, 2)))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


ConvNeXtTiny = functools.partial(ConvNeXt, stage_sizes=(3, 3, 9, 3), num_filters=96)
