"""ResNets in plain Flax NNX, written as an NNX user writes them: the conventions of Flax's ImageNet example.

Nothing here imports jaxoffload. The benchmarks wrap the blocks of a model
built here in place, with ``jaxoffload.nnx.wrap(block, strategy)``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx


def _layers(dtype, rngs):
    conv = functools.partial(nnx.Conv, use_bias=False, dtype=dtype, rngs=rngs)
    norm = functools.partial(nnx.BatchNorm, momentum=0.9, epsilon=1e-5, dtype=dtype, rngs=rngs)
    return conv, norm


class ResNetBlock(nnx.Module):
    """Two 3x3 convolutions with BatchNorm, and the shortcut (ResNet-18 and -34)."""

    expansion = 1

    def __init__(self, in_features: int, filters: int, strides=(1, 1), *, dtype=jnp.float32, rngs):
        conv, norm = _layers(dtype, rngs)
        self.conv1, self.bn1 = conv(in_features, filters, (3, 3), strides=strides), norm(filters)
        self.conv2 = conv(filters, filters, (3, 3))
        # The last BatchNorm starts at zero, so each block starts as the identity.
        self.bn2 = norm(filters, scale_init=nnx.initializers.zeros_init())
        self.has_proj = in_features != filters or strides != (1, 1)
        if self.has_proj:
            self.proj, self.proj_bn = (
                conv(in_features, filters, (1, 1), strides=strides),
                norm(filters),
            )

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        residual = self.proj_bn(self.proj(x)) if self.has_proj else x
        return nnx.relu(residual + y)


class BottleneckResNetBlock(nnx.Module):
    """1x1, 3x3 (strided) and 1x1 convolutions with BatchNorm, and the shortcut."""

    expansion = 4

    def __init__(self, in_features: int, filters: int, strides=(1, 1), *, dtype=jnp.float32, rngs):
        conv, norm = _layers(dtype, rngs)
        out = filters * 4
        self.conv1, self.bn1 = conv(in_features, filters, (1, 1)), norm(filters)
        self.conv2, self.bn2 = conv(filters, filters, (3, 3), strides=strides), norm(filters)
        self.conv3 = conv(filters, out, (1, 1))
        self.bn3 = norm(out, scale_init=nnx.initializers.zeros_init())
        self.has_proj = in_features != out or strides != (1, 1)
        if self.has_proj:
            self.proj, self.proj_bn = conv(in_features, out, (1, 1), strides=strides), norm(out)

    def __call__(self, x):
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = nnx.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        residual = self.proj_bn(self.proj(x)) if self.has_proj else x
        return nnx.relu(residual + y)


class ResNet(nnx.Module):
    """ResNet v1.5: a 7x7 stem, four stages of blocks and a linear classifier, NHWC."""

    def __init__(
        self,
        stage_sizes: Sequence[int],
        block_cls: Any,
        *,
        num_classes: int = 1000,
        num_filters: int = 64,
        dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        conv, norm = _layers(dtype, rngs)
        self.conv_init = conv(3, num_filters, (7, 7), strides=(2, 2), padding=[(3, 3), (3, 3)])
        self.bn_init = norm(num_filters)
        blocks, features = [], num_filters
        for i, size in enumerate(stage_sizes):
            for j in range(size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                filters = num_filters * 2**i
                blocks.append(block_cls(features, filters, strides, dtype=dtype, rngs=rngs))
                features = filters * block_cls.expansion
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(features, num_classes, dtype=dtype, rngs=rngs)
        self.dtype = dtype

    def __call__(self, x):
        x = nnx.relu(self.bn_init(self.conv_init(x)))
        x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for block in self.blocks:
            x = block(x)
        return jnp.asarray(self.head(jnp.mean(x, axis=(1, 2))), self.dtype)


ResNet18 = functools.partial(ResNet, stage_sizes=(2, 2, 2, 2), block_cls=ResNetBlock)
ResNet50 = functools.partial(ResNet, stage_sizes=(3, 4, 6, 3), block_cls=BottleneckResNetBlock)
