"""VGG in plain Flax, in torchvision's layout: ``nn.Conv``, ``nn.relu`` and ``nn.max_pool``.

Nothing here imports jaxoffload. A stage is the convolutions between two
pools and the pool that ends them; ``stage_cls`` takes any stage class, such
as ``jaxoffload.linen.wrap(VGGStage, jaxoffload.Lean())``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any


class VGGStage(nn.Module):
    """``num_convs`` 3x3 convolutions, each followed by a ReLU, then a 2x2 max-pool."""

    features: int
    num_convs: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        for _ in range(self.num_convs):
            x = nn.relu(nn.Conv(self.features, (3, 3), padding=1, dtype=self.dtype)(x))
        return nn.max_pool(x, (2, 2), strides=(2, 2))


class VGG(nn.Module):
    """VGG: five stages of 64, 128, 256, 512 and 512 features, and the 4096-wide classifier."""

    stage_sizes: Sequence[int]
    stage_cls: ModuleDef = VGGStage
    num_classes: int = 1000
    dtype: Any = jnp.float32
    dropout_rate: float = 0.5
    num_filters: int = 64
    classifier_width: int = 4096

    @nn.compact
    def __call__(self, x, train: bool = True):
        for i, num_convs in enumerate(self.stage_sizes):
            x = self.stage_cls(self.num_filters * 2 ** min(i, 3), num_convs, dtype=self.dtype)(x)
        x = x.reshape((x.shape[0], -1))
        for _ in range(2):
            x = nn.relu(nn.Dense(self.classifier_width, dtype=self.dtype)(x))
            x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


VGG11 = functools.partial(VGG, stage_sizes=(1, 1, 2, 2, 2))
VGG16 = functools.partial(VGG, stage_sizes=(2, 2, 3, 3, 3))
VGG19 = functools.partial(VGG, stage_sizes=(2, 2, 4, 4, 4))
