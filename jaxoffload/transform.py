"""Function transforms that choose what a function keeps for its backward pass, and where.

:func:`offload` keeps a function's residuals in pinned host memory between its
two passes; :func:`wrap` applies any strategy value of
:mod:`jaxoffload.strategies` to a function. Both are shaped like
:func:`jax.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import flax.linen as flax_linen
import jax
import numpy as np
from flax import nnx as flax_nnx
from jax.extend import core as jex_core

from jaxoffload import cut as cut_lib
from jaxoffload import rewrite
from jaxoffload.report import OffloadWarning, _equations, _warn_once_on_one_memory
from jaxoffload.strategies import Lean, Offload, Remat, Store, Strategy, check_strategy

__all__ = [
    "OffloadedCall",
    "Residual",
    "offload",
    "offloaded_calls",
    "residuals_per_call",
    "saved_residuals",
    "wrap",
]

F = TypeVar("F", bound=Callable[..., Any])

_HOST = jax.memory.Space.Host
_DEVICE = jax.memory.Space.Device
_barrier = jax.lax.optimization_barrier


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value that the backward pass of a wrapped function reads.

    Attributes:
      shape: the residual's shape.
      dtype: its dtype.
      nbytes: its size in bytes.
      placement: ``"pinned_host"`` if it waits in host memory between the
        forward and the backward pass, ``"device"`` if it stays on the device.
      reason: why it is kept, and why it is placed there, in words.
      output: whether it is also one of the call's outputs, which the next
        layer usually keeps as its input.
      where: the operation that computes it, with its layer's name
        (``"Block_0/Conv_1: conv_general_dilated"``), or ``"input"``.
    """

    shape: tuple[int, ...]
    dtype: Any
    nbytes: int
    placement: str
    reason: str
    output: bool = False
    where: str = ""

    def __str__(self) -> str:
        dtype = getattr(self.dtype, "name", str(self.dtype))
        where = f" [{self.where}]" if self.where else ""
        return f"{dtype}{list(self.shape)} {self.nbytes:,} B -> {self.placement} ({self.reason}){where}"


@dataclasses.dataclass(frozen=True)
class OffloadedCall:
    """One wrapped call in a traced function (see :func:`offloaded_calls`).

    Attributes:
      residuals: what its backward pass reads, and where each value waits.
      flops: the floating-point operations of its forward pass's matrix
        products and convolutions (2 per multiply-add); elementwise work is
        not counted.
      grad_flops: the same, for its forward and backward passes together,
        with what the backward pass recomputes.
      rewrites: where lean rules replaced jax's, and where they could not.
      forward: its forward pass as a closed jaxpr, on its own:
        ``jax.extend.core.jaxpr_as_fun(call.forward)`` runs it, so that a
        planner can time it.
      device_inputs: the positions, among ``forward``'s inputs, of those
        kept on the device anyway (parameters).
    """

    residuals: tuple[Residual, ...]
    flops: int
    grad_flops: int
    rewrites: tuple[rewrite.Rewrite, ...] = ()
    forward: Any = dataclasses.field(default=None, repr=False, compare=False)
    device_inputs: tuple[int, ...] = ()

    @property
    def host_bytes(self) -> int:
        """The bytes of its residuals that wait in host memory: what it moves each way."""
        return sum(r.nbytes for r in self.residuals if r.placement == "pinned_host")

    @property
    def device_bytes(self) -> int:
        """The bytes of its residuals that stay on the device."""
        return sum(r.nbytes for r in self.residuals if r.placement == "device")


