"""What each block costs under each strategy, measured on the device, and a model of the step.

A block program's time comes from its traced FLOPs at the plain step's ms per FLOP
(:func:`traced_blocks`), or timed alone (:func:`cost_blocks`); its residuals, from traces. The
step's time (:func:`estimate_step_ms`) combines them; its peak, :mod:`~jaxoffload._src.planner.peak`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.extend import core as jex_core

from jaxoffload._src import transform
from jaxoffload._src.jaxprs import eqn_flops, nbytes, struct_of, trace_vjp
from jaxoffload._src.planner.front import Option
from jaxoffload._src.planner.hiding import copy_timeline, hidden_copies
from jaxoffload._src.strategies import Lean, Store, Strategy
from jaxoffload._src.timing import compile_all, timed_together, vjp_programs
from jaxoffload._src.transfers import without_host_placement

__all__ = [
    "BlockCost",
    "BlockCosts",
    "block_options",
    "cap_key",
    "cap_sizes",
    "cost_blocks",
    "estimate_step_ms",
    "hidden_offloads",
    "rescaled",
    "step_flops",
    "trace_blocks",
    "traced_blocks",
    "traced_options",
    "waits_ms",
    "with_traced_caps",
]


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """What one block costs under one strategy, measured on the device and read from traces.

    Attributes:
      device_bytes: residuals that stay on the device, other than its input
        and outputs.
      input_bytes: its input, if it keeps it on the device (else 0).
      output_bytes: its outputs, if it keeps them on the device (else 0).
      host_bytes: residuals that wait in host memory: what moves each way.
      recompute_bytes: what its backward pass recomputes and holds at once.
      forward_ms: its forward pass, alone on the device.
      backward_ms: its backward pass, recomputation included, transfers not.
      host_sizes: the sizes of the residuals in host memory, largest first.
      spread: how far its timed runs fell apart, over their median.
      inner_sizes: the sizes of its residuals other than its input, its outputs and
        scalars, each alone, largest first: under ``Lean()``, what a byte cap chooses among.
    """

    device_bytes: int
    input_bytes: int
    output_bytes: int
    host_bytes: int
    recompute_bytes: int
    forward_ms: float
    backward_ms: float
    host_sizes: tuple[int, ...] = ()
    spread: float = 0.0
    inner_sizes: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class BlockCosts:
    """One plannable block: its path, the sizes at its edges, and its cost under each strategy.

    ``capped`` holds byte-capped strategies as traced (:func:`with_traced_caps`), by
    :func:`cap_key`: a cap may change the block's cut, so what it moves and keeps is read
    from its own trace, not from the uncapped one.
    """

    path: str
    input_bytes: int
    output_bytes: int
    costs: dict[Strategy, BlockCost]
    size: float = 0.0  # what its times scale with (see rescaled)
    capped: dict[Strategy, BlockCost] = dataclasses.field(default_factory=dict)

    def cost(self, strategy: Strategy) -> BlockCost:
        """The cost under ``strategy``: as measured, with what a byte cap leaves on the device
        as traced, or else as the uncapped trace's largest residuals under the cap."""
        cost = self.costs[strategy.costed()]
        if strategy.max_bytes is None:
            return cost
        if cap_key(strategy) in self.capped:  # its bytes as traced, its times as calibrated
            times = {k: getattr(cost, k) for k in ("forward_ms", "backward_ms", "spread")}
            return dataclasses.replace(self.capped[cap_key(strategy)], **times)
        moved = [size for size, go in zip(cost.host_sizes, strategy.moved(cost.host_sizes)) if go]
        return dataclasses.replace(
            cost,
            device_bytes=cost.device_bytes + cost.host_bytes - sum(moved),
            host_bytes=sum(moved),
            host_sizes=tuple(moved),
        )


def cap_key(strategy: Strategy) -> Strategy:
    """What decides a capped strategy's residuals: the strategy without its windows."""
    return dataclasses.replace(strategy, window=1, fetch_window=None)


