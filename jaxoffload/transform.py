"""The ``offload`` transform: a function's residuals wait in pinned host memory."""

from __future__ import annotations

import dataclasses
import functools
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxoffload.report import OffloadWarning

__all__ = ["Residual", "offload", "saved_residuals"]

F = TypeVar("F", bound=Callable[..., Any])

_HOST = jax.memory.Space.Host
_DEVICE = jax.memory.Space.Device
_barrier = jax.lax.optimization_barrier


@dataclasses.dataclass(frozen=True)
class Residual:
    """One value that the backward pass of an offloaded function reads.

    Attributes:
      shape: the residual's shape.
      dtype: its dtype.
      nbytes: its size in bytes.
      placement: ``"pinned_host"`` if it waits in host memory between the
        forward and the backward pass, ``"device"`` if it stays on the device.
      reason: why it is placed there, in words.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    placement: str
    reason: str

    def __str__(self) -> str:
        dtype = np.dtype(self.dtype).name
        return f"{dtype}{list(self.shape)} {self.nbytes:,} B -> {self.placement} ({self.reason})"


@dataclasses.dataclass(frozen=True)
class _Config:
    names: tuple[str, ...] | None
    min_bytes: int
    device_argnums: tuple[int, ...]
    static_argnums: tuple[int, ...]


@overload
def offload(
    fun: F,
    *,
    names: Sequence[str] | None = None,
    min_bytes: int = 0,
    device_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
) -> F: ...


@overload
def offload(
    fun: None = None,
    *,
    names: Sequence[str] | None = None,
    min_bytes: int = 0,
    device_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
) -> Callable[[F], F]: ...


def offload(
    fun=None,
    *,
    names=None,
    min_bytes=0,
    device_argnums=(),
    static_argnums=(),
):
    """Keeps ``fun``'s residuals in pinned host memory between its two passes.

    ``offload`` is shaped like :func:`jax.checkpoint`. Where ``jax.checkpoint``
    throws residuals away and recomputes them, ``offload`` moves them to
    ``pinned_host`` memory at the end of ``fun``'s forward pass and brings them
    back when ``fun``'s backward pass starts. Outputs and gradients are those of
    ``fun``; only where the residuals wait changes.

    Which residuals move is decided by these rules, in order (see
    :func:`saved_residuals` to list them for given arguments):

    1. residuals that *are* leaves of the arguments in ``device_argnums`` stay
       on the device: those arrays live on the device anyway (parameters);
    2. residuals smaller than ``min_bytes`` stay on the device;
    3. every other residual moves to the host.

    If a function has residuals but none of them moves, an
    :class:`~jaxoffload.OffloadWarning` says so when it is differentiated.

    With ``names``, ``fun`` is first wrapped in ``jax.checkpoint`` with
    ``save_only_these_names(*names)``: the residuals are then the values named
    with :func:`jax.ad_checkpoint.checkpoint_name` and the arguments, and all
    else is recomputed in the backward pass.

    XLA:GPU deletes a host round trip that nothing forces, and its scheduler
    lets fetched residuals and weight-gradient work pile up. The transfers are
    therefore tied into the data flow with ``jax.lax.optimization_barrier``:

    - the host copy is separated from its way back, so the pair is kept;
    - ``fun``'s outputs wait for the host copies of its residuals, so a
      residual's device buffer dies before the next layer runs;
    - the residuals are fetched only once the output cotangent has arrived,
      and the input cotangent leaves together with the parameter cotangents,
      so the previous offloaded function fetches only after this one's
      weight gradients exist.

    The backward pass therefore waits for each fetch: transfers are not yet
    overlapped with compute. ``tests/test_gpu.py`` checks on a GPU that the
    copies are kept and that device memory falls.

    ``offload`` is built on :func:`jax.custom_vjp`, so it supports reverse-mode
    differentiation (``grad``, ``vjp``, ``value_and_grad``), ``jit``, ``vmap``
    and sharding, but not forward mode (``jvp``, ``linearize``, ``hessian``).

    Args:
      fun: the function to wrap. Its array arguments are differentiated as
        with :func:`jax.vjp`; integer arguments get ``float0`` cotangents.
      names: optional names of :func:`~jax.ad_checkpoint.checkpoint_name`
        values to keep; everything else is recomputed.
      min_bytes: residuals smaller than this stay on the device.
      device_argnums: positional arguments whose leaves stay on the device when
        they are residuals, typically parameters.
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
    config = _Config(
        names=_check_names(names),
        min_bytes=_check_min_bytes(min_bytes),
        device_argnums=_check_argnums("device_argnums", device_argnums),
        static_argnums=_check_argnums("static_argnums", static_argnums),
    )
    if fun is None:
        return functools.partial(_offload, config=config)
    return _offload(fun, config=config)


