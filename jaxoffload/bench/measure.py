"""One workload measured in this process: its compiled program, runtime peak, steps and gradient.

``peak_bytes_in_use`` never goes down inside a process, so :func:`measure` runs in a
fresh process of its own (:mod:`jaxoffload.bench.child`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import statistics
import time
from typing import Any

import flax
import jax

import jaxoffload
from jaxoffload import compiler_options, measure_overlap
from jaxoffload.bench.catalog import CHOSEN_STRATEGIES, PLANS
from jaxoffload.bench.gradients import accumulation_check, compare_gradients
from jaxoffload.bench.record import Record
from jaxoffload.bench.step import train_step
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import (
    analyze,
    brief,
    fallbacks,
    link_probe_bytes,
    measure_link,
    median_ms,
    read_spatial_gathers,
    requested_host_transfers,
    slower_link_gbps,
    with_copy_costs,
    with_twin,
    without_host_placement,
)

__all__ = [
    "CACHE_DIR",
    "cache_env",
    "compile_only",
    "compile_twin",
    "device_fields",
    "measure",
    "plan_fields",
    "probe",
    "requested_host_bytes",
    "spatial_fields",
    "timed_steps",
]


def requested_host_bytes(workload: Workload) -> int:
    """The bytes a workload's training step asks to move to host memory, from its jaxpr alone.

    Traces the step with abstract values: no device memory and no compilation,
    so it runs anywhere, at any size. It predicts what a GPU's compiled
    program moves (a record's ``device_to_host_bytes``, beside it in the same
    record).
    """
    step, state, batch, _ = train_step(workload, abstract=True)
    return sum(requested_host_transfers(step.trace(state, batch).jaxpr))


def measure(
    workload: Workload,
    *,
    steps: int = 10,
    warmup: int = 2,
    reference: str | None = None,
    time_forward: bool = False,
    probe_link: bool = False,
    time_twin: bool = False,
    trace: bool = False,
) -> Record:
    """Compiles and runs a workload in this process; returns its record.

    Call it in a fresh process (see :meth:`jaxoffload.bench.child.Children.measure`): the runtime
    peak covers everything the process did before.

    Args:
      workload: what to measure.
      steps: timed steps; the record holds their median.
      warmup: untimed steps first.
      reference: a ``.npz`` path. If the file exists, the record's
        ``grad_rel_err`` compares this workload's gradient at the initial
        parameters with the one stored there; if not, this workload's gradient
        is stored there (measure the ``"none"`` strategy first). The gradient is
        computed after the runtime peak is read. An accumulating workload
        checks its gradient against the whole batch's itself
        (:func:`accumulation_check`), and reads no reference.
      time_forward: also time the forward pass alone (``forward_ms``), after
        the runtime peak is read.
      probe_link: also measure the host link (``d2h_gbps``, ``h2d_gbps``, see
        :func:`measure_link`), after the runtime peak is read.
      time_twin: if the step moves residuals, also time its twin without
        host placement (``twin_step_ms``, ``twin_forward_ms``), after the
        runtime peak is read: the compute of its transfer bound.
      trace: also trace :data:`TRACED_STEPS` steps with ``jax.profiler``, after the
        runtime peak is read: the compute's and each copy direction's busy time, their
        overlap and a timeline (:func:`jaxoffload.measure_overlap`).

    A chosen strategy's workload must carry its choice
    (:meth:`jaxoffload.bench.child.Children.hidden_offload`, ``plan_budgets``).
    With ``num_devices`` or ``spatial`` > 1 the memory figures are per device: the
    compiled program's are one device's, and the runtime peak is the largest
    device's; with ``spatial`` > 1, ``spatial_gathers`` lists the all-gathers that
    undo the split (:func:`jaxoffload.spatial_gathers`).
    """
    if (
        workload.strategy in CHOSEN_STRATEGIES
        and workload.block_names is None
        and workload.planned is None
    ):
        raise ValueError(
            f"{workload.strategy!r} needs a plan first: see Children.hidden_offload, whose "
            "timing runs would otherwise count in this process's peak."
        )
    step, state, batch, loss_fn = train_step(workload)
    devices = jax.devices()[: workload.devices]
    # Donation consumes the initial state: keep a host copy for the gradient check, and
    # where it was (a sharded step's gradients are sharded as its parameters are).
    initial = None
    if reference is not None or workload.micro_batch is not None:
        initial = jax.device_get(state[:2]), jax.tree.map(lambda a: a.sharding, state[:2])
    hits = _cache_hits()[0]
    start = time.perf_counter()
    traced = step.trace(state, batch)  # Lean(max_slowdown=...) times its blocks here
    trace_s = time.perf_counter() - start
    compiled, report = _compile_and_analyze(traced)
    from_cache = _cache_hits()[0] > hits if os.environ.get(CACHE_DIR) else None
    compile_peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    twin = None
    if report.moved:
        # The same program without host placement: what the copies free.
        twin = compile_twin(workload)
        report = with_twin(report, twin[0])
    state, loss, times = _time_steps(compiled, state, batch, warmup=warmup, steps=steps)
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    peak = None if None in peaks else max(peaks)
    device = devices[0]
    extra = {}
    if workload.spatial > 1:  # what the partitioner could not split along the rows
        gathers = read_spatial_gathers(compiled.as_text())
        extra["spatial_gathers"] = [dataclasses.asdict(g) for g in gathers]
    if time_forward:
        extra["forward_ms"] = _forward_ms(loss_fn, state, batch, runs=steps)
    if time_twin and twin is not None:
        state, loss, twin_times = _time_twin(*twin, state, batch, steps=steps)
        extra.update(twin_times)
    if trace:
        state, overlap = _traced(compiled, state, batch)
        extra.update(overlap.fields(), timeline=overlap.rows())
    del state
    if probe_link:
        extra.update(_probe_link(devices))
    gradient = {"grad_rel_err": None}
    if initial is not None:
        initial = jax.device_put(*initial)
        if workload.micro_batch is not None:
            gradient = accumulation_check(workload, loss_fn, initial)
        else:
            gradient["grad_rel_err"] = compare_gradients(loss_fn, initial, batch, reference)
    fields = {
        **_workload_fields(workload),
        **device_fields(device),
        **_compiled_fields(report),
        "peak_bytes_in_use": peak,
        # What compiling held at its peak (autotuning runs kernels on the device), and
        # whether the step came from the persistent cache that Children.compile fills.
        "compile_peak_bytes": None if None in compile_peaks else max(compile_peaks),
        "compiled_from_cache": from_cache,
        "trace_s": trace_s,
        # Lean(max_slowdown=...)'s distinct blocks: each fallback's time, and the one taken.
        "fallbacks": fallbacks.taken() or None,
        **_step_fields(workload, times, loss),
        **gradient,
        "date": datetime.date.today().isoformat(),
        **extra,
    }
    return Record.of(**fields)


# The steps a trace covers, after a warm-up step (shared/MEASURING: at least 5).
TRACED_STEPS = 5


def _traced(compiled, state, batch):
    """The state after :data:`TRACED_STEPS` more steps, and how they ran (:class:`Overlap`)."""
    holder = [state]

    def run_step():
        holder[0], loss = compiled(holder[0], batch)
        return loss

    overlap = measure_overlap(run_step, steps=TRACED_STEPS, warmup=1)
    return holder[0], overlap


def _compile_and_analyze(traced):
    """The compiled step, and what its compiled program holds and moves (:func:`analyze`)."""
    compiled = _compiled(traced.lower())
    return compiled, analyze(traced, compiled, on_dropped="warn")


def _compiled(lowered):
    """A step compiled as the README tells users to compile an offloading step.

    With :func:`jaxoffload.compiler_options`, whatever its strategy (the options touch only
    asynchronous work, such as host copies); and where it has host copies, compiled again
    with each priced at its bytes over the link (:func:`with_copy_costs`).
    """
    options = compiler_options()
    compiled = lowered.compile(options)
    priced = with_copy_costs(options, compiled.as_text(), _pricing_link_gbps)
    return compiled if priced is options else lowered.compile(priced)


@functools.cache
def _pricing_link_gbps() -> float:
    """The link speed that prices host copies: measured once per run folder and kept there.

    A child that compiles a step for the persistent cache and the child that then measures it
    must compile the same program, prices included, or the second compiles it again.
    """
    folder = os.environ.get(CACHE_DIR)
    path = os.path.join(folder, "pricing_link_gbps.json") if folder else None
    if path and os.path.exists(path):
        with open(path) as f:
            return float(json.load(f))
    gbps = round(slower_link_gbps(), 1)
    if path:
        with open(path, "w") as f:
            json.dump(gbps, f)
    return gbps


# jax's persistent compilation cache, by the environment variables that set it: a child that
# compiles a step leaves it there for the child that measures it.
CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"


@functools.cache
def _cache_hits() -> list[int]:
    """This process's count of persistent-cache hits, counted from the first call on."""
    hits = [0]

    def count(event: str, **_: Any) -> None:
        hits[0] += event == "/jax/compilation_cache/cache_hits"

    jax.monitoring.register_event_listener(count)
    return hits


