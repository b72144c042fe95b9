"""The ``offload`` transform: a function's residuals wait in pinned host memory."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import operator
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxoffload.report import OffloadWarning

__all__ = [
    "OffloadedCall",
    "Residual",
    "offload",
    "offloaded_calls",
    "residuals_per_call",
    "saved_residuals",
    "schedule",
]

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
      output: whether it is also one of the call's outputs, which the next
        layer usually keeps as its input.
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    nbytes: int
    placement: str
    reason: str
    output: bool = False

    def __str__(self) -> str:
        dtype = np.dtype(self.dtype).name
        return f"{dtype}{list(self.shape)} {self.nbytes:,} B -> {self.placement} ({self.reason})"


@dataclasses.dataclass(frozen=True)
class OffloadedCall:
    """One offloaded call in a traced function (see :func:`offloaded_calls`).

    Attributes:
      residuals: what its backward pass reads, and where each value waits.
      flops: the floating-point operations of its forward pass's matrix
        products and convolutions (2 per multiply-add); elementwise work is
        not counted.
      grad_flops: the same, for its forward and backward passes together,
        with what the backward pass recomputes.
      forward: its forward pass as a closed jaxpr, on its own:
        ``jax.extend.core.jaxpr_as_fun(call.forward)`` runs it, so that a
        planner can time it (:func:`jaxoffload.benchmark.time_offloaded_calls`).
    """

    residuals: tuple[Residual, ...]
    flops: int
    grad_flops: int
    forward: Any = dataclasses.field(repr=False, compare=False)

    @property
    def host_bytes(self) -> int:
        """The bytes of its residuals that wait in host memory: what it moves each way."""
        return sum(r.nbytes for r in self.residuals if r.placement == "pinned_host")

    @property
    def device_bytes(self) -> int:
        """The bytes of its residuals that stay on the device."""
        return sum(r.nbytes for r in self.residuals if r.placement == "device")


@dataclasses.dataclass(frozen=True)
class _Config:
    names: tuple[str, ...] | None
    min_bytes: int
    device_argnums: tuple[int, ...]
    static_argnums: tuple[int, ...]
    to_host: bool


class schedule:
    """Chains the offloaded calls made inside it, so their transfers overlap compute.

    On its own, each :func:`offload` call waits for its own transfers: its
    outputs wait for the host copies of its residuals, and its backward pass
    fetches them only once its output cotangent exists. Inside
    ``with schedule(window=w)``, the offloaded calls form one chain, in call
    order, and up to ``w`` of them have transfers in flight:

    - forward: call ``i``'s outputs wait for the host copies of call
      ``i - w + 1``, so each copy runs while the next ``w - 1`` calls compute;
    - backward: call ``i``'s residuals are fetched as soon as call
      ``i + w - 1`` starts its backward pass, so each fetch runs while the
      ``w - 1`` calls between compute theirs. The last ``w - 1`` calls have
      no such later call, and nothing orders their fetches (gating them on
      their own backward pass instead raised the device temp of a 16-layer
      chain at window 2 from 1.34 to 1.61 GB on an H200).

    Device memory for residuals in flight is therefore bounded by ``w``
    calls' residuals, whatever the depth. ``window=1`` is the behaviour
    without a schedule. Calls made with ``to_host=False`` move nothing but
    still take their turn, so that the window counts them.

    The chain links calls with scalar tokens, each one element of a value the
    earlier call made, tied to the later call by an ``optimization_barrier``
    (``FINDINGS.md`` §4, rules 2 and 3). XLA drops a barrier operand whose
    output is never read, so each call reads its gates' far sides: one of
    its gradients, a small one that a training step reads, adds zero times
    each of them. Measured on an H200, each step of the window adds one
    layer's residuals to device temp, and depth adds nothing
    (``tests/test_gpu.py``, ``benchmarks/README.md``).
    Use the context inside the differentiated function, around the layers
    (a model's ``__call__`` is a good place). Calls traced under a different
    JAX trace (inside a ``scan`` body, say) start a chain of their own.

    Args:
      window: how many offloaded calls may have transfers in flight, at least 1.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload import offload, schedule
      >>> layer = offload(lambda w, x: jnp.tanh(x @ w), device_argnums=0)
      >>> def loss(ws, x):
      ...     with schedule(window=2):
      ...         for w in ws:
      ...             x = layer(w, x)
      ...     return x.sum()
      >>> ws = [jnp.eye(4) / 2] * 3
      >>> g = jax.grad(loss)(ws, jnp.ones((2, 4)))
      >>> [gi.shape for gi in g]
      [(4, 4), (4, 4), (4, 4)]
    """

    _active = threading.local()

    def __init__(self, window: int = 2):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int of at least 1, got {window!r}.")
        self.window = window
        self._tokens: collections.deque = collections.deque()
        self._trace = None

    def __enter__(self) -> schedule:
        stack = schedule._stack()
        if self in stack:
            raise RuntimeError("this schedule is already active; make a new one to nest.")
        stack.append(self)
        self._tokens.clear()
        return self

    def __exit__(self, *exc) -> None:
        schedule._stack().pop()
        self._tokens.clear()

    @staticmethod
    def _stack() -> list[schedule]:
        if not hasattr(schedule._active, "stack"):
            schedule._active.stack = []
        return schedule._active.stack

    @staticmethod
    def current() -> schedule | None:
        """The innermost active schedule, or ``None``."""
        stack = schedule._stack()
        return stack[-1] if stack else None

    def _next_gate(self):
        """The token of the call ``window - 1`` calls back, if this call waits on one."""
        trace = jex_core.get_opaque_trace_state(convention="jaxoffload")
        if trace != self._trace:  # a new trace: its calls cannot use the old tokens
            self._tokens.clear()
            self._trace = trace
        if self.window > 1 and len(self._tokens) == self.window - 1:
            return self._tokens.popleft()
        return None

    def _push(self, token) -> None:
        if self.window > 1:
            self._tokens.append(token)


@overload
def offload(
    fun: F,
    *,
    names: Sequence[str] | None = None,
    min_bytes: int = 0,
    device_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    to_host: bool = True,
) -> F: ...


@overload
def offload(
    fun: None = None,
    *,
    names: Sequence[str] | None = None,
    min_bytes: int = 0,
    device_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    to_host: bool = True,
) -> Callable[[F], F]: ...


def offload(
    fun=None,
    *,
    names=None,
    min_bytes=0,
    device_argnums=(),
    static_argnums=(),
    to_host=True,
):
    """Keeps ``fun``'s residuals in pinned host memory between its two passes.

    ``offload`` is shaped like :func:`jax.checkpoint`. Where ``jax.checkpoint``
    throws residuals away and recomputes them, ``offload`` moves them to
    ``pinned_host`` memory at the end of ``fun``'s forward pass and brings them
    back when ``fun``'s backward pass starts. Outputs and gradients are those of
    ``fun``; only where the residuals wait changes.

    Which residuals move is decided by these rules, in order (see
    :func:`saved_residuals` to list them for given arguments):

    1. with ``to_host=False``, none: the call keeps its residuals on the
       device but still takes its turn in a :class:`schedule`;
    2. residuals that *are* leaves of the arguments in ``device_argnums`` stay
       on the device: those arrays live on the device anyway (parameters);
    3. residuals smaller than ``min_bytes`` stay on the device;
    4. every other residual moves to the host.

    If a function has residuals but none of them moves although ``to_host``
    is true, an :class:`~jaxoffload.OffloadWarning` says so when it is
    differentiated.

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

    So on its own, an offloaded call waits for its transfers. Inside a
    :class:`schedule`, consecutive calls are chained instead, and each
    transfer overlaps the compute of the calls around it.
    ``tests/test_gpu.py`` checks on a GPU that the copies are kept and that
    device memory falls.

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
      to_host: ``False`` keeps every residual on the device; the call still
        orders its backward pass as above and counts in a :class:`schedule`'s
        window.

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
        to_host=_check_to_host(to_host),
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


_recording = threading.local()


def offloaded_calls(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> list[OffloadedCall]:
    """Lists every offloaded call that ``fun`` differentiates: its residuals and its compute.

    ``fun`` is traced, not run, so arguments may be
    :class:`jax.ShapeDtypeStruct`. It must take gradients itself, as a
    training step does: residuals exist only under differentiation.

    Returns:
      One :class:`OffloadedCall` per offloaded call, in call order.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload import offload, offloaded_calls
      >>> layer = offload(lambda w, x: jnp.tanh(x @ w), device_argnums=0)
      >>> step = jax.grad(lambda w, x: layer(w, layer(w, x)).sum())
      >>> calls = offloaded_calls(step, jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> [(c.flops, c.host_bytes) for c in calls]
      [(512, 384), (512, 384)]
    """
    calls: list[tuple[list[Residual], int, int, Any]] = []
    outer = getattr(_recording, "calls", None)
    _recording.calls = calls
    try:
        jax.make_jaxpr(fun)(*args, **kwargs)
    finally:
        _recording.calls = outer
    return [OffloadedCall(tuple(residuals), *rest) for residuals, *rest in calls]


def residuals_per_call(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> list[list[Residual]]:
    """Lists, for every offloaded call that ``fun`` differentiates, its residuals.

    ``[list(call.residuals) for call in offloaded_calls(fun, *args, **kwargs)]``:
    one list per offloaded call, in call order (see :func:`offloaded_calls`).
    """
    return [list(call.residuals) for call in offloaded_calls(fun, *args, **kwargs)]


def _matmul_flops(jaxpr) -> int:
    """2 × the multiply-adds of the matrix products and convolutions in ``jaxpr``, nested ones too."""
    total = 0
    for eqn in jaxpr.eqns:
        out = eqn.outvars[0].aval.shape if eqn.outvars else ()
        if eqn.primitive.name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(out) * math.prod(lhs[d] for d in contracting)
        elif eqn.primitive.name == "conv_general_dilated":
            rhs = eqn.invars[1].aval.shape
            out_features = rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += 2 * math.prod(out) * (math.prod(rhs) // out_features)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    total += _matmul_flops(sub.jaxpr)
                elif isinstance(sub, jex_core.Jaxpr):
                    total += _matmul_flops(sub)
    return total


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
    if record is None and getattr(_recording, "calls", None) is not None:
        record = []
        forward = jax.make_jaxpr(call)(dynamic, kwargs)
        both = jax.make_jaxpr(_forward_and_backward(call))(dynamic, kwargs)
        flops = _matmul_flops(forward.jaxpr), _matmul_flops(both.jaxpr)
        _recording.calls.append((record, *flops, forward))
    # The backward pass needs the pytree structure of the forward pass's vjp
    # function; custom_vjp traces the two rules one after the other.
    saved: dict[str, Any] = {}
    chain = schedule.current()
    gate = chain._next_gate() if chain is not None else None
    # How many later calls this call's transfers may overlap.
    delay = chain.window - 1 if chain is not None else 0

    @jax.custom_vjp
    def run(dynamic, kwargs, gate):
        return call(dynamic, kwargs), _token()

    def run_fwd(dynamic, kwargs, gate):
        out, vjp_fun = jax.vjp(call, dynamic, kwargs)
        leaves, treedef = jax.tree.flatten(vjp_fun)
        kept_ids = {id(leaf) for n in keep for leaf in jax.tree.leaves(dynamic[n])}
        out_ids = {id(leaf) for leaf in jax.tree.leaves(out)}
        used = _used_residuals(treedef, leaves, out)
        to_host, residuals, dead = [], [], {}
        for n, (leaf, is_used) in enumerate(zip(leaves, used)):
            placement, reason = _place(leaf, is_used, kept_ids, config)
            if placement is None:
                dead[n] = (np.shape(leaf), leaf.dtype)
                residuals.append(None)
                continue
            if record is not None:
                record.append(_describe(leaf, placement, reason, id(leaf) in out_ids))
            if placement == "pinned_host":
                to_host.append(len(residuals))
            residuals.append(leaf)
        kept = [n for n in range(len(leaves)) if n not in dead]
        if config.to_host and kept and not to_host:
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
            # XLA drops a barrier operand whose output is never read, and with
            # it the ordering: every gate below is read, through `anchors`.
            anchors = []
            if delay == 0:
                # The outputs wait for this call's copies, so each residual's
                # device buffer dies before the next layer runs (rule 2).
                out, host = _barrier((out, host))
                token = _token()
            else:
                # In a schedule, they wait for the copies of the call `delay`
                # calls back; this call's copies overlap the next calls. The
                # barriers cost nothing; adding zero times the gate to an output
                # would cost a pass over it.
                if gate is not None:
                    out, gate = _barrier((out, gate))
                    anchors.append(gate)
                host, token = _barrier((host, _scalar_of(out)))
        for n, value in zip(to_host, host):
            residuals[n] = value
        saved.update(treedef=treedef, dead=dead, to_host=tuple(to_host))
        return (out, token), (residuals, anchors)

    def run_bwd(saved_values, cotangents):
        residuals, anchors = saved_values
        cotangent, token_cotangent = cotangents
        residuals = list(residuals)
        to_host = saved["to_host"]
        with jax.named_scope("jaxoffload/to_device"):
            # Fetch only once the output cotangent exists (or, in a schedule,
            # once the call `delay` calls later starts its backward pass), so
            # fetched values do not wait on the device for long (rule 3).
            fetched = [residuals[n] for n in to_host]
            if fetched and delay == 0:
                fetched, cotangent = _barrier_arrays((fetched, cotangent))
            elif fetched:
                fetched, token_cotangent = _barrier_arrays((fetched, token_cotangent))
                anchors = [*anchors, token_cotangent]
            for n, value in zip(to_host, fetched):
                residuals[n] = jax.device_put(value, _DEVICE)
        for n, (shape, dtype) in saved["dead"].items():
            # Never read by the backward pass, so never saved: a placeholder.
            residuals[n] = jax.numpy.zeros(shape, dtype)
        vjp_fun = jax.tree.unflatten(saved["treedef"], residuals)
        # The gate's cotangent exists once this call's backward pass starts:
        # it starts the fetch of the call `delay` calls back.
        gate_cotangent = _scalar_of(cotangent) if gate is not None else None
        # The gates' far sides are read by one gradient (the anchor), so that
        # XLA keeps them. The input cotangent leaves with the parameter cotangents:
        # XLA would otherwise sink weight-gradient work to the end of the
        # backward pass and keep every fetched residual alive until then (rule 3).
        cotangents_in = _after_tokens(vjp_fun(cotangent), anchors)
        return (*_barrier_arrays(cotangents_in), gate_cotangent)

    run.defvjp(run_fwd, run_bwd)
    out, token = run(dynamic, kwargs, gate)
    if chain is not None:
        chain._push(token)
    return out


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
    element = jax.lax.slice(first, (0,) * first.ndim, (1,) * first.ndim)
    return jax.lax.reshape(element, ()).astype(np.float32)


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


def _place(leaf, is_used: bool, kept_ids: set[int], config: _Config) -> tuple[str | None, str]:
    if not is_used:
        return None, "not read by the backward pass"
    if not isinstance(leaf, jax.Array):
        return "device", "constant"
    if not config.to_host:
        return "device", "to_host=False"
    if id(leaf) in kept_ids:
        return "device", "argument in device_argnums"
    if _nbytes(leaf) < config.min_bytes:
        return "device", f"smaller than min_bytes={config.min_bytes}"
    return "pinned_host", "offloaded"


def _describe(leaf, placement: str, reason: str, output: bool) -> Residual:
    shape, dtype = tuple(np.shape(leaf)), np.dtype(leaf.dtype)
    return Residual(shape, dtype, _nbytes(leaf), placement, reason, output)


def _nbytes(leaf) -> int:
    return int(np.prod(np.shape(leaf), dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def _barrier_arrays(tree):
    """An optimization barrier over the leaves that are real arrays (not float0)."""
    leaves, treedef = jax.tree.flatten(tree)
    real = [n for n, leaf in enumerate(leaves) if _is_real(leaf)]
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


def _check_to_host(to_host) -> bool:
    if not isinstance(to_host, bool):
        raise TypeError(f"to_host must be a bool, got {to_host!r}.")
    return to_host


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
