"""``jaxoffload bench`` once its flags are parsed: the workloads measured and searched into
the output folder, and the results shown.

The device is probed in a child process (:class:`~jaxoffload.bench.child.Children`):
this process starts no device client of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
from typing import Any

from jaxoffload.bench import models
from jaxoffload.bench.catalog import (
    ACCUMULATED_STRATEGIES,
    CHOSEN_STRATEGIES,
    COMPUTE_TWIN,
    PLANS,
)
from jaxoffload.bench.child import Children
from jaxoffload.bench.console import (
    Progress,
    outcome,
    print_table,
    say_notes,
    size_cells,
    stderr_console,
)
from jaxoffload.bench.folder import (
    RECORDS,
    REFERENCE,
    earlier_records,
    run_fields,
    writable_folder,
    write_records,
)
from jaxoffload.bench.measure import spatial_fields
from jaxoffload.bench.options import SIZE_SEARCHES, BenchError, workload_fields
from jaxoffload.bench.plots import plot_records, plot_sizes, plot_timelines
from jaxoffload.bench.record import Record
from jaxoffload.bench.run import measure_all, timed_runs
from jaxoffload.bench.workload import STRATEGIES, Workload

__all__ = ["bench", "memory_cap_env"]


def bench(
    args: argparse.Namespace,
    strategies: list[str],
    axes: list[str],
    *,
    command: str | None = None,
    children: Children | None = None,
) -> list[Record]:
    """Runs ``jaxoffload bench``; returns the records it wrote.

    Args:
      args: the parsed command line, its flags checked (:func:`~jaxoffload.bench.options.check`).
      strategies, axes: the strategies and the size searches' axes that the check returned.
      command: the command as typed, stored in each record so it can be rerun.
      children: the child processes that probe, measure and search
        (:class:`~jaxoffload.bench.child.Children`), or a stand-in for them.

    Raises:
      BenchError: if the arguments do not fit together or with the device, or if a
        workload or a search failed (the others' records are written all the same).
    """
    children = Children() if children is None else children
    workloads = [Workload(**fields) for fields in workload_fields(args, strategies)]
    out = writable_folder(args.out)
    if args.resume:
        earlier = earlier_records(out / RECORDS, args)
    else:
        earlier = {}
        (out / REFERENCE).unlink(missing_ok=True)  # its gradient is another run's
    device = children.probe()
    _check_device_count(args, device)
    env = _measuring_env(args, device, axes)
    console = stderr_console()
    if device["platform"] == "cpu" and set(COMPUTE_TWIN) & set(strategies):
        console.print(
            "[yellow]note:[/] on CPU, host placement has no effect: offload strategies move "
            "nothing, so their memory equals 'none'. Measure memory on a GPU."
        )
    _add_needed_strategies(workloads, strategies, console)
    # The plain model runs first: it is every other strategy's gradient reference.
    # Chosen strategies run last: they are chosen from earlier runs' records.
    workloads.sort(key=lambda w: (w.strategy != "none", w.strategy in CHOSEN_STRATEGIES))
    records = _measure(
        workloads, args, out, earlier, axes=axes, device=device, env=env, console=console,
        command=command, children=children,
    )  # fmt: skip
    print_table(records)
    say_notes(records, console)
    plots = [
        plot_records(records, out / "pareto.png"),
        plot_timelines(records, out / "timeline.png"),
    ]
    plots += [plot_sizes(records, axis, out / f"max_{axis}.png") for axis in axes]
    plotted = ", ".join(str(p) for p in plots if p)
    console.print(f"wrote {out / RECORDS}" + (f" and {plotted}" if plotted else ""))
    failed = [f"{r.name}: {r.error}" for r in records if r.error is not None] + [
        f"{r.name} {flag}: {r.search_errors[axis]}"
        for r in records
        for axis, (flag, *_) in SIZE_SEARCHES.items()
        if axis in r.search_errors
    ]
    if failed:
        raise BenchError(
            f"{len(failed)} failed ({RECORDS} has the rest; --resume runs only these again):\n"
            + "\n".join(failed)
        )
    (out / REFERENCE).unlink(missing_ok=True)  # nothing left to compare with it
    return records


def _check_device_count(args: argparse.Namespace, device: dict[str, Any]) -> None:
    """``--devices`` by ``--spatial`` is at most what the measuring processes' jax sees."""
    count, needed = device.get("device_count", 1), args.devices * args.spatial
    if needed > count:
        flag = f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}"
        more = f"; on CPU, {flag} gives more" if device["platform"] == "cpu" else ""
        asked = f"--devices {args.devices}" + (
            f" by --spatial {args.spatial}" if args.spatial > 1 else ""
        )
        raise BenchError(f"{asked}: jax sees {count} {device['platform']} devices here{more}")


