"""Jaxpr utilities: bytes and FLOPs of traced values, liveness, sub-programs, one interpreter,
and the forward pass of ``jax.vjp`` traced with its residuals."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

__all__ = [
    "VjpTrace",
    "bind",
    "debug_info",
    "eqn_flops",
    "equations",
    "evaluate",
    "fingerprint",
    "format_bytes",
    "live_vars",
    "nbytes",
    "struct_of",
    "sub_function",
    "trace_vjp",
    "uses_after",
]


def nbytes(aval: Any, *, per_device: bool = False) -> int:
    """The bytes of an abstract value (0 for tokens and other non-arrays).

    With ``per_device``, the bytes of one device's shard, where the value's
    type carries a sharding (arrays under an Explicit mesh).
    """
    shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    sharding = getattr(aval, "sharding", None)
    if per_device and isinstance(sharding, jax.sharding.NamedSharding) and any(sharding.spec):
        shape = sharding.shard_shape(shape)
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes, such as PRNG keys
        itemsize = getattr(dtype, "itemsize", 8)
    return int(np.prod(shape, dtype=np.int64)) * int(itemsize)


def format_bytes(n: float) -> str:
    """Bytes as a person reads them: exact below a MiB, then MiB, and GiB from a quarter of one."""
    if abs(n) < 2**20:
        return f"{round(n):,} B"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**28 else f"{n / 2**20:.1f} MiB"


def struct_of(aval: Any, dtype: Any = None, *, rebind: bool = False) -> jax.ShapeDtypeStruct:
    """``aval``'s shape, with ``dtype`` (its own by default), and its sharding where it has one.

    Under ``jax.set_mesh`` with Explicit axes, a struct without a sharding is
    replicated, and a ``custom_vjp`` then refuses batch-sharded cotangents.
    With ``rebind``, the sharding's spec is put on the concrete mesh in
    context, which ``jnp.zeros(..., device=...)`` needs.
    """
    dtype = aval.dtype if dtype is None else dtype
    sharding = getattr(aval, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = jax.sharding.get_mesh() if rebind else None  # outside jit only
        if mesh is not None and not mesh.empty:
            sharding = jax.sharding.NamedSharding(mesh, sharding.spec)
            return jax.ShapeDtypeStruct(aval.shape, dtype, sharding=sharding)
        if not rebind and any(sharding.spec):
            return jax.ShapeDtypeStruct(aval.shape, dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(aval.shape, dtype)


def eqn_flops(eqn: Any) -> int:
    """2 × the multiply-adds of a matrix product or convolution, of those nested in calls too."""
    name = eqn.primitive.name
    if name == "dot_general":
        (contracting, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        out = eqn.outvars[0].aval.shape
        return 2 * math.prod(out) * math.prod(lhs[d] for d in contracting)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        out = eqn.outvars[0].aval.shape
        out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
        return 2 * math.prod(out) * (math.prod(rhs) // out_features)
    return sum(eqn_flops(e) for sub in jex_core.jaxprs_in_params(eqn.params) for e in sub.eqns)


def equations(jaxpr: Any) -> Iterator[Any]:
    """Every equation of ``jaxpr`` (open or closed), those of the jaxprs nested in it too."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for sub in jex_core.jaxprs_in_params(eqn.params):
            yield from equations(sub)


def live_vars(jaxpr: Any) -> set:
    """Variables that the outputs (or an effectful equation) depend on."""
    live = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
    return live


def uses_after(jaxpr: Any) -> Callable[[Any, int], bool]:
    """``used(v, n)``: whether variable ``v`` is read by equation ``n`` or later, or is an output."""
    last = {v: len(jaxpr.eqns) for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    for n, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jex_core.Var):
                last[v] = max(last.get(v, -1), n)
    return lambda v, n: last.get(v, -1) >= n


def debug_info(invars: Sequence[Any]) -> Any:
    """The debug info of a jaxpr that jaxoffload builds from parts of a traced one."""
    return jex_core.DebugInfo("jaxoffload", "<residuals>", ("",) * len(invars), None)


# Constants up to this many elements are told apart by value; larger ones by identity.
_CONSTANT_BY_VALUE = 2**16


def fingerprint(closed: Any) -> tuple | None:
    """A key equal for closed jaxprs that compute the same; ``None`` if a constant is a tracer.

    The program's text names its variables in order, so two traces of one
    function print alike. A large constant counts by identity: whatever is
    keyed by it must keep it alive. A tracer of an enclosing trace is never a
    key: it dies with that trace. The context mesh counts too: the text names a
    sharded axis (``f32[1,32@space,32,4]``) but not its size, and a program traced
    under one mesh does not run under another.
    """
    consts = []
    for c in closed.consts:
        if isinstance(c, jax.core.Tracer):
            return None
        if np.size(c) <= _CONSTANT_BY_VALUE:
            array = np.asarray(c)
            consts.append((array.shape, str(array.dtype), array.tobytes()))
        else:
            consts.append(("id", id(c)))
    return str(closed.jaxpr), tuple(consts), repr(jax.sharding.get_abstract_mesh())