def wrap(
    fun: F,
    strategy: Strategy,
    *,
    device_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
) -> F:
    """Applies a strategy of :mod:`jaxoffload.strategies` to a function.

    ``Store()`` returns ``fun``; ``Remat(policy)`` is ``jax.checkpoint``;
    ``Lean()`` keeps the fewest residual bytes on the device, recomputing
    cheap values in the backward pass; ``Offload(...)`` keeps them in
    pinned host memory (see :func:`offload`).

    Args:
      fun: the function to wrap.
      strategy: what it keeps for its backward pass.
      device_argnums: positional arguments that are kept on the device anyway,
        typically parameters: they cost nothing to keep and never move.
      static_argnums: positional arguments that are not arrays, as with
        :func:`jax.checkpoint`. Keyword arguments that hold no arrays
        (``train=True``) are static without being named.

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
    device_argnums = _check_argnums("device_argnums", device_argnums)
    static_argnums = _check_argnums("static_argnums", static_argnums)
    if inspect.ismethod(fun) and _is_nnx_module(fun.__self__):
        raise TypeError(_NNX_HINT.format(name=type(fun.__self__).__name__))
    _refuse_linen(fun)
    argnums = _Argnums(device=device_argnums, static=static_argnums)
    if isinstance(strategy, Store):
        return fun

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        modules = [
            x for x in jax.tree.leaves((args, kwargs), is_leaf=_is_nnx_module) if _is_nnx_module(x)
        ]
        if modules:
            raise TypeError(_NNX_HINT.format(name=type(modules[0]).__name__))
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
    wrapped calls that follow, whatever wraps them. ``tests/test_gpu.py``
    checks on a GPU that the copies are kept and that device memory falls.

    ``offload`` is built on :func:`jax.custom_vjp`: it supports reverse-mode
    differentiation, ``jit``, ``vmap`` and sharding, but not forward mode.

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
      device_argnums: positional arguments kept on the device anyway
        (parameters): they never move.
      static_argnums: positional arguments that are not arrays; they must be
        hashable, as with :func:`jax.jit`.

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
    )

    def decorate(fun):
        return wrap(fun, strategy, device_argnums=device_argnums, static_argnums=static_argnums)

    return decorate if fun is None else decorate(fun)


_NNX_HINT = (
    "jaxoffload.wrap and jaxoffload.offload take arrays, but got the NNX Module {name}: its "
    "variable updates (BatchNorm statistics, RNG counts) would be lost. Use "
    "jaxoffload.nnx.wrap(f, strategy) or jaxoffload.nnx.offload, which write them back."
)


def _refuse_linen(fun) -> None:
    """Raises if ``fun`` is a linen Module class or instance: its variables live in a Flax scope."""
    cls = fun.func if isinstance(fun, functools.partial) else fun
    if isinstance(cls, type) and issubclass(cls, flax_linen.Module):
        raise TypeError(
            "jaxoffload.wrap and jaxoffload.offload take a function of arrays, but got the "
            f"linen Module class {cls.__name__}: it would be called to build a Module, not to "
            f"apply one. Write jaxoffload.linen.offload({cls.__name__}) or "
            f"jaxoffload.linen.wrap({cls.__name__}, strategy): they return a Module class with "
            f"{cls.__name__}'s variables."
        )
    if isinstance(fun, flax_linen.Module):
        name = type(fun).__name__
        raise TypeError(
            "jaxoffload.wrap and jaxoffload.offload take a function of arrays, but got the "
            f"linen Module {name}(...), whose variables (parameters, batch_stats) a function "
            f"transform cannot see. Write jaxoffload.linen.offload({name})(...) where you wrote "
            f"{name}(...), or wrap a pure function such as {name}(...).apply."
        )


def _holds_arrays(value) -> bool:
    return any(
        isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)
        for leaf in jax.tree.leaves(value)
    )


def _is_nnx_module(x) -> bool:
    return isinstance(x, flax_nnx.Module)


# ---- listing residuals ------------------------------------------------------------------


def saved_residuals(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """Lists the residuals of a wrapped function, where each one waits, and why.

    Args:
      fun: a function made by :func:`wrap` or :func:`offload` with ``Lean`` or
        ``Offload``.
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
            "saved_residuals expects a function made by jaxoffload.wrap or jaxoffload.offload "
            f"with Lean or Offload, got {fun!r}."
        ) from None
    calls = offloaded_calls(
        lambda args, kwargs: jax.vjp(lambda *a: fun(*a, **kwargs), *args), args, kwargs
    )
    return list(calls[0].residuals)


_recording = threading.local()


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
    calls: list[OffloadedCall] = []
    outer = getattr(_recording, "calls", None)
    _recording.calls = calls
    try:
        jax.make_jaxpr(fun)(*args, **kwargs)
    finally:
        _recording.calls = outer
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


# ---- the twin without host placement --------------------------------------------------


_placement = threading.local()


class without_host_placement:
    """Inside it, traced ``Offload`` calls keep every residual on the device.

    Only the copies go: the program is otherwise the same, barriers and all.
    Compiled, it is the twin that tells how much device memory the copies free.
    """

    def __enter__(self):
        self._outer = getattr(_placement, "off", False)
        _placement.off = True
        return self

    def __exit__(self, *exc):
        _placement.off = self._outer


# ---- arguments ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Argnums:
    device: tuple[int, ...]
    static: tuple[int, ...]

    def __post_init__(self):
        _check_disjoint(set(self.static), set(self.device))  # negative ones at the call

    def split(self, args: tuple, kwargs: dict, names: Sequence[str] = ()):
        """``(dynamic, rebuild, device)``: the array arguments, a function of them, and
        the positions among them of ``device_argnums``.

        ``names`` are the function's positional parameters, for the errors.
        """
        n = len(args)
        for what, argnums in (("static_argnums", self.static), ("device_argnums", self.device)):
            _check_positions(what, argnums, n, kwargs, names)
        static = {i % n for i in self.static}
        _check_disjoint(static, {i % n for i in self.device})
        positions = [i for i in range(n) if i not in static]
        dynamic = tuple(args[i] for i in positions)
        device = tuple(positions.index(i % n) for i in self.device)

        def rebuild(dynamic, kwargs):
            values = dict(zip(positions, dynamic))
            return [values[i] if i in values else args[i] for i in range(n)], kwargs

        return dynamic, rebuild, device