def _measuring_env(
    args: argparse.Namespace, device: dict[str, Any], axes: list[str]
) -> dict[str, str]:
    """The measuring processes' environment, for ``--memory-cap``; it and the size searches need a GPU."""
    options = ["--memory-cap"] * (args.memory_cap is not None)
    options += [SIZE_SEARCHES[axis][0] for axis in axes]
    if options and device["platform"] != "gpu":
        raise BenchError(
            f"{' and '.join(options)} need{'s' * (len(options) == 1)} a GPU: this machine's jax "
            f"backend is {device['platform']}, where device memory is host memory and running "
            "out of it stops the machine, not the step"
        )
    if args.memory_cap is None:
        return {}
    return memory_cap_env(args.memory_cap, device["bytes_limit"])


def memory_cap_env(gib: float, bytes_limit: int | None) -> dict[str, str]:
    """XLA_PYTHON_CLIENT_MEM_FRACTION that gives the children ``gib`` of device memory."""
    if gib <= 0:
        raise BenchError(f"--memory-cap must be positive, got {gib}")
    # bytes_limit is what a child's allocator may take: the default fraction
    # (0.75) of the device, unless the environment set another.
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
    total = (bytes_limit or 0) / fraction
    if gib * 2**30 > total:
        raise BenchError(
            f"--memory-cap {gib} GiB is more than this GPU has ({total / 2**30:.1f} GiB)"
        )
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{gib * 2**30 / total:.6f}"}


def _add_needed_strategies(workloads: list[Workload], strategies: list[str], console: Any) -> None:
    """Adds, in place and with a note, the strategies that others need: ``none`` and planned ones' twins.

    An accumulating strategy checks its gradient against its own step on a whole batch,
    so a run of those alone does not add ``none``, whose step at the global batch is the
    one that does not fit.
    """
    compared = any(map(_compared_with_none, strategies))
    for needed, why in [("none", "gradients are compared with it")] * compared + [
        (COMPUTE_TWIN[s], f"{s!r} is planned from its run")
        for s in strategies
        if s in CHOSEN_STRATEGIES and s not in PLANS
    ]:
        if needed not in strategies:
            console.print(f"note: adding the {needed!r} strategy: {why}.")
            workloads.append(dataclasses.replace(workloads[0], strategy=needed, micro_batch=None))
            strategies.append(needed)


def _compared_with_none(strategy: str) -> bool:
    """Whether a strategy's gradient is compared with ``none``'s: an accumulating one
    checks itself against its own step on a whole batch."""
    return strategy != "none" and strategy not in ACCUMULATED_STRATEGIES


def _measure(
    workloads: list[Workload],
    args: argparse.Namespace,
    out: pathlib.Path,
    earlier: dict[str, Record],
    *,
    axes: list[str],
    device: dict[str, Any],
    env: dict[str, str],
    console: Any,
    command: str | None,
    children: Children,
) -> list[Record]:
    """Measures the workloads, then searches the sizes, that ``earlier`` lacks; writes records.json after each."""
    path, reference = out / RECORDS, out / REFERENCE
    kept = {w.name: earlier[w.name] for w in workloads if w.name in earlier}
    compared = any(_compared_with_none(w.strategy) for w in workloads if w.name not in kept)
    none = kept.get("none")
    if none is not None and none.step_time_ms is not None and not reference.exists() and compared:
        del kept["none"]  # measured again: the others' gradients are compared with its
    todo = [w for w in workloads if w.name not in kept]
    searched = _searched(workloads, axes)
    measuring = {w.name for w in todo}  # their records are new: nothing searched yet
    searches = [
        (name, axis)
        for name in searched
        for axis in axes
        if name in measuring
        or name not in earlier
        or (found := earlier[name].searches.get(axis)) is None
        or found.size is None
        or (name == "plan" and found.min_speed != args.min_speed)
    ]
    if args.resume:
        searching = f"; searching {', '.join(f'{n} {a}' for n, a in searches) or 'nothing more'}"
        console.print(
            f"resuming {path}: kept {', '.join(kept) or 'nothing'}; measuring "
            f"{', '.join(w.name for w in todo) or 'nothing more'}{searching if axes else ''}."
        )
    first_plans = {p: next((w for w in todo if w.strategy == p), None) for p in PLANS}
    # Each workload runs --repeat times; a kept record with fewer runs gets those it lacks.
    done = [n for r in kept.values() if (n := timed_runs(r))]
    more = (args.repeat - 1) * len(todo) + sum(max(0, args.repeat - n) for n in done)
    total = len(todo) + more + len(searches)
    with Progress(console, total=total) as progress:

        def on_start(w, run):
            work = f"compile and {args.steps} steps"
            if run > 1:
                work = f"run {run} of {args.repeat}: {args.steps} steps"
            elif w is first_plans.get(w.strategy):  # its budgets are planned in one process first
                budgets = sum(v.strategy == w.strategy for v in todo)
                work = f"plan at {budgets} budgets, {work}"
            progress.start(f"{w.name} on {w.model}, batch {w.batch}: {work}")

        def on_record(records, i):
            records[i] = r = records[i].with_fields(**run_fields(args, command))
            write_records(path, records)
            runs = r.step_time_ms_runs
            if runs:  # a further run: what it took, and the median of the runs so far
                took = "failed" if runs[-1] is None else f"{runs[-1]:.1f} ms"
                progress.end(f"{r.name}: run {len(runs)} {took}; median {outcome(r)}")
            else:
                progress.end(f"{r.name}: {outcome(r)}")

        records = measure_all(
            workloads,
            steps=args.steps,
            env=env,
            on_start=on_start,
            on_record=on_record,
            measured=list(kept.values()),
            reference=str(reference),
            # A GPU autotunes while compiling, on the device: not in the measured peak.
            compile_first=device["platform"] != "cpu",
            trace=args.trace,
            repeat=args.repeat,
            children=children,
        )
        if "plan" in searched:
            records.append(
                earlier.get("plan") or _plan_search_record(workloads[0], device, args, command)
            )
        _search_sizes(
            records, searched, searches, args, path, env=env, progress=progress, children=children
        )
    write_records(path, records)  # with the transfer bounds, which need every record
    return records


