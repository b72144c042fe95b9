"""What the wrapped calls of a function keep, as a user asks: ``saved_residuals`` and ``offloaded_calls``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax

from jaxoffload._src import context, transform
from jaxoffload._src import traced as traced_call
from jaxoffload._src.errors import OffloadWarning
from jaxoffload._src.residuals import OffloadedCall, Residual, select

__all__ = ["offloaded_calls", "residuals_per_call", "saved_residuals"]


def saved_residuals(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """Lists the residuals of a wrapped function, where each one waits, and why.

    Every strategy answers: ``Lean`` and ``Offload`` list their cut, ``Remat``
    what its ``jax.checkpoint`` policy keeps (the inputs, by default), and
    ``Store`` jax's residuals.

    Args:
      fun: a function made by :func:`jaxoffload.wrap` or :func:`jaxoffload.offload`.
      *args: arguments, as arrays or :class:`jax.ShapeDtypeStruct`.
      **kwargs: keyword arguments, likewise.

    Returns:
      One :class:`Residual` per value that the backward pass reads.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload import offload, saved_residuals
      >>> f = offload(lambda w, x: jnp.sin(x @ w), device_argnums=0)
      >>> for r in saved_residuals(f, jnp.ones((8, 8)), jnp.ones((4, 8))):
      ...     print(r)
      float32[4, 8] 128 B -> pinned_host (offloaded) [input]
      float32[8, 8] 256 B -> device (argument in device_argnums) [input]
      float32[4, 8] 128 B -> pinned_host (keeping it costs less than recomputing it; offloaded) [cos]
    """
    try:
        inner, strategy, argnums = fun.__jaxoffload__  # type: ignore[attr-defined]
    except AttributeError:
        raise TypeError(
            "saved_residuals expects a function made by jaxoffload.wrap or jaxoffload.offload, "
            f"got {fun!r}; for jax's own residuals, wrap it with Store(): "
            "saved_residuals(jaxoffload.wrap(f, jaxoffload.Store()), *args)."
        ) from None
    traced = traced_call.trace_call(inner, argnums, args, kwargs)
    if traced_call.has_inner_calls(traced) and not strategy.is_identity:
        # The code between inner wrapped calls is cut into regions: list the first call's.
        calls = offloaded_calls(
            lambda args, kwargs: jax.vjp(lambda *a: fun(*a, **kwargs), *args), args, kwargs
        )
        return list(calls[0].residuals)
    strategy = transform.resolved(strategy, traced)
    kept = select(traced.replay, traced.dynamic, traced.kwargs, strategy, traced.device_leaves)
    return list(kept.residuals)


def offloaded_calls(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> list[OffloadedCall]:
    """Traces ``fun`` and describes every wrapped call that it differentiates.

    Nothing is compiled or run: ``fun`` is traced with ``jax.make_jaxpr``, so
    its arguments may be :class:`jax.ShapeDtypeStruct`\\ s of any size. A
    call appears once per differentiation, in call order.

    Args:
      fun: a function that differentiates calls made by :func:`wrap` or
        :func:`offload` (a training step, say).
      *args: arguments, as arrays or :class:`jax.ShapeDtypeStruct`.
      **kwargs: keyword arguments, likewise.

    Returns:
      One :class:`OffloadedCall` per wrapped call, in call order.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload import offload, offloaded_calls
      >>> layer = offload(lambda w, x: jnp.tanh(x @ w), device_argnums=0)
      >>> step = jax.grad(lambda w, x: layer(w, layer(w, x)).sum())
      >>> calls = offloaded_calls(step, jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> [(c.flops, c.host_bytes) for c in calls]
      [(512, 256), (512, 256)]
    """
    if not callable(fun):
        raise TypeError(
            f"offloaded_calls takes a function that differentiates wrapped calls (a training "
            f"step), got {fun!r}: write offloaded_calls(step, *args)."
        )
    with context.recording_calls() as calls:
        jax.make_jaxpr(fun)(*args, **kwargs)
    return calls


def residuals_per_call(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> list[list[Residual]]:
    """Lists, for every wrapped call that ``fun`` differentiates, its residuals.

    ``[list(call.residuals) for call in offloaded_calls(fun, *args, **kwargs)]``.
    """
    calls = offloaded_calls(fun, *args, **kwargs)
    if not calls:
        warnings.warn(
            "residuals_per_call: the traced function differentiates no call made by "
            "jaxoffload.wrap or jaxoffload.offload; pass a function that takes a gradient.",
            OffloadWarning,
            stacklevel=2,
        )
    return [list(call.residuals) for call in calls]
