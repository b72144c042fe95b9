"""A run: workloads measured in turn, each in a process of its own, the reference first.

Records of an earlier run are kept in place of measuring again, by strategy and budget;
the chosen strategies are chosen in processes of their own first; the transfer bound is
added to each offloading record once its compute twin is measured.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from jaxoffload.bench.catalog import ACCUMULATED_STRATEGIES, COMPUTE_TWIN, PLANS
from jaxoffload.bench.child import Children, OutOfMemory
from jaxoffload.bench.measure import cache_env
from jaxoffload.bench.planning import budget_bytes, compute_ms, hidden_budget
from jaxoffload.bench.record import Record
from jaxoffload.bench.workload import Workload

__all__ = ["NoPlan", "add_transfer_bounds", "measure_all"]


def measure_all(
    workloads: list[Workload],
    *,
    steps: int = 10,
    env: dict[str, str] | None = None,
    on_start: Callable[[Workload], None] | None = None,
    on_record: Callable[[list[Record]], None] | None = None,
    measured: Sequence[Record] = (),
    reference: str | None = None,
    compile_first: bool = False,
    trace: bool = False,
    children: Children | None = None,
) -> list[Record]:
    """Measures each workload in its own process, with gradients compared to the first.

    The first workload must use the ``"none"`` strategy: it is the reference
    for every ``grad_rel_err`` (but an accumulating strategy's, which its process
    checks at a smaller batch). A workload that runs out of memory gives a
    record with ``"out_of_memory": True``; one whose process fails otherwise
    gives a record with its ``"error"``. Records of strategies that move
    residuals to the host get the transfer bound (:func:`add_transfer_bounds`)
    when their :data:`COMPUTE_TWIN` is among the workloads. A chosen strategy
    is chosen in a process of its own (:meth:`Children.hidden_offload`,
    :meth:`Children.plan_budgets`), from earlier records, which must come before it.

    Args:
      workloads: what to measure, the reference first (none where every workload
        accumulates gradients: each checks its own against its step on a whole batch).
      steps: timed steps per workload.
      env: extra environment variables for the child processes.
      on_start: called with each workload before it starts (for progress).
      on_record: called with the records so far after each one, so that an
        interrupted run loses nothing already measured.
      measured: records of an earlier run of these workloads, kept in place of
        measuring again the workloads they match (by strategy and budget).
      reference: the ``.npz`` file of the first workload's gradient, which the
        others are compared with; a temporary one by default. A run that keeps
        the first workload's record in ``measured`` must give the file that
        its run wrote.
      compile_first: compile each step in a process of its own first, into a
        persistent compilation cache that the measuring process loads it
        from (:func:`compile_only`): on a GPU, so that the runtime peak is the
        step's, not its compile's. Planning compiles into a cache of its own
        (empty when it starts), from which the plans' steps are then loaded.
      trace: trace each workload's step too (:func:`jaxoffload.bench.measure.measure`).
      children: the child processes (:class:`~jaxoffload.bench.child.Children`), or a
        stand-in for them.
    """
    children = Children() if children is None else children
    self_checked = all(w.strategy in ACCUMULATED_STRATEGIES for w in workloads)
    if not workloads or (workloads[0].strategy != "none" and not self_checked):
        raise ValueError(
            "the first workload must use the 'none' strategy: it is the reference (unless "
            "every workload accumulates, and checks itself against its own whole step)."
        )
    kept = {(r.strategy, r.budget): r for r in measured}
    records: list[Record] = []
    with tempfile.TemporaryDirectory() as folder:
        cache, planned = None, dict.fromkeys(PLANS)
        if compile_first:
            cache = cache_env(os.path.join(folder, "compiled"))
            # Each planning compiles into a cache of its own, cold as a user's, from which the
            # plans it returns are loaded rather than compiled again.
            planned = {p: cache_env(os.path.join(folder, p)) for p in PLANS}
        budget_plans = {
            p: _BudgetPlans(p, workloads, kept, {**(env or {}), **(c or {})}, children)
            for p, c in planned.items()
        }
        reference = reference or os.path.join(folder, "reference_gradient.npz")
        for w in workloads:
            record = kept.get((w.strategy, w.budget))
            if record is None:
                if on_start is not None:
                    on_start(w)
                record = _plan_and_measure(
                    w,
                    records,
                    budget_plans.get(w.strategy),
                    steps=steps,
                    reference=reference,
                    env=env,
                    cache=planned[w.strategy] if w.strategy in PLANS else cache,
                    trace=trace,
                    children=children,
                )
            records.append(record)
            if w is workloads[0] and record.step_time_ms is None:
                reference = None  # no reference gradient: no errors to report
            if (w.strategy, w.budget) not in kept and on_record is not None:
                on_record(records)
    add_transfer_bounds(records)
    return records


def _plan_and_measure(
    workload: Workload,
    records: list[Record],
    budget_plans: _BudgetPlans | None,
    *,
    steps: int,
    reference: str | None,
    env: dict[str, str] | None,
    cache: dict[str, str] | None,
    trace: bool,
    children: Children,
) -> Record:
    """The record of one workload, planned first if its strategy is: measured, or its failure.

    With ``cache`` (a :func:`cache_env`), its step is compiled in a process of its own first.
    """
    w = workload
    try:
        if w.strategy in PLANS and w.planned is None:
            w = budget_plans.apply(w, records)
        if w.strategy == "offload-hidden":
            w = children.hidden_offload(w, env=env, **hidden_budget(w, records))
        if cache is not None:
            env = {**(env or {}), **cache}
            children.compile(w, env)
        record = children.measure(
            w, steps=steps, reference=reference, env=env, trace=trace,
            **_measure_options(w.strategy),
        )  # fmt: skip
    except OutOfMemory:
        return _failure_record(w, {"out_of_memory": True})
    except NoPlan as e:
        # An answer, not a failure: the least that any plan reached, and why.
        no_plan = {"no_plan": e.message, "least_share": e.least_share, "platform": e.platform}
        return _failure_record(w, {**no_plan, **budget_plans.planning(w)})
    except RuntimeError as e:
        # One broken strategy must not cost the others' measurements.
        return _failure_record(w, {"error": str(e)})
    if w.strategy in PLANS:
        record = record.with_fields(**budget_plans.planning(w))
    return record


def _measure_options(strategy: str) -> dict[str, bool]:
    """What :func:`measure` times beyond the step for a strategy, after its peak is read."""
    may_offload = strategy in PLANS and PLANS[strategy] is None  # planned with offload options
    return {
        "time_forward": strategy in COMPUTE_TWIN.values(),
        # Twins measure the link too: offload-hidden's choice takes it from them.
        "probe_link": strategy in {*COMPUTE_TWIN, *COMPUTE_TWIN.values()} or may_offload,
        "time_twin": may_offload,
    }


def _failure_record(workload: Workload, failure: dict[str, Any]) -> Record:
    """The record of a workload that could not be measured: the workload, and what went wrong."""
    return Record.of(
        **workload.record_fields(),
        offloaded_blocks=workload.offloaded_blocks,
        framework="jax",
        **failure,
    )


class NoPlan(RuntimeError):
    """No plan fits a ``"plan"`` workload's budget: the planner's message and the least share."""

    def __init__(self, message: str, least_share: float | None, platform: str | None):
        super().__init__(message)
        self.message, self.least_share, self.platform = message, least_share, platform


class _BudgetPlans:
    """The plans of a run's budgets under one of :data:`PLANS`, all made in one process when
    the first is needed.

    Planning measures every block's costs, once for all the budgets; in a
    process of its own (:meth:`Children.plan_budgets`), they count in no measured
    peak.
    """

    def __init__(
        self,
        strategy: str,
        workloads: Sequence[Workload],
        kept: dict[tuple[str, float | None], Record],
        env: dict[str, str] | None,
        children: Children,
    ):
        self.budgets = [
            w.budget
            for w in workloads
            if w.strategy == strategy and (strategy, w.budget) not in kept
        ]
        self.env, self.children = env, children
        self.results: dict[float, dict[str, Any]] = {}

    def apply(self, workload: Workload, records: list[Record]) -> Workload:
        """``workload`` with its budget's plan; raises ``RuntimeError`` if none fits."""
        if not self.results:
            budgets_bytes, held = budget_bytes(self.budgets, records)
            results = self.children.plan_budgets(workload, budgets_bytes, held, env=self.env)
            self.results.update(zip(self.budgets, results))
        result = self.results[workload.budget]
        if "no_plan" in result:
            raise NoPlan(result["no_plan"], result.get("least_share"), result.get("platform"))
        return dataclasses.replace(workload, planned=result["planned"])

    def planning(self, workload: Workload) -> dict[str, Any]:
        """How long planning took (``planning_s``), and for how many budgets together; the
        first budget's also with the plans that planning compiled (``planner_points``)."""
        result = self.results[workload.budget]
        keys = ("planning_s", "planned_budgets", "planner_points")
        return {k: result[k] for k in keys if k in result}


