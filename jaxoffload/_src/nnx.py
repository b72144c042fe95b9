"""Strategies for Flax NNX: ``wrap`` and ``offload``, shaped like ``nnx.remat``.

An NNX Module is a mutable object: a function that takes one may update its
variables (BatchNorm's running statistics, RNG stream counts). A function
transform of jax sees only arrays, so these updates would be lost: here the
Modules among the arguments are split into their variables, the function runs
on them under the strategy, and the variables it changed are written back, as
``nnx.remat`` does.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

import jax
from flax import nnx

from jaxoffload._src import checks, context, flax_kinds, transform
from jaxoffload._src.argnums import (
    MODULE_VARIABLES,
    Argnums,
    check_argnums,
    named_after,
    positional_names,
)
from jaxoffload._src.strategies import Offload, Strategy, brief, check_strategy

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
    flax_kinds.check_nnx_target(f, strategy)
    if isinstance(f, nnx.Module):
        return wrap_instance(f, strategy, static_argnums)  # type: ignore[return-value]
    if not callable(f):
        raise TypeError(f"wrap expects a callable, got {f!r}.")
    static_argnums = check_argnums("static_argnums", static_argnums)
    bound = None
    if inspect.ismethod(f) and isinstance(f.__self__, nnx.Module):
        # The Module must be an argument, or its updates would escape the trace.
        bound, f = f.__self__, f.__func__
        static_argnums = tuple(i + 1 for i in static_argnums)
    if strategy.is_identity:
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
    max_bytes: int | None = None,
    fetch_window: int | None = None,
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
    max_bytes: int | None = None,
    fetch_window: int | None = None,
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
    max_bytes=None,
    fetch_window=None,
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
        max_bytes=max_bytes,
        fetch_window=fetch_window,
    )

    def decorate(f):
        return wrap(f, strategy, static_argnums=static_argnums)

    return decorate if f is None else decorate(f)


def wrap_instance(module, strategy, static_argnums, path=None):
    """``module``, its class swapped for a subclass of the same name whose calls take ``strategy``.

    A planned block also knows its ``path``, so that the planner can see the
    order in which the blocks are called.
    """
    base = getattr(type(module), "__jaxoffload_base__", type(module))
    static_argnums = check_argnums("static_argnums", static_argnums)
    if strategy.is_identity:
        module.__class__ = base
        return module
    if not any("__call__" in vars(k) for k in base.__mro__ if k is not object):
        held = (
            "the blocks it holds" if isinstance(module, nnx.List | nnx.Dict) else "its submodules"
        )
        raise TypeError(
            f"jaxoffload.nnx.wrap wraps a Module's calls, and {base.__name__} has no __call__: "
            f"under {brief(strategy)} nothing would change. Wrap {held} instead, e.g. "
            f"for block in model.blocks: jaxoffload.nnx.wrap(block, {brief(strategy)})."
        )
    key = (base, strategy, static_argnums, path)
    if key not in _WRAPPED_CLASSES:
        # `self` becomes the first argument of the wrapped function.
        call = wrap(base.__call__, strategy, static_argnums=tuple(i + 1 for i in static_argnums))

        def __call__(self, *args, **kwargs):
            if path is not None:
                context.record_path(path)
            return call(self, *args, **kwargs)

        def __reduce_ex__(self, protocol):
            # This class is made here, so pickle cannot find it by its name: the Module
            # pickles as its own class, and is wrapped again where it is loaded.
            plain = object.__new__(base)
            plain.__dict__.update(self.__dict__)
            return wrap_instance, (plain, strategy, static_argnums, path)

        _WRAPPED_CLASSES[key] = type(
            base.__name__,
            (base,),
            {
                "__call__": __call__,
                "__reduce_ex__": __reduce_ex__,
                "__qualname__": base.__qualname__,
                "__module__": base.__module__,
                "__jaxoffload_base__": base,
            },
            **_pytree_mode(base),
        )
    module.__class__ = _WRAPPED_CLASSES[key]
    return module


_WRAPPED_CLASSES: dict[tuple, type] = {}


def _pytree_mode(base: type) -> dict[str, bool]:
    """``base``'s pytree mode, for a subclass to keep: flax gives a subclass the default
    mode, and a Module of ``pytree=False`` (which may hold its submodules in plain lists)
    read in the other mode has no state: its gradients would come back empty."""
    mode = getattr(base, "_pytree__is_pytree", None)
    return {} if mode is None else {"pytree": mode}


def _call(f, strategy, static_argnums, args, kwargs):
    split = Argnums(device=(), static=static_argnums).split
    dynamic, rebuild, _ = split(args, kwargs, positional_names(f))
    # Arguments that hold Modules are split into their variables and the rest; the others
    # pass as they are, so that jax's errors name them as the user does (``train``).
    holds = [_holds_modules(a) for a in dynamic]
    modules = tuple(a for a, h in zip(dynamic, holds) if h)
    plain = tuple(a for a, h in zip(dynamic, holds) if not h)
    module_kwargs = {k: v for k, v in kwargs.items() if _holds_modules(v)}
    plain_kwargs = {k: v for k, v in kwargs.items() if k not in module_kwargs}
    graphdef, variables, rest = nnx.split((modules, module_kwargs), nnx.Variable, ...)
    old_leaves, variables_tree = jax.tree.flatten(variables)
    changed: list[int] = []

    def pure(variables, rest, *plain, **plain_kwargs):
        inputs = jax.tree.leaves(variables)
        # Fresh Variables of this trace: NNX refuses to mutate those of an outer one.
        modules, module_kwargs = nnx.merge(graphdef, variables, rest, copy=True)
        given, others = iter(modules), iter(plain)
        dynamic = [next(given) if h else next(others) for h in holds]
        all_args, all_kwargs = rebuild(dynamic, {**module_kwargs, **plain_kwargs})
        out = f(*all_args, **{k: all_kwargs[k] for k in kwargs})
        _, new_variables, _ = nnx.split((modules, module_kwargs), nnx.Variable, ...)
        new_leaves = jax.tree.leaves(new_variables)
        # Traced once: the variables whose values are new tracers are the ones it changed.
        changed[:] = [k for k, (a, b) in enumerate(zip(inputs, new_leaves)) if a is not b]
        return out, [new_leaves[k] for k in changed]

    n = len(args)
    positions = [i for i in range(n) if i not in {j % n for j in static_argnums}]
    named = [p for p, h in zip(positions, holds) if not h]
    pure = named_after(pure, f, named, plain_kwargs, leading=("variables", "rest"))
    # The variables stay on the device, as the user's Module keeps them, named or not.
    argnums = Argnums(device=(0,), static=(), reasons=(MODULE_VARIABLES,))
    out, updates = transform.wrap_with(pure, strategy, argnums)(
        variables, rest, *plain, **plain_kwargs
    )
    if changed:
        new_leaves = list(old_leaves)
        for k, value in zip(changed, updates):
            new_leaves[k] = value
        # Only what it changed is written back, as the plain Module writes: a write of an
        # unchanged Param would be refused where the Module lives outside the trace
        # (``jax.grad`` of the input, the Module closed over).
        paths = _paths(variables)
        written = {paths[k] for k in changed}
        new = jax.tree.unflatten(variables_tree, new_leaves)
        nnx.update((modules, module_kwargs), nnx.filter_state(new, lambda path, _: path in written))
    return out


def _paths(state) -> list[tuple]:
    """The nnx path of each of ``state``'s leaves, in ``jax.tree.leaves`` order."""
    keys = jax.tree_util.tree_flatten_with_path(state)[0]
    return [tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)) for path, _ in keys]


