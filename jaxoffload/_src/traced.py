"""One call of a wrapped function, traced once: what it computes, and the wrapped calls in it.

A wrapped call is traced once (a Flax Module called twice would draw its RNGs twice), and
everything after replays that trace: choosing the residuals, costing the call, running it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxoffload._src.argnums import Argnums, is_static, named_after, positional_names

__all__ = [
    "CALL_NAME",
    "TracedCall",
    "has_inner_calls",
    "is_inner_call",
    "is_wrapped_call",
    "trace_call",
]

# The name of the custom_vjp of every wrapped call, by which an enclosing
# wrapped call tells it apart from the code around it.
CALL_NAME = "jaxoffload_call"
# Calls that keep their own strategy inside an enclosing wrapped call.
_INNER_CALLS = ("checkpoint", "remat", "remat2")


@dataclasses.dataclass(frozen=True)
class TracedCall:
    """One call of a wrapped function, traced once, and a replay of its trace.

    Attributes:
      replay: ``(dynamic, kwargs) -> outputs``: the traced call, run again.
      dynamic: the positional arguments that are not static.
      kwargs: the keyword arguments that hold arrays.
      device_leaves: the positions, among the flat leaves of
        ``(dynamic, kwargs)``, of those kept on the device, each with why.
      closed: the call's closed jaxpr.
      out_tree: the pytree structure of its outputs.
    """

    replay: Callable[..., Any]
    dynamic: tuple
    kwargs: dict
    device_leaves: dict[int, str]
    closed: Any
    out_tree: Any


def trace_call(fun: Callable[..., Any], argnums: Argnums, args: tuple, kwargs: dict) -> TracedCall:
    """Traces ``fun(*args, **kwargs)`` once; what follows replays the trace.

    A Flax Module called twice would draw its RNGs twice, and initialise other
    values: ``fun`` runs once, here.
    """
    # Arguments that hold no arrays (``train=True``, positional or keyword), and NumPy
    # bools, are static, as jit's static arguments are: traced, a flag could not steer
    # the function.
    argnums = argnums.with_static_values(args)
    dynamic, rebuild, device = argnums.split(args, kwargs, positional_names(fun))
    static_kwargs = {k: v for k, v in kwargs.items() if is_static(v)}
    kwargs = {k: v for k, v in kwargs.items() if k not in static_kwargs}

    def call(*dynamic, **kwargs):
        args, kwargs = rebuild(dynamic, kwargs)
        return fun(*args, **kwargs, **static_kwargs)

    # Flat positions of the leaves kept on the device among (dynamic, kwargs), and why.
    sizes = [len(jax.tree.leaves(a)) for a in dynamic]
    starts = np.cumsum([0, *sizes])
    device_leaves = {int(starts[n]) + k: why for n, why in device.items() for k in range(sizes[n])}
    positions = [i for i in range(len(args)) if i not in {j % len(args) for j in argnums.static}]
    call = named_after(call, fun, positions, kwargs)
    try:
        closed, out_shape = jax.make_jaxpr(call, return_shape=True)(*dynamic, **kwargs)
    except jax.errors.ConcretizationTypeError as e:
        e.add_note(
            f"jaxoffload traces {call.__qualname__} once, with its array arguments abstract, as "
            "jax.jit does: an argument that steers Python control flow (`if train:`) must be "
            "static. Pass it as a Python value (train=True), or name its position in "
            "static_argnums."
        )
        raise
    out_tree = jax.tree.structure(out_shape)
    run = jex_core.jaxpr_as_fun(closed)

    def replay(dynamic, kwargs):
        return jax.tree.unflatten(out_tree, run(*jax.tree.leaves((dynamic, kwargs))))

    return TracedCall(replay, dynamic, kwargs, device_leaves, closed, out_tree)


def has_inner_calls(traced: TracedCall) -> bool:
    """Whether the call holds wrapped calls, or ``jax.checkpoint`` calls, with strategies of their own."""
    return any(is_inner_call(e) for e in traced.closed.jaxpr.eqns)


def is_inner_call(eqn) -> bool:
    """Whether ``eqn`` is a wrapped call (or a ``jax.checkpoint``) with a strategy of its own."""
    return eqn.primitive.name in _INNER_CALLS or is_wrapped_call(eqn)


def is_wrapped_call(eqn) -> bool:
    """Whether ``eqn`` is a wrapped call: a jaxoffload one, not a ``jax.checkpoint``."""
    if not eqn.primitive.name.startswith("custom_vjp_call"):
        return False
    # jax names the function in the equation, or only in its jaxpr's debug info.
    called = eqn.params.get("name")
    if called is None:
        jaxpr = getattr(eqn.params.get("call_jaxpr"), "jaxpr", None)
        called = getattr(getattr(jaxpr, "debug_info", None), "func_name", None)
    return called == CALL_NAME
