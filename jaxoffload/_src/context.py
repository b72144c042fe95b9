"""The ambient state of jaxoffload: every value that a call sees without a signature carrying it.

Each piece is here, thread-local, with the reason it cannot be an argument:
the code that reads it runs inside a user's Flax model or a jax trace, whose
signatures are the user's.

- **The chain** of the wrapped calls of one trace, in call order
  (:func:`chain_of_trace`): an ``Offload`` window ties a call's transfers to
  calls made later in the same trace, by code between them that is the user's.
- **The recorder** of traced calls (:func:`recording_calls`), which
  ``offloaded_calls`` fills while it traces a user's training step.
- **Host placement off** (:func:`host_placement_off`), under which traced
  ``Offload`` calls keep their residuals on the device: the twin that a memory
  report compiles to tell what the copies free.
- **The active plan** (:func:`active_plan`), from which the plannable blocks of
  a linen model pick their strategies while the planned model runs: Flax
  builds the blocks inside the user's ``__call__``.
- **The recorder of planned NNX blocks** (:func:`recording_paths`), which tells
  the planner the order in which the blocks are called.
- **Said once** (:func:`say_once`): warnings given once per process.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "SAID",
    "active_plan",
    "chain_of_trace",
    "host_placement_is_off",
    "host_placement_off",
    "plan_in_effect",
    "record_call",
    "record_path",
    "recording_calls",
    "recording_paths",
    "say_once",
]

_local = threading.local()
SAID: set[str] = set()  # the keys say_once has said in this process


@contextlib.contextmanager
def _set(name: str, value: Any) -> Iterator[Any]:
    outer = getattr(_local, name, None)
    setattr(_local, name, value)
    try:
        yield value
    finally:
        setattr(_local, name, outer)


def chain_of_trace(trace: Any, new: Callable[[Any], Any]) -> Any:
    """The chain of wrapped calls of ``trace``: the current one, or ``new(trace)`` for a new trace."""
    chain = getattr(_local, "chain", None)
    if chain is None or chain.trace != trace:
        chain = _local.chain = new(trace)
    return chain


def recording_calls() -> contextlib.AbstractContextManager[list[Any]]:
    """Inside it, every traced wrapped call appends its description to the list it yields."""
    return _set("calls", [])


def record_call(describe: Callable[[], Any]) -> None:
    """Appends ``describe()`` to the innermost recording, if one is open (else calls nothing)."""
    calls = getattr(_local, "calls", None)
    if calls is not None:
        calls.append(describe())


def host_placement_off() -> contextlib.AbstractContextManager[bool]:
    """Inside it, traced ``Offload`` calls keep every residual on the device (the twin)."""
    return _set("placement_off", True)


def host_placement_is_off() -> bool:
    return bool(getattr(_local, "placement_off", False))


def plan_in_effect(plan: Any) -> contextlib.AbstractContextManager[Any]:
    """Inside it, plannable linen blocks take their strategies from ``plan``."""
    return _set("plan", plan)


def active_plan() -> Any:
    """The plan in effect, or ``None``."""
    return getattr(_local, "plan", None)


def recording_paths() -> contextlib.AbstractContextManager[list[str]]:
    """Inside it, each planned NNX block that is called appends its path to the list it yields."""
    return _set("paths", [])


def record_path(path: str) -> None:
    paths = getattr(_local, "paths", None)
    if paths is not None:
        paths.append(path)


def say_once(key: str) -> bool:
    """Whether ``key`` is new to this process; marks it said."""
    if key in SAID:
        return False
    SAID.add(key)
    return True