def cache_env(folder: str) -> dict[str, str]:
    """The environment of a child that reads and writes every compiled program in ``folder``."""
    return {
        CACHE_DIR: folder,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }


def compile_only(workload: Workload) -> dict[str, float]:
    """Compiles the workload's step (and its twin, if it moves bytes) as :func:`measure` does.

    Under :func:`cache_env`, the programs land in the persistent cache, so
    that :func:`measure` in another process loads them rather than compile:
    on a GPU compiling autotunes kernels on the device, and its scratch
    buffers count in the process's peak, above what the step holds (docs/design.md,
    "A runtime peak is the step's").
    """
    start = time.perf_counter()
    step, state, batch, _ = train_step(workload)
    _, report = _compile_and_analyze(step.trace(state, batch))
    if report.moved:
        compile_twin(workload)
    return {"compile_s": time.perf_counter() - start}


def compile_twin(workload: Workload):
    """The workload's step compiled without host placement, and its ``loss_fn``, allocating nothing.

    The twin keeps the same residuals and compute as the step, on the
    device: its temp is what the host copies free, and its times are the
    compute of the step's transfer bound. The bench's internal API, for
    :func:`measure` and ``benchmarks/probes/compile_probe.py``.
    """
    with without_host_placement():
        step, state, batch, loss_fn = train_step(workload, abstract=True)
        return _compiled(step.trace(state, batch).lower()), loss_fn


