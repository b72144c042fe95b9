"""Strategies for Flax linen Modules: ``wrap`` and ``offload``, shaped like ``nn.remat``."""

from jaxoffload._src.linen import offload as offload
from jaxoffload._src.linen import plannable as plannable
from jaxoffload._src.linen import wrap as wrap

__all__ = ["offload", "plannable", "wrap"]