def _check_disjoint(static: set[int], device: set[int]) -> None:
    both = sorted(static & device)
    if both:
        raise ValueError(
            f"arguments {both} are in both static_argnums and device_argnums; a static argument "
            "is not an array, so it cannot be kept on the device: leave "
            f"{'it' if len(both) == 1 else 'them'} out of device_argnums."
        )


def _check_positions(
    what: str,
    argnums: Sequence[int],
    n: int,
    kwargs: dict,
    names: Sequence[str] = (),
    first: int = 0,
) -> None:
    """Raises if ``argnums`` names a position that a call with ``n`` positional arguments lacks.

    ``names`` are the function's positional parameters: one that ``argnums``
    names but the call passes by keyword is named. Positions count from
    ``first``: linen's count ``self`` as 0, and the first argument as 1.
    """
    bad = [i for i in argnums if not -n <= i - first < n]
    if not bad:
        return
    by_keyword = [names[i] for i in bad if 0 <= i < len(names) and names[i] in kwargs]
    if by_keyword:
        fix = f"; pass {', '.join(map(repr, by_keyword))} positionally"
    else:
        fix = "; pass those arguments positionally" if kwargs else ""
    counted = {0: "and there are none", 1: f"here only {first}"}.get(
        n, f"here {first} to {first + n - 1}"
    )
    raise ValueError(
        f"{what}={tuple(argnums)} names positions {bad} that this call does not have: it passes "
        f"{n} positional argument{'s' * (n != 1)}"
        + (" after self" if first else "")
        + (f" and the keywords {sorted(kwargs)}" if kwargs else "")
        + f". {what} counts the arguments passed positionally, {counted}{fix}."
    )


def _positional_names(fun: Callable[..., Any]) -> tuple[str, ...]:
    """The names of ``fun``'s positional parameters, or none where it has no signature."""
    try:
        parameters = inspect.signature(fun).parameters.values()
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds)


def _check_argnums(what: str, argnums) -> tuple[int, ...]:
    if isinstance(argnums, bool | str) or not isinstance(argnums, int | Sequence):
        raise TypeError(
            f"{what} must be an int or a sequence of ints, got {argnums!r} of type "
            f"{type(argnums).__name__}; {_argnums_hint(what, argnums)}."
        )
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    bad = [a for a in argnums if isinstance(a, bool) or not isinstance(a, int)]
    if bad:
        raise TypeError(
            f"{what} must be ints, got {bad!r} in {argnums!r}; {_argnums_hint(what, argnums)}."
        )
    return argnums


def _argnums_hint(what: str, argnums) -> str:
    """What to write instead: the same positions as ints where they are whole numbers (``1.0``)."""
    many = isinstance(argnums, tuple | list)
    values = tuple(argnums) if many else (argnums,)
    if all(type(a) is int or (isinstance(a, float) and a.is_integer()) for a in values):
        ints = tuple(int(a) for a in values)
        return f"write {what}={ints if many else ints[0]}"
    return f"write an int such as {what}=1, or a tuple such as {what}=(0, 1)"


# ---- the chain of calls in one trace ----------------------------------------------------


class _Chain:
    """The wrapped calls of one trace, in call order, and the transfers still in flight.

    A call with window ``w`` lets the next ``w - 1`` calls run before its
    host copies must be done: the outputs of call ``i + w - 1`` wait for
    call ``i``'s copies (its token), and call ``i``'s fetch starts when call
    ``i + w - 1`` starts its backward pass (the token's cotangent). So the
    device memory held by transfers in flight is bounded by the windows,
    whatever the depth. The last calls have no such later call, and nothing
    orders their fetches.
    """

    _current = threading.local()

    def __init__(self, trace):
        self.trace = trace
        self.index = 0
        self.pending: dict[int, list[jax.Array]] = {}  # call index -> tokens it gates on

    @classmethod
    def of_current_trace(cls) -> _Chain:
        trace = jex_core.get_opaque_trace_state(convention="jaxoffload")
        chain = getattr(cls._current, "chain", None)
        if chain is None or chain.trace != trace:  # a new trace starts a new chain
            chain = cls._current.chain = cls(trace)
        return chain

    def next_gates(self) -> tuple[int, list[jax.Array]]:
        """This call's index, and the tokens of earlier calls whose outputs must wait here."""
        index = self.index
        self.index += 1
        return index, self.pending.pop(index, [])

    def push(self, index: int, window: int, token: jax.Array) -> None:
        if window > 1:
            self.pending.setdefault(index + window - 1, []).append(token)