def _time_steps(compiled, state, batch, *, warmup: int, steps: int):
    """``(state, loss, times)`` after ``warmup`` untimed steps and ``steps`` timed ones, in seconds."""
    for _ in range(warmup):
        state, loss = compiled(state, batch)
    loss.block_until_ready()
    return timed_steps(compiled, state, batch, steps)


def timed_steps(compiled, state, batch, steps: int):
    """``(state, loss, times)``: ``steps`` steps, each timed from the end of the one before, in seconds.

    Each step is queued before the one before it is waited for, as a training loop dispatches
    them, so the host launches a step while the device runs the one before: the times are the
    device's steps. A step timed alone from its launch would add the launch, and the launch's
    spread from one process to the next (``docs/design.md``, "Copies that hide").
    """
    times = []
    end = time.perf_counter()
    state, loss = compiled(state, batch)
    for n in range(steps):
        running = loss
        if n + 1 < steps:
            state, loss = compiled(state, batch)
        running.block_until_ready()
        now = time.perf_counter()
        times.append(now - end)
        end = now
    return state, loss, times


def _forward_ms(loss_fn, state, batch, *, runs: int) -> float:
    """The median time of the forward pass alone (the loss), in milliseconds."""
    forward = jax.jit(lambda params, model_state, batch: loss_fn(params, model_state, batch)[0])
    return median_ms(forward, state[0], state[1], batch, runs=runs)


def _time_twin(twin, twin_loss, state, batch, *, steps: int):
    """``(state, loss, {"twin_forward_ms", "twin_step_ms"})``: the twin's forward pass and step.

    The twin's steps go on training ``state``; the first, a warm-up, is not counted.
    """
    with without_host_placement():
        forward_ms = _forward_ms(twin_loss, state, batch, runs=steps)
    state, loss, times = timed_steps(twin, state, batch, steps + 1)
    return (
        state,
        loss,
        {
            "twin_forward_ms": forward_ms,
            "twin_step_ms": statistics.median(times[1:]) * 1e3,
        },
    )


