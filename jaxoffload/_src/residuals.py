"""What a wrapped call keeps for its backward pass, where each value waits, and why.

:func:`select` traces a call's forward pass with its ``jax.vjp`` residuals and
chooses what to keep, as its strategy answers: jax's residuals (``Store``), a
``jax.checkpoint`` policy's (``Remat``, ``Offload(names=...)``), or the cheapest
cut of the forward graph with lean rules (:mod:`jaxoffload._src.cut`,
:mod:`jaxoffload._src.rewrite`). :class:`Residual` and :class:`OffloadedCall`
describe the result for people.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.extend import core as jex_core

from jaxoffload._src import cut as cut_lib
from jaxoffload._src import jaxprs, rewrite
from jaxoffload._src.jaxprs import (
    VjpTrace,
    eqn_flops,
    fingerprint,
    format_bytes,
    nbytes,
    sub_function,
    trace_vjp,
)
from jaxoffload._src.strategies import Strategy

__all__ = [
    "SELECTIONS",
    "OffloadedCall",
    "Residual",
    "Selection",
    "check_marked",
    "describe",
    "restructured",
    "select",
    "select_once",
]


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
      strategy: the strategy that chose its residuals: the one it was wrapped
        with, or the fallback that ``Lean(max_slowdown=...)`` took.
    """

    residuals: tuple[Residual, ...]
    flops: int
    grad_flops: int
    rewrites: tuple[rewrite.Rewrite, ...] = ()
    forward: Any = dataclasses.field(default=None, repr=False, compare=False)
    device_inputs: tuple[int, ...] = ()
    strategy: Strategy | None = None

    @property
    def host_bytes(self) -> int:
        """The bytes of its residuals that wait in host memory: what it moves each way."""
        return sum(r.nbytes for r in self.residuals if r.placement == "pinned_host")

    @property
    def device_bytes(self) -> int:
        """The bytes of its residuals that stay on the device."""
        return sum(r.nbytes for r in self.residuals if r.placement == "device")

    def __repr__(self) -> str:
        n = len(self.residuals)
        return (
            f"OffloadedCall({n} residual{'s' * (n != 1)}, {format_bytes(self.host_bytes)} on the host, "
            f"{format_bytes(self.device_bytes)} on the device, {_count(self.flops)}FLOP)"
        )

    def __str__(self) -> str:
        """Its sizes, then one line per residual and per rewrite.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> from jaxoffload import offload, offloaded_calls
          >>> layer = offload(lambda w, x: jnp.tanh(x @ w), device_argnums=0)
          >>> step = jax.grad(lambda w, x: layer(w, x).sum())
          >>> (call,) = offloaded_calls(step, jnp.ones((8, 8)), jnp.ones((4, 8)))
          >>> call
          OffloadedCall(3 residuals, 256 B on the host, 256 B on the device, 512 FLOP)
          >>> print(call)
          OffloadedCall(3 residuals, 256 B on the host, 256 B on the device, 512 FLOP)
            float32[4, 8] 128 B -> pinned_host (offloaded) [input]
            float32[8, 8] 256 B -> device (argument in device_argnums) [input]
            float32[4, 8] 128 B -> pinned_host (an output; offloaded) [tanh]
        """
        lines = [repr(self), *(f"  {r}" for r in self.residuals)]
        lines += [f"  rewrite: {r}" for r in self.rewrites]
        return "\n".join(lines)


def _count(n: int) -> str:
    """A count with an SI prefix and a space: ``'2.1 G'``, ``'512 '``."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {prefix}"
    return f"{n} "


@dataclasses.dataclass(frozen=True)
class Selection:
    """What one call keeps for its backward pass, and where: made once per trace of its forward pass.

    Attributes:
      forward: flat inputs -> flat outputs, then the saved values.
      backward: saved values -> the residuals of ``vjp``, in order.
      recomputes: whether ``backward`` computes anything.
      residuals: a description of each saved value.
      to_host: the positions of the saved values that move to the host.
      vjp_tree: the pytree structure of the ``vjp`` function.
      out_tree: the pytree structure of the outputs.
      num_outputs: how many flat outputs ``forward`` gives before the saved values.
      rewrites: where lean rules replaced jax's (:mod:`jaxoffload._src.rewrite`).
      recompute_flops: the FLOPs of the products that ``backward`` recomputes.
      grad_flops: those of the function differentiated (the call with lean rules,
        or under ``jax.checkpoint``), forward and backward, and ``recompute_flops``.
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
    grad_flops: int


