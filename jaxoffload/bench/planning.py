"""Planning workloads: ``jaxoffload.plan`` at a run's budgets, and ``offload-hidden``'s choices."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jex_core

from jaxoffload import Lean, NoPlanFits, Offload, OffloadedCall, Plan, offloaded_calls
from jaxoffload.bench import models
from jaxoffload.bench.catalog import COMPUTE_TWIN, PLANS
from jaxoffload.bench.record import Record
from jaxoffload.bench.reference_hidden import choose_hidden_offload
from jaxoffload.bench.step import linen_model, nnx_training, train_step, training
from jaxoffload.bench.workload import STRATEGIES, Workload
from jaxoffload.internal import (
    Planner,
    cap_sizes,
    compiled_points,
    copy_timeline,
    cost_blocks,
    discover,
    hidden_copies,
    median_ms,
    step_flops,
    trace_blocks,
    trace_step,
    traced_blocks,
    with_traced_caps,
    zeros,
)

__all__ = [
    "HIDDEN_RECOMPUTE_SHARE",
    "budget_bytes",
    "compute_ms",
    "hidden_budget",
    "hidden_offload_workload",
    "hidden_plan",
    "plan_budgets",
    "planner_of",
    "planning_inputs",
    "reference_hidden_workload",
    "time_offloaded_calls",
]


# The share of a step's compute time that "offload-hidden" may add by recomputation.
HIDDEN_RECOMPUTE_SHARE = 0.02


def planning_inputs(workload: Workload) -> tuple[Any, Callable[..., Any], tuple, Any]:
    """``(model, step, (state, batch), blocks)``: the workload's plain-Flax model, abstract
    arguments and training step, as a user gives them to :func:`jaxoffload.plan`."""
    dtype = jnp.dtype(workload.dtype)
    if models.is_nnx(workload.model):
        model = nnx.eval_shape(
            lambda: models.create_nnx(
                workload.model, dtype=dtype, num_classes=workload.num_classes, rngs=nnx.Rngs(1)
            )
        )
        _, state, batch, _ = nnx_training(workload, abstract=True, model=model)

        def step(model, state, batch):
            return nnx_training(workload, abstract=None, model=model)[0](state, batch)

        return model, step, (state, batch), models.nnx_block_class(workload.model)
    model = linen_model(workload, plannable=True)
    _, state, batch, _ = training(workload, model, abstract=True)

    def step(model, state, batch):
        return training(workload, model, abstract=None)[0](state, batch)

    return model, step, (state, batch), None


def planner_of(
    workload: Workload, say: Callable[[str], None], inputs=None, held_bytes: int | None = None
) -> Planner:
    """The :class:`~jaxoffload._src.planner.search.Planner` of the workload's plain-Flax
    model and training step (``inputs``, by default :func:`planning_inputs`), as ``bench
    --budget`` plans it: the state donated, ``workload.block_costs``, ``held_bytes``
    counted in every budget beside the compiled step, and the options of its strategy in
    :data:`~jaxoffload.bench.catalog.PLANS`."""
    model, step, args, blocks = planning_inputs(workload) if inputs is None else inputs
    names = PLANS.get(workload.strategy)
    return Planner(
        model,
        step,
        args,
        None if names is None else tuple(STRATEGIES[n] for n in names),
        blocks=blocks,
        runs=5,
        say=say,
        donate_argnums=(0,),
        block_costs=workload.block_costs,
        held_bytes=held_bytes,
    )


def plan_budgets(
    workload: Workload,
    budgets_bytes: Sequence[int],
    held_bytes: int = 0,
    per_round: int | None = None,
) -> list[dict[str, Any]]:
    """:func:`jaxoffload.plan` of the workload's plain-Flax model at each budget, in bytes,
    of which the process that runs the plan holds ``held_bytes`` besides the step
    (``jaxoffload.plan(..., held_bytes=)``; :func:`budget_bytes`), each round compiling at
    most ``per_round`` candidates a budget (``None``: ``jaxoffload.plan``'s default).

    Returns:
      One ``{"planned": Plan.to_dict()}`` per budget, or ``{"no_plan": message}``
      where no plan fits; each with ``planning_s``, the seconds that planning
      every budget took (they are planned together, from the model and its abstract
      arguments built, as :func:`jaxoffload.plan` is given them), and ``planned_budgets``;
      the first also with ``planner_points``, every plan compiled
      (:func:`~jaxoffload._src.planner.peak.compiled_points`).
    """
    inputs = planning_inputs(workload)
    # Planning is what jaxoffload.plan does, from the model and arguments that a user has.
    start = time.perf_counter()
    say = _progress(start)
    shared = planner_of(workload, say, inputs, held_bytes)
    results = []
    found = shared.plans_for([int(b) for b in budgets_bytes], max_rounds=3, per_round=per_round)
    # The budgets are planned together: each one's planning time is theirs together.
    planning_s = time.perf_counter() - start
    for planned in found:
        if isinstance(planned, NoPlanFits):
            e = planned
            share = e.least_bytes / e.plain_bytes if e.least_bytes and e.plain_bytes else None
            results.append(
                {"no_plan": str(e), "least_share": share, "platform": jax.default_backend()}
            )
        else:
            results.append({"planned": planned.to_dict()})
        results[-1].update(planning_s=planning_s, planned_budgets=len(budgets_bytes))
        print(results[-1].get("no_plan") or Plan.from_dict(results[-1]["planned"]), file=sys.stderr)
    # What was compiled, once, with the first budget's result: for calibrating byte models offline.
    results[0]["planner_points"] = compiled_points(shared)
    return results


def _progress(start: float) -> Callable[[str], None]:
    """``say(line)``: a ``[plan]`` line on stderr, which the parent passes on as it comes,
    with the seconds since ``start``, to see where planning's time goes."""

    def say(line: str) -> None:
        print(f"[plan] {time.perf_counter() - start:6.1f} s  {line}", file=sys.stderr, flush=True)

    return say


def budget_bytes(budgets: Sequence[float], records: Sequence[Record]) -> tuple[list[int], int]:
    """Each budget share of the ``"none"`` run's runtime peak, in bytes, and what that run
    held beyond its compiled bytes (its allocator's, its process's).

    The planner plans in a process of its own, which holds nothing of the measuring
    one's, so it is given what that holds (:func:`plan_budgets`): each plan's compiled
    step then fits its budget less it, and a plan's runtime peak reads against its
    budget, the share of ``none``'s runtime peak that the run was asked for.
    """
    none = next((r for r in records if r.strategy == "none" and r.step_time_ms is not None), None)
    if none is None:
        raise RuntimeError("'plan' budgets are shares of the 'none' run's peak: it failed.")
    compiled = none.compiled_temp_bytes + none.compiled_argument_bytes
    peak = none.peak_bytes_in_use or compiled  # no runtime peak on some backends
    return [int(b * peak) for b in budgets], max(0, peak - compiled)


def hidden_offload_workload(
    workload: Workload,
    *,
    fwd_ms: float,
    bwd_ms: float,
    d2h_gbps: float,
    h2d_gbps: float,
    recompute_share: float = HIDDEN_RECOMPUTE_SHARE,
) -> Workload:
    """The workload with ``offload-hidden``'s choice, made from its twin's step and link.

    A plain-Flax linen model gets ``planned``, the :class:`jaxoffload.Plan` of
    :func:`hidden_plan`: the library's link timeline, block by block. A reference model
    gets ``block_names`` and ``window``, one strategy name per block and one window, from
    :func:`reference_hidden_workload`.

    Args:
      workload: an ``offload-hidden`` workload.
      fwd_ms, bwd_ms: the twin's forward pass and the rest of its step.
      d2h_gbps, h2d_gbps: the link, as the twin's process measured it.
      recompute_share: for a reference model, the share of the step that recomputation may
        add (see :func:`reference_hidden_workload`).
    """
    if models.is_plain(workload.model):
        plan = hidden_plan(workload, (d2h_gbps, h2d_gbps), twin_ms=(fwd_ms, bwd_ms))
        return dataclasses.replace(workload, planned=plan.to_dict())
    return reference_hidden_workload(
        workload,
        fwd_ms=fwd_ms,
        bwd_ms=bwd_ms,
        d2h_gbps=d2h_gbps,
        h2d_gbps=h2d_gbps,
        recompute_share=recompute_share,
    )


def hidden_plan(
    workload: Workload,
    link: tuple[float, float],
    *,
    twin_ms: tuple[float, float] | None = None,
    runs: int = 5,
) -> Plan:
    """``offload-hidden``'s plan of a plain-Flax linen model: the copies that blocks' compute hides.

    Per plannable block, in call order (the model of :func:`planning_inputs`): the
    residuals it moves under ``Offload()``, read from its trace, and its compute as a
    ``Lean()`` block, which every block computes in the plan, moving or not. The times are
    each distinct block program's, timed alone on the device as :func:`jaxoffload.plan`
    times them (``workload.block_costs`` ``"timed"``), or its FLOPs at the twin's step over
    the plain step's FLOPs (``"traced"``, which compiles nothing). Blocks timed alone take
    longer than in the step, and a schedule on those times moves more than the link carries;
    their FLOP shares of the twin's step came closer to the blocks of a traced step
    (``docs/design.md``, "Copies that hide"). So timed blocks keep their proportions, scaled
    down to add up to their FLOP shares where they add up to more (and to no more than the
    twin's forward pass, and the rest of its step). From these and the link,
    :func:`~jaxoffload._src.planner.hiding.hidden_copies` chooses what each block moves and
    its windows, so that the copies take turns on the link while blocks compute: a block
    that gets copies takes ``Offload(window=..., max_bytes=..., fetch_window=...)``, which
    moves exactly those residuals; the others, and the code outside the blocks, ``Lean()``.

    The plan's ``estimated_step_ms`` is the blocks' time with its copies, on the same times
    (:func:`~jaxoffload._src.planner.hiding.copy_timeline`), and its notes say, per block,
    what it computes, moves, and when the schedule has its copies run.

    Args:
      workload: an ``offload-hidden`` workload of a plain-Flax linen model.
      link: ``(d2h_gbps, h2d_gbps)``, the link's measured speed each way.
      twin_ms: the twin's forward pass and the rest of its step, in ms: the step that the
        blocks' FLOP shares are of.
      runs: timed runs of each block program.
    """
    say = _progress(time.perf_counter())
    model, step, args, blocks = planning_inputs(workload)
    say("tracing the step to find the plannable blocks")
    paths, calls = discover(model, step, args, blocks)
    if not paths or len(calls) != len(paths):
        raise RuntimeError(
            f"{workload.model}: the step calls {len(paths)} plannable blocks and differentiates "
            f"{len(calls)} wrapped calls; offload-hidden needs one call per block."
        )
    traces = trace_blocks(calls, (Lean(), Offload()))
    shares = None  # each block's share of the twin's step, by its FLOPs
    if twin_ms is not None:
        # The plain step's FLOPs against the lean twin's time: a lean step recomputes
        # elementwise work, which FLOPs do not count.
        flops = step_flops(trace_step(model, step, args, None, (0,)).jaxpr.jaxpr)
        if flops > 0:
            shares = traced_blocks(paths, calls, traces, ms_per_flop=sum(twin_ms) / flops)
    if workload.block_costs == "traced":
        if shares is None:
            raise ValueError("'traced' block costs need the step's time and its FLOPs.")
        costs = shares
    else:
        costs = cost_blocks(paths, calls, traces, runs=runs, say=say)
    forward = [b.cost(Lean()).forward_ms for b in costs]
    backward = [b.cost(Lean()).backward_ms for b in costs]
    if shares is not None:
        # At most their FLOP shares, and at most the twin's passes, which hold more than them.
        lean = [b.cost(Lean()) for b in shares]
        forward = _at_most(forward, min(sum(c.forward_ms for c in lean), twin_ms[0]))
        backward = _at_most(backward, min(sum(c.backward_ms for c in lean), twin_ms[1]))
    sizes = [cap_sizes(b, Offload()) for b in costs]
    copies = hidden_copies(forward, backward, sizes, link)
    choices = [
        Lean() if c is None else Offload().with_cap(c.window, c.moved, c.fetch_window)
        for c in copies
    ]
    # What each cap moves, as its own trace says: the schedule's sizes are the lean cut's.
    costs = with_traced_caps(costs, calls, [choices])
    moved = [b.cost(s).host_bytes if s.to_host else 0 for b, s in zip(costs, choices)]
    windows = [1 if c is None else c.window for c in copies]
    fetch_windows = [1 if c is None else c.fetch_window for c in copies]
    estimated = sum(copy_timeline(forward, backward, moved, windows, fetch_windows, link))
    notes = [
        _hidden_note(c, m, f, b, sum(s))
        for c, m, f, b, s in zip(copies, moved, forward, backward, sizes)
    ]
    plan = Plan(tuple(zip(paths, choices)), Lean(), estimated_step_ms=estimated, notes=tuple(notes))
    say(f"{sum(moved) / 1e6:.1f} MB move each way, on {sum(map(bool, moved))} blocks")
    print(plan, file=sys.stderr)
    return plan


def _at_most(times: list[float], total: float) -> list[float]:
    """``times``, scaled down to add up to ``total`` where they add up to more.

    Example:
      >>> _at_most([2.0, 6.0], 4.0), _at_most([2.0, 6.0], 10.0)
      ([1.0, 3.0], [2.0, 6.0])
    """
    scale = min(1.0, total / sum(times)) if sum(times) > 0 else 1.0
    return [t * scale for t in times]


def _hidden_note(copies, moved: int, forward_ms: float, backward_ms: float, movable: int) -> str:
    """What one block computes, and what of its residuals moves when, as a plan's note:
    ``moved`` as its cap's trace says, ``copies`` the schedule."""
    compute = f"Lean() compute {forward_ms:.2f} + {backward_ms:.2f} ms"
    if copies is None:
        return f"{compute}; none of its {movable / 1e6:.2f} MB of residuals hides"
    (out, out_end), (back, back_end) = copies.to_host_ms, copies.fetch_ms
    return (
        f"{compute}; moves {moved / 1e6:.2f} of {movable / 1e6:.2f} MB: to the host at "
        f"{out:.2f}-{out_end:.2f} ms of the forward pass, back at {back:.2f}-{back_end:.2f} ms "
        "of the backward pass"
    )


def reference_hidden_workload(
    workload: Workload,
    *,
    fwd_ms: float,
    bwd_ms: float,
    d2h_gbps: float,
    h2d_gbps: float,
    recompute_share: float = HIDDEN_RECOMPUTE_SHARE,
) -> Workload:
    """A reference model's workload with the choice of
    :func:`jaxoffload.bench.reference_hidden.choose_hidden_offload`: ``block_names`` and one
    ``window``.

    The choice frees the most device memory whose transfers hide behind
    compute and whose recomputation adds at most ``recompute_share`` of the
    step's compute time (``fwd_ms + bwd_ms``). Per block, from traces alone
    (:func:`jaxoffload.offloaded_calls`):

    - the bytes it moves, and the device bytes it keeps, when it offloads
      and its neighbours are ``"lean"``, as in the choices this makes: two
      traces, in which every other block offloads. A ResNet block between
      lean ones leaves on the device the input that the block before keeps
      anyway;
    - the device bytes it frees: what it keeps as a ``"lean"`` block (a
      third trace), less what it keeps when it offloads, less the residuals
      that are its own outputs, which the next block keeps as its input;
    - its recomputation: its forward time times the extra FLOPs of its
      backward pass over a lean block's, as a share of its forward FLOPs.

    Each block's forward time comes from timing it alone on the default
    device (:func:`time_offloaded_calls`). The step's compute times and the
    bandwidths are measured ones, e.g. those of the ``"lean"`` run.
    """
    n = models.num_blocks(workload.model)

    def traced_calls(names):
        with_names = dataclasses.replace(workload, block_names=names)
        step, state, batch, _ = train_step(with_names, abstract=True)
        traced = offloaded_calls(step, state, batch)
        if len(traced) != n:
            raise RuntimeError(f"expected one offloaded call per block, traced {len(traced)}.")
        return traced

    calls: list[Any] = [None] * n
    for parity in (0, 1):
        alternate = tuple("offload" if i % 2 == parity else "lean" for i in range(n))
        calls[parity::2] = traced_calls(alternate)[parity::2]
    lean = traced_calls(("lean",) * n)
    forward_ms = time_offloaded_calls(calls)
    freed = [
        lean_call.device_bytes
        - sum(r.nbytes for r in lean_call.residuals if r.output)
        - call.device_bytes
        for call, lean_call in zip(calls, lean)
    ]
    extra = [
        ms * max(0, call.grad_flops - lean_call.grad_flops) / call.flops if call.flops else 0.0
        for ms, call, lean_call in zip(forward_ms, calls, lean)
    ]
    chosen = choose_hidden_offload(
        [call.host_bytes for call in calls],
        block_costs=forward_ms,
        freed_bytes=[max(0, f) for f in freed],
        extra_ms=extra,
        max_extra_ms=recompute_share * (fwd_ms + bwd_ms),
        fwd_ms=fwd_ms,
        bwd_ms=bwd_ms,
        d2h_gbps=d2h_gbps,
        h2d_gbps=h2d_gbps,
    )
    names = tuple("offload" if offloads else "lean" for offloads in chosen.offload)
    return dataclasses.replace(workload, block_names=names, window=chosen.window)


def hidden_budget(workload: Workload, records: Sequence[Record]) -> dict[str, float]:
    """What ``offload-hidden``'s choice is made from (:func:`hidden_offload_workload`): the
    compute and the link of its :data:`COMPUTE_TWIN`'s record, which must come before it."""
    twin = COMPUTE_TWIN[workload.strategy]
    done = [r for r in records if r.strategy == twin and r.d2h_gbps is not None]
    if not done:
        raise RuntimeError(
            f"{workload.strategy!r} is planned from the {twin!r} run's times and link: "
            f"list {twin!r} before it."
        )
    r = done[-1]
    fwd, bwd = compute_ms(r)
    return {"fwd_ms": fwd, "bwd_ms": bwd, "d2h_gbps": r.d2h_gbps, "h2d_gbps": r.h2d_gbps}


def compute_ms(twin: Record) -> tuple[float, float]:
    """A no-transfer run's forward time, and the rest of its step (backward and update)."""
    return twin.forward_ms, twin.step_time_ms - twin.forward_ms


def time_offloaded_calls(calls: Sequence[OffloadedCall], runs: int = 5) -> list[float]:
    """Each offloaded call's forward pass, run alone on the default device: median ms.

    The per-block compute that ``offload-hidden`` weighs on a reference model. Blocks of the same FLOPs can take very
    different times: BatchNorm and ReLU passes over memory, which scale with
    the activations, take much of a block's time (measured on ResNet-50 for
    commit d3bc458). Calls with the same forward program are timed once. The
    inputs are zeros: a convolution's time does not depend on its values.

    Args:
      calls: from :func:`jaxoffload.offloaded_calls`.
      runs: timed runs per distinct call, after one to compile and warm up.

    Returns:
      One time per call, in call order.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload import offload, offloaded_calls
      >>> layer = offload(lambda w, x: jnp.tanh(x @ w), device_argnums=0)
      >>> step = jax.grad(lambda w, x: layer(w, layer(w, x)).sum())
      >>> calls = offloaded_calls(step, jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> first, second = time_offloaded_calls(calls, runs=2)
      >>> first == second  # the same program, timed once
      True
    """
    programs = [str(call.forward) for call in calls]
    times: dict[str, float] = {}
    for call, program in zip(calls, programs):
        if program not in times:
            args = [zeros(v.aval) for v in call.forward.jaxpr.invars]
            forward = jax.jit(jex_core.jaxpr_as_fun(call.forward))
            times[program] = median_ms(forward, *args, runs=runs)
    return [times[program] for program in programs]