def _searched(workloads: list[Workload], axes: list[str]) -> dict[str, Workload]:
    """The workloads whose sizes are searched, by the name of the record that takes the fields.

    Each strategy of one value for every block is searched as it is. A plain-Flax
    (linen) model is also planned at each size, from the plain workload, into a record
    of its own, ``"plan"``. ``offload-hidden``'s plans and ``--budget``'s are made for
    the batch measured, and an accumulating strategy's memory is set by its micro-batch: they are
    not searched.
    """
    if not axes:
        return {}
    searched = {w.name: w for w in workloads if w.strategy in STRATEGIES}
    if models.is_plain(workloads[0].model):  # and linen: the searches refuse NNX models
        searched["plan"] = workloads[0]
    return searched


def _plan_search_record(
    plain: Workload, device: dict[str, Any], args: argparse.Namespace, command: str | None
) -> Record:
    """The record of the planned model's size searches, before they add their fields.

    Its strategy is ``"plan"`` with no ``budget``: each size is planned for the device's
    memory, not for a share of ``none``'s peak as ``--budget``'s plans are, and no step
    of its own is measured at the run's batch.
    """
    fields = ("model", "batch", "image_size", "dtype", "num_devices")
    return Record.of(
        **{k: getattr(plain, k) for k in fields},
        **spatial_fields(plain),
        strategy="plan",
        framework="jax",
        device=device["device"],
        platform=device["platform"],
        date=datetime.date.today().isoformat(),
        **run_fields(args, command),
    )


def _search_sizes(
    records: list[Record],
    searched: dict[str, Workload],
    searches: list[tuple[str, str]],
    args: argparse.Namespace,
    path: pathlib.Path,
    *,
    env: dict[str, str],
    progress: Progress,
    children: Children,
) -> None:
    """Runs each search ``(name, axis)`` in a process of its own; adds what it found to the
    record named, in the list."""
    index = {r.name: n for n, r in enumerate(records)}
    for name, axis in searches:
        n, what = index[name], f"{name}: largest {axis.replace('_', ' ')}"
        progress.start(f"{what}, compiling for up to {args.time_limit:g} s")
        try:
            found = children.largest(
                searched[name],
                axis,
                plan=name == "plan",
                env=env,
                time_limit_s=args.time_limit,
                min_speed=args.min_speed if name == "plan" else None,
            )
        except RuntimeError as e:  # one failed search must not cost the others
            r = records[n]
            records[n] = dataclasses.replace(r, search_errors={**r.search_errors, axis: str(e)})
            said = f"failed: {str(e).strip().splitlines()[-1]}"
        else:
            # An earlier run's error of this search, searched again, goes.
            records[n] = records[n].with_search(axis, found)
            size, speed = size_cells(records[n], axis)
            said = size + (f", {speed} {SIZE_SEARCHES[axis][2]}" if speed != "-" else "")
            if stopped := found.searches[axis].stopped:
                said += f" ({stopped})"
        write_records(path, records)
        progress.end(f"{what} {said}")
