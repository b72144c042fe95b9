"""Host transfers, and the data dependencies that make XLA:GPU keep and order them.

XLA:GPU deletes a host round trip that nothing forces, and its scheduler lets
copies and fetched residuals pile up. Each construction here ties a transfer
into the data flow with ``jax.lax.optimization_barrier``; ``docs/design.md``
says why each one is there, and ``tests/test_gpu.py`` checks on a GPU that the
copies are kept and that device memory falls.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import warnings
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxoffload._src import context
from jaxoffload._src.errors import OffloadWarning

__all__ = [
    "PACK_BELOW",
    "Chain",
    "HostValues",
    "Packing",
    "after_tokens",
    "barrier_arrays",
    "empty_token",
    "fetch",
    "is_real",
    "move_out",
    "packed",
    "put_back",
    "recompute_after",
    "say_if_nothing_moves",
    "scalar_of",
    "unpacked",
    "without_host_placement",
]

_HOST = jax.memory.Space.Host
_DEVICE = jax.memory.Space.Device


@jax.custom_jvp
def _barrier(tree):
    """``jax.lax.optimization_barrier``, whose tangents pass through unbarriered.

    A second-order gradient differentiates the forward and backward rules of an
    offloaded call. jax's own rules for the barrier make a zero tangent or
    cotangent in device memory for a value in host memory, and the cotangent check
    then fails (``Expected cotangent type float32[4,8] but got float32<host>[4,8]``).
    A barrier is the identity on values, so its tangents need none: only the
    program's order is at stake, and that is the primal pass's.
    ``tests/test_composition.py::test_a_gradient_of_a_gradient_is_the_plain_one``.
    """
    return jax.lax.optimization_barrier(tree)


@functools.partial(_barrier.defjvp, symbolic_zeros=True)
def _barrier_jvp(primals, tangents):
    (tree,), (tangent,) = primals, tangents
    return _barrier(tree), tangent


def without_host_placement():
    """Inside it, traced ``Offload`` calls keep every residual on the device.

    Only the copies go: the program is otherwise the same, barriers and all.
    Compiled, it is the twin that tells how much device memory the copies free.
    """
    return context.host_placement_off()


class Chain:
    """The wrapped calls of one trace, in call order, and the transfers still in flight.

    A call with window ``w`` lets the next ``w - 1`` calls run before its
    host copies must be done: the outputs of call ``i + w - 1`` wait for
    call ``i``'s copies (its token), and call ``i``'s fetch starts when call
    ``i + w - 1`` starts its backward pass (the token's cotangent). So the
    device memory held by transfers in flight is bounded by the windows,
    whatever the depth. The last calls have no such later call, and nothing
    orders their fetches.
    """

    def __init__(self, trace):
        self.trace = trace
        self.index = 0
        self.pending: dict[int, list[jax.Array]] = {}  # call index -> tokens it gates on

    @classmethod
    def of_current_trace(cls) -> Chain:
        """The chain of the trace in progress; a new trace starts a new chain."""
        trace = jex_core.get_opaque_trace_state(convention="jaxoffload")
        return context.chain_of_trace(trace, cls)

    def next_gates(self) -> tuple[int, list[jax.Array]]:
        """This call's index, and the tokens of earlier calls whose outputs must wait here."""
        index = self.index
        self.index += 1
        return index, self.pending.pop(index, [])

    def push(self, index: int, window: int, token: jax.Array) -> None:
        if window > 1:
            self.pending.setdefault(index + window - 1, []).append(token)


def say_if_nothing_moves(fun, selection) -> None:
    """Warns where an offloading call moves nothing: no residual goes, or the backend has one memory."""
    if context.host_placement_is_off() or not selection.residuals:
        return  # the twin asks for no transfer, and a call without residuals has none to make
    if selection.to_host:
        _warn_once_on_one_memory(jax.default_backend())
        return
    # Each residual's placement reason, as saved_residuals gives it: what kept it here.
    why = sorted({r.reason.split("; ")[-1] for r in selection.residuals})
    warnings.warn(
        f"offload({getattr(fun, '__name__', fun)}): none of its {len(selection.residuals)} "
        f"residuals moves to the host ({'; '.join(why)}); it behaves like the plain function. "
        "saved_residuals() lists them.",
        OffloadWarning,
        stacklevel=3,
    )


def _warn_once_on_one_memory(platform: str) -> None:
    """Warns, once per process, that offloaded calls traced for ``platform`` move nothing.

    XLA:CPU keeps every buffer in one memory, so training on CPU with
    offload runs as it would without. Every trace of every offloaded call
    would say the same, hence once.
    """
    if platform != "cpu" or not context.say_once("one memory"):
        return
    warnings.warn(
        "offloaded calls are traced for CPU, where host placement has no effect: XLA:CPU "
        "keeps every buffer in one memory, so nothing moves and no device memory is freed "
        "(outputs and gradients are unchanged). Measure memory savings on a GPU. This "
        "warning is given once per process.",
        OffloadWarning,
        stacklevel=4,
    )


def move_out(out, saved, to_host, gates, window):
    """Moves saved values to the host, and ties the copies into the forward pass's data flow.

    Returns ``(out, saved, host, token, anchors)``: ``saved`` without the values that moved,
    which ``host`` (:class:`HostValues`) holds.
    """
    saved = list(saved)
    moving, packing = packed([saved[n] for n in to_host])
    host = HostValues(tuple(_put(value, _HOST) for value in moving), tuple(to_host), packing)
    for n in to_host:
        saved[n] = None
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
        token = empty_token()
    else:
        # The outputs of the call window - 1 calls later wait for them
        # instead; this call's copies overlap the calls in between.
        host, token = _barrier((host, scalar_of(out)))
    if gates:
        # This call's outputs wait for the copies of the earlier calls that gated here.
        out, gates = _barrier((out, list(gates)))
        anchors.extend(gates)
    return out, saved, host, token, anchors


def fetch(host, cotangent, fetch_cotangent, anchors, fetch_window):
    """Brings ``host``'s arrays back to the device once the backward pass needs them (see
    :class:`Chain`), still packed: :func:`put_back` places their values.

    Returns ``(fetched, cotangent, anchors)``.
    """
    if host.arrays and fetch_window == 1:
        host, cotangent = barrier_arrays((host, cotangent))
    elif host.arrays:
        host, fetch_cotangent = barrier_arrays((host, fetch_cotangent))
        anchors = [*anchors, fetch_cotangent]
    return [_put(value, _DEVICE) for value in host.arrays], cotangent, anchors


def recompute_after(cotangent, saved, fetched):
    """``saved`` and ``fetched`` (:func:`fetch`'s arrays) once ``cotangent`` has arrived, for the
    backward pass's recomputation to read: as ``jax.checkpoint`` recomputes, since XLA would
    otherwise merge the recomputation with the forward pass's.

    Returns ``(saved, fetched, cotangent)``.
    """
    (saved, fetched), cotangent = barrier_arrays(((saved, fetched), cotangent))
    return saved, fetched, cotangent


def put_back(saved, host, fetched):
    """``saved`` with the values of ``fetched`` (:func:`fetch`'s arrays) where they came from.

    Unpacking after the backward pass's recompute barrier, not before it, lets each slice
    fuse into the kernel that reads it: a barrier's operand is a buffer of its own.
    """
    saved = list(saved)
    for n, value in zip(host.positions, unpacked(fetched, host.packing)):
        saved[n] = value
    return saved


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class HostValues:
    """What a call moved to the host: the arrays, and where their values go back.

    Attributes:
      arrays: the values in host memory, as :func:`packed` laid them out.
      positions: where each value goes back among the call's saved values.
      packing: the layout, to unpack them.
    """

    arrays: tuple[jax.Array, ...]
    positions: tuple[int, ...]
    packing: Packing

    def tree_flatten(self):
        return self.arrays, (self.positions, self.packing)

    @classmethod
    def tree_unflatten(cls, static, arrays):
        return cls(tuple(arrays), *static)


# A host copy costs a few microseconds of stream synchronisation whatever its size
# (docs/design.md, "Copies that hide"), so a call's small values of one dtype travel as one
# buffer. A large value travels alone: packing it would cost a pass through device memory
# and a second buffer of its size. Packing concatenates, which jax differentiates: a
# gradient of a gradient reaches the packed values.
PACK_BELOW = 1 << 22


@dataclasses.dataclass(frozen=True)
class Packing:
    """How :func:`packed` laid values out: which travel alone, and the rest by dtype.

    Attributes:
      alone: the positions of the values that travel alone, in order.
      groups: per packed buffer, the position and shape of each value in it, in order.
    """

    alone: tuple[int, ...]
    groups: tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]