def select(
    call, dynamic, kwargs, strategy: Strategy, device_leaves: Mapping[int, str]
) -> Selection:
    """Traces ``call``'s forward pass with its ``vjp`` residuals, and chooses what to keep.

    ``device_leaves`` are the positions, among the flat inputs, of leaves that
    live on the device anyway (parameters), each with why, in words.
    """
    differentiated = _differentiate(call, dynamic, kwargs, strategy)
    kept = _kept(differentiated, strategy, device_leaves)
    return _selection(differentiated, strategy, device_leaves, kept)


@dataclasses.dataclass(frozen=True)
class _Differentiated:
    """The ``vjp`` of the function that a strategy differentiates, traced, and where lean rules
    replaced jax's: the same for every strategy that cuts, and for a strategy's windows and caps."""

    traced: VjpTrace
    notes: tuple[rewrite.Rewrite, ...]


def _differentiate(call, dynamic, kwargs, strategy: Strategy) -> _Differentiated:
    notes: list[rewrite.Rewrite] = []
    if strategy.cuts:
        fun = rewrite.with_lean_rules(call, notes)
    else:
        fun = strategy.checkpointed(call) or call
    traced = trace_vjp(fun, dynamic, kwargs)
    return _Differentiated(traced, tuple(notes))


def _kept(differentiated: _Differentiated, strategy: Strategy, device_leaves):
    """``(saved, recomputed, recompute_flops, cut, stay)``: what ``strategy`` keeps, and
    recomputes in the backward pass; the same for its windows, not always for its caps
    (:func:`_cheapest`). ``stay`` maps the saved values that the cut keeps on the device
    whatever the strategy's placement, to why."""
    traced = differentiated.traced
    if not strategy.cuts:
        return list(dict.fromkeys(traced.needed)), (), 0, None, {}
    jaxpr = traced.jaxpr
    params = {jaxpr.invars[i] for i in device_leaves} | set(jaxpr.constvars)
    chosen, stay = _cheapest(jaxpr, traced.needed, traced.outputs, params, strategy)
    return list(chosen.saved), chosen.recomputed, chosen.recompute_flops, chosen, stay


def _selection(differentiated: _Differentiated, strategy, device_leaves, kept) -> Selection:
    """The selection that keeps ``kept`` (:func:`_kept`), each saved value where ``strategy`` puts it."""
    traced, (saved, recomputed, flops, chosen, stay) = differentiated.traced, kept
    jaxpr, consts = traced.jaxpr, traced.consts
    on_device = {**stay, **{jaxpr.invars[i]: why for i, why in device_leaves.items()}}
    residuals, to_host = _describe_saved(saved, jaxpr, traced.outputs, on_device, strategy, chosen)
    forward = sub_function(jaxpr, consts, list(jaxpr.invars), [*traced.outputs, *saved])
    backward_eqns = [jaxpr.eqns[i] for i in recomputed]
    backward = _residuals_from(traced, saved, backward_eqns)
    grad_flops = sum(eqn_flops(e) for j in (jaxpr, traced.backward.jaxpr) for e in j.eqns) + flops
    return Selection(
        forward, backward, bool(recomputed), tuple(residuals), tuple(to_host),
        traced.vjp_tree, traced.out_tree, len(traced.outputs), differentiated.notes, flops,
        grad_flops,
    )  # fmt: skip


# Selections, and the traces and cuts that they are made of, by what decides them, so that
# a model's repeated blocks, and a planner's steps under many plans, trace each distinct
# call once for every strategy that cuts, and cut it once for each strategy's windows and caps.
SELECTIONS: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
_SELECTIONS_KEPT = 512