def add_transfer_bounds(records: list[Record]) -> None:
    """Adds the per-phase lower bound on step time to each offloading record of the list.

    ``bound_ms = max(fwd_compute_ms, offloaded_bytes / d2h) + max(bwd_compute_ms,
    fetched bytes / h2d)``: the least a step takes if each phase must both
    compute and move its own bytes. It is a model, not a floor: copies that
    spill from the forward into the backward pass share the full-duplex link
    with fetches, and can beat it. The compute times are those of the
    record's :data:`COMPUTE_TWIN` in the same run (``forward_ms``, and the
    rest of its step, optimizer update included), the bandwidths those that
    the record's own process measured, and the bytes those of its compiled
    program's host copies (or of its own twin, ``twin_step_ms``, when its
    process timed one). Records that move nothing (every record on CPU),
    without a twin, or without link figures, are left as they are.
    """
    done = {r.strategy: r for r in records if r.step_time_ms is not None}
    for n, r in enumerate(records):
        if r.d2h_gbps is None or not r.device_to_host_bytes:
            continue
        if r.twin_step_ms is not None:  # its own twin, timed in its process
            fwd, bwd = r.twin_forward_ms, r.twin_step_ms - r.twin_forward_ms
            twin = r.strategy + " without host placement"
        else:
            measured = done.get(COMPUTE_TWIN.get(r.strategy, ""))
            if measured is None or measured.forward_ms is None:
                continue
            fwd, bwd = compute_ms(measured)
            twin = measured.strategy
        out_ms = r.device_to_host_bytes / (r.d2h_gbps * 1e6)
        back_ms = r.host_to_device_bytes / (r.h2d_gbps * 1e6)
        bound = max(fwd, out_ms) + max(bwd, back_ms)
        records[n] = r.with_fields(
            offloaded_bytes=r.device_to_host_bytes,
            compute_twin=twin,
            fwd_compute_ms=fwd,
            bwd_compute_ms=bwd,
            bound_ms=bound,
            bound_ratio=r.step_time_ms / bound,
        )