def _holds_modules(value) -> bool:
    """Whether ``value`` holds NNX graph nodes: Modules, or Variables."""
    is_node = nnx.graph.is_graph_node
    return any(is_node(x) for x in jax.tree.leaves(value, is_leaf=is_node))


# ---- what plans need of NNX models ------------------------------------------------------------------------------


def submodules(model: nnx.Module) -> dict[str, nnx.Module]:
    """``model``'s submodules by path, the keys joined by ``/`` (``"blocks/3"``)."""
    return {
        "/".join(map(str, path)): node
        for path, node in nnx.iter_graph(model)
        if path and isinstance(node, nnx.Module)
    }


def _check_selects(blocks: Callable) -> None:
    """Raises unless ``blocks`` can be called as ``blocks(path, module)``."""
    why = checks.cannot_take(blocks, ("blocks/0", None))
    if why:
        raise TypeError(
            f"blocks= as a function is called as blocks(path, module), with a path such as "
            f"'blocks/0', but {why}: write blocks=lambda path, module: isinstance(module, MyBlock)."
        )


def block_paths(model: nnx.Module, blocks: Any) -> list[str]:
    """The paths of ``model``'s submodules that ``blocks`` selects, for :func:`jaxoffload.plan`.

    Args:
      model: an NNX Module.
      blocks: a Module class or a tuple of them (their instances are the
        blocks), or a function ``(path, module) -> bool``.

    Raises:
      ValueError: if nothing is selected, or a selected block holds another.
    """
    if blocks is None:
        counts = collections.Counter(type(m).__name__ for m in submodules(model).values())
        repeated = ", ".join(f"{k} ({v})" for k, v in counts.most_common())
        raise ValueError(
            "say which submodules of the NNX model are its blocks: blocks=MyBlock (a class), a "
            "tuple of classes, or a function (path, module) -> bool. Its submodules' classes: "
            f"{repeated or 'none'}."
        )
    if isinstance(blocks, type) or (
        isinstance(blocks, tuple) and all(isinstance(b, type) for b in blocks)
    ):
        classes = blocks

        def select(path, module):
            return isinstance(module, classes)

    elif isinstance(blocks, nnx.Module):  # callable too, but its __call__ is the block's
        name = type(blocks).__name__
        raise TypeError(
            f"blocks= takes the blocks' class, not a block: got a {name} instance; write "
            f"blocks={name}, or a function (path, module) -> bool."
        )
    elif callable(blocks):
        _check_selects(blocks)
        select = blocks
    else:
        raise TypeError(
            f"blocks must be a Module class, a tuple of them, or a function (path, module) -> "
            f"bool; got {blocks!r}."
        )
    chosen = sorted(p for p, m in submodules(model).items() if select(p, m))
    if not chosen:
        raise ValueError(f"blocks={blocks!r} selects no submodule of {type(model).__name__}.")
    nested = [(a, b) for a in chosen for b in chosen if b.startswith(a + "/")]
    if nested:
        raise ValueError(
            f"block {nested[0][1]!r} is inside block {nested[0][0]!r}: a plan gives each block one "
            "strategy, so select blocks that do not hold one another."
        )
    return chosen