def select_once(
    closed, out_tree, call, dynamic, kwargs, strategy: Strategy, device_leaves: Mapping[int, str]
) -> Selection:
    """:func:`select`, made once per distinct call: ``call`` replays ``closed``, its closed
    jaxpr, and unflattens its outputs to ``out_tree``, which with ``device_leaves`` and
    ``strategy`` decide the selection.

    The inputs' structure does not (a linen block's RNG names its path in it): a selection
    computes from flat leaves, and its input cotangents come back in the structure of the
    call it was made for, to be put in this one's (:func:`restructured`)."""
    program = fingerprint(closed)
    if program is None:
        return select(call, dynamic, kwargs, strategy, device_leaves)
    key, costed = (program, out_tree, tuple(sorted(device_leaves.items()))), strategy.costed()
    trace = ("differentiated", program, out_tree, True if strategy.cuts else costed)
    made = _once(trace, lambda: _differentiate(call, dynamic, kwargs, strategy))
    kept = _once(
        ("kept", *key, costed, strategy.max_bytes), lambda: _kept(made, strategy, device_leaves)
    )
    return _once(
        ("selection", *key, strategy), lambda: _selection(made, strategy, device_leaves, kept)
    )


def _once(key: tuple, make: Callable[[], Any]) -> Any:
    if key in SELECTIONS:
        SELECTIONS.move_to_end(key)
        return SELECTIONS[key]
    SELECTIONS[key] = made = make()
    if len(SELECTIONS) > _SELECTIONS_KEPT:
        SELECTIONS.popitem(last=False)
    return made


def restructured(cotangents, like):
    """``cotangents`` of a selection's inputs, in the structure of ``like``: the inputs of
    the call that the selection serves, which may be another with the same flat program."""
    return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(cotangents))


# Why a lean cut's inputs and outputs stay on the device under an Offload's cap.
KEPT_AROUND = "kept anyway outside the call (an input or an output): moving it frees nothing"


def _cheapest(jaxpr, needed, out_atoms, params, strategy) -> tuple[cut_lib.Cut, dict]:
    """The cut that ``strategy`` keeps (see :func:`jaxoffload._src.cut.cheapest_cut`), and the
    saved values that stay on the device whatever ``strategy`` places, each with why.

    A lean call's inputs and outputs are kept anyway, by the layers around
    it, so they cost nothing; an offloading call moves its own, and never
    more than a lean call would keep. The offloading cut recomputes more to
    move less, which pays only where what it keeps does move.
    """
    kept_anyway = params | set(jaxpr.invars) | {a for a in out_atoms if isinstance(a, jex_core.Var)}
    lean = cut_lib.cheapest_cut(jaxpr, needed, kept_anyway, max_recompute=strategy.max_recompute)
    if not strategy.to_host:
        return lean, {}
    chosen = cut_lib.cheapest_cut(jaxpr, needed, params, max_recompute=strategy.max_recompute)
    if _bytes(chosen.saved, params) > _bytes(lean.saved, params):
        return lean, {}
    # Where the cap leaves on the device some of what the offloading cut keeps, the cut
    # that leaves less there, and on a tie the lean one, which recomputes less. Under the
    # lean cut, what the layers around keep stays, and the cap goes to the rest.
    fixed = dict.fromkeys(params, "")
    around = {v: KEPT_AROUND for v in lean.saved if v in kept_anyway and v not in params}

    def held_back(cut, stay) -> int:
        capped = _places(cut.saved, {**fixed, **stay}, strategy, jaxpr)[1]
        return sum(nbytes(cut.saved[n].aval) for n in capped if cut.saved[n] not in kept_anyway)

    left = held_back(chosen, {})
    return (lean, around) if left and left >= held_back(lean, around) else (chosen, {})


