"""Strategies for Flax NNX: ``wrap`` and ``offload``, shaped like ``nnx.remat``.

An NNX Module is a mutable object: a function that takes one may update its
variables (BatchNorm's running statistics, RNG stream counts). A function
transform of jax sees only arrays, so these updates would be lost: here the
Modules among the arguments are split into their variables, the function runs
on them under the strategy, and the variables it changed are written back, as
``nnx.remat`` does.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import jax
from flax import nnx

from jaxoffload import transform
from jaxoffload.strategies import Offload, Store, Strategy, check_strategy

__all__ = ["offload", "wrap"]

F = TypeVar("F", bound=Callable[..., Any])


def wrap(f: F, strategy: Strategy, *, static_argnums: int | Sequence[int] = ()) -> F:
    """Applies a strategy to a function that takes NNX Modules, a Module's method, or a Module.

    Variables never move and cost nothing to keep: they live on the device
    for the whole step. Every ``nnx.Variable`` that the function changes
    (``BatchStat``, RNG counts, any other) is written back to the Module
    afterwards, as under ``nnx.remat``. A bound method (``model.block.__call__``)
    is wrapped with its Module as the first argument. A Module instance is
    wrapped in place, with no edit to the model that calls it: its calls
    take the strategy, and its class name, variables and their paths stay::

        for block in model.blocks:
            jaxoffload.nnx.wrap(block, jaxoffload.Lean())

    Args:
      f: a function whose arguments may hold NNX Modules, a bound method, or
        a Module instance.
      strategy: :class:`~jaxoffload.Store`, :class:`~jaxoffload.Lean`,
        :class:`~jaxoffload.Remat` or :class:`~jaxoffload.Offload`.
      static_argnums: positional arguments that are not arrays or Modules.

    Returns:
      A function with ``f``'s signature and outputs; ``f`` itself for ``Store()``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxoffload
      >>> bn = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
      >>> lean = jaxoffload.nnx.wrap(lambda bn, x: nnx.relu(bn(x)), jaxoffload.Lean())
      >>> y = lean(bn, jnp.arange(6.0).reshape(2, 3))
      >>> [round(float(m), 3) for m in bn.mean[...]]  # the running mean moved, as without it
      [0.015, 0.025, 0.035]
    """
    strategy = check_strategy(strategy)
    if isinstance(f, nnx.Module):
        return _wrap_instance(f, strategy, static_argnums)  # type: ignore[return-value]
    if not callable(f):
        raise TypeError(f"wrap expects a callable, got {f!r}.")
    static_argnums = transform._check_argnums("static_argnums", static_argnums)
    bound = None
    if inspect.ismethod(f) and isinstance(f.__self__, nnx.Module):
        # The Module must be an argument, or its updates would escape the trace.
        bound, f = f.__self__, f.__func__
        static_argnums = tuple(i + 1 for i in static_argnums)
    if isinstance(strategy, Store):
        return f if bound is None else functools.partial(f, bound)  # type: ignore[return-value]

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        if bound is not None:
            args = (bound, *args)
        return _call(f, strategy, static_argnums, args, kwargs)

    return wrapped  # type: ignore[return-value]


@overload
def offload(
    f: F,
    *,
    names: Sequence[str] | None = None,
    recompute: bool = False,
    min_bytes: int = 0,
    max_recompute: float = 0.25,
    window: int = 1,
    static_argnums: int | Sequence[int] = (),
) -> F: ...


@overload
def offload(
    f: None = None,
    *,
    names: Sequence[str] | None = None,
    recompute: bool = False,
    min_bytes: int = 0,
    max_recompute: float = 0.25,
    window: int = 1,
    static_argnums: int | Sequence[int] = (),
) -> Callable[[F], F]: ...


def offload(
    f=None,
    *,
    names=None,
    recompute=False,
    min_bytes=0,
    max_recompute=0.25,
    window=1,
    static_argnums=(),
):
    """``wrap(f, Offload(...))``, bare or configured, as ``nnx.remat`` is used.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxoffload
      >>> @jaxoffload.nnx.offload(window=2)
      ... def layer(dense, x):
      ...     return jnp.tanh(dense(x))
      >>> layer(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), jnp.ones((1, 3))).shape
      (1, 2)
    """
    strategy = Offload(
        names=names,
        recompute=recompute,
        min_bytes=min_bytes,
        max_recompute=max_recompute,
        window=window,
    )

    def decorate(f):
        return wrap(f, strategy, static_argnums=static_argnums)

    return decorate if f is None else decorate(f)


def _wrap_instance(module, strategy, static_argnums):
    """``module``, its class swapped for a subclass of the same name whose calls take ``strategy``."""
    base = getattr(type(module), "__jaxoffload_base__", type(module))
    static_argnums = transform._check_argnums("static_argnums", static_argnums)
    if isinstance(strategy, Store):
        module.__class__ = base
        return module
    key = (base, strategy, static_argnums)
    if key not in _WRAPPED_CLASSES:
        # `self` becomes the first argument of the wrapped function.
        call = wrap(base.__call__, strategy, static_argnums=tuple(i + 1 for i in static_argnums))
        _WRAPPED_CLASSES[key] = type(
            base.__name__,
            (base,),
            {
                "__call__": lambda self, *args, **kwargs: call(self, *args, **kwargs),
                "__qualname__": base.__qualname__,
                "__module__": base.__module__,
                "__jaxoffload_base__": base,
            },
        )
    module.__class__ = _WRAPPED_CLASSES[key]
    return module


_WRAPPED_CLASSES: dict[tuple, type] = {}


def _call(f, strategy, static_argnums, args, kwargs):
    dynamic, rebuild, _ = transform._Argnums(device=(), static=static_argnums).split(args, kwargs)
    graphdef, variables, rest = nnx.split((dynamic, kwargs), nnx.Variable, ...)
    old_leaves, variables_tree = jax.tree.flatten(variables)
    changed: list[int] = []

    def pure(variables, rest):
        inputs = jax.tree.leaves(variables)
        # Fresh Variables of this trace: NNX refuses to mutate those of an outer one.
        dynamic, kwargs = nnx.merge(graphdef, variables, rest, copy=True)
        all_args, all_kwargs = rebuild(dynamic, kwargs)
        out = f(*all_args, **all_kwargs)
        _, new_variables, _ = nnx.split((dynamic, kwargs), nnx.Variable, ...)
        new_leaves = jax.tree.leaves(new_variables)
        # Traced once: the variables whose values are new tracers are the ones it changed.
        changed[:] = [k for k, (a, b) in enumerate(zip(inputs, new_leaves)) if a is not b]
        return out, [new_leaves[k] for k in changed]

    out, updates = transform.wrap(pure, strategy, device_argnums=0)(variables, rest)
    new_leaves = list(old_leaves)
    for k, value in zip(changed, updates):
        new_leaves[k] = value
    nnx.update((dynamic, kwargs), jax.tree.unflatten(variables_tree, new_leaves))
    return out
