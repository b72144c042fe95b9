"""jaxoffload: train CNNs whose activations do not fit in GPU memory."""

__version__ = "0.2.0"

from jaxoffload import linen as linen
from jaxoffload import nnx as nnx
from jaxoffload.planner import NoPlanFits as NoPlanFits
from jaxoffload.planner import Plan as Plan
from jaxoffload.planner import plan as plan
from jaxoffload.report import MemoryReport as MemoryReport
from jaxoffload.report import OffloadDroppedError as OffloadDroppedError
from jaxoffload.report import OffloadWarning as OffloadWarning
from jaxoffload.report import memory_report as memory_report
from jaxoffload.strategies import Lean as Lean
from jaxoffload.strategies import Offload as Offload
from jaxoffload.strategies import Remat as Remat
from jaxoffload.strategies import Store as Store
from jaxoffload.strategies import Strategy as Strategy
from jaxoffload.transform import OffloadedCall as OffloadedCall
from jaxoffload.transform import Residual as Residual
from jaxoffload.transform import offload as offload
from jaxoffload.transform import offloaded_calls as offloaded_calls
from jaxoffload.transform import residuals_per_call as residuals_per_call
from jaxoffload.transform import saved_residuals as saved_residuals
from jaxoffload.transform import wrap as wrap

__all__ = [
    "Lean",
    "MemoryReport",
    "NoPlanFits",
    "Offload",
    "OffloadDroppedError",
    "OffloadWarning",
    "OffloadedCall",
    "Plan",
    "Remat",
    "Residual",
    "Store",
    "Strategy",
    "linen",
    "memory_report",
    "nnx",
    "offload",
    "offloaded_calls",
    "plan",
    "residuals_per_call",
    "saved_residuals",
    "wrap",
]


def __getattr__(name: str):
    # Removed names that a user of an earlier version may still write.
    if name == "schedule":
        raise AttributeError(
            "jaxoffload.schedule was removed in 0.2.0: a context around a call that was "
            "already compiled changed nothing. The window is now part of the strategy, fixed "
            "where a call is wrapped: write jaxoffload.offload(f, window=2), or "
            "jaxoffload.Offload(window=2) for jaxoffload.wrap and jaxoffload.linen.wrap."
        )
    raise AttributeError(f"module 'jaxoffload' has no attribute {name!r}")