# ---- what a call keeps ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one call keeps for its backward pass: made once per trace of its forward pass.

    Attributes:
      forward: flat inputs -> flat outputs, then the saved values.
      backward: saved values -> the residuals of ``vjp``, in order.
      recomputes: whether ``backward`` computes anything.
      residuals: a description of each saved value.
      to_host: the positions of the saved values that move to the host.
      vjp_tree: the pytree structure of the ``vjp`` function.
      out_tree: the pytree structure of the outputs.
      num_outputs: how many flat outputs ``forward`` gives before the saved values.
      rewrites: where lean rules replaced jax's (:mod:`jaxoffload.rewrite`).
      recompute_flops: the FLOPs of the products that ``backward`` recomputes.
      fun: the function differentiated: the call with lean rules, or under
        ``jax.checkpoint`` for ``Offload(names=...)``.
    """

    forward: Callable[..., list[Any]]
    backward: Callable[..., list[Any]]
    recomputes: bool
    residuals: tuple[Residual, ...]
    to_host: tuple[int, ...]
    vjp_tree: Any
    out_tree: Any
    num_outputs: int
    rewrites: tuple[rewrite.Rewrite, ...]
    recompute_flops: int
    fun: Callable[..., Any]


def _plan(call, dynamic, kwargs, strategy, device_leaves: set[int]) -> _Plan:
    """Traces ``call``'s forward pass with its ``vjp`` residuals, and chooses what to keep.

    ``device_leaves`` are the positions, among the flat inputs, of leaves that
    live on the device anyway (parameters).
    """
    notes: list[rewrite.Rewrite] = []
    cut_residuals = isinstance(strategy, Lean) or (
        strategy.names is None and not strategy.recompute
    )
    if cut_residuals:
        fun = rewrite.with_lean_rules(call, notes)
    else:
        names = () if strategy.recompute else strategy.names
        policy = jax.checkpoint_policies.save_only_these_names(*names)
        fun = jax.checkpoint(call, policy=policy)
    trees = {}

    def forward_and_residuals(dynamic, kwargs):
        out, vjp_fun = jax.vjp(fun, dynamic, kwargs)
        leaves, trees["vjp"] = jax.tree.flatten(vjp_fun)
        trees["out"] = jax.tree.structure(out)
        return jax.tree.leaves(out), leaves

    closed = jax.make_jaxpr(forward_and_residuals)(dynamic, kwargs)
    jaxpr, consts = closed.jaxpr, closed.consts
    num_out = trees["out"].num_leaves
    out_atoms, residual_atoms = jaxpr.outvars[:num_out], jaxpr.outvars[num_out:]
    used = _used_residuals(trees["vjp"], [a.aval for a in residual_atoms], trees["out"], jaxpr)
    needed = [a for a, u in zip(residual_atoms, used) if u and isinstance(a, jex_core.Var)]
    params = {jaxpr.invars[i] for i in device_leaves} | set(jaxpr.constvars)
    if cut_residuals:
        chosen = _cheapest(jaxpr, needed, out_atoms, params, strategy)
        saved, recomputed, flops = list(chosen.saved), chosen.recomputed, chosen.recompute_flops
    else:
        saved, recomputed, flops, chosen = list(dict.fromkeys(needed)), (), 0, None
    residuals, to_host = _describe_saved(saved, jaxpr, out_atoms, params, strategy, chosen)
    forward = _sub_function(jaxpr, consts, list(jaxpr.invars), [*out_atoms, *saved])
    backward_eqns = [jaxpr.eqns[i] for i in recomputed]
    backward = _residuals_from(jaxpr, consts, saved, backward_eqns, residual_atoms, used)
    return _Plan(
        forward, backward, bool(recomputed), tuple(residuals), tuple(to_host),
        trees["vjp"], trees["out"], num_out, tuple(notes), flops, fun,
    )  # fmt: skip


def _cheapest(jaxpr, needed, out_atoms, params, strategy) -> cut_lib.Cut:
    """The cut that ``strategy`` keeps (see :func:`jaxoffload.cut.cheapest_cut`).

    A lean call's inputs and outputs are kept anyway, by the layers around
    it, so they cost nothing; an offloading call moves its own, and never
    more than a lean call would keep.
    """
    kept_anyway = params | set(jaxpr.invars) | {a for a in out_atoms if isinstance(a, jex_core.Var)}
    lean = cut_lib.cheapest_cut(jaxpr, needed, kept_anyway, max_recompute=strategy.max_recompute)
    if isinstance(strategy, Lean):
        return lean
    chosen = cut_lib.cheapest_cut(jaxpr, needed, params, max_recompute=strategy.max_recompute)
    return lean if _bytes(chosen.saved, params) > _bytes(lean.saved, params) else chosen


def _describe_saved(saved, jaxpr, out_atoms, params, strategy, chosen):
    """``(residuals, to_host)``: a :class:`Residual` per saved value, and which move."""
    residuals, to_host = [], []
    outputs = {a for a in out_atoms if isinstance(a, jex_core.Var)}
    for n, v in enumerate(saved):
        placement, reason = _place(v, params, strategy, jaxpr)
        if placement == "pinned_host":
            to_host.append(n)
        why = _why_kept(v, jaxpr, chosen, outputs)
        residuals.append(
            Residual(
                tuple(v.aval.shape), v.aval.dtype, cut_lib.nbytes(v.aval), placement,
                f"{why}; {reason}" if why else reason, v in outputs, _where(v, jaxpr),
            )
        )  # fmt: skip
    return residuals, to_host


def _bytes(values, free) -> int:
    return sum(cut_lib.nbytes(v.aval) for v in values if v not in free)


def _place(v, params, strategy, jaxpr) -> tuple[str, str]:
    if v in jaxpr.constvars:
        return "device", "constant"
    if v in params:
        return "device", "argument in device_argnums"
    if isinstance(strategy, Lean):
        return "device", "Lean"
    if not v.aval.shape:
        return "device", "a scalar"
    if cut_lib.nbytes(v.aval) < strategy.min_bytes:
        return "device", f"smaller than min_bytes={strategy.min_bytes}"
    return "pinned_host", "offloaded"


def _why_kept(v, jaxpr, chosen, outputs) -> str:
    """Why the cut keeps ``v`` rather than recompute it (empty without a cut)."""
    if chosen is None or v in jaxpr.invars or v in jaxpr.constvars:
        return ""
    if v in outputs:
        return "an output"
    i = next(i for i, e in enumerate(jaxpr.eqns) if v in e.outvars)
    if i in chosen.never:
        return f"not recomputable: {chosen.never[i]}"
    if cut_lib.eqn_flops(jaxpr.eqns[i]):
        return "recomputing it would pass max_recompute"
    return "keeping it costs less than recomputing it"


def _where(v, jaxpr) -> str:
    if v in jaxpr.invars:
        return "input"
    if v in jaxpr.constvars:
        return "constant"
    eqn = next(e for e in jaxpr.eqns if v in e.outvars)
    stack = str(eqn.source_info.name_stack)
    # Tracing under jax.vjp prefixes the stack with transformation names.
    stack = "/".join(s.removeprefix("jvp(").removesuffix(")") for s in stack.split("/") if s)
    return f"{stack}: {eqn.primitive.name}" if stack else eqn.primitive.name


def _sub_function(jaxpr, consts, invars, outvars) -> Callable[..., list[Any]]:
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
        list(jaxpr.constvars), list(invars), list(outvars), eqns, jaxpr.effects, _debug_info(invars)
    )
    return jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(sub, list(consts)))


def _residuals_from(jaxpr, consts, saved, eqns, residual_atoms, used):
    """saved values -> every residual leaf of ``vjp``, recomputing what was not saved."""
    needed = [a for a, u in zip(residual_atoms, used) if u and isinstance(a, jex_core.Var)]
    recompute = _sub_function(jaxpr, consts, list(saved), needed) if eqns else None
    positions = {v: n for n, v in enumerate(saved)}

    def residuals(saved_values):
        values = dict(zip(needed, recompute(*saved_values))) if recompute else {}
        leaves = []
        for atom, is_used in zip(residual_atoms, used):
            if isinstance(atom, jex_core.Literal):
                leaves.append(atom.val)
            elif not is_used:  # never read by the backward pass, so never saved
                leaves.append(jax.numpy.zeros(atom.aval.shape, atom.aval.dtype))
            elif atom in values:
                leaves.append(values[atom])
            else:
                leaves.append(saved_values[positions[atom]])
        return leaves

    return residuals


def _used_residuals(vjp_tree, avals, out_tree, jaxpr) -> list[bool]:
    """Which leaves of a vjp function its backward computation really reads.

    ``jax.vjp`` can keep values that the backward pass then ignores; keeping
    them would cost memory (and moving them two transfers) for nothing.
    """
    num_out = out_tree.num_leaves
    cotangents = jax.tree.unflatten(
        out_tree,
        [
            _struct_of(
                a.aval,
                a.aval.dtype
                if jax.dtypes.issubdtype(a.aval.dtype, np.inexact)
                else jax.dtypes.float0,
            )
            for a in jaxpr.outvars[:num_out]
        ],
    )
    structs = [_struct_of(a, a.dtype) for a in avals]
    backward = jax.make_jaxpr(lambda r, c: jax.tree.unflatten(vjp_tree, r)(c))(structs, cotangents)
    live = _live_vars(backward.jaxpr)
    return [v in live for v in backward.jaxpr.invars[: len(avals)]]


def _struct_of(aval, dtype) -> jax.ShapeDtypeStruct:
    """``aval``'s shape with ``dtype``, and its sharding where the type has one.

    Under ``jax.set_mesh`` with Explicit axes, a struct without a sharding is
    replicated, and a custom_vjp then refuses the batch-sharded cotangents.
    """
    sharding = getattr(aval, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and any(sharding.spec):
        return jax.ShapeDtypeStruct(aval.shape, dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(aval.shape, dtype)


def _live_vars(jaxpr) -> set:
    """Variables that the outputs (or an effectful equation) depend on."""
    live = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
    return live


# ---- the wrapped call -------------------------------------------------------------------


# The name of the custom_vjp of every wrapped call, by which an enclosing
# wrapped call tells it apart from the code around it.
_CALL_NAME = "jaxoffload_call"
# Calls that keep their own strategy inside an enclosing wrapped call.
_INNER_CALLS = ("checkpoint", "remat", "remat2")


def _wrapped_call(fun, strategy, argnums: _Argnums, args: tuple, kwargs: dict, check_names=True):
    dynamic, rebuild, device = argnums.split(args, kwargs, _positional_names(fun))
    # Keywords that hold no arrays (``train=True``) are static, as jit's static
    # arguments are: traced, a Python bool could not steer the function.
    static_kwargs = {k: v for k, v in kwargs.items() if not _holds_arrays(v)}
    kwargs = {k: v for k, v in kwargs.items() if k not in static_kwargs}

    def call(dynamic, kwargs):
        args, kwargs = rebuild(dynamic, kwargs)
        return fun(*args, **kwargs, **static_kwargs)

    # Flat positions of the leaves of device_argnums among (dynamic, kwargs).
    sizes = [len(jax.tree.leaves(a)) for a in dynamic]
    starts = np.cumsum([0, *sizes])
    device_leaves = {int(starts[n]) + k for n in device for k in range(sizes[n])}
    # `fun` runs once, here; what follows replays its trace. A Flax Module
    # called twice would draw its RNGs twice, and initialise other values.
    closed, out_shape = jax.make_jaxpr(call, return_shape=True)(dynamic, kwargs)
    out_tree = jax.tree.structure(out_shape)
    if check_names and isinstance(strategy, Offload) and strategy.names:
        _check_names(strategy.names, closed)
    if any(_is_inner_call(e) for e in closed.jaxpr.eqns):
        flat = _run_regions(closed, jax.tree.leaves((dynamic, kwargs)), strategy, device_leaves)
        return jax.tree.unflatten(out_tree, flat)
    traced = jex_core.jaxpr_as_fun(closed)

    def replay(dynamic, kwargs):
        return jax.tree.unflatten(out_tree, traced(*jax.tree.leaves((dynamic, kwargs))))

    if isinstance(strategy, Remat):
        remat = jax.checkpoint(replay, policy=strategy.policy, prevent_cse=strategy.prevent_cse)
        return remat(dynamic, kwargs)
    return _custom_call(replay, strategy, dynamic, kwargs, device_leaves, fun)


def _check_names(names: tuple[str, ...], closed) -> None:
    """Raises if ``names`` holds a name that the traced function never marks.

    A typo would otherwise keep nothing but the inputs, and recompute the rest.
    """
    marked = {e.params["name"] for e in _equations(closed.jaxpr) if e.primitive.name == "name"}
    missing = [n for n in names if n not in marked]
    if missing:
        raise ValueError(
            f"Offload(names={names!r}): the function marks no value named "
            f"{', '.join(map(repr, missing))} with jax.ad_checkpoint.checkpoint_name; "
            + (f"the names it marks are {sorted(marked)}." if marked else "it marks no value.")
            + " Fix the name, or mark the value: checkpoint_name(x, name)."
        )


def _is_inner_call(eqn) -> bool:
    """Whether ``eqn`` is a wrapped call (or a ``jax.checkpoint``) with a strategy of its own."""
    name = eqn.primitive.name
    if name in _INNER_CALLS:
        return True
    if not name.startswith("custom_vjp_call"):
        return False
    # jax names the function in the equation, or only in its jaxpr's debug info.
    called = eqn.params.get("name")
    if called is None:
        jaxpr = getattr(eqn.params.get("call_jaxpr"), "jaxpr", None)
        called = getattr(getattr(jaxpr, "debug_info", None), "func_name", None)
    return called == _CALL_NAME


def _run_regions(closed, flat, strategy, device_leaves) -> list[Any]:
    """Runs a traced function whose wrapped calls keep their strategies, and ``strategy`` elsewhere.

    The code between the wrapped calls (a ResNet's stem and classifier, say)
    is cut into regions, and each region that does more than elementwise
    work is wrapped with ``strategy`` on its own.
    """
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts)) | dict(zip(jaxpr.invars, flat))
    params = {jaxpr.invars[i] for i in device_leaves} | set(jaxpr.constvars)
    later_uses = _uses_after(jaxpr)

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    region: list[Any] = []

    def flush(n):
        """Runs the region that ends before equation ``n``."""
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
        sub = jex_core.Jaxpr([], inputs, outputs, list(region), jaxpr.effects, _debug_info(inputs))
        fun = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(sub, []))
        args = tuple(env[v] for v in inputs)
        if any(
            cut_lib.eqn_flops(e) or e.primitive.name.startswith("reduce_window") for e in region
        ):
            device = tuple(k for k, v in enumerate(inputs) if v in params)
            # The names were checked on the whole function; a region may mark none of them.
            argnums = _Argnums(device=device, static=())
            results = _wrapped_call(fun, strategy, argnums, args, {}, check_names=False)
        else:
            results = fun(*args)
        for v, x in zip(outputs, results):
            env[v] = x
        region.clear()

    for n, eqn in enumerate(jaxpr.eqns):
        if not _is_inner_call(eqn):
            region.append(eqn)
            continue
        flush(n)
        for v, x in zip(eqn.outvars, rewrite.bind(eqn, [read(v) for v in eqn.invars])):
            env[v] = x
    flush(len(jaxpr.eqns))
    return [read(v) for v in jaxpr.outvars]


def _uses_after(jaxpr):
    """``used(v, n)``: whether variable ``v`` is read by equation ``n`` or later, or is an output."""
    last = {v: len(jaxpr.eqns) for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    for n, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jex_core.Var):
                last[v] = max(last.get(v, -1), n)
    return lambda v, n: last.get(v, -1) >= n


def _debug_info(invars):
    return jex_core.DebugInfo("jaxoffload", "<residuals>", ("",) * len(invars), None)


def _custom_call(call, strategy, dynamic, kwargs, device_leaves, fun):
    """``call`` under one ``custom_vjp`` that keeps what ``strategy`` chooses, where it chooses."""
    chain = _Chain.of_current_trace()
    index, gates = chain.next_gates()
    window = strategy.window if isinstance(strategy, Offload) else 1
    to_host = isinstance(strategy, Offload)
    recorder = getattr(_recording, "calls", None)
    plans: dict[str, _Plan] = {}

    def run(dynamic, kwargs, gates):
        return call(dynamic, kwargs), _token()

    run.__name__ = _CALL_NAME  # how an enclosing call finds it
    run = jax.custom_vjp(run)

    def run_fwd(dynamic, kwargs, gates):
        plan = plans["plan"] = _plan(call, dynamic, kwargs, strategy, device_leaves)
        if recorder is not None:
            recorder.append(_describe(call, plan, dynamic, kwargs, device_leaves))
        if to_host:
            _say_if_nothing_moves(fun, plan)
        flat = plan.forward(*jax.tree.leaves((dynamic, kwargs)))
        out = jax.tree.unflatten(plan.out_tree, flat[: plan.num_outputs])
        saved = list(flat[plan.num_outputs :])
        with jax.named_scope("jaxoffload/to_host"):
            out, saved, token, anchors = _move_out(out, saved, plan.to_host, gates, window)
        return (out, token), (saved, anchors)

    def run_bwd(residuals, cotangents):
        plan = plans["plan"]
        saved, anchors = residuals
        cotangent, token_cotangent = cotangents
        with jax.named_scope("jaxoffload/to_device"):
            saved, cotangent, anchors = _fetch(
                saved, plan.to_host, cotangent, token_cotangent, anchors, window
            )
        if plan.recomputes:
            # Recomputed after the cotangent arrives, as jax.checkpoint does:
            # otherwise XLA merges the recomputation with the forward pass's.
            saved, cotangent = _barrier_arrays((saved, cotangent))
        vjp_fun = jax.tree.unflatten(plan.vjp_tree, plan.backward(saved))
        # Each gate's cotangent exists once this call's backward pass starts:
        # it starts the fetch of the call that gated on it.
        gate_cotangents = [_scalar_of(cotangent) for _ in gates]
        # The input cotangent leaves with the parameter cotangents: XLA would
        # otherwise sink weight-gradient work to the end of the backward pass
        # and keep every fetched residual alive until then.
        cotangents_in = _after_tokens(vjp_fun(cotangent), anchors)
        return (*_barrier_arrays(cotangents_in), gate_cotangents)

    run.defvjp(run_fwd, run_bwd)
    out, token = run(dynamic, kwargs, gates)
    chain.push(index, window, token)
    return out


def _say_if_nothing_moves(fun, plan: _Plan) -> None:
    """Warns where an offloading call moves nothing: no residual goes, or the backend has one memory."""
    if getattr(_placement, "off", False) or not plan.residuals:
        return  # the twin asks for no transfer, and a call without residuals has none to make
    if plan.to_host:
        _warn_once_on_one_memory(jax.default_backend())
        return
    warnings.warn(
        f"offload({getattr(fun, '__name__', fun)}): none of its {len(plan.residuals)} "
        "residuals moves to the host (all are in device_argnums or under min_bytes); it "
        "behaves like the plain function. saved_residuals() lists them.",
        OffloadWarning,
        stacklevel=3,
    )


def _move_out(out, saved, to_host, gates, window):
    """Moves saved values to the host, and ties the copies into the forward pass's data flow."""
    saved = list(saved)
    host = [_put(saved[n], _HOST) for n in to_host]
    # Without a barrier between the move out and the move back, XLA deletes
    # the pair.
    host = _barrier(host)
    # XLA drops a barrier operand whose output is never read, and with it the
    # ordering: every gate below is read, through `anchors`.
    anchors = []
    if window == 1:
        # The outputs wait for this call's copies, so each residual's device
        # buffer dies before the next layer runs.
        out, host = _barrier((out, host))
        token = _token()
    else:
        # The outputs of the call window - 1 calls later wait for them
        # instead; this call's copies overlap the calls in between.
        host, token = _barrier((host, _scalar_of(out)))
    if gates:
        # This call's outputs wait for the copies of the earlier calls that gated here.
        out, gates = _barrier((out, list(gates)))
        anchors.extend(gates)
    for n, value in zip(to_host, host):
        saved[n] = value
    return out, saved, token, anchors


def _fetch(saved, to_host, cotangent, token_cotangent, anchors, window):
    """Brings host values back once the backward pass needs them (see :class:`_Chain`)."""
    saved = list(saved)
    fetched = [saved[n] for n in to_host]
    if fetched and window == 1:
        fetched, cotangent = _barrier_arrays((fetched, cotangent))
    elif fetched:
        fetched, token_cotangent = _barrier_arrays((fetched, token_cotangent))
        anchors = [*anchors, token_cotangent]
    for n, value in zip(to_host, fetched):
        saved[n] = _put(value, _DEVICE)
    return saved, cotangent, anchors


def _put(value, space):
    """``jax.device_put(value, space)``, or ``value`` itself in a twin (:class:`without_host_placement`)."""
    return value if getattr(_placement, "off", False) else jax.device_put(value, space)


def _describe(call, plan: _Plan, dynamic, kwargs, device_leaves) -> OffloadedCall:
    """The record :func:`offloaded_calls` gives of one call."""
    forward = jax.make_jaxpr(call)(dynamic, kwargs)
    # Of the function that is differentiated: recomputation under names included.
    both = jax.make_jaxpr(_forward_and_backward(plan.fun))(dynamic, kwargs)
    return OffloadedCall(
        plan.residuals,
        sum(cut_lib.eqn_flops(e) for e in forward.jaxpr.eqns),
        sum(cut_lib.eqn_flops(e) for e in both.jaxpr.eqns) + plan.recompute_flops,
        plan.rewrites,
        forward,
        tuple(sorted(device_leaves)),
    )


def _forward_and_backward(call):
    """``call``'s forward pass, then its backward pass from a cotangent of zeros."""

    def both(*args):
        out, vjp_fun = jax.vjp(call, *args)
        return vjp_fun(jax.tree.map(_zero_cotangent, out))

    return both


def _zero_cotangent(x):
    if jax.dtypes.issubdtype(x.dtype, np.inexact):
        return jax.numpy.zeros_like(x)
    return np.zeros(np.shape(x), jax.dtypes.float0)


def _token() -> jax.Array:
    """A scalar token that gates nothing."""
    return jax.numpy.zeros((), np.float32)


def _scalar_of(tree) -> jax.Array:
    """A float32 scalar that exists only once ``tree`` does: one of its elements.

    A barrier over a constant gates nothing: XLA drops the operands of an
    ``optimization_barrier`` whose outputs are never read.
    """
    leaves = [x for x in jax.tree.leaves(tree) if _is_real(x) and x.size]
    if not leaves:
        return _token()
    first = leaves[0]
    # Under an Explicit mesh a sharded dimension cannot be sliced to one element: keep it
    # whole (a batch's first elements, one row per example) and take the maximum, which
    # cannot overflow (tests/test_sharding.py).
    spec = tuple(getattr(jax.typeof(first).sharding, "spec", None) or ())
    spec += (None,) * (first.ndim - len(spec))
    limit = tuple(n if axes is not None else 1 for n, axes in zip(first.shape, spec))
    element = jax.lax.slice(first, (0,) * first.ndim, limit)
    if all(n == 1 for n in limit):
        return jax.lax.reshape(element, ()).astype(np.float32)
    return jax.numpy.max(element).astype(np.float32)


def _after_tokens(tree, tokens: list[jax.Array]):
    """``tree``, its anchor leaf made to wait for every token: ``leaf + 0 * tokens``.

    XLA does not fold ``x * 0`` for floats, so the dependency survives. The
    sum is exact unless a token is inf or NaN, when the gradient already is.
    The anchor is the smallest float leaf of rank 2 or more (the smallest
    float leaf if none has that rank): small, because the add costs a pass
    over it, and not a vector, because the gradients that a training step
    never reads are vectors, such as those of BatchNorm's running statistics.
    If a program never reads the anchor, XLA drops the tokens' ordering
    (not the values).
    """
    if not tokens:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    floats = [
        n
        for n, x in enumerate(leaves)
        if _is_real(x) and jax.dtypes.issubdtype(x.dtype, np.inexact)
    ]
    if floats:
        n = min(floats, key=lambda n: (leaves[n].ndim < 2, leaves[n].size))
        zero = functools.reduce(operator.add, tokens) * 0
        leaves[n] = leaves[n] + zero.astype(leaves[n].dtype)
    return jax.tree.unflatten(treedef, leaves)


def _is_real(x) -> bool:
    return x.dtype != jax.dtypes.float0


def _barrier_arrays(tree):
    """An optimization barrier over the leaves that are real arrays (not float0)."""
    leaves, treedef = jax.tree.flatten(tree)
    real = [n for n, leaf in enumerate(leaves) if _is_real(leaf)]
    tied = _barrier([leaves[n] for n in real])
    for n, value in zip(real, tied):
        leaves[n] = value
    return jax.tree.unflatten(treedef, leaves)
