"""Strategies for Flax linen Modules: ``wrap`` and ``offload``, shaped like ``nn.remat``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import flax.linen as nn
from flax.core import lift
from flax.linen import transforms as linen_transforms

from jaxoffload._src import context, flax_kinds, transform
from jaxoffload._src.argnums import (
    MODULE_RNGS,
    MODULE_VARIABLES,
    NAMED,
    Argnums,
    check_argnums,
    check_positions,
)
from jaxoffload._src.strategies import Offload, Store, Strategy, check_strategy

__all__ = ["offload", "plannable", "wrap"]

Target = TypeVar("Target")


def wrap(
    target: Target,
    strategy: Strategy,
    *,
    static_argnums: int | Sequence[int] = (),
    device_argnums: int | Sequence[int] = (),
    variables: Any = True,
    rngs: Any = True,
    methods: Sequence[str] | None = None,
) -> Target:
    """Applies a strategy to a Module's calls: ``nn.remat``'s shape, for every strategy.

    Give it a Module class (or a ``functools.partial`` of one) and it returns
    a Module class; use it on a method inside a class body and it returns a
    method. The class keeps its name, so auto-named instances keep theirs
    (``Block_0``): the variable tree, its names and its initial values are
    the plain model's, and variables trained without jaxoffload load as they
    are. Switching strategies is one value::

        Block = jaxoffload.linen.wrap(ResNetBlock, jaxoffload.Lean())
        Block = jaxoffload.linen.wrap(ResNetBlock, jaxoffload.Offload(window=2))

    Variables (parameters, ``batch_stats``) never move, and cost nothing to
    keep: they live on the device for the whole step. ``batch_stats`` updates
    and RNG streams such as ``dropout`` work as under ``nn.remat``. A lean
    block uses leaner rules than jax's for the ReLUs and max-pools it calls,
    with no edit to its code.

    Wrapped Modules nest: wrapping a whole model whose blocks are wrapped
    applies ``strategy`` to the code outside the blocks (a ResNet's stem and
    classifier), and the blocks keep their own.

    Args:
      target: a Module class, a ``functools.partial`` of one, or a method.
      strategy: :class:`~jaxoffload.Store`, :class:`~jaxoffload.Lean`,
        :class:`~jaxoffload.Remat` or :class:`~jaxoffload.Offload`.
      static_argnums: as in ``nn.remat``: positions of non-array arguments,
        counting ``self`` as 0. Arguments that hold no arrays (``train=True``,
        positional or keyword), and NumPy bools, are static without being named.
      device_argnums: positions of arguments, counting ``self`` as 0, kept on
        the device anyway: for instance an input that the layer before keeps,
        so that moving it would free nothing.
      variables: the variable collections that are lifted (all by default).
      rngs: the RNG streams that are lifted (all by default).
      methods: the methods to transform when ``target`` is a class; by default
        ``__call__``.

    Returns:
      The transformed Module class or method; ``target`` itself for ``Store()``.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> import jaxoffload
      >>> class Model(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         return jaxoffload.linen.wrap(nn.Dense, jaxoffload.Lean())(4)(x)
      >>> v = Model().init(jax.random.key(0), jnp.ones((2, 3)))
      >>> list(v["params"])
      ['Dense_0']
    """
    strategy = check_strategy(strategy)
    static_argnums = check_argnums("static_argnums", static_argnums)
    device_argnums = check_argnums("device_argnums", device_argnums)
    if any(i <= 0 for i in static_argnums + device_argnums):
        raise ValueError(
            "static_argnums and device_argnums count `self` as 0, which cannot be in them, and "
            f"take no negative positions; got static_argnums={static_argnums} and "
            f"device_argnums={device_argnums}. The first argument after self is 1."
        )
    Argnums(device=device_argnums, static=static_argnums)  # refuses overlaps
    flax_kinds.check_linen_target(target, strategy)
    if flax_kinds.linen_class(target) is None and not callable(target):
        raise TypeError(
            f"jaxoffload.linen.wrap and jaxoffload.linen.offload take a linen Module class or a "
            f"method, got {target!r}; for a function of arrays, write jaxoffload.wrap(f, strategy)."
        )
    _check_methods(target, methods)
    if strategy.is_identity:
        return target
    options = dict(
        strategy=strategy,
        variables=variables,
        rngs=rngs,
        device_argnums=device_argnums,
        static_argnums=static_argnums,
    )
    base = flax_kinds.linen_class(target)
    if base is None:
        transformed = linen_transforms.lift_transform(_lifted, target, **options, method=target)
        return _method(transformed, target)
    # Each method is lifted knowing itself, so that jax's errors name it and its arguments.
    each = {m: {**options, "method": getattr(base, m)} for m in (methods or ("__call__",))}
    transformed = linen_transforms.lift_transform(_lifted, target, methods=each)
    return _named_like(transformed, target)


def offload(
    target: Target,
    *,
    names: Sequence[str] | None = None,
    recompute: bool = False,
    min_bytes: int = 0,
    max_recompute: float = 0.25,
    window: int = 1,
    max_bytes: int | None = None,
    fetch_window: int | None = None,
    static_argnums: int | Sequence[int] = (),
    device_argnums: int | Sequence[int] = (),
    variables: Any = True,
    rngs: Any = True,
    methods: Sequence[str] | None = None,
) -> Target:
    """``wrap(target, Offload(...))``: the Module's residuals wait in pinned host memory.

    The keyword arguments are those of :class:`jaxoffload.Offload` and of
    :func:`wrap`.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> import jaxoffload
      >>> Dense = jaxoffload.linen.offload(nn.Dense)
      >>> x = jnp.ones((2, 3))
      >>> v = Dense(4).init(jax.random.key(0), x)
      >>> jax.tree.map(jnp.shape, v) == jax.tree.map(jnp.shape, nn.Dense(4).init(jax.random.key(0), x))
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
    return wrap(
        target,
        strategy,
        static_argnums=static_argnums,
        device_argnums=device_argnums,
        variables=variables,
        rngs=rngs,
        methods=methods,
    )


def plannable(
    target: Target,
    *,
    static_argnums: int | Sequence[int] = (),
    device_argnums: int | Sequence[int] = (),
    variables: Any = True,
    rngs: Any = True,
) -> Target:
    """A Module class whose strategy a :class:`jaxoffload.Plan` picks, instance by instance.

    The class keeps ``target``'s name, fields and variables. Called outside a
    planned model it is ``target`` itself (``Store()``). Inside a model made
    by :meth:`jaxoffload.Plan.apply`, each instance takes the strategy that the
    plan gives its path (``"BottleneckResNetBlock_3"``), with
    :func:`wrap`'s arguments. :func:`jaxoffload.plan` finds the plannable
    instances by tracing the model, and picks a strategy for each.

    Args:
      target: a Module class, or a ``functools.partial`` of one; its
        ``__call__`` is what the plan transforms.
      static_argnums, device_argnums, variables, rngs: as in :func:`wrap`.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> import jaxoffload
      >>> Dense = jaxoffload.linen.plannable(nn.Dense)
      >>> Dense.__name__, issubclass(Dense, nn.Dense)
      ('Dense', True)
    """
    options = dict(
        static_argnums=static_argnums, device_argnums=device_argnums, variables=variables, rngs=rngs
    )
    wrap(target, Store(), **options)  # checks the arguments now, not at the first call
    base = flax_kinds.linen_class(target)
    if base is None:
        raise TypeError(f"plannable takes a Module class, got {target!r}.")
    by_strategy: dict[Strategy, Any] = {}

    def __call__(self, *args, **kwargs):
        plan = context.active_plan()  # the plan of the planned model being called, if any
        strategy = Store() if plan is None else plan.strategy_for("/".join(self.path))
        if strategy not in by_strategy:
            by_strategy[strategy] = wrap(base, strategy, **options)
        return by_strategy[strategy].__call__(self, *args, **kwargs)

    __call__.__doc__ = base.__call__.__doc__
    planned = type(
        base.__name__,
        (base,),
        {"__call__": __call__, "__qualname__": base.__qualname__, "__module__": base.__module__},
    )
    planned.__jaxoffload_plannable__ = base
    if isinstance(target, functools.partial):
        return functools.partial(planned, *target.args, **target.keywords)  # type: ignore[return-value]
    return planned  # type: ignore[return-value]


def _check_methods(target: Any, methods: Any) -> None:
    """Raises unless ``methods`` is ``None`` or names methods of the Module class ``target``."""
    base = flax_kinds.linen_class(target)
    if methods is None:
        return
    if base is None:
        raise TypeError(
            f"methods names the methods of a Module class to wrap, but got the method "
            f"{getattr(target, '__name__', target)!r} itself, which is what is wrapped: leave "
            "methods out."
        )
    if isinstance(methods, str) or not isinstance(methods, Sequence):
        write = (methods,) if isinstance(methods, str) else ("__call__",)
        raise TypeError(
            f"methods is a sequence of method names, got {methods!r}; write methods={write!r}."
        )
    missing = [m for m in methods if not callable(getattr(base, str(m), None))]
    if missing:
        raise ValueError(
            f"methods={tuple(methods)} names {missing}, which {base.__name__} does not have as "
            "methods: name methods that the class defines, such as '__call__'."
        )


def _named_like(transformed, target):
    """A transformed Module class under ``target``'s name, so that Flax names instances as it would."""
    cls = transformed.func if isinstance(transformed, functools.partial) else transformed
    original = target.func if isinstance(target, functools.partial) else target
    if isinstance(cls, type):
        cls.__name__ = original.__name__
        cls.__qualname__ = original.__qualname__
    return transformed


def _method(transformed, target):
    """``transformed``, the method made from the function ``target``, refusing a non-Module ``self``.

    Given a function, ``nn.remat`` and :func:`wrap` make a method; called on
    arrays, flax would fail deep inside, with no word of why.
    """
    name = getattr(target, "__name__", repr(target))

    @functools.wraps(transformed)
    def method(self, *args, **kwargs):
        if not isinstance(self, nn.Module):
            raise TypeError(
                f"jaxoffload.linen.wrap({name}, ...) and jaxoffload.linen.offload({name}) make a "
                f"method of a linen Module, but self, its first argument, is of type "
                f"{type(self).__name__}. Use them on a Module class or on a method in a class "
                f"body; for a function of arrays, write jaxoffload.offload({name}) or "
                f"jaxoffload.wrap({name}, strategy)."
            )
        return transformed(self, *args, **kwargs)

    return method


def _named_after(wrapped: Callable[..., Any], method: Callable[..., Any] | None):
    """``wrapped``, named as the Module's ``method``: its variables, RNGs and the method's
    arguments after ``self``. A traced ``train`` flag is then ``train`` in jax's errors, in
    ``Block.__call__``, not an argument of flax's or jaxoffload's inner functions."""
    if method is None:
        return wrapped
    try:
        after_self = list(inspect.signature(method).parameters.values())[1:]
        lifted = [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in ("variables", "rngs")
        ]
        signature = inspect.Signature(lifted + after_self)
    except (TypeError, ValueError):  # no signature, or one that names variables or rngs
        return wrapped
    wrapped.__wrapped__ = method  # type: ignore[attr-defined]
    wrapped.__signature__ = signature  # type: ignore[attr-defined]
    wrapped.__name__, wrapped.__qualname__ = method.__name__, method.__qualname__
    return wrapped


def _lifted(
    fn: Callable[..., Any],
    strategy: Strategy,
    variables: Any = True,
    rngs: Any = True,
    device_argnums: tuple[int, ...] = (),
    static_argnums: tuple[int, ...] = (),
    method: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """``transform.wrap`` lifted over Flax scopes, as ``flax.core.lift.checkpoint`` lifts ``jax.checkpoint``.

    ``device_argnums`` and ``static_argnums`` count ``self`` as 0. ``method`` is the
    Module's method that ``fn`` calls, by whose name and arguments jax's errors speak.
    """

    def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
        # Checked here, in the user's numbering: the lifted function's differs.
        for what, argnums in (
            ("static_argnums", static_argnums),
            ("device_argnums", device_argnums),
        ):
            check_positions(what, argnums, len(args), kwargs, first=1)

        # The lifted function takes (variables, rngs, *args): `self` becomes two.
        argnums = Argnums(
            device=(0, 1, *(i + 1 for i in device_argnums)),
            static=tuple(i + 1 for i in static_argnums),
            reasons=(MODULE_VARIABLES, MODULE_RNGS, *(NAMED for _ in device_argnums)),
        )

        @functools.wraps(fn)
        def wrapped(variable_groups, rng_groups, *args, **kwargs):
            scope = scope_fn(variable_groups, rng_groups)
            y = fn(scope, *args, **kwargs)
            return y, repack_fn(scope)

        named = _named_after(wrapped, method)
        return transform.wrap_with(named, strategy, argnums)(
            variable_groups, rng_groups, *args, **kwargs
        )

    # enable_kwargs: otherwise flax drops keyword arguments, with only a RuntimeWarning.
    return lift.pack(
        inner,
        (variables,),
        (variables,),
        (rngs,),
        name=type(strategy).__name__.lower(),
        enable_kwargs=True,
    )