def _offload(fun: F, *, config: _Config) -> F:
    if not callable(fun):
        raise TypeError(f"offload expects a callable, got {fun!r} of type {type(fun).__name__}.")

    @functools.wraps(fun)
    def offloaded(*args, **kwargs):
        return _offloaded_call(fun, config, args, kwargs, record=None)

    offloaded.__jaxoffload__ = (fun, config)  # type: ignore[attr-defined]
    return offloaded  # type: ignore[return-value]


def saved_residuals(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Residual]:
    """Lists the residuals of an offloaded function and where each one waits.

    Args:
      fun: a function made by :func:`offload`.
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
      float32[8, 8] 256 B -> device (argument in device_argnums)
      float32[4, 8] 128 B -> pinned_host (offloaded)
      float32[4, 8] 128 B -> pinned_host (offloaded)
    """
    try:
        inner, config = fun.__jaxoffload__  # type: ignore[attr-defined]
    except AttributeError:
        raise TypeError(
            f"saved_residuals expects a function made by jaxoffload.offload, got {fun!r}."
        ) from None
    found: list[Residual] = []

    def trace(*args, **kwargs):
        jax.grad(
            lambda *a: _sum_outputs(_offloaded_call(inner, config, a, kwargs, record=found)),
            argnums=tuple(i for i in range(len(args)) if i not in set(config.static_argnums)),
            allow_int=True,
        )(*args)

    jax.make_jaxpr(trace, static_argnums=config.static_argnums)(*args, **kwargs)
    return found


def _sum_outputs(out) -> jax.Array:
    floats = [
        leaf.astype(np.float32).sum()
        for leaf in jax.tree.leaves(out)
        if jax.dtypes.issubdtype(leaf.dtype, np.inexact)
    ]
    return functools.reduce(operator.add, floats, np.float32(0))


def _offloaded_call(fun, config: _Config, args: tuple, kwargs: dict, record: list | None):
    static = {i % len(args) for i in config.static_argnums if -len(args) <= i < len(args)}
    if len(static) != len(config.static_argnums):
        raise ValueError(
            f"static_argnums={config.static_argnums} names positions that a call with "
            f"{len(args)} positional arguments does not have."
        )
    if any(not -len(args) <= i < len(args) for i in config.device_argnums):
        raise ValueError(
            f"device_argnums={config.device_argnums} names positions that a call with "
            f"{len(args)} positional arguments does not have."
        )
    dynamic = tuple(a for i, a in enumerate(args) if i not in static)
    # Positions of device_argnums among the dynamic arguments.
    dynamic_index = {i: n for n, i in enumerate(i for i in range(len(args)) if i not in static)}
    keep = tuple(
        dynamic_index[i % len(args)]
        for i in config.device_argnums
        if i % len(args) in dynamic_index
    )

    def call(dynamic, kwargs):
        it = iter(dynamic)
        full = [args[i] if i in static else next(it) for i in range(len(args))]
        return fun(*full, **kwargs)

    if config.names is not None:
        call = jax.checkpoint(
            call, policy=jax.checkpoint_policies.save_only_these_names(*config.names)
        )
    # The backward pass needs the pytree structure of the forward pass's vjp
    # function; custom_vjp traces the two rules one after the other.
    saved: dict[str, Any] = {}

    @jax.custom_vjp
    def run(dynamic, kwargs):
        return call(dynamic, kwargs)

    def run_fwd(dynamic, kwargs):
        out, vjp_fun = jax.vjp(call, dynamic, kwargs)
        leaves, treedef = jax.tree.flatten(vjp_fun)
        kept_ids = {id(leaf) for n in keep for leaf in jax.tree.leaves(dynamic[n])}
        used = _used_residuals(treedef, leaves, out)
        to_host, residuals, dead = [], [], {}
        for n, (leaf, is_used) in enumerate(zip(leaves, used)):
            placement, reason = _place(leaf, is_used, kept_ids, config.min_bytes)
            if placement is None:
                dead[n] = (np.shape(leaf), leaf.dtype)
                residuals.append(None)
                continue
            if record is not None:
                record.append(_describe(leaf, placement, reason))
            if placement == "pinned_host":
                to_host.append(len(residuals))
            residuals.append(leaf)
        kept = [n for n in range(len(leaves)) if n not in dead]
        if kept and not to_host:
            warnings.warn(
                f"offload({getattr(fun, '__name__', fun)}): none of its {len(kept)} residuals "
                "moves to the host (all are in device_argnums or under min_bytes); it behaves "
                "like the plain function. saved_residuals() lists them.",
                OffloadWarning,
                stacklevel=2,
            )
        with jax.named_scope("jaxoffload/to_host"):
            host = [jax.device_put(residuals[n], _HOST) for n in to_host]
            # Without a barrier between the move out and the move back, XLA
            # deletes the pair (FINDINGS §4, rule 1).
            host = _barrier(host)
            # The outputs wait for the copies, so each residual's device buffer
            # is free before the next layer runs (rule 2).
            out, host = _barrier((out, host))
        for n, value in zip(to_host, host):
            residuals[n] = value
        saved.update(treedef=treedef, dead=dead, to_host=tuple(to_host))
        return out, residuals

    def run_bwd(residuals, cotangent):
        residuals = list(residuals)
        to_host = saved["to_host"]
        with jax.named_scope("jaxoffload/to_device"):
            # Fetch only once the output cotangent exists, so the fetched values
            # do not sit on the device while later layers run backwards (rule 3).
            host, cotangent = _barrier_arrays(([residuals[n] for n in to_host], cotangent))
            for n, value in zip(to_host, host):
                residuals[n] = jax.device_put(value, _DEVICE)
        for n, (shape, dtype) in saved["dead"].items():
            # Never read by the backward pass, so never saved: a placeholder.
            residuals[n] = jax.numpy.zeros(shape, dtype)
        vjp_fun = jax.tree.unflatten(saved["treedef"], residuals)
        cotangents = vjp_fun(cotangent)
        # The input cotangent leaves with the parameter cotangents. XLA would
        # otherwise sink weight-gradient work to the end of the backward pass
        # and keep every fetched residual alive until then (rule 3).
        return _barrier_arrays(cotangents)

    run.defvjp(run_fwd, run_bwd)
    return run(dynamic, kwargs)