def cap_sizes(block: BlockCosts, strategy: Strategy) -> tuple[int, ...]:
    """The residual sizes that a byte cap of ``strategy`` chooses among, largest first.

    A cap that leaves some of the offloading cut's residuals on the device keeps
    ``Lean()``'s cut, whose residuals inside the block it then moves, the largest first
    (``_src/residuals.py``, ``_cheapest``); without ``Lean()``'s trace, the offloading
    cut's.
    """
    lean = block.costs.get(Lean(strategy.max_recompute)) if strategy.cuts else None
    if lean is None:
        return block.cost(strategy.costed()).host_sizes
    return tuple(x for x in lean.inner_sizes if x >= strategy.min_bytes)


def with_traced_caps(
    blocks: Sequence[BlockCosts], calls, strategies: Sequence[Sequence[Strategy | None]]
) -> list[BlockCosts]:
    """``blocks``, with the bytes of each byte-capped strategy of ``strategies`` (one list
    per block, entries ``None`` where nothing is capped) traced on its call; its times are
    its uncapped one's (:meth:`BlockCosts.cost`)."""
    out = []
    for i, (block, call) in enumerate(zip(blocks, calls)):
        capped = dict(block.capped)
        for listed in strategies:
            s = listed[i]
            if getattr(s, "max_bytes", None) is None or cap_key(s) in capped:
                continue
            t = _trace(call, cap_key(s))
            capped[cap_key(s)] = BlockCost(
                t.device, t.kept_input, t.kept_output, t.host,
                max(0, block.costs[Store()].device_bytes - t.device) if s.recomputes else 0,
                0.0, 0.0, t.host_sizes, 0.0, t.inner_sizes,
            )  # fmt: skip
        out.append(dataclasses.replace(block, capped=capped))
    return out


def estimate_step_ms(
    blocks: Sequence[BlockCosts], choice: Sequence[Strategy], link: tuple[float, float] | None
) -> float:
    """The blocks' time in a step: their compute, and the waits for copies it cannot hide.

    The copies share the link, one at a time, in the order the ``Offload`` chain starts
    them, and the blocks wait for them where the chain makes them wait: the model of
    :func:`~jaxoffload._src.planner.hiding.copy_timeline`.

    Args:
      link: ``(d2h_gbps, h2d_gbps)``; ``None`` if nothing moves.
    """
    c = [b.cost(s) for b, s in zip(blocks, choice)]
    forward = [x.forward_ms for x in c]
    backward = [x.backward_ms for x in c]
    moved = [x.host_bytes for x in c]
    if not any(moved):
        return sum(forward) + sum(backward)
    if link is None:
        raise ValueError("a plan that moves bytes needs the link's bandwidth.")
    windows = [s.window for s in choice]
    fetch_windows = [s.fetch_window or s.window for s in choice]
    return sum(copy_timeline(forward, backward, moved, windows, fetch_windows, link))


def waits_ms(
    blocks: Sequence[BlockCosts], i: int, moved: int, link: tuple[float, float], window: int
) -> float:
    """The ms of block ``i``'s copies of ``moved`` bytes, out and back, that the compute of
    the blocks after it within ``window`` cannot hide: those blocks as plain ones, since their
    own choices are not known yet."""
    later = [b.cost(Store()) for b in blocks[i + 1 : i + window]]
    forward = sum(x.forward_ms for x in later)
    backward = sum(x.backward_ms for x in later)
    out = max(0.0, moved / (link[0] * 1e6) - forward)
    return out + max(0.0, moved / (link[1] * 1e6) - backward)


@dataclasses.dataclass(frozen=True)
class _Traced:
    """What ``jax.vjp`` of one block program under one strategy keeps and computes, traced.

    ``device``: residuals on the device other than its input and outputs;
    ``kept_input``, ``kept_output``: its input and outputs, where kept;
    ``host``: residuals in host memory, of ``host_sizes``, largest first;
    ``flops``: its matrix products' and convolutions' FLOPs, forward and backward;
    ``inner_sizes``: its residuals on the device other than its input, its outputs and
    scalars, largest first.
    """

    device: int
    kept_input: int
    kept_output: int
    host: int
    host_sizes: tuple[int, ...]
    flops: int
    inner_sizes: tuple[int, ...] = ()