def sub_function(jaxpr, consts, invars, outvars) -> Callable[..., list[Any]]:
    """The part of ``jaxpr`` that computes ``outvars`` from ``invars`` (and its constants)."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    keep, todo = set(), [v for v in outvars if isinstance(v, jex_core.Var)]
    known = set(invars) | set(jaxpr.constvars)
    while todo:
        v = todo.pop()
        if v in known or v in keep:
            continue
        keep.add(v)
        todo.extend(u for u in producer[v].invars if isinstance(u, jex_core.Var))
    eqns = [e for e in jaxpr.eqns if any(v in keep for v in e.outvars)]
    sub = jex_core.Jaxpr(
        list(jaxpr.constvars), list(invars), list(outvars), eqns, jaxpr.effects, debug_info(invars)
    )
    return jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(sub, list(consts)))


def bind(eqn: Any, invals: list[Any]) -> list[Any]:
    """Runs one traced equation on ``invals``, as ``jax.core.eval_jaxpr`` would: its outputs, as a list."""
    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return outs if eqn.primitive.multiple_results else [outs]


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    run: Callable[[Any, list[Any]], Sequence[Any]] = bind,
    steps: Sequence[Any] | None = None,
) -> list[Any]:
    """Runs ``jaxpr`` on ``args``, each step by ``run(step, invals) -> outvals``.

    The steps are the jaxpr's equations, or ``steps``: anything with
    ``invars`` and ``outvars`` over its variables (a group of equations, say).
    """
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for step in jaxpr.eqns if steps is None else steps:
        env.update(zip(step.outvars, run(step, [read(v) for v in step.invars])))
    return [read(v) for v in jaxpr.outvars]


@dataclasses.dataclass(frozen=True)
class VjpTrace:
    """The forward pass of ``jax.vjp(fun)``, traced with its residuals.

    Attributes:
      jaxpr: the forward pass, whose outputs are ``fun``'s flat outputs, then
        the residuals (the leaves of the vjp function).
      consts: its constants.
      outputs: its first outputs: ``fun``'s.
      residuals: the rest.
      used: per residual, whether the backward pass really reads it.
      backward: the backward pass, from the residuals and the cotangents.
      vjp_tree: the pytree structure of the vjp function.
      out_tree: the pytree structure of ``fun``'s outputs.
    """

    jaxpr: Any
    consts: list[Any]
    outputs: list[Any]
    residuals: list[Any]
    used: list[bool]
    backward: Any
    vjp_tree: Any
    out_tree: Any

    @property
    def needed(self) -> list[Any]:
        """The residuals that the backward pass reads, as variables of ``jaxpr``."""
        return [a for a, u in zip(self.residuals, self.used) if u and isinstance(a, jex_core.Var)]


def trace_vjp(fun: Callable[..., Any], *args: Any) -> VjpTrace:
    """Traces ``jax.vjp(fun, *args)``'s forward pass, and which residuals its backward pass reads.

    ``jax.vjp`` can keep values that the backward pass then ignores; keeping
    them would cost memory (and moving them two transfers) for nothing.
    """
    trees = {}

    def forward_and_residuals(*args):
        out, vjp_fun = jax.vjp(fun, *args)
        leaves, trees["vjp"] = jax.tree.flatten(vjp_fun)
        trees["out"] = jax.tree.structure(out)
        return jax.tree.leaves(out), leaves

    closed = jax.make_jaxpr(forward_and_residuals)(*args)
    jaxpr = closed.jaxpr
    num_out = trees["out"].num_leaves
    outputs, residuals = jaxpr.outvars[:num_out], jaxpr.outvars[num_out:]
    cotangents = jax.tree.unflatten(
        trees["out"],
        [
            struct_of(a.aval, a.aval.dtype if _is_inexact(a.aval) else jax.dtypes.float0)
            for a in outputs
        ],
    )
    structs = [struct_of(a.aval) for a in residuals]
    vjp_tree = trees["vjp"]
    backward = jax.make_jaxpr(lambda r, c: jax.tree.unflatten(vjp_tree, r)(c))(structs, cotangents)
    live = live_vars(backward.jaxpr)
    used = [v in live for v in backward.jaxpr.invars[: len(residuals)]]
    return VjpTrace(
        jaxpr, closed.consts, outputs, residuals, used, backward, vjp_tree, trees["out"]
    )


def _is_inexact(aval) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, np.inexact)
