"""A run: workloads measured in turn, each in a process of its own, the reference first.

Records of an earlier run are kept in place of measuring again, by strategy and budget;
the chosen strategies are chosen in processes of their own first; with ``repeat``, every
workload then runs again in fresh processes, in alternation, round after round; the
transfer bound is added to each offloading record once its compute twin is measured.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from jaxoffload.bench.catalog import ACCUMULATED_STRATEGIES, CHOSEN_STRATEGIES, COMPUTE_TWIN, PLANS
from jaxoffload.bench.child import Children, OutOfMemory
from jaxoffload.bench.measure import cache_env
from jaxoffload.bench.planning import budget_bytes, compute_ms, hidden_budget
from jaxoffload.bench.record import Record
from jaxoffload.bench.workload import Workload

__all__ = ["NoPlan", "add_transfer_bounds", "measure_all", "timed_runs", "with_run"]


def measure_all(
    workloads: list[Workload],
    *,
    steps: int = 10,
    env: dict[str, str] | None = None,
    on_start: Callable[[Workload, int], None] | None = None,
    on_record: Callable[[list[Record], int], None] | None = None,
    measured: Sequence[Record] = (),
    reference: str | None = None,
    compile_first: bool = False,
    trace: bool = False,
    repeat: int = 1,
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
      on_start: called with each workload and its run (1 for the first) before it starts
        (for progress).
      on_record: called with the records so far and the index of the one just measured,
        so that an interrupted run loses nothing already measured.
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
      repeat: how many processes time each workload's step (:func:`with_run`). After the
        first round, which plans and measures everything, each further round runs every
        workload once more, in the same order, as planned in the first, with nothing but its
        steps timed: variants in alternation, so that a drift of the machine falls on all of
        them. A kept record with fewer runs gets the runs it lacks.
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

        def cache_of(w: Workload) -> dict[str, str] | None:
            return planned[w.strategy] if w.strategy in PLANS else cache

        ran = []  # each workload as it ran: chosen strategies with their choice
        for w in workloads:
            record = kept.get((w.strategy, w.budget))
            if record is None:
                if on_start is not None:
                    on_start(w, 1)
                w, record = _plan_and_measure(
                    w,
                    records,
                    budget_plans.get(w.strategy),
                    steps=steps,
                    reference=reference,
                    env=env,
                    cache=cache_of(w),
                    trace=trace,
                    children=children,
                )
            else:
                w = _as_recorded(w, record)
            records.append(record)
            ran.append(w)
            if w is workloads[0] and record.step_time_ms is None:
                reference = None  # no reference gradient: no errors to report
            if (w.strategy, w.budget) not in kept and on_record is not None:
                on_record(records, len(records) - 1)
        fresh = {(w.strategy, w.budget) for w in workloads} - set(kept)
        for run in range(2, repeat + 1):
            for i, w in enumerate(ran):
                if not 0 < timed_runs(records[i]) < run:
                    continue
                if on_start is not None:
                    on_start(w, run)
                run_env = {**(env or {}), **(cache_of(w) or {})}
                try:
                    if cache_of(w) is not None and (w.strategy, w.budget) not in fresh:
                        children.compile(w, run_env)  # kept: not in this run's cache yet
                    again = children.measure(w, steps=steps, reference=None, env=run_env)
                except (OutOfMemory, RuntimeError) as e:
                    again = _failure_record(w, {"error": str(e) or "out of memory"})
                records[i] = with_run(records[i], again)
                if on_record is not None:
                    on_record(records, i)
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
) -> tuple[Workload, Record]:
    """One workload as it ran (planned first, if its strategy is) and its record: measured,
    or its failure.

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
        return w, _failure_record(w, {"out_of_memory": True})
    except NoPlan as e:
        # An answer, not a failure: the least that any plan reached, and why.
        no_plan = {"no_plan": e.message, "least_share": e.least_share, "platform": e.platform}
        return w, _failure_record(w, {**no_plan, **budget_plans.planning(w)})
    except RuntimeError as e:
        # One broken strategy must not cost the others' measurements.
        return w, _failure_record(w, {"error": str(e)})
    if w.strategy in PLANS:
        record = record.with_fields(**budget_plans.planning(w))
    return w, record


def with_run(record: Record, again: Record) -> Record:
    """``record`` with the step of one more process, ``again``: its ``step_time_ms`` the
    median of every process's (each a median of its steps), listed in ``step_time_ms_runs``,
    and its images per second from that. A failed run is listed as ``None`` and counts in
    no median. The other fields stay the first process's.

    Example:
      >>> r = Record(strategy="lean", batch=8, step_time_ms=40.0)
      >>> for ms in (42.0, 41.0):
      ...     r = with_run(r, Record(strategy="lean", step_time_ms=ms))
      >>> r.step_time_ms, r.step_time_ms_runs
      (41.0, [40.0, 42.0, 41.0])
    """
    runs = [*(record.step_time_ms_runs or [record.step_time_ms]), again.step_time_ms]
    median = statistics.median(ms for ms in runs if ms is not None)
    images_per_s = None if record.batch is None else record.batch / median * 1e3
    return record.with_fields(
        step_time_ms=median, step_time_ms_runs=runs, images_per_s=images_per_s
    )


def timed_runs(record: Record) -> int:
    """How many processes have timed a record's step (:func:`with_run`); 0 if it failed."""
    if record.step_time_ms is None:
        return 0
    return len(record.step_time_ms_runs or [record.step_time_ms])


def _as_recorded(workload: Workload, record: Record) -> Workload:
    """A kept record's workload as it ran: a chosen strategy with its record's choice."""
    if workload.strategy not in CHOSEN_STRATEGIES or record.step_time_ms is None:
        return workload
    window = workload.window if record.window is None else record.window
    return dataclasses.replace(
        workload, planned=record.planned, block_names=record.plan, window=window
    )


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
