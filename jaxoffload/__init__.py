"""jaxoffload: train CNNs whose activations do not fit in GPU memory.

This module, :mod:`jaxoffload.linen`, :mod:`jaxoffload.nnx` and
:mod:`jaxoffload.strategies` are the public API; ``jaxoffload._src`` is internal.
"""

import importlib
import typing

__version__ = "0.2.0"

# Where each public name comes from. A name is imported when it is first read (PEP 562),
# not by `import jaxoffload`: Python runs this module before any other of the package,
# `python -m jaxoffload` and the `jaxoffload` command included, and importing jax here
# (seconds on a GPU machine) would make the command wait that long to refuse a mistyped
# flag. The imports under TYPE_CHECKING say the same to type checkers;
# tests/test_package.py checks that the two agree.
_SOURCES = {
    "linen": "jaxoffload.linen",
    "nnx": "jaxoffload.nnx",
    "strategies": "jaxoffload.strategies",
    "offloaded_calls": "jaxoffload._src.calls",
    "residuals_per_call": "jaxoffload._src.calls",
    "saved_residuals": "jaxoffload._src.calls",
    "NoPlanFits": "jaxoffload._src.errors",
    "OffloadDroppedError": "jaxoffload._src.errors",
    "OffloadWarning": "jaxoffload._src.errors",
    "Fit": "jaxoffload._src.planner",
    "Plan": "jaxoffload._src.planner",
    "largest_size": "jaxoffload._src.planner",
    "plan": "jaxoffload._src.planner",
    "MemoryReport": "jaxoffload._src.report",
    "SpatialGather": "jaxoffload._src.report",
    "memory_report": "jaxoffload._src.report",
    "spatial_gathers": "jaxoffload._src.report",
    "OffloadedCall": "jaxoffload._src.residuals",
    "Residual": "jaxoffload._src.residuals",
    "compiler_options": "jaxoffload._src.xla_options",
    "Lean": "jaxoffload._src.strategies",
    "Offload": "jaxoffload._src.strategies",
    "Remat": "jaxoffload._src.strategies",
    "Store": "jaxoffload._src.strategies",
    "Strategy": "jaxoffload._src.strategies",
    "Overlap": "jaxoffload._src.overlap",
    "measure_overlap": "jaxoffload._src.overlap",
    "overlap_in_trace": "jaxoffload._src.overlap",
    "offload": "jaxoffload._src.transform",
    "wrap": "jaxoffload._src.transform",
}

if typing.TYPE_CHECKING:
    from jaxoffload import linen as linen
    from jaxoffload import nnx as nnx
    from jaxoffload import strategies as strategies
    from jaxoffload._src.calls import offloaded_calls as offloaded_calls
    from jaxoffload._src.calls import residuals_per_call as residuals_per_call
    from jaxoffload._src.calls import saved_residuals as saved_residuals
    from jaxoffload._src.errors import NoPlanFits as NoPlanFits
    from jaxoffload._src.errors import OffloadDroppedError as OffloadDroppedError
    from jaxoffload._src.errors import OffloadWarning as OffloadWarning
    from jaxoffload._src.overlap import Overlap as Overlap
    from jaxoffload._src.overlap import measure_overlap as measure_overlap
    from jaxoffload._src.overlap import overlap_in_trace as overlap_in_trace
    from jaxoffload._src.planner import Fit as Fit
    from jaxoffload._src.planner import Plan as Plan
    from jaxoffload._src.planner import largest_size as largest_size
    from jaxoffload._src.planner import plan as plan
    from jaxoffload._src.report import MemoryReport as MemoryReport
    from jaxoffload._src.report import SpatialGather as SpatialGather
    from jaxoffload._src.report import memory_report as memory_report
    from jaxoffload._src.report import spatial_gathers as spatial_gathers
    from jaxoffload._src.residuals import OffloadedCall as OffloadedCall
    from jaxoffload._src.residuals import Residual as Residual
    from jaxoffload._src.strategies import Lean as Lean
    from jaxoffload._src.strategies import Offload as Offload
    from jaxoffload._src.strategies import Remat as Remat
    from jaxoffload._src.strategies import Store as Store
    from jaxoffload._src.strategies import Strategy as Strategy
    from jaxoffload._src.transform import offload as offload
    from jaxoffload._src.transform import wrap as wrap
    from jaxoffload._src.xla_options import compiler_options as compiler_options

__all__ = [
    "Fit",
    "Lean",
    "MemoryReport",
    "NoPlanFits",
    "Offload",
    "OffloadDroppedError",
    "OffloadWarning",
    "OffloadedCall",
    "Overlap",
    "Plan",
    "Remat",
    "Residual",
    "SpatialGather",
    "Store",
    "Strategy",
    "compiler_options",
    "largest_size",
    "linen",
    "measure_overlap",
    "memory_report",
    "nnx",
    "offload",
    "offloaded_calls",
    "overlap_in_trace",
    "plan",
    "residuals_per_call",
    "saved_residuals",
    "spatial_gathers",
    "wrap",
]


def __getattr__(name: str):
    if name in _SOURCES:
        module = importlib.import_module(_SOURCES[name])
        value = module if module.__name__ == f"jaxoffload.{name}" else getattr(module, name)
        globals()[name] = value  # read once: the next read finds it here
        return value
    # Removed names that a user of an earlier version may still write.
    if name == "schedule":
        raise AttributeError(
            "jaxoffload.schedule was removed in 0.2.0: a context around a call that was "
            "already compiled changed nothing. The window is now part of the strategy, fixed "
            "where a call is wrapped: write jaxoffload.offload(f, window=2), or "
            "jaxoffload.Offload(window=2) for jaxoffload.wrap and jaxoffload.linen.wrap."
        )
    raise AttributeError(f"module 'jaxoffload' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
