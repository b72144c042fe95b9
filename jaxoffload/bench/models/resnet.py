"""ResNets (He et al., 2015) in Flax linen, NHWC, torchvision's v1.5 layout."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxoffload import Lean, Remat, Store, Strategy
from jaxoffload import linen as offload_linen
from jaxoffload.bench import layers
from jaxoffload.bench.catalog import RESNETS as RESNETS
from jaxoffload.bench.models.common import (
    CONV_NAME,
    check_strategies,
    is_lean,
    uses_lean_layers,
    wrap_block,
)
from jaxoffload.internal import relu, relu_max_pool
from jaxoffload.strategies import check_strategy

__all__ = ["BasicBlock", "BottleneckBlock", "ResNet", "RESNETS"]


def _layers(dtype: Any, train: bool, lean: bool = False):
    """``(conv, norm, norm_relu_conv, relu)``: flax's layers, or the hand-made lean ones if ``lean``.

    ``norm_relu_conv(y, *conv_args, **conv_kwargs)`` is
    ``conv(*conv_args, **conv_kwargs)(relu(norm()(y)))``; the lean one does not
    store the convolution's input (:func:`jaxoffload.bench.layers.conv_after`). Both
    kinds give the same variable names (``BatchNorm_0``, ...), so a model's
    variables do not depend on which its blocks use.
    """
    conv = functools.partial(nn.Conv, use_bias=False, dtype=dtype)
    options = {"use_running_average": not train, "momentum": 0.9, "epsilon": 1e-5, "dtype": dtype}
    if lean:
        norm = functools.partial(layers.BatchNorm, **options)

        def norm_relu_conv(y, *conv_args, **conv_kwargs):
            after = layers.conv_after(norm(relu=True))
            return conv(*conv_args, conv_general_dilated=after, **conv_kwargs)(y)

        return conv, norm, norm_relu_conv, relu
    norm = functools.partial(nn.BatchNorm, **options)

    def norm_relu_conv(y, *conv_args, **conv_kwargs):
        y = nn.relu(norm()(y))
        return conv(*conv_args, **conv_kwargs)(y)

    return conv, norm, norm_relu_conv, nn.relu


def stem_strategy(stem: Strategy | None, block_strategies: Sequence[Strategy]) -> Strategy:
    """The stem's strategy: ``stem``, or one that suits the blocks when ``stem`` is ``None``.

    ``Store()`` uses flax's layers, ``Lean()`` the lean ones (the convolution's
    output, the pooled output and a byte per pooled value), and ``Remat()``
    the lean layers recomputed from the image, which the step keeps anyway.
    """
    if stem is None:
        # Once every block's residuals leave the device, the stem's are the
        # largest left, and recomputing them costs less than moving them
        # (measured with commit b56266b, which made the stem lean).
        if all(s.to_host for s in block_strategies):
            return Remat()
        return Lean() if uses_lean_layers(block_strategies[0]) else Store()
    stem = check_strategy(stem)
    if stem.to_host:
        raise ValueError(f"the stem takes Store(), Lean() or Remat(), got {stem!r}.")
    return stem


class _Stem(nn.Module):
    """The 7x7, stride-2 convolution, BatchNorm, ReLU and 3x3, stride-2 max-pool."""

    dtype: Any = jnp.float32
    lean: bool = False

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv, norm, _, _ = _layers(self.dtype, train, self.lean)
        x = norm(name="norm")(conv(64, (7, 7), (2, 2), padding=3, name="conv")(x))
        pool = (3, 3), (2, 2), ((1, 1), (1, 1))
        if self.lean:
            return relu_max_pool(x, *pool)
        return nn.max_pool(nn.relu(x), pool[0], strides=pool[1], padding=pool[2])


class _ResidualBlock(nn.Module):
    """What both block kinds share: the last convolution, the shortcut and the final ReLU.

    Subclasses give the branch (:meth:`branch`) up to the input of its last
    convolution, and that convolution's arguments; the last convolution, its
    BatchNorms, the shortcut, the sum and the ReLU are made here.

    ``lean`` uses :class:`jaxoffload.bench.layers.BatchNorm`, fused with the ReLU
    and the convolution that follow it. With ``defer_relu`` (lean blocks
    only), a block returns its sum before the final ReLU, and the block after
    it applies that ReLU to its input (``relu_input``): between two
    offloading blocks, the one tensor at the boundary is then the sum.

    ``fuse_tail`` (lean blocks only) makes the last convolution, the
    BatchNorms around it, the sum and the ReLU one rule
    (:func:`jaxoffload.bench.layers.residual_tail`), which keeps the block's output
    (the next block's input, kept there anyway) and recomputes the last
    convolution's input and output. A bottleneck then keeps its input, its
    first two convolutions' outputs and its shortcut convolution's output.
    """

    features: int
    strides: int = 1
    dtype: Any = jnp.float32
    _: dataclasses.KW_ONLY
    lean: bool = False
    relu_input: bool = False
    fuse_tail: bool = False
    defer_relu: bool = False

    # How many convolutions the branch has: the shortcut's is named after them.
    branch_convs: ClassVar[int]

    @nn.compact
    def __call__(self, x, train: bool = True):
        if (self.relu_input or self.fuse_tail or self.defer_relu) and not self.lean:
            raise ValueError("only lean blocks take relu_input, fuse_tail or defer_relu")
        if self.fuse_tail and self.defer_relu:
            raise ValueError("a fused tail ends in its ReLU: it cannot defer it")
        conv, norm, norm_relu_conv, relu = _layers(self.dtype, train, self.lean)
        if self.relu_input:
            x = relu(x)
        strides = (self.strides, self.strides)
        y, (features, *last_args), last_kwargs = self.branch(x, strides, conv, norm_relu_conv)
        projects = x.shape[-1] != features or self.strides != 1
        if self.fuse_tail:
            before, after = norm(relu=True), norm()
            shortcut_norm = norm() if projects else None
            shortcut = x
            if projects:
                name = f"Conv_{self.branch_convs}"
                shortcut = conv(features, (1, 1), strides, name=name)(x)
            tail = layers.tail_conv(before, after, shortcut, shortcut_norm)
            return conv(features, *last_args, conv_general_dilated=tail, **last_kwargs)(y)
        y = checkpoint_name(norm_relu_conv(y, features, *last_args, **last_kwargs), CONV_NAME)
        # Made after the branch's layers, so that they are named after them.
        y = norm()(y)
        if projects:
            shortcut_norm = norm()
            x = shortcut_norm(conv(features, (1, 1), strides)(x))
        y = x + y
        return y if self.defer_relu else relu(y)

    def branch(self, x, strides, conv, norm_relu_conv):
        """``(y, last_args, last_kwargs)``: the last convolution's input and its ``nn.Conv`` arguments."""
        raise NotImplementedError


class BasicBlock(_ResidualBlock):
    """Two 3x3 convolutions with BatchNorm, and the shortcut (ResNet-18 and -34).

    ``lean``, ``relu_input``, ``fuse_tail`` and ``defer_relu``: see ``_ResidualBlock``.
    """

    branch_convs = 2

    def branch(self, x, strides, conv, norm_relu_conv):
        y = checkpoint_name(conv(self.features, (3, 3), strides, padding=1)(x), CONV_NAME)
        return y, (self.features, (3, 3)), {"padding": 1}


class BottleneckBlock(_ResidualBlock):
    """1x1, 3x3 (strided) and 1x1 convolutions with BatchNorm, and the shortcut.

    ``lean``, ``relu_input``, ``fuse_tail`` and ``defer_relu``: see ``_ResidualBlock``.

    Offloaded (``models.wrap_block``), a block keeps its input and the 3x3
    convolution's output (``offload_names``), and recomputes the rest: the
    1x1 convolutions' outputs are the block's widest tensors and its cheapest
    to compute, so the block moves less than its lean residuals.
    """

    branch_convs = 3
    offload_names = ("bottleneck_3x3",)

    def branch(self, x, strides, conv, norm_relu_conv):
        y = checkpoint_name(conv(self.features, (1, 1))(x), CONV_NAME)
        y = norm_relu_conv(y, self.features, (3, 3), strides, padding=1)
        (kept,) = self.offload_names
        y = checkpoint_name(checkpoint_name(y, CONV_NAME), kept)
        return y, (self.features * 4, (1, 1)), {}


class ResNet(nn.Module):
    """ResNet with a 7x7 stem, four stages and a linear classifier.

    Attributes:
      stage_sizes: blocks per stage, e.g. ``(3, 4, 6, 3)``.
      block: ``"basic"`` or ``"bottleneck"``.
      num_classes: classifier outputs.
      dtype: compute dtype; parameters are float32.
      block_strategies: one strategy value per residual block, or empty for
        all ``Store()``. Blocks under ``Lean`` and ``Offload`` are built from
        :mod:`jaxoffload.bench.layers`. The classifier is never wrapped.
      stem: the stem's strategy (``Store()``, ``Lean()`` or ``Remat()``), or
        ``None``: ``Remat()`` if every block offloads, ``Lean()`` if the first
        block uses lean layers, ``Store()`` otherwise.
    """

    stage_sizes: Sequence[int] = (3, 4, 6, 3)
    block: str = "bottleneck"
    num_classes: int = 1000
    dtype: Any = jnp.float32
    block_strategies: Sequence[Strategy] = ()
    stem: Strategy | None = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        if self.block not in ("basic", "bottleneck"):
            raise ValueError(f"block must be 'basic' or 'bottleneck', got {self.block!r}.")
        strategies = check_strategies(self.block_strategies, sum(self.stage_sizes))
        kind = BasicBlock if self.block == "basic" else BottleneckBlock
        stem = stem_strategy(self.stem, strategies)
        stem_module = offload_linen.wrap(_Stem, stem, static_argnums=(2,))
        x = stem_module(self.dtype, not stem.is_identity, name="stem")(x, train)
        blocks = [(stage, i) for stage, size in enumerate(self.stage_sizes) for i in range(size)]
        owed = False  # the block before left its final ReLU to its reader
        for n, (stage, i) in enumerate(blocks):
            strategy = strategies[n]
            lean = uses_lean_layers(strategy)
            # A lean block keeps its output on the device, where the next block
            # shares it; moving that input again would free nothing there.
            kept = is_lean(strategies[n - 1] if n else stem)
            block = wrap_block(
                kind, strategy, static_argnums=(2,), device_argnums=(1,) if kept else ()
            )
            fuse = is_lean(strategy)
            # An offloading block leaves its ReLU to the next one only if that
            # one offloads too (or is the classifier). A ReLU applied by any
            # other reader is one that XLA recomputes from the sum in the
            # backward pass, keeping the sum alive beside the ReLU's output
            # (XLA's live-range dump of one offloading block between lean ones,
            # read for commit d70be6b).
            last = n + 1 == len(strategies)
            defer = lean and not fuse and (last or strategies[n + 1].to_host)
            module = block(
                64 * 2**stage,
                2 if stage > 0 and i == 0 else 1,
                self.dtype,
                lean=lean,
                relu_input=owed,
                fuse_tail=fuse,
                defer_relu=defer,
                name=f"block{n}",
            )
            x, owed = module(x, train), defer
        x = relu(x) if owed else x
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)