def _probe_link(devices) -> dict[str, float]:
    """The host link's bandwidths per device, all the step's devices copying at once
    (:func:`measure_link`), with an array that fits what each has free."""
    # Under a memory cap, the probe must fit in what the step left free.
    nbytes = link_probe_bytes(devices[0])
    for stats in (d.memory_stats() or {} for d in devices):
        if "bytes_limit" in stats:
            nbytes = min(nbytes, (stats["bytes_limit"] - stats["bytes_in_use"]) // 4)
    return measure_link(nbytes, devices=devices)


def _workload_fields(workload: Workload) -> dict[str, Any]:
    """What a record says of its workload, the plan included."""
    return {
        "model": workload.model,
        "batch": workload.batch,
        "image_size": workload.image_size,
        "dtype": workload.dtype,
        "strategy": workload.strategy,
        "window": workload.window,
        "plan": workload.block_names,
        **plan_fields(workload),
        "offloaded_blocks": workload.offloaded_blocks,
        "num_devices": workload.num_devices,
        **spatial_fields(workload),
        **_accumulation_fields(workload),
        "framework": "jax",
    }


def spatial_fields(workload: Workload) -> dict[str, Any]:
    """A spatially split workload's mesh; the image size recorded is the whole image's."""
    if workload.spatial == 1:
        return {}
    return {"spatial": workload.spatial, "mesh": {"data": workload.num_devices,
                                                 "space": workload.spatial}}  # fmt: skip


def _accumulation_fields(workload: Workload) -> dict[str, Any]:
    """An accumulating workload's micro-batch, and how many make its (global) batch."""
    if workload.micro_batch is None:
        return {}
    return {
        "micro_batch": workload.micro_batch,
        "accumulation_steps": workload.batch // workload.micro_batch,
    }


def device_fields(device) -> dict[str, Any]:
    """The device and the versions a record was measured with."""
    return {
        "device": device.device_kind,
        "platform": device.platform,
        "jax_version": jax.__version__,
        "flax_version": flax.__version__,
        "jaxoffload_version": jaxoffload.__version__,
    }


def _compiled_fields(report) -> dict[str, Any]:
    """What the compiled program holds and moves, from its :class:`jaxoffload.MemoryReport`."""
    return {
        "compiled_temp_bytes": report.temp_bytes,
        "compiled_host_temp_bytes": report.host_temp_bytes,
        "compiled_argument_bytes": report.argument_bytes,
        "twin_temp_bytes": report.twin_temp_bytes,
        "copies_free_little": report.frees_little,
        "requested_host_bytes": report.requested_bytes,
        "host_buffers": report.host_buffers,
        "device_to_host_copies": report.device_to_host,
        "device_to_host_bytes": report.device_to_host_bytes,
        "host_to_device_copies": report.host_to_device,
        "host_to_device_bytes": report.host_to_device_bytes,
    }


def _step_fields(workload: Workload, times: list[float], loss) -> dict[str, Any]:
    """The timed steps' median and each, the throughput and the last loss."""
    step_s = statistics.median(times)
    return {
        "step_time_ms": step_s * 1e3,
        "step_times_ms": [t * 1e3 for t in times],
        "images_per_s": workload.batch / step_s,
        "final_loss": float(loss),
    }


def plan_fields(workload: Workload) -> dict[str, Any]:
    """The fields of a record that say the plan its workload ran (:attr:`Workload.runs_plan`):
    its per-block choices and the plan itself; for a budget's plan (``"plan"``,
    ``"plan-device"``) its budget and the planner's figures, for ``"offload-hidden"`` the bytes
    that its schedule moves; none for others."""
    if not workload.runs_plan:
        return {}
    planned = workload.block_plan
    common = {
        "block_costs": workload.block_costs,
        "plan_choices": [brief(s) for s in planned.strategies],
        "plan_outside": brief(planned.outside),
        "plan_estimated_step_ms": planned.estimated_step_ms,
        "planned": workload.planned,  # the plan itself: it re-applies without planning
    }
    if workload.strategy not in PLANS:
        # Each block's max_bytes is what hidden_copies has it move, each way.
        moved = sum(s.max_bytes or 0 for s in planned.strategies if s.to_host)
        return {**common, "plan_moved_bytes": moved}
    return {
        "budget": workload.budget,
        "budget_bytes": planned.budget_bytes,
        **common,
        "plan_compiled_bytes": planned.compiled_bytes,
        "plan_estimated_bytes": planned.estimated_bytes,
        "plan_measured_step_ms": planned.measured_step_ms,
    }


def probe() -> dict[str, Any]:
    """The default device's platform, kind, memory limit, and how many devices jax sees."""
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {
        "platform": device.platform,
        "device": device.device_kind,
        "bytes_limit": stats.get("bytes_limit"),
        "device_count": jax.device_count(),
    }
