"""Strategies for Flax NNX: ``wrap`` and ``offload``, shaped like ``nnx.remat``."""

from jaxoffload._src.nnx import offload as offload
from jaxoffload._src.nnx import wrap as wrap

__all__ = ["offload", "wrap"]