def calls_recorded() -> contextlib.AbstractContextManager[list[str]]:
    """Collects the paths of the planned blocks called (traced) inside the block, in call order."""
    return context.recording_paths()


@contextlib.contextmanager
def classes_kept(model: nnx.Module) -> Iterator[None]:
    """Puts the classes of ``model`` and of its submodules back as they were, on exit."""
    before = [(m, type(m)) for m in (model, *submodules(model).values())]
    try:
        yield
    finally:
        for module, cls in before:
            module.__class__ = cls


def functional(
    step: Callable[..., Any], model: nnx.Module, args: Sequence[Any], donate_argnums=()
) -> tuple[Callable[..., Any], tuple[Any, ...], tuple[int, ...]]:
    """``step(model, *args)`` as a function of arrays: ``(fun, arrays, donate_argnums)``.

    The Modules among ``model`` and ``args`` (an ``nnx.Optimizer``, say) are
    split into one state, the first of ``fun``'s arguments; the other
    arguments follow. ``fun`` returns ``step``'s output and the variables
    it changed, so that the updates it makes to the Modules are part of the
    program. ``donate_argnums`` (counting after ``model``) names arguments to
    donate; the Modules' state is not donated, as under ``nnx.jit``, since
    the variables that a step leaves alone stay in use.
    """
    is_node = [nnx.graph.is_graph_node(a) for a in args]
    graphdef, state = nnx.split((model, *[a for a, node in zip(args, is_node) if node]))
    others = tuple(a for a, node in zip(args, is_node) if not node)
    position = [n for n, node in enumerate(is_node) if not node]
    donate = check_argnums("donate_argnums", donate_argnums)
    beyond = [i for i in donate if not -len(args) <= i < len(args)]
    if beyond:
        raise ValueError(
            f"donate_argnums={donate} names positions {beyond}, but the step takes "
            f"{len(args)} arguments after the model (counted from 0)."
        )
    modules = [i for i in donate if is_node[i]]
    if modules:
        raise ValueError(
            f"donate_argnums={donate} names the NNX Modules at {modules}, whose state is not "
            "donated (as under nnx.jit, the variables a step leaves alone stay in use): leave "
            "them out of donate_argnums."
        )

    def fun(state, *others):
        before = jax.tree.leaves(state)
        model, *nodes = nnx.merge(graphdef, state)
        node_args, other_args = iter(nodes), iter(others)
        out = step(model, *[next(node_args) if node else next(other_args) for node in is_node])
        after = jax.tree.leaves(nnx.state((model, *nodes)))
        # Only what the step changed: a variable it never reads costs the program nothing.
        return out, [new for old, new in zip(before, after) if new is not old]

    return fun, (state, *others), tuple(1 + position.index(i % len(args)) for i in donate)
