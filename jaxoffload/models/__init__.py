"""Reference CNNs whose blocks each take a memory strategy."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxoffload.models.common import BLOCK_STRATEGIES as BLOCK_STRATEGIES
from jaxoffload.models.common import LEAN_STRATEGIES as LEAN_STRATEGIES
from jaxoffload.models.common import OFFLOAD_STRATEGIES as OFFLOAD_STRATEGIES
from jaxoffload.models.common import PLANNED_STRATEGIES as PLANNED_STRATEGIES
from jaxoffload.models.common import SCHEDULED_STRATEGIES as SCHEDULED_STRATEGIES
from jaxoffload.models.common import first_k as first_k
from jaxoffload.models.common import wrap_block as wrap_block
from jaxoffload.models.resnet import RESNETS
from jaxoffload.models.resnet import STEM_STRATEGIES as STEM_STRATEGIES
from jaxoffload.models.resnet import BasicBlock as BasicBlock
from jaxoffload.models.resnet import BottleneckBlock as BottleneckBlock
from jaxoffload.models.resnet import ResNet as ResNet
from jaxoffload.models.vgg import VGG as VGG
from jaxoffload.models.vgg import VGG11 as VGG11
from jaxoffload.models.vgg import VGG13 as VGG13
from jaxoffload.models.vgg import VGG16 as VGG16
from jaxoffload.models.vgg import VGG19 as VGG19
from jaxoffload.models.vgg import ConvBlock as ConvBlock
from jaxoffload.models.vgg import num_conv_blocks

_VGGS = {"vgg11": VGG11, "vgg13": VGG13, "vgg16": VGG16, "vgg19": VGG19}

MODEL_NAMES = tuple(
    sorted([*_VGGS, *(f"{name}_bn" for name in _VGGS), *RESNETS], key=lambda n: (n[:3], len(n), n))
)

__all__ = [
    "BLOCK_STRATEGIES",
    "LEAN_STRATEGIES",
    "MODEL_NAMES",
    "OFFLOAD_STRATEGIES",
    "PLANNED_STRATEGIES",
    "SCHEDULED_STRATEGIES",
    "STEM_STRATEGIES",
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
    "first_k",
    "num_blocks",
    "wrap_block",
]


def num_blocks(name: str) -> int:
    """How many blocks (each taking one strategy) the named model has."""
    _check_name(name)
    if name in RESNETS:
        return sum(RESNETS[name][0])
    return num_conv_blocks(_VGGS[name.removesuffix("_bn")])


def create(
    name: str,
    *,
    strategy: str | tuple[str, ...] = "none",
    dtype: Any = jnp.float32,
    num_classes: int = 1000,
    offload_window: int = 1,
) -> nn.Module:
    """Builds a reference model by name, with one strategy for all blocks or one each.

    Args:
      name: one of ``MODEL_NAMES``, e.g. ``"vgg19"``, ``"vgg16_bn"``, ``"resnet50"``.
      strategy: a key of ``BLOCK_STRATEGIES``, or a tuple with one per block.
      dtype: the compute dtype; parameters are float32.
      num_classes: classifier outputs.
      offload_window: the :class:`jaxoffload.schedule` window of offloading blocks.

    Returns:
      A Flax module called as ``model.apply(variables, x, train)``.

    Example:
      >>> model = create("resnet18", strategy="remat", num_classes=10)
      >>> len(model.block_strategies)
      8
    """
    _check_name(name)
    n = num_blocks(name)
    strategies = (strategy,) * n if isinstance(strategy, str) else tuple(strategy)
    if name in RESNETS:
        stages, block = RESNETS[name]
        return ResNet(stages, block, num_classes, dtype, strategies, offload_window)
    return VGG(
        _VGGS[name.removesuffix("_bn")],
        num_classes=num_classes,
        dtype=dtype,
        block_strategies=strategies,
        norm=name.endswith("_bn"),
        offload_window=offload_window,
    )


def _check_name(name: str) -> None:
    if name not in MODEL_NAMES:
        raise ValueError(f"Unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}.")
