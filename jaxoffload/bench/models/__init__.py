"""CNNs for the benchmarks: plain-Flax models (``flax-*``) and the reference models.

The plain-Flax models (:mod:`.flax_resnet`, :mod:`.flax_vgg`,
:mod:`.flax_mobilenet`, :mod:`.flax_convnext`, :mod:`.flax_efficientnet`, :mod:`.flax_unet`,
and the NNX
:mod:`.flax_nnx_resnet`) are written as a user writes them and import nothing
from jaxoffload: :func:`create` wraps their blocks, unmodified, with
:func:`jaxoffload.linen.wrap`. The reference models (:mod:`.resnet`,
:mod:`.vgg`) were built by hand with :mod:`jaxoffload.bench.layers`, and take
one strategy per block.

Each model has a task (:func:`task`): ``"classify"`` gives one logit vector per
image, to train against one label per image; ``"segment"`` (``flax-unet``)
gives one per pixel, to train against a ``(batch, height, width)`` label map.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxoffload import Lean, Store, Strategy
from jaxoffload import linen as offload_linen
from jaxoffload.bench.catalog import MODEL_NAMES as MODEL_NAMES
from jaxoffload.bench.catalog import RESNETS, check_model
from jaxoffload.bench.catalog import TASKS as TASKS
from jaxoffload.bench.catalog import default_num_classes as default_num_classes
from jaxoffload.bench.catalog import is_nnx as is_nnx
from jaxoffload.bench.catalog import is_plain as is_plain
from jaxoffload.bench.catalog import task as task
from jaxoffload.bench.models import (
    flax_convnext,
    flax_efficientnet,
    flax_mobilenet,
    flax_nnx_resnet,
    flax_resnet,
    flax_unet,
    flax_vgg,
)
from jaxoffload.bench.models.common import check_strategies as check_strategies
from jaxoffload.bench.models.common import uses_lean_layers as uses_lean_layers
from jaxoffload.bench.models.common import wrap_block as wrap_block
from jaxoffload.bench.models.resnet import BasicBlock as BasicBlock
from jaxoffload.bench.models.resnet import BottleneckBlock as BottleneckBlock
from jaxoffload.bench.models.resnet import ResNet as ResNet
from jaxoffload.bench.models.vgg import VGG as VGG
from jaxoffload.bench.models.vgg import VGG11 as VGG11
from jaxoffload.bench.models.vgg import VGG13 as VGG13
from jaxoffload.bench.models.vgg import VGG16 as VGG16
from jaxoffload.bench.models.vgg import VGG19 as VGG19
from jaxoffload.bench.models.vgg import ConvBlock as ConvBlock
from jaxoffload.bench.models.vgg import num_conv_blocks

# Each model name of jaxoffload.bench.catalog is built below (tests/test_models.py checks).
_VGGS = {"vgg11": VGG11, "vgg13": VGG13, "vgg16": VGG16, "vgg19": VGG19}

# name: (model constructor, the block class that strategies wrap)
_PLAIN = {
    "flax-resnet18": (flax_resnet.ResNet18, flax_resnet.ResNetBlock),
    "flax-resnet34": (flax_resnet.ResNet34, flax_resnet.ResNetBlock),
    "flax-resnet50": (flax_resnet.ResNet50, flax_resnet.BottleneckResNetBlock),
    "flax-resnet101": (flax_resnet.ResNet101, flax_resnet.BottleneckResNetBlock),
    "flax-vgg11": (flax_vgg.VGG11, flax_vgg.VGGStage),
    "flax-vgg16": (flax_vgg.VGG16, flax_vgg.VGGStage),
    "flax-vgg19": (flax_vgg.VGG19, flax_vgg.VGGStage),
    "flax-mobilenetv2": (flax_mobilenet.MobileNetV2, flax_mobilenet.InvertedResidual),
    "flax-convnext-t": (flax_convnext.ConvNeXtTiny, flax_convnext.ConvNeXtBlock),
    "flax-efficientnet-b0": (flax_efficientnet.EfficientNetB0, flax_efficientnet.MBConv),
    "flax-unet": (flax_unet.UNet, flax_unet.DoubleConv),
}
# Plain Flax NNX models, whose block instances are wrapped in place.
_NNX = {
    "flax-nnx-resnet18": (flax_nnx_resnet.ResNet18, flax_nnx_resnet.ResNetBlock),
    "flax-nnx-resnet50": (flax_nnx_resnet.ResNet50, flax_nnx_resnet.BottleneckResNetBlock),
}
# The attribute through which each plain model takes its block class.
_BLOCK_ATTRIBUTE = {
    flax_resnet.ResNet: "block_cls",
    flax_vgg.VGG: "stage_cls",
    flax_mobilenet.MobileNetV2: "block_cls",
    flax_convnext.ConvNeXt: "block_cls",
    flax_efficientnet.EfficientNet: "block_cls",
    flax_unet.UNet: "block_cls",
}
# How many blocks a plain model of each class has, read from its attributes.
_BLOCK_COUNT = {
    flax_resnet.ResNet: lambda model: sum(model.stage_sizes),
    flax_vgg.VGG: lambda model: sum(model.stage_sizes),
    flax_mobilenet.MobileNetV2: lambda model: sum(n for _, _, n, _ in model.stages),
    flax_convnext.ConvNeXt: lambda model: sum(model.stage_sizes),
    flax_efficientnet.EfficientNet: lambda model: sum(stage[-1] for stage in model.stages),
    # A double conv at each level down, one at the bottom, one at each level up.
    flax_unet.UNet: lambda model: 2 * model.depth + 1,
}


def _outside_blocks(strategy: Strategy) -> Strategy | None:
    """What a plain-Flax model's code outside its blocks (a stem, a classifier) does, if wrapped.

    Under blocks that cut their residuals or move them (``Lean``, every
    ``Offload``) it is lean; recomputing it instead (``Remat``) held more
    (docs/design.md, the alternatives measured and dropped). Under the
    others it is left as it is.
    """
    return Lean() if strategy.cuts or strategy.to_host else None


__all__ = [
    "MODEL_NAMES",
    "TASKS",
    "VGG",
    "VGG11",
    "VGG13",
    "VGG16",
    "VGG19",
    "BasicBlock",
    "BottleneckBlock",
    "ConvBlock",
    "ResNet",
    "create",
    "create_nnx",
    "default_num_classes",
    "wrap_nnx_blocks",
    "is_nnx",
    "is_plain",
    "nnx_block_class",
    "num_blocks",
    "plain_model",
    "plannable_model",
    "task",
    "wrap_block",
]


def num_blocks(name: str) -> int:
    """How many blocks (each taking one strategy) the named model has."""
    check_model(name)
    if name in _PLAIN:
        model, block = _PLAIN[name]
        base = model.func if isinstance(model, functools.partial) else model
        return _BLOCK_COUNT[base](model(**{_BLOCK_ATTRIBUTE[base]: block}))
    if name in _NNX:
        return sum(_NNX[name][0].keywords["stage_sizes"])
    if name in RESNETS:
        return sum(RESNETS[name][0])
    return num_conv_blocks(_VGGS[name.removesuffix("_bn")])


def create(
    name: str,
    *,
    strategy: Strategy | Sequence[Strategy] | None = None,
    dtype: Any = jnp.float32,
    num_classes: int | None = None,
) -> nn.Module:
    """Builds a model by name, with one strategy for all blocks or one each.

    Args:
      name: one of ``MODEL_NAMES``, e.g. ``"flax-resnet50"``, ``"vgg19"``.
      strategy: a strategy value, or a sequence with one per block;
        ``None`` means ``Store()`` (the plain model). A plain-Flax model
        wraps one block class, so its blocks share one; under ``Lean`` and
        ``Offload`` the model itself is wrapped too (see ``_outside_blocks``),
        which reaches the code outside its blocks, such as a stem.
      dtype: the compute dtype; parameters are float32.
      num_classes: classifier outputs (per pixel, for a ``"segment"`` model);
        ``None`` means :func:`default_num_classes`.

    Returns:
      A Flax module called as ``model.apply(variables, x, train)``.

    Example:
      >>> import jaxoffload
      >>> model = create("flax-resnet18", strategy=jaxoffload.Lean(), num_classes=10)
      >>> type(model).__name__, model.block_cls.__name__
      ('ResNet', 'ResNetBlock')
    """
    check_model(name)
    if name in _NNX:
        raise ValueError(f"{name} is an NNX model: build it with create_nnx.")
    n = num_blocks(name)
    num_classes = default_num_classes(name) if num_classes is None else num_classes
    strategy = Store() if strategy is None else strategy
    strategies = check_strategies(
        (strategy,) * n if not isinstance(strategy, Sequence) else strategy, n
    )
    if name in _PLAIN:
        model, block = _PLAIN[name]
        if len(set(strategies)) > 1:
            raise ValueError(
                f"{name} wraps one block class, so its blocks take one strategy; got {strategies}."
            )
        return plain_model(model, block, strategies[0], num_classes=num_classes, dtype=dtype)
    if name in RESNETS:
        stages, block = RESNETS[name]
        return ResNet(stages, block, num_classes, dtype, strategies)
    return VGG(
        _VGGS[name.removesuffix("_bn")],
        num_classes=num_classes,
        dtype=dtype,
        block_strategies=strategies,
        norm=name.endswith("_bn"),
    )


def plain_model(model: Any, block: Any, strategy: Strategy, **kwargs: Any) -> nn.Module:
    """A plain-Flax model whose blocks are wrapped with ``strategy``, as a user would wrap them.

    ``jaxoffload.linen.wrap(block, strategy)`` goes in through the model's
    block-class attribute, and under ``Lean`` and ``Offload`` the model class
    is wrapped too (see ``_outside_blocks``).

    Args:
      model: a plain-Flax model class (:class:`.flax_resnet.ResNet`,
        :class:`.flax_vgg.VGG`, :class:`.flax_mobilenet.MobileNetV2`,
        :class:`.flax_convnext.ConvNeXt`, :class:`.flax_unet.UNet`), or a
        ``functools.partial`` of one.
      block: the block class to wrap.
      strategy: the blocks' strategy.
      **kwargs: the model's other attributes.
    """
    base = model.func if isinstance(model, functools.partial) else model
    wrapped = offload_linen.wrap(block, strategy)
    outside = _outside_blocks(strategy)
    if outside is not None:
        # The stem and the classifier: `train` (argument 2) is static.
        model = offload_linen.wrap(model, outside, static_argnums=(2,))
    return model(**{_BLOCK_ATTRIBUTE[base]: wrapped}, **kwargs)


def create_nnx(
    name: str,
    *,
    strategy: Strategy | None = None,
    dtype: Any = jnp.float32,
    num_classes: int = 1000,
    rngs: Any,
) -> Any:
    """Builds a plain Flax NNX model by name, its blocks wrapped in place with ``strategy``.

    As :func:`create` does for linen, under ``Lean`` and ``Offload`` the model
    itself is wrapped too, which reaches its stem and classifier.

    Example:
      >>> from flax import nnx
      >>> import jaxoffload
      >>> model = nnx.eval_shape(lambda: create_nnx(
      ...     "flax-nnx-resnet18", strategy=jaxoffload.Lean(), num_classes=10, rngs=nnx.Rngs(0)))
      >>> type(model).__name__, type(model.blocks[0]).__name__
      ('ResNet', 'ResNetBlock')
    """
    check_model(name)
    if name not in _NNX:
        raise ValueError(f"{name} is a linen model: build it with create.")
    strategy = Store() if strategy is None else check_strategies((strategy,), 1)[0]
    model = _NNX[name][0](num_classes=num_classes, dtype=dtype, rngs=rngs)
    return wrap_nnx_blocks(model, strategy)


def wrap_nnx_blocks(model: Any, strategy: Strategy) -> Any:
    """Wraps the blocks of a plain NNX model (``model.blocks``) in place, as a user would.

    Under ``Lean`` and ``Offload`` the model is wrapped too (see ``_outside_blocks``).
    """
    from jaxoffload import nnx as offload_nnx

    for block in model.blocks:
        offload_nnx.wrap(block, strategy)
    outside = _outside_blocks(strategy)
    if outside is not None:
        offload_nnx.wrap(model, outside)
    return model


def nnx_block_class(name: str) -> type:
    """The block class of a plain NNX model: what ``jaxoffload.plan(..., blocks=)`` selects."""
    check_model(name)
    if name not in _NNX:
        raise ValueError(f"{name} is not an NNX model; choose one of {', '.join(_NNX)}.")
    return _NNX[name][1]


def plannable_model(
    name: str, *, dtype: Any = jnp.float32, num_classes: int | None = None
) -> nn.Module:
    """A plain-Flax model whose block class is :func:`jaxoffload.linen.plannable`, for :func:`jaxoffload.plan`.

    Unplanned, it is the plain model; ``plan.apply(model)`` gives it a plan.
    ``num_classes=None`` means :func:`default_num_classes`.

    Example:
      >>> model = plannable_model("flax-resnet18", num_classes=10)
      >>> model.block_cls.__name__
      'ResNetBlock'
    """
    check_model(name)
    if name not in _PLAIN:
        raise ValueError(
            f"{name} is a reference model, which takes strategies per block directly; plan one "
            f"of the plain-Flax models ({', '.join(_PLAIN)})."
        )
    model, block = _PLAIN[name]
    base = model.func if isinstance(model, functools.partial) else model
    return model(
        **{_BLOCK_ATTRIBUTE[base]: offload_linen.plannable(block)},
        num_classes=default_num_classes(name) if num_classes is None else num_classes,
        dtype=dtype,
    )
