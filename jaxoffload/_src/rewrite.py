"""Lean rules found in unmodified code: a traced function's ReLUs and max-pools, replaced.

A user's block calls ``flax.linen.relu`` and ``flax.linen.max_pool``. Their jax
rules keep more than the backward pass needs: the ReLU keeps a mask of its
input, which the next layer does not keep, and the max-pool's gradient makes
XLA:GPU write int32 index tensors of the input's size. :func:`with_lean_rules`
traces a function and runs it again with :mod:`jaxoffload._src.layers`' rules in
their place, so that the rest (which values to keep, see :mod:`jaxoffload._src.cut`)
works on the leaner program. Everything else runs as traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxoffload._src import jaxprs, layers

__all__ = ["Rewrite", "with_lean_rules"]

_CALLS_TO_INLINE = ("jit", "pjit")
# Readers that keep their input for the backward pass (or an output, which the
# next layer keeps): a ReLU whose output one of them reads needs no mask of its own.
_KEEPS_ITS_INPUT = {"conv_general_dilated", "dot_general", "reduce_window_max", "output"}


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """One place where a lean rule replaced jax's, or could not.

    Attributes:
      where: the layer, as its name stack (``Block_0/Conv_1``).
      rule: the rule, such as ``"relu"``, ``"max_pool"`` or ``"relu_max_pool"``.
      applied: whether it replaced jax's rule.
      why: for a rule not applied, the reason.
    """

    where: str
    rule: str
    applied: bool = True
    why: str = ""

    def __str__(self) -> str:
        status = "lean rule" if self.applied else f"jax's rule ({self.why})"
        return f"{self.where or '(top level)'}: {self.rule}, {status}"


def with_lean_rules(fun: Callable[..., Any], notes: list[Rewrite] | None = None):
    """``fun``, with jax.nn.relu and max-pools computed by :mod:`jaxoffload._src.layers`' rules.

    The outputs are ``fun``'s; gradients are too, except that ties in a
    max-pool window send the gradient to the window's first maximum.

    Args:
      fun: a function of arrays and pytrees of arrays.
      notes: a list to which each rule applied or refused is appended.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> notes = []
      >>> f = with_lean_rules(lambda x: nn.max_pool(nn.relu(x), (2, 2), (2, 2)), notes)
      >>> f(jnp.ones((1, 4, 4, 1))).shape, [n.rule for n in notes]
      ((1, 2, 2, 1), ['relu', 'relu_max_pool'])
    """

    @functools.wraps(fun)
    def rewritten(*args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        # Python scalars and other non-arrays (a `train` flag) stay Python values.
        arrays = [n for n, x in enumerate(leaves) if _is_array(x)]

        def traced(*values):
            full = list(leaves)
            for n, x in zip(arrays, values):
                full[n] = x
            args, kwargs = jax.tree.unflatten(tree, full)
            return fun(*args, **kwargs)

        values = [leaves[n] for n in arrays]
        closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(*values)
        out = _run(closed.jaxpr, closed.consts, values, [] if notes is None else notes)
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return rewritten


def _is_array(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _run(jaxpr, consts, args, notes: list[Rewrite], prefix: str = "") -> list[Any]:
    readers: dict[Any, list[str]] = {}  # variable -> the primitives that read it
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, jex_core.Var):
                readers.setdefault(v, []).append(eqn.primitive.name)
    for v in jaxpr.outvars:
        if isinstance(v, jex_core.Var):
            readers.setdefault(v, []).append("output")
    uses = {v: len(r) for v, r in readers.items()}
    relu_inputs: dict[Any, Any] = {}  # a ReLU's output variable -> its input value

    def run(eqn, invals):
        where = "/".join(s for s in (prefix, str(eqn.source_info.name_stack)) if s)
        with jax.named_scope(where) if where else contextlib.nullcontext():
            if eqn.primitive.name in _CALLS_TO_INLINE:
                inner = eqn.params["jaxpr"]
                return _run(inner.jaxpr, inner.consts, invals, notes, where)
            if _is_relu(eqn) and _KEEPS_ITS_INPUT & set(readers.get(eqn.outvars[0], ())):
                notes.append(Rewrite(where, "relu"))
                relu_inputs[eqn.outvars[0]] = invals[0]
                return [layers.relu(invals[0])]
            if eqn.primitive.name == "reduce_window_max":
                return [_max_pool(eqn, invals[0], relu_inputs, uses, where, notes)]
            if _is_relu(eqn):
                why = "no reader keeps its output, so jax's one-byte mask is smaller"
                notes.append(Rewrite(where, "relu", applied=False, why=why))
            return jaxprs.bind(eqn, invals)

    return jaxprs.evaluate(jaxpr, consts, args, run)


def _is_relu(eqn) -> bool:
    """Whether ``eqn`` is ``jax.nn.relu`` (flax's ``nn.relu``): a custom JVP around ``max(x, 0)``."""
    if eqn.primitive.name != "custom_jvp_call" or len(eqn.invars) != 1:
        return False
    inner = eqn.params["call_jaxpr"].jaxpr
    while len(inner.eqns) == 1 and inner.eqns[0].primitive.name in _CALLS_TO_INLINE:
        inner = inner.eqns[0].params["jaxpr"].jaxpr
    if len(inner.eqns) != 1 or inner.eqns[0].primitive.name != "max":
        return False
    a, b = inner.eqns[0].invars
    zero = [v for v in (a, b) if isinstance(v, jex_core.Literal) and np.ndim(v.val) == 0]
    x = eqn.invars[0].aval
    return len(zero) == 1 and zero[0].val == 0 and jax.numpy.issubdtype(x.dtype, np.floating)


def _max_pool(eqn, x, relu_inputs, uses, where, notes):
    """A ``reduce_window_max`` through the lean rule, fused with the ReLU before it if it can be."""
    p = eqn.params
    spatial = slice(1, -1)
    why = ""
    if len(p["window_dimensions"]) < 3:
        why = "no batch and feature dimensions"
    elif (p["window_dimensions"][0], p["window_dimensions"][-1]) != (1, 1) or (
        p["window_strides"][0],
        p["window_strides"][-1],
    ) != (1, 1):
        why = "the window spans the batch or feature dimension"
    elif any(d != 1 for d in (*p["base_dilation"], *p["window_dilation"])):
        why = "dilated"
    elif (tuple(p["padding"][0]), tuple(p["padding"][-1])) != ((0, 0), (0, 0)):
        why = "padded batch or feature dimension"
    elif (
        layers.Pool.of(
            x, p["window_dimensions"][spatial], p["window_strides"][spatial], p["padding"][spatial]
        )
        is None
    ):
        why = "a window wholly in the padding, or an integer dtype"
    if why:
        notes.append(Rewrite(where, "max_pool", applied=False, why=why))
        return jaxprs.bind(eqn, [x])[0]
    args = p["window_dimensions"][spatial], p["window_strides"][spatial], p["padding"][spatial]
    source = eqn.invars[0]
    if source in relu_inputs and uses.get(source) == 1:
        # The ReLU's output feeds only this pool: one rule for both keeps a
        # one-byte index instead of the ReLU's output.
        notes.append(Rewrite(where, "relu_max_pool"))
        return layers.relu_max_pool(relu_inputs[source], *args)
    notes.append(Rewrite(where, "max_pool"))
    return layers.max_pool(x, *args)