def _describe_saved(saved, jaxpr, out_atoms, on_device, strategy, chosen):
    """``(residuals, to_host)``: a :class:`Residual` per saved value, and which move."""
    residuals, to_host = [], []
    outputs = {a for a in out_atoms if isinstance(a, jex_core.Var)}
    places = _places(saved, on_device, strategy, jaxpr)[0]
    for n, v in enumerate(saved):
        placement, reason = places[n]
        if placement == "pinned_host":
            to_host.append(n)
        why = _why_kept(v, jaxpr, chosen, outputs)
        residuals.append(
            Residual(
                tuple(v.aval.shape), v.aval.dtype, nbytes(v.aval), placement,
                f"{why}; {reason}" if why else reason, v in outputs, _where(v, jaxpr),
            )
        )  # fmt: skip
    return residuals, to_host


def _places(saved, on_device, strategy, jaxpr) -> tuple[list[tuple[str, str]], list[int]]:
    """Where each of ``saved`` waits and why (:func:`_place`), and those that the cap keeps."""
    places = [_place(v, on_device, strategy, jaxpr) for v in saved]
    movable = [n for n, (placement, _) in enumerate(places) if placement == "pinned_host"]
    moved = strategy.moved(tuple(nbytes(saved[n].aval) for n in movable))
    capped = [n for n, go in zip(movable, moved) if not go]
    for n in capped:
        places[n] = ("device", f"over max_bytes={strategy.max_bytes}")
    return places, capped


def _bytes(values, free) -> int:
    return sum(nbytes(v.aval) for v in values if v not in free)


def _place(v, on_device, strategy, jaxpr) -> tuple[str, str]:
    if v in jaxpr.constvars:
        return "device", "constant"
    if v in on_device:
        return "device", on_device[v]
    return strategy.placement(nbytes(v.aval), tuple(v.aval.shape))


def _why_kept(v, jaxpr, chosen, outputs) -> str:
    """Why the cut keeps ``v`` rather than recompute it (empty without a cut)."""
    if chosen is None or v in jaxpr.invars or v in jaxpr.constvars:
        return ""
    if v in outputs:
        return "an output"
    i = next(i for i, e in enumerate(jaxpr.eqns) if v in e.outvars)
    if i in chosen.never:
        return f"not recomputable: {chosen.never[i]}"
    if eqn_flops(jaxpr.eqns[i]):
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


def _residuals_from(traced: VjpTrace, saved, eqns):
    """saved values -> every residual leaf of ``vjp``, recomputing what was not saved."""
    needed = traced.needed
    recompute = sub_function(traced.jaxpr, traced.consts, list(saved), needed) if eqns else None
    positions = {v: n for n, v in enumerate(saved)}

    def residuals(saved_values):
        values = dict(zip(needed, recompute(*saved_values))) if recompute else {}
        leaves = []
        for atom, is_used in zip(traced.residuals, traced.used):
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


def describe(closed, selection: Selection, device_leaves, strategy: Strategy) -> OffloadedCall:
    """The record :func:`offloaded_calls` gives of one call, whose closed jaxpr is ``closed``,
    its residuals chosen by ``strategy``."""
    return OffloadedCall(
        selection.residuals,
        sum(eqn_flops(e) for e in closed.jaxpr.eqns),
        selection.grad_flops,
        selection.rewrites,
        closed,
        tuple(sorted(device_leaves)),
        strategy,
    )


def check_marked(names: tuple[str, ...], closed) -> None:
    """Raises if ``names`` holds a name that the traced function never marks.

    A typo would otherwise keep nothing but the inputs, and recompute the rest.
    """
    marked = {
        e.params["name"] for e in jaxprs.equations(closed.jaxpr) if e.primitive.name == "name"
    }
    missing = [n for n in names if n not in marked]
    if missing:
        raise ValueError(
            f"Offload(names={names!r}): the function marks no value named "
            f"{', '.join(map(repr, missing))} with jax.ad_checkpoint.checkpoint_name; "
            + (f"the names it marks are {sorted(marked)}." if marked else "it marks no value.")
            + " Fix the name, or mark the value: checkpoint_name(x, name)."
        )