def packed(values: list[jax.Array]) -> tuple[list[jax.Array], Packing]:
    """``values`` as fewer arrays: the large and sharded ones alone, the rest one buffer a dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> moving, packing = packed([jnp.ones(3), jnp.arange(2, dtype=jnp.int8), jnp.zeros(1)])
      >>> [(m.shape, m.dtype.name) for m in moving]
      [((2,), 'int8'), ((4,), 'float32')]
      >>> [v.tolist() for v in unpacked(moving, packing)]
      [[1.0, 1.0, 1.0], [0, 1], [0.0]]
    """
    by_dtype: dict[Any, list[int]] = {}
    for n, value in enumerate(values):
        if _packable(value):
            by_dtype.setdefault(value.dtype, []).append(n)
    groups = [group for group in by_dtype.values() if len(group) > 1]
    in_groups = {n for group in groups for n in group}
    alone = tuple(n for n in range(len(values)) if n not in in_groups)
    buffers = [jax.numpy.concatenate([values[n].reshape(-1) for n in g]) for g in groups]
    layout = tuple(tuple((n, values[n].shape) for n in g) for g in groups)
    return [values[n] for n in alone] + buffers, Packing(alone, layout)


def unpacked(moving: list[jax.Array], packing: Packing) -> list[jax.Array]:
    """The values that :func:`packed` laid out as ``moving``, in their first order."""
    values: list[Any] = [None] * (len(packing.alone) + sum(map(len, packing.groups)))
    for n, value in zip(packing.alone, moving):
        values[n] = value
    for buffer, group in zip(moving[len(packing.alone) :], packing.groups):
        start = 0
        for n, shape in group:
            size = int(np.prod(shape, dtype=np.int64))
            values[n] = buffer[start : start + size].reshape(shape)
            start += size
    return values


