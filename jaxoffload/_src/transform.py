"""Function transforms that choose what a function keeps for its backward pass, and where.

:func:`offload` keeps a function's residuals in pinned host memory between its
two passes; :func:`wrap` applies any strategy value to a function. Both are
shaped like :func:`jax.checkpoint`. A wrapped call is traced once, its residuals
are chosen (:mod:`jaxoffload._src.residuals`), and it runs under one
``custom_vjp`` whose transfers :mod:`jaxoffload._src.transfers` ties into the
data flow.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import jax
from jax.extend import core as jex_core

from jaxoffload._src import context, fallbacks, flax_kinds, jaxprs, transfers
from jaxoffload._src.argnums import Argnums, check_argnums
from jaxoffload._src.errors import OffloadWarning
from jaxoffload._src.residuals import check_marked, describe, restructured, select_once
from jaxoffload._src.strategies import Offload, Strategy, brief, check_strategy
from jaxoffload._src.traced import (
    CALL_NAME,
    TracedCall,
    has_inner_calls,
    is_inner_call,
    is_wrapped_call,
    trace_call,
)

__all__ = ["offload", "resolved", "wrap", "wrap_with"]

F = TypeVar("F", bound=Callable[..., Any])


def wrap(
    fun: F,
    strategy: Strategy,
    *,
    device_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
) -> F:
    """Applies a strategy (``Store``, ``Lean``, ``Remat``, ``Offload``) to a function.

    ``Store()`` calls ``fun`` as it is; ``Remat(policy)`` is ``jax.checkpoint``;
    ``Lean()`` keeps the fewest residual bytes on the device, recomputing
    cheap values in the backward pass; ``Offload(...)`` keeps them in
    pinned host memory (see :func:`offload`).

    Args:
      fun: the function to wrap.
      strategy: what it keeps for its backward pass.
      device_argnums: positional arguments that are kept on the device anyway,
        typically parameters: they cost nothing to keep and never move.
      static_argnums: positional arguments that are not arrays, as with
        :func:`jax.checkpoint`. Arguments that hold no arrays (``True``,
        ``train=True``), positional or keyword, are static without being named.

    Returns:
      A function with ``fun``'s signature, outputs and gradients.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload import Lean, wrap
      >>> layer = wrap(lambda w, x: jax.nn.relu(x @ w), Lean(), device_argnums=0)
      >>> w, x = jnp.eye(3), jnp.arange(6.0).reshape(2, 3) - 2
      >>> g = jax.grad(lambda w, x: layer(w, x).sum(), argnums=1)(w, x)
      >>> g.tolist()
      [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    """
    strategy = check_strategy(strategy)
    if not callable(fun):
        raise TypeError(f"wrap expects a callable, got {fun!r} of type {type(fun).__name__}.")
    device_argnums = check_argnums("device_argnums", device_argnums)
    static_argnums = check_argnums("static_argnums", static_argnums)
    return wrap_with(fun, strategy, Argnums(device=device_argnums, static=static_argnums))


def wrap_with(fun: F, strategy: Strategy, argnums: Argnums) -> F:
    """:func:`wrap` with its positions as one value, which says why each device argument stays.

    The linen and NNX faces pass a Module's variables as device arguments
    that the user never named: their reasons say so.
    """
    flax_kinds.check_function_target(fun, strategy)
    if strategy.is_identity:
        # Calls ``fun`` as it is; marked, so that saved_residuals lists jax's residuals.
        plain = functools.wraps(fun)(lambda *args, **kwargs: fun(*args, **kwargs))
        plain.__jaxoffload__ = (fun, strategy, argnums)  # type: ignore[attr-defined]
        return plain  # type: ignore[return-value]

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        flax_kinds.refuse_nnx_arguments(args, kwargs)
        return _wrapped_call(fun, strategy, argnums, args, kwargs)

    wrapped.__jaxoffload__ = (fun, strategy, argnums)  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]


@overload
def offload(
    fun: F,
    *,
    names: Sequence[str] | None = None,
    recompute: bool = False,
    min_bytes: int = 0,
    max_recompute: float = 0.25,
    window: int = 1,
    max_bytes: int | None = None,
    fetch_window: int | None = None,
    device_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
) -> F: ...


@overload
def offload(
    fun: None = None,
    *,
    names: Sequence[str] | None = None,
    recompute: bool = False,
    min_bytes: int = 0,
    max_recompute: float = 0.25,
    window: int = 1,
    max_bytes: int | None = None,
    fetch_window: int | None = None,
    device_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
) -> Callable[[F], F]: ...


def offload(
    fun=None,
    *,
    names=None,
    recompute=False,
    min_bytes=0,
    max_recompute=0.25,
    window=1,
    max_bytes=None,
    fetch_window=None,
    device_argnums=(),
    static_argnums=(),
):
    """Keeps ``fun``'s residuals in pinned host memory between its two passes.

    ``offload`` is shaped like :func:`jax.checkpoint`. Where ``jax.checkpoint``
    throws residuals away and recomputes them, ``offload`` moves them to
    ``pinned_host`` memory at the end of ``fun``'s forward pass and brings
    them back when its backward pass starts. Outputs and gradients are
    ``fun``'s; only where the residuals wait changes. It is
    ``wrap(fun, Offload(...))``: the arguments are those of
    :class:`jaxoffload.Offload`.

    What moves is what a lean function would keep (:class:`jaxoffload.Lean`):
    the cheapest set of values from which the backward pass can recompute the
    rest, so that cheap values (elementwise results, BatchNorm's normalised
    copies, masks) are recomputed, not moved. Of those, values in
    ``device_argnums`` and values under ``min_bytes`` stay on the device.
    :func:`saved_residuals` lists them, and why each is kept where it is.

    XLA:GPU deletes a host round trip that nothing forces, and its scheduler
    lets fetched residuals and weight-gradient work pile up. The transfers are
    tied into the data flow with ``jax.lax.optimization_barrier``:

    - the host copy is separated from its way back, so the pair is kept;
    - ``fun``'s outputs wait for the host copies of its residuals (or, with
      ``window`` ``w``, the outputs of the call ``w - 1`` calls later do), so
      a residual's device buffer dies early;
    - the residuals are fetched only once the output cotangent has arrived
      (or the call ``w - 1`` calls later starts its backward pass), and the
      input cotangent leaves together with the parameter cotangents, so the
      previous call fetches only after this one's weight gradients exist.

    The calls of one trace form a chain in call order, so a window spans the
    wrapped calls that follow, whatever wraps them.

    ``offload`` is built on :func:`jax.custom_vjp`: it supports reverse-mode
    differentiation (a gradient of a gradient too), ``jit``, ``vmap`` and sharding,
    but not forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``).

    Args:
      fun: the function to wrap.
      names: keep and move only the :func:`~jax.ad_checkpoint.checkpoint_name`
        values with these names, and the arguments; recompute the rest.
      recompute: move only the arguments, and recompute everything else.
      min_bytes: residuals smaller than this stay on the device.
      max_recompute: the FLOPs of convolutions and matrix products that may
        be recomputed to move fewer bytes, as a share of the forward pass's.
      window: how many consecutive wrapped calls may have transfers in
        flight; 1 waits for this call's own transfers.
      max_bytes: move at most this many bytes, the largest residuals first;
        the rest stays on the device (as in :class:`Offload`).
      fetch_window: how many wrapped calls ahead of its own the backward pass
        may fetch the residuals (the earliest: XLA's scheduler may start the
        fetch later); ``None`` for ``window``.
      device_argnums: positional arguments kept on the device anyway
        (parameters): they never move.
      static_argnums: positional arguments that are not arrays, as in
        :func:`wrap`; those that hold no arrays are static without being named.

    Returns:
      A function with ``fun``'s signature and outputs.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload import offload
      >>> @offload(device_argnums=0)
      ... def layer(w, x):
      ...     return jnp.tanh(x @ w)
      >>> w, x = jnp.ones((4, 4)) / 4, jnp.ones((2, 4))
      >>> g = jax.grad(lambda w, x: layer(w, x).sum(), argnums=1)(w, x)
      >>> bool(jnp.allclose(g, jax.grad(lambda w, x: jnp.tanh(x @ w).sum(), argnums=1)(w, x)))
      True
    """
    strategy = Offload(
        names=names,
        recompute=recompute,
        min_bytes=min_bytes,
        max_recompute=max_recompute,
        window=window,
        max_bytes=max_bytes,
        fetch_window=fetch_window,
    )

    def decorate(fun):
        return wrap(fun, strategy, device_argnums=device_argnums, static_argnums=static_argnums)

    return decorate if fun is None else decorate(fun)


def _wrapped_call(fun, strategy, argnums: Argnums, args: tuple, kwargs: dict, check_names=True):
    traced = trace_call(fun, argnums, args, kwargs)
    if check_names and strategy.required_names:
        check_marked(strategy.required_names, traced.closed)
    if has_inner_calls(traced):
        flat = _run_regions(traced, strategy)
        return jax.tree.unflatten(traced.out_tree, flat)
    if not strategy.to_host and _in_forward_mode((traced.dynamic, traced.kwargs)):
        remat = resolved(strategy, traced).checkpointed(traced.replay)
        if remat is not None:
            # jax.checkpoint itself, which forward mode differentiates; a custom_vjp cannot.
            return remat(traced.dynamic, traced.kwargs)
    return _custom_call(traced, strategy, fun)


def _in_forward_mode(operands) -> bool:
    """Whether jax differentiates ``operands`` in forward mode (``jvp``, ``jacfwd``)."""
    return any(type(leaf).__name__ == "JVPTracer" for leaf in jax.tree.leaves(operands))


def resolved(strategy: Strategy, traced: TracedCall) -> Strategy:
    """The strategy that a traced call runs under: ``strategy``, or the fallback it measured."""
    if strategy.max_slowdown is None:
        return strategy
    device = tuple(sorted(traced.device_leaves))
    return fallbacks.fastest_enough(strategy, traced.closed, device, wrap)


@dataclasses.dataclass(frozen=True)
class _Region:
    """Equations between wrapped calls, run as one step: wrapped with the enclosing strategy."""

    eqns: list[Any]
    invars: list[Any]
    outvars: list[Any]
    works: bool  # more than elementwise work: it takes the strategy, or runs as it is


def _run_regions(traced: TracedCall, strategy) -> list[Any]:
    """Runs a traced function whose wrapped calls keep their strategies, and ``strategy`` elsewhere.

    The code between the wrapped calls (a ResNet's stem and classifier, say)
    is cut into regions, and each region that does more than elementwise
    work is wrapped with ``strategy`` on its own.
    """
    closed = traced.closed
    jaxpr = closed.jaxpr
    # What stays on the device, and why: a region keeps the reasons of the whole call.
    why = {jaxpr.invars[i]: r for i, r in traced.device_leaves.items()}
    why |= dict.fromkeys(jaxpr.constvars, "constant")

    def run(step, invals):
        if not isinstance(step, _Region):
            return jaxprs.bind(step, invals)
        sub = jex_core.Jaxpr(
            [], step.invars, step.outvars, step.eqns, jaxpr.effects, jaxprs.debug_info(step.invars)
        )
        fun = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(sub, []))
        if not step.works:
            return fun(*invals)
        device = tuple(k for k, v in enumerate(step.invars) if v in why)
        reasons = tuple(why[step.invars[k]] for k in device)
        # The names were checked on the whole function; a region may mark none of them.
        argnums = Argnums(device=device, static=(), reasons=reasons)
        return _wrapped_call(fun, strategy, argnums, tuple(invals), {}, check_names=False)

    steps = _regions(jaxpr)
    if not any(s.works if isinstance(s, _Region) else is_wrapped_call(s) for s in steps):
        warnings.warn(
            f"{brief(strategy)} applies to nothing in this call: its convolutions and products "
            "all run inside jax.checkpoint calls of its own (nn.remat, nn.checkpoint), which "
            "keep their own policy. Wrap the Module inside the nn.remat instead, or call it "
            "without nn.remat.",
            OffloadWarning,
            stacklevel=2,
        )
    flat = jax.tree.leaves((traced.dynamic, traced.kwargs))
    return jaxprs.evaluate(jaxpr, closed.consts, flat, run, steps)


def _regions(jaxpr) -> list[Any]:
    """The steps of ``jaxpr``: its wrapped calls, and a region of the equations between each two."""
    later_uses = jaxprs.uses_after(jaxpr)
    steps, region = [], []

    def flush(n):  # the region that ends before equation n
        if not region:
            return
        defined = {v for e in region for v in e.outvars}
        inputs = list(
            dict.fromkeys(
                v for e in region for v in e.invars
                if isinstance(v, jex_core.Var) and v not in defined
            )
        )  # fmt: skip
        outputs = [
            v for v in dict.fromkeys(v for e in region for v in e.outvars) if later_uses(v, n)
        ]
        works = any(
            jaxprs.eqn_flops(e) or e.primitive.name.startswith("reduce_window") for e in region
        )
        steps.append(_Region(list(region), inputs, outputs, works))
        region.clear()

    for n, eqn in enumerate(jaxpr.eqns):
        if is_inner_call(eqn):
            flush(n)
            steps.append(eqn)
        else:
            region.append(eqn)
    flush(len(jaxpr.eqns))
    return steps


def _custom_call(traced: TracedCall, strategy: Strategy, fun) -> Any:
    """The traced call under one ``custom_vjp`` that keeps what ``strategy`` chooses, where it chooses."""
    call, device_leaves = traced.replay, traced.device_leaves
    chain = transfers.Chain.of_current_trace()
    index, gates = chain.next_gates()
    window, fetch_window = strategy.window, strategy.fetch_window or strategy.window
    chosen: dict[str, Any] = {}  # the selection, made when the forward pass is traced

    def run(dynamic, kwargs, gates):
        return call(dynamic, kwargs), transfers.empty_token(), transfers.empty_token()

    run.__name__ = CALL_NAME  # how an enclosing call finds it
    run = jax.custom_vjp(run)

    def run_fwd(dynamic, kwargs, gates):
        # Fallbacks are timed here, when the call is differentiated: an init or an
        # evaluation runs ``run`` alone, under any of them alike.
        taken = resolved(strategy, traced)
        kept = chosen["kept"] = select_once(
            traced.closed, traced.out_tree, call, dynamic, kwargs, taken, device_leaves
        )
        context.record_call(lambda: describe(traced.closed, kept, device_leaves, taken))
        if strategy.to_host:
            transfers.say_if_nothing_moves(fun, kept)
        flat = kept.forward(*jax.tree.leaves((dynamic, kwargs)))
        out = jax.tree.unflatten(kept.out_tree, flat[: kept.num_outputs])
        saved = list(flat[kept.num_outputs :])
        with jax.named_scope("jaxoffload/to_host"):
            out, saved, host, token, anchors = transfers.move_out(
                out, saved, kept.to_host, gates, window
            )
        # Its cotangent starts the fetch: it exists once the call fetch_window - 1 calls
        # later starts its backward pass. Apart from the copies' token, it gates nothing.
        fetch_token = token if fetch_window == window else transfers.scalar_of(out)
        return (out, token, fetch_token), (saved, host, anchors)

    def run_bwd(residuals, cotangents):
        kept = chosen["kept"]
        saved, host, anchors = residuals
        cotangent, token_cotangent, fetch_cotangent = cotangents
        if fetch_window == window:
            fetch_cotangent = token_cotangent
        with jax.named_scope("jaxoffload/to_device"):
            fetched, cotangent, anchors = transfers.fetch(
                host, cotangent, fetch_cotangent, anchors, fetch_window
            )
        if kept.recomputes:
            saved, fetched, cotangent = transfers.recompute_after(cotangent, saved, fetched)
        saved = transfers.put_back(saved, host, fetched)
        vjp_fun = jax.tree.unflatten(kept.vjp_tree, kept.backward(saved))
        # Each gate's cotangent exists once this call's backward pass starts:
        # it starts the fetch of the call that gated on it.
        gate_cotangents = [transfers.scalar_of(cotangent) for _ in gates]
        # The input cotangent leaves with the parameter cotangents: XLA would
        # otherwise sink weight-gradient work to the end of the backward pass
        # and keep every fetched residual alive until then.
        cotangents_in = restructured(vjp_fun(cotangent), (traced.dynamic, traced.kwargs))
        cotangents_in = transfers.after_tokens(cotangents_in, anchors)
        return (*transfers.barrier_arrays(cotangents_in), gate_cotangents)

    run.defvjp(run_fwd, run_bwd)
    operands = traced.dynamic, traced.kwargs, gates
    # jax.jvp of a custom_vjp: under jit, jax would say so only when lowering, in its words.
    if _in_forward_mode(operands):
        raise _forward_mode_error(fun, strategy)
    try:
        out, token, fetch_token = run(*operands)
    except TypeError as e:  # forward mode that the check above did not see: jax's words
        if "forward-mode" not in str(e):
            raise
        raise _forward_mode_error(fun, strategy) from e
    chain.push(index, window, token)
    if fetch_window != window:
        chain.push(index, fetch_window, fetch_token)
    return out


def _forward_mode_error(fun, strategy: Strategy) -> TypeError:
    name = getattr(fun, "__qualname__", None) or getattr(fun, "__name__", repr(fun))
    return TypeError(
        f"jax.jvp, jax.jacfwd and jax.hessian differentiate in forward mode, which {name}, "
        f"wrapped with {brief(strategy)}, does not support: a custom_vjp rule chooses its "
        "residuals, and jax differentiates those in reverse mode only. For forward mode, "
        "wrap it with Remat() or Store(); for second order, go reverse over reverse: "
        "jax.jacrev(jax.jacrev(f)), or jax.grad of jax.grad."
    )
