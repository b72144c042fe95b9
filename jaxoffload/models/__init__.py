"""Reference CNNs whose blocks each take a memory strategy."""

from jaxoffload.models.common import BLOCK_STRATEGIES as BLOCK_STRATEGIES
from jaxoffload.models.common import first_k as first_k
from jaxoffload.models.common import wrap_block as wrap_block
from jaxoffload.models.vgg import VGG as VGG
from jaxoffload.models.vgg import VGG11 as VGG11
from jaxoffload.models.vgg import VGG13 as VGG13
from jaxoffload.models.vgg import VGG16 as VGG16
from jaxoffload.models.vgg import VGG19 as VGG19
from jaxoffload.models.vgg import ConvBlock as ConvBlock

__all__ = [
    "BLOCK_STRATEGIES",
    "VGG",
    "VGG11",
    "VGG13",
    "VGG16",
    "VGG19",
    "ConvBlock",
    "first_k",
    "wrap_block",
]