def _packable(value) -> bool:
    """Small, and whole on every device: a sharded value cannot be flattened into another."""
    spec = getattr(jax.typeof(value).sharding, "spec", None) or ()
    return value.nbytes < PACK_BELOW and all(axes is None for axes in spec)


def _put(value, space):
    """``jax.device_put(value, space)``, or ``value`` itself in a twin (:class:`without_host_placement`)."""
    if context.host_placement_is_off():
        return value
    # The source named: a second-order gradient transposes the copy, and without a source
    # jax leaves the cotangent of a device value on the host.
    return jax.device_put(value, space, src=_DEVICE if space == _HOST else _HOST)


def empty_token() -> jax.Array:
    """A scalar token that gates nothing."""
    return jax.numpy.zeros((), np.float32)


def scalar_of(tree) -> jax.Array:
    """A float32 scalar that exists only once ``tree`` does: one of its elements.

    A barrier over a constant gates nothing: XLA drops the operands of an
    ``optimization_barrier`` whose outputs are never read.
    """
    leaves = [x for x in jax.tree.leaves(tree) if is_real(x) and x.size]
    if not leaves:
        return empty_token()
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


def after_tokens(tree, tokens: list[jax.Array]):
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
        n for n, x in enumerate(leaves) if is_real(x) and jax.dtypes.issubdtype(x.dtype, np.inexact)
    ]
    if floats:
        n = min(floats, key=lambda n: (leaves[n].ndim < 2, leaves[n].size))
        zero = functools.reduce(operator.add, tokens) * 0
        leaves[n] = leaves[n] + zero.astype(leaves[n].dtype)
    return jax.tree.unflatten(treedef, leaves)


def is_real(x) -> bool:
    return x.dtype != jax.dtypes.float0


def barrier_arrays(tree):
    """An optimization barrier over the leaves that are real arrays (not float0)."""
    leaves, treedef = jax.tree.flatten(tree)
    real = [n for n, leaf in enumerate(leaves) if is_real(leaf)]
    tied = _barrier([leaves[n] for n in real])
    for n, value in zip(real, tied):
        leaves[n] = value
    return jax.tree.unflatten(treedef, leaves)