def trace_blocks(calls, options) -> dict[tuple, dict[Strategy, _Traced]]:
    """Per distinct block program, what it keeps and computes under each option: traced once,
    nothing compiled. Windows and byte caps change when and how much moves, not what a block
    keeps or computes, so each option is traced as its strategy with window 1 and no cap."""
    costed = list(dict.fromkeys([Store(), *(s.costed() for s in options)]))
    return {
        program: {s: _trace(call, s) for s in costed} for program, call in _distinct(calls).items()
    }


def _trace(call, strategy: Strategy) -> _Traced:
    fun = transform.wrap(
        jex_core.jaxpr_as_fun(call.forward), strategy, device_argnums=call.device_inputs
    )
    traced = trace_vjp(fun, *[struct_of(v.aval, rebind=True) for v in call.forward.jaxpr.invars])
    inputs = {v: k for k, v in enumerate(traced.jaxpr.invars)}
    device = kept_input = kept_output = host = 0
    sizes, inner = [], []
    for v in dict.fromkeys(traced.needed):
        if inputs.get(v, -1) in call.device_inputs:
            continue
        size = nbytes(v.aval, per_device=True)
        if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host:
            host += size
            sizes.append(size)
        elif v in inputs:
            kept_input += size
        elif v in traced.outputs:
            kept_output += size
        else:
            device += size
            if v.aval.shape:
                inner.append(size)
    flops = step_flops(traced.jaxpr) + step_flops(traced.backward.jaxpr)
    return _Traced(
        device, kept_input, kept_output, host, _largest_first(sizes), flops, _largest_first(inner)
    )


def _largest_first(sizes) -> tuple[int, ...]:
    return tuple(sorted(sizes, reverse=True))


def cost_blocks(paths, calls, traces, *, runs, say) -> list[BlockCosts]:
    """Each block's cost under each strategy of ``traces`` (:func:`trace_blocks`), timed once
    per distinct program; an offload's compute is timed as its twin's on the device
    (``Strategy.timed_as``). The programs are compiled one after another (:func:`compile_all`).
    """
    distinct = _distinct(calls)
    costed = list(traces[next(iter(distinct))])
    timed = list(dict.fromkeys(s.timed_as() for s in costed))
    say(f"timing block programs: {len(distinct)} distinct, each under {len(timed)} strategies")
    times = _time_programs(list(distinct.values()), timed, runs)
    times = [{s: t[s.timed_as()] for s in costed} for t in times]
    return _costs_of(paths, calls, traces, dict(zip(distinct, times)))


def traced_blocks(paths, calls, traces, *, ms_per_flop: float) -> list[BlockCosts]:
    """Each block's cost under each strategy of ``traces`` (:func:`trace_blocks`), its times
    from its FLOPs: nothing is compiled.

    A block's forward pass takes ``ms_per_flop`` per FLOP of its matrix
    products and convolutions (the plain step's measured ms over its FLOPs,
    say), and its backward pass as much per FLOP of the forward and backward
    passes together, recomputation included, less the forward pass's. What
    FLOPs miss (a lean cut's elementwise work, memory-bound kernels) is for
    the calibration to whole steps to add (:func:`~jaxoffload._src.planner.calibration.calibrated`).
    """
    times = {}
    for program, call in _distinct(calls).items():
        forward = step_flops(call.forward.jaxpr)
        times[program] = {
            s: (forward * ms_per_flop, max(0, t.flops - forward) * ms_per_flop, 0.0)
            for s, t in traces[program].items()
        }
    return _costs_of(paths, calls, traces, times)


def step_flops(jaxpr) -> int:
    """The FLOPs of ``jaxpr``'s matrix products and convolutions, those nested in calls too."""
    return sum(eqn_flops(e) for e in jaxpr.eqns)


def rescaled(measured: Sequence[BlockCosts], calls) -> list[BlockCosts]:
    """``measured``'s blocks at another size (batch or image): bytes traced anew, times scaled.

    A block's times scale with its forward pass's FLOPs (with its input's bytes
    where it has none), so that costs measured once serve every size.
    """
    if len(measured) != len(calls):
        raise ValueError(f"{len(measured)} blocks were measured, but the step calls {len(calls)}.")
    times = {}
    for block, call in zip(measured, calls):
        scale = _size(call) / block.size if block.size else 1.0
        times[_program(call)] = {
            s: (c.forward_ms * scale, c.backward_ms * scale, c.spread)
            for s, c in block.costs.items()
        }
    traces = trace_blocks(calls, list(measured[0].costs))
    return _costs_of([b.path for b in measured], calls, traces, times)


