"""What a block keeps for its backward pass, as small frozen values: ``Store``, ``Lean``,
``Remat`` and ``Offload``, and their JSON form."""

from jaxoffload._src.strategies import Lean as Lean
from jaxoffload._src.strategies import Offload as Offload
from jaxoffload._src.strategies import Remat as Remat
from jaxoffload._src.strategies import Store as Store
from jaxoffload._src.strategies import Strategy as Strategy
from jaxoffload._src.strategies import check_strategy as check_strategy
from jaxoffload._src.strategies import strategy_from_dict as strategy_from_dict
from jaxoffload._src.strategies import strategy_to_dict as strategy_to_dict

__all__ = [
    "Lean",
    "Offload",
    "Remat",
    "Store",
    "Strategy",
    "check_strategy",
    "strategy_from_dict",
    "strategy_to_dict",
]