def _place(leaf, is_used: bool, kept_ids: set[int], min_bytes: int) -> tuple[str | None, str]:
    if not is_used:
        return None, "not read by the backward pass"
    if not isinstance(leaf, jax.Array):
        return "device", "constant"
    if id(leaf) in kept_ids:
        return "device", "argument in device_argnums"
    if _nbytes(leaf) < min_bytes:
        return "device", f"smaller than min_bytes={min_bytes}"
    return "pinned_host", "offloaded"


def _describe(leaf, placement: str, reason: str) -> Residual:
    return Residual(tuple(np.shape(leaf)), np.dtype(leaf.dtype), _nbytes(leaf), placement, reason)


def _nbytes(leaf) -> int:
    return int(np.prod(np.shape(leaf), dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def _barrier_arrays(tree):
    """An optimization barrier over the leaves that are real arrays (not float0)."""
    leaves, treedef = jax.tree.flatten(tree)
    real = [n for n, leaf in enumerate(leaves) if leaf.dtype != jax.dtypes.float0]
    tied = _barrier([leaves[n] for n in real])
    for n, value in zip(real, tied):
        leaves[n] = value
    return jax.tree.unflatten(treedef, leaves)


def _used_residuals(treedef, leaves: list, out) -> list[bool]:
    """Which leaves of a vjp function its backward computation really reads.

    ``jax.vjp`` can keep values that the backward pass then ignores; moving them
    would cost two transfers for nothing.
    """
    avals = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
    cotangents = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape,
            x.dtype if jax.dtypes.issubdtype(x.dtype, np.inexact) else jax.dtypes.float0,
        ),
        out,
    )
    jaxpr = jax.make_jaxpr(lambda r, c: jax.tree.unflatten(treedef, r)(c))(avals, cotangents).jaxpr
    live = _live_vars(jaxpr)
    return [v in live for v in jaxpr.invars[: len(leaves)]]


def _live_vars(jaxpr) -> set:
    """Variables that the outputs (or an effectful equation) depend on."""
    live = {v for v in jaxpr.outvars if isinstance(v, jex_core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            live.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
    return live


def _check_names(names) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str):
        raise TypeError(
            f"names must be a sequence of strings, got the string {names!r}; write names=[{names!r}]."
        )
    names = tuple(names)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"names must be strings, got {bad!r}.")
    return names


def _check_min_bytes(min_bytes) -> int:
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"min_bytes must be a non-negative int, got {min_bytes!r}.")
    return min_bytes


def _check_argnums(what: str, argnums) -> tuple[int, ...]:
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    bad = [a for a in argnums if isinstance(a, bool) or not isinstance(a, int)]
    if bad:
        raise TypeError(f"{what} must be ints, got {bad!r}.")
    return argnums