def _program(call) -> tuple:
    return str(call.forward), call.device_inputs


def _distinct(calls) -> dict[tuple, Any]:
    """The first call of each distinct block program, by program."""
    distinct: dict[tuple, Any] = {}
    for call in calls:
        distinct.setdefault(_program(call), call)
    return distinct


def _size(call) -> float:
    """What a block's time scales with: its forward FLOPs, or its input bytes without them."""
    flops = step_flops(call.forward.jaxpr)
    return float(flops or sum(nbytes(v.aval) for v in call.forward.jaxpr.invars))


def _costs_of(paths, calls, traces, times) -> list[BlockCosts]:
    """Each block with its traced bytes (``traces``, by program and strategy) and
    ``times[program][strategy]``: ``(forward, backward, spread)``."""
    costs = {program: _block_costs(traces[program], times[program]) for program in _distinct(calls)}
    blocks = []
    for path, call in zip(paths, calls):
        invars, outvars = call.forward.jaxpr.invars, call.forward.jaxpr.outvars
        input_bytes = sum(
            nbytes(v.aval, per_device=True)
            for k, v in enumerate(invars)
            if k not in call.device_inputs
        )
        output_bytes = sum(nbytes(v.aval, per_device=True) for v in outvars)
        blocks.append(
            BlockCosts(path, input_bytes, output_bytes, costs[_program(call)], _size(call))
        )
    return blocks


def _block_costs(traced: dict[Strategy, _Traced], times) -> dict[Strategy, BlockCost]:
    """One block program's cost under each strategy of ``times``: its bytes traced, its times given."""
    store_device = traced[Store()].device
    return {
        s: BlockCost(
            t.device,
            t.kept_input,
            t.kept_output,
            t.host,
            max(0, store_device - t.device) if s.recomputes else 0,
            *times[s][:2],
            t.host_sizes,
            times[s][2],
            t.inner_sizes,
        )  # fmt: skip
        for s, t in ((s, traced[s]) for s in times)
    }


def _time_programs(calls, strategies, runs) -> list[dict[Strategy, tuple[float, float, float]]]:
    """Per distinct block call and strategy: ``(forward ms, backward ms, spread)``, on the device.

    Compute alone: the link's share is the planner's model of the step. The
    forward pass is Store's, whatever the strategy keeps; the backward pass
    is the forward and backward together, less it.
    """
    lowered, programs = [], []
    with without_host_placement():
        for call in calls:
            fun = jex_core.jaxpr_as_fun(call.forward)
            structs = [struct_of(v.aval, rebind=True) for v in call.forward.jaxpr.invars]
            for n, strategy in enumerate(strategies):
                wrapped = transform.wrap(fun, strategy, device_argnums=call.device_inputs)
                forward, both, forward_args, both_args = vjp_programs(wrapped, structs)
                if n == 0:
                    lowered.append(forward.trace(*forward_args).lower())
                    programs.append((call, None, forward_args))
                lowered.append(both.trace(*both_args).lower())
                programs.append((call, strategy, both_args))
    executables = compile_all(lowered, parallel=False)
    results = []
    for call in calls:  # a block's programs are timed in turns, one block at a time
        mine = [n for n, program in enumerate(programs) if program[0] is call]
        timed = timed_together([(executables[n], programs[n][2]) for n in mine], runs)
        (forward_ms, _), *rest = timed
        results.append(
            {
                programs[n][1]: (forward_ms, max(0.0, ms - forward_ms), spread)
                for n, (ms, spread) in zip(mine[1:], rest)
            }
        )
    return results


