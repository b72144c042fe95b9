"""U-Net in plain Flax, written as a user writes it: the paper's network, with SAME padding and BatchNorm.

Nothing here imports jaxoffload. ``block_cls`` takes any double-conv class,
such as ``jaxoffload.linen.wrap(DoubleConv, jaxoffload.Offload())``: it is
every level's, on the way down, at the bottom and on the way up.
Ronneberger et al., "U-Net: Convolutional Networks for Biomedical Image
Segmentation" (2015); the padding and BatchNorm are those of the common
reimplementations, which keep the output at the input's size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

ModuleDef = Any


class DoubleConv(nn.Module):
    """Two 3x3 convolutions, each followed by BatchNorm and a ReLU."""

    features: int
    conv: ModuleDef
    norm: ModuleDef
    act: Callable

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = self.act(self.norm()(self.conv(self.features, (3, 3), padding="SAME")(x)))
        return x


class UNet(nn.Module):
    """U-Net: ``depth`` 2x2 max-pools down from ``num_filters`` channels, as many 2x2 up-convs back, NHWC.

    Each level doubles the channels on the way down (64 to 1024 by
    default) and the up-convolution halves them; the skip of the same level
    is concatenated before its double conv. A 1x1 convolution gives
    ``num_classes`` logits per pixel: ``(batch, height, width, num_classes)``.
    """

    block_cls: ModuleDef = DoubleConv
    num_classes: int = 2
    num_filters: int = 64
    depth: int = 4
    dtype: Any = jnp.float32
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x, train: bool = True):
        multiple = 2**self.depth
        if x.shape[1] % multiple or x.shape[2] % multiple:
            raise ValueError(
                f"UNet of depth {self.depth} needs a height and width divisible by {multiple}, "
                f"got {x.shape[1]}x{x.shape[2]}: resize or pad the images."
            )
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm,
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            dtype=self.dtype,
        )
        block = functools.partial(self.block_cls, conv=conv, norm=norm, act=self.act)
        skips = []
        for level in range(self.depth):
            x = block(self.num_filters * 2**level)(x)
            skips.append(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = block(self.num_filters * 2**self.depth)(x)
        for level in reversed(range(self.depth)):
            features = self.num_filters * 2**level
            x = nn.ConvTranspose(features, (2, 2), strides=(2, 2), dtype=self.dtype)(x)
            x = jnp.concatenate([skips[level], x], axis=-1)
            x = block(features)(x)
        x = nn.Conv(self.num_classes, (1, 1), dtype=self.dtype, name="conv_out")(x)
        return jnp.asarray(x, self.dtype)