def block_options(
    blocks: Sequence[BlockCosts],
    options: Sequence[Strategy],
    link: tuple[float, float] | None,
    hidden_ms_per_byte: float = 0.0,
    untied: frozenset[Strategy] = frozenset(),
    hidden: Sequence[Sequence[Strategy | None]] | None = None,
) -> list[list[Option]]:
    """Per block, its options with what each keeps and costs: the front's input.

    Each option is costed as measured, with the transfers that the compute of
    the blocks after it cannot hide. Where anything moves, each block may also
    get a hidden offload of each offloading option (on top of the lean cut, or
    of recomputation): the copies that the link carries while the blocks
    compute, with the windows that place them, chosen for all the blocks at
    once as :func:`~jaxoffload._src.planner.hiding.hidden_copies` does, so
    that moving them costs almost nothing. Where a whole step showed that it
    does not, ``hidden_ms_per_byte`` is what each byte such an offload moves
    was measured to cost. Options of one block
    within their timing noise count as equally fast, but for the kinds in
    ``untied``, whose whole steps ran apart from the plain one's: their small per-block
    differences are real. ``hidden`` gives those offloads (:func:`hidden_offloads`), whose
    capped costs ``blocks`` may hold as traced (:func:`with_traced_caps`); ``None`` chooses them here.
    """
    if hidden is None:
        hidden = hidden_offloads(blocks, options, link)
    choices = []
    for i in range(len(blocks)):
        strategies = list(dict.fromkeys(options)) + [h[i] for h in hidden if h[i] is not None]
        options_i = [
            _option(blocks, i, s, link, hidden_ms_per_byte) for s in dict.fromkeys(strategies)
        ]
        noise = max(blocks[i].cost(o.strategy).spread for o in options_i)
        choices.append(_ties_as_equal(options_i, max(TIE, noise), untied))
    return choices


def traced_options(blocks, calls, options, link, hidden_ms_per_byte=0.0, untied=frozenset()):
    """``(blocks, choices)``: :func:`block_options` with each byte cap among the options and
    the hidden offloads traced on each block's call (:func:`with_traced_caps`), and the
    blocks that now hold those costs."""
    hidden = hidden_offloads(blocks, options, link)
    capped = [[s] * len(blocks) for s in options if s.max_bytes is not None]
    blocks = with_traced_caps(blocks, calls, [*hidden, *capped])
    return blocks, block_options(blocks, options, link, hidden_ms_per_byte, untied, hidden)


# Options of one block within this share of its fastest, or within the spread of its
# timed runs if that is larger, are taken as equally fast, so that timing noise cannot flip
# a plan between them: the one that keeps less is chosen.
TIE = 0.03


def _ties_as_equal(options: list[Option], margin: float, untied=frozenset()) -> list[Option]:
    fastest = min(o.ms for o in options)
    return [
        dataclasses.replace(o, ms=fastest)
        if o.ms <= fastest * (1 + margin) and o.strategy.timed_as() not in untied
        else o
        for o in options
    ]


def hidden_offloads(blocks, options, link) -> list[list[Strategy | None]]:
    """The hidden offloads: one offloading option's schedule (:func:`hidden_copies`), the one
    that moves the most, as each block's entry (``None`` where nothing hides); none without a
    link. Each schedule counts on the whole link: two in one plan would wait on each other
    (design §13). The blocks are costed as plain ones: their choices are not known yet.
    """
    if link is None:
        return []
    forward = [b.cost(Store()).forward_ms for b in blocks]
    backward = [b.cost(Store()).backward_ms for b in blocks]
    schedules = [
        (base, hidden_copies(forward, backward, [cap_sizes(b, base) for b in blocks], link))
        for base in dict.fromkeys(options)
        if base.to_host
    ]
    moved = [sum(c.moved for c in copies if c) for _, copies in schedules]
    if not any(moved):
        return []
    base, copies = schedules[moved.index(max(moved))]
    return [[c and base.with_cap(c.window, c.moved, c.fetch_window) for c in copies]]


def _option(blocks, i, strategy, link, hidden_ms_per_byte=0.0) -> Option:
    cost = blocks[i].cost(strategy)
    kept = cost.device_bytes + cost.input_bytes
    ms = cost.forward_ms + cost.backward_ms
    if cost.host_bytes:
        if link is None:
            raise ValueError(f"{strategy} moves bytes, but the planner has no link bandwidth.")
        ms += waits_ms(blocks, i, cost.host_bytes, link, strategy.window)
        if strategy.max_bytes is not None:
            ms += hidden_ms_per_byte * cost.host_bytes
    return Option(strategy, int(kept), float(ms), int(cost.host_bytes))
