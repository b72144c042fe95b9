"""What the command says: progress and notes on stderr, the records' table on stdout."""

from __future__ import annotations

import sys
import time
from typing import Any

from jaxoffload.bench.catalog import PLANS
from jaxoffload.bench.envelope import envelope_step, uniform_points
from jaxoffload.bench.options import SIZE_SEARCHES
from jaxoffload.bench.record import Record, SizeSearch

__all__ = [
    "GRADIENT_CONTROL",
    "Progress",
    "gradient_flags",
    "outcome",
    "print_table",
    "records_table",
    "say_notes",
    "size_cells",
    "stderr_console",
]


def stderr_console() -> Any:
    """The console of progress and notes: stderr, its lines whole when it is a log."""
    from rich.console import Console

    console = Console(stderr=True)
    console.soft_wrap = not console.is_terminal  # a log's lines are not cut at 80 columns
    return console


class Progress:
    """Says each step of the work as it starts and ends, with the time it took.

    It goes to stderr. Where stderr and stdout are both a terminal it is a live
    bar; where either is a log file or a pipe (CI, ``bench > log``) each step is
    a plain, flushed line, which stays where the bar, erased when done, would not.
    """

    def __init__(self, console: Any, total: int):
        self.console, self.total, self.steps, self.began = console, total, 0, 0.0
        self.bar = None
        if console.is_terminal and sys.stdout.isatty():
            import rich.progress

            self.bar = rich.progress.Progress(console=console, transient=True)
            self.task = self.bar.add_task("measuring", total=total)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def start(self, what: str) -> None:
        self.began = time.monotonic()
        self._say(what)

    def end(self, outcome: str) -> None:
        self._say(f"{outcome} ({time.monotonic() - self.began:.1f} s)")
        self.steps += 1
        if self.bar is not None:
            self.bar.advance(self.task)

    def _say(self, text: str) -> None:
        line = f"[{self.steps + 1}/{self.total}] {text}"
        if self.bar is not None:
            self.bar.update(self.task, description=line)
        else:
            print(line, file=self.console.file, flush=True)


def print_table(records: list[Record]) -> None:
    """The records' table, on stdout."""
    from rich.console import Console

    out_console = Console()
    if not out_console.is_terminal:  # a file or a pipe: no width to fit, so do not squeeze
        out_console = Console(width=200)  # the widest table: both size searches, × bound
    out_console.print(records_table(records))


def records_table(records: list[Record]) -> Any:
    """A ``rich`` table of the records: a row each, a column pair per size search."""
    from rich.table import Table

    first = records[0]
    devices, spatial = first.num_devices or 1, first.spatial or 1
    table = Table(
        title=f"{first.model}, batch {first.batch}, {first.image_size}², {first.dtype}"
        + (f", {devices} devices" if devices > 1 else "")
        + (f", rows over {spatial} devices" if spatial > 1 else "")
    )
    columns = ["strategy", "temp GiB", "host GiB", "peak GiB", "step ms", "images/s", "grad err"]
    bound = any(r.bound_ratio is not None for r in records)
    if bound:
        columns.append("× bound")
    axes = [
        axis
        for axis in SIZE_SEARCHES
        if any(_found(r, axis) is not None or axis in r.search_errors for r in records)
    ]
    for axis in axes:
        columns += [f"max {axis.replace('_', ' ')}", f"{SIZE_SEARCHES[axis][2]} at max"]
    table.add_column(columns[0], no_wrap=True)  # the figures' columns wrap first
    for c in columns[1:]:
        table.add_column(c, justify="right")
    flagged = gradient_flags(records)
    for r in records:
        sizes = [cell for axis in axes for cell in size_cells(r, axis)]
        table.add_row(r.name, *_measured_cells(r, flagged, bound), *sizes)
    return table


def _measured_cells(r: Record, flagged: list[Record], bound: bool) -> list[str]:
    """A record's cells of its measured step, from temp to grad err (and × bound)."""
    blank = [""] * (5 + bound)
    if r.no_plan is not None:
        return [_least(r), *blank]
    if r.out_of_memory or r.error is not None:
        return ["out of memory" if r.out_of_memory else "failed", *blank]
    if r.step_time_ms is None:  # the planned model's size searches: no step at the run's size
        return ["-"] * (6 + bound)
    err = r.grad_rel_err
    cells = [
        _gib(r.compiled_temp_bytes),
        _gib(r.compiled_host_temp_bytes),
        _gib(r.peak_bytes_in_use),
        f"{r.step_time_ms:.1f}",
        f"{r.images_per_s:.1f}",
        "-" if err is None else f"{err:.1e}{' !' if r in flagged else ''}",
    ]
    if bound:
        cells.append("-" if r.bound_ratio is None else f"{r.bound_ratio:.2f}")
    return cells


def size_cells(r: Record, axis: str) -> list[str]:
    """A record's cells of one size search: the largest size found and the speed there."""
    if axis in r.search_errors:
        return ["failed", ""]
    found = _found(r, axis)
    if found is None:  # not searched: grad-accum(-lean), or a plan made for one batch
        return ["-", "-"]
    speed = getattr(found, SIZE_SEARCHES[axis][1])
    return [str(found.size), "-" if speed is None else f"{speed:.1f}"]


def _found(r: Record, axis: str) -> SizeSearch | None:
    """What the record's search of ``axis`` found, if it has a size."""
    found = r.searches.get(axis)
    return None if found is None or found.size is None else found


def _least(r: Record) -> str:
    """The least share of the plain step that any plan reached: ``"least 0.97 on CPU"``."""
    where = " on CPU" if r.platform == "cpu" else ""
    return f"least {r.least_share:.2f}{where}" if r.least_share is not None else "no plan"


def outcome(r: Record) -> str:
    """What a measured record came to, in a few words."""
    if r.out_of_memory:
        return "out of memory"
    if r.no_plan is not None:
        return f"no plan fits: {_least(r)}"
    if r.error is not None:
        return f"failed: {r.error.strip().splitlines()[-1]}"
    return f"{r.step_time_ms:.1f} ms a step"


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.3f}"


# The run whose arithmetic is the plain model's, rematerialised: its gradient error is
# rounding, the scale against which the other strategies' errors are read.
GRADIENT_CONTROL = "remat"


def gradient_flags(records: list[Record]) -> list[Record]:
    """The records whose gradient error is over twice the same-arithmetic control's, same run.

    The control is :data:`GRADIENT_CONTROL`'s record; without it, or with a
    control error of 0 (float64, or a CPU that sums in one order), nothing is
    flagged.

    Example:
      >>> records = [Record(strategy="remat", grad_rel_err=1e-3),
      ...            Record(strategy="lean", grad_rel_err=3e-3)]
      >>> [r.strategy for r in gradient_flags(records)]
      ['lean']
    """
    control = next((r.grad_rel_err for r in records if r.strategy == GRADIENT_CONTROL), None)
    if not control:
        return []
    return [r for r in records if r.grad_rel_err is not None and r.grad_rel_err > 2 * control]


def say_notes(records: list[Record], console: Any) -> None:
    """What the table does not say: copies that free little, empty plans, gradients, plans."""
    for r in records:
        if r.copies_free_little:
            console.print(
                f"[yellow]note:[/] {r.strategy!r} moves {_gib(r.device_to_host_bytes)} GiB to "
                f"the host but its device temp is {_gib(r.compiled_temp_bytes)} GiB against "
                f"{_gib(r.twin_temp_bytes)} GiB without "
                "the copies: they free less than a tenth of what they move. The peak is a "
                "working set, not residuals; 'lean' keeps as little without the transfers."
            )
        if gathers := r.spatial_gathers:
            sources = sorted({g["op_name"] for g in gathers})
            console.print(
                f"[yellow]note:[/] {r.name!r} gathers {len(gathers)} activations whole on every "
                f"device, undoing the row split ({_gib(sum(g['nbytes'] for g in gathers))} GiB in "
                f"all), from: {'; '.join(sources)}."
            )
        if r.strategy == "offload-hidden" and r.offloaded_blocks == 0:
            ran = repr(r.plan[0]) if r.plan else "Lean() on every block"
            console.print(
                f"[yellow]note:[/] {r.strategy!r} offloads nothing here: no block's transfers "
                f"fit behind the compute around it, so it ran as {ran}."
            )
    for r in records:
        if r.grad_rel_err_note:
            console.print(
                f"{r.name} ({r.accumulation_steps} micro-batches of {r.micro_batch}): grad "
                f"err {r.grad_rel_err:.1e} {r.grad_rel_err_note}."
            )
    compiled_high = [
        r.name
        for r in records
        if r.compile_peak_bytes and r.compile_peak_bytes >= r.peak_bytes_in_use
    ]
    if compiled_high:
        console.print(
            f"[yellow]note:[/] the runtime peak of {', '.join(compiled_high)} was reached while "
            "compiling (autotuning), not by the step: compare their compiled bytes."
        )
    flagged = gradient_flags(records)
    if flagged:
        control = next(r for r in records if r.strategy == GRADIENT_CONTROL).grad_rel_err
        console.print(
            "[yellow]note:[/] gradient error over twice the same-arithmetic control's "
            f"({GRADIENT_CONTROL!r}, {control:.1e}) in this run: "
            + ", ".join(f"{r.name} {r.grad_rel_err:.1e}" for r in flagged)
            + " (marked !)."
        )
    for r in records:
        if r.plan_choices is not None:
            choices = ", ".join(
                f"{c} x{r.plan_choices.count(c)}" for c in dict.fromkeys(r.plan_choices)
            )
            console.print(
                f"{r.name}: {choices}; outside the blocks {r.plan_outside}"
                + (_against_envelope(r, records) if r.strategy in PLANS else _moved(r))
                + _against_device_plan(r, records)
            )


def _against_device_plan(plan: Record, records: list[Record]) -> str:
    """A ``plan`` record's step against the ``plan-device`` one's at its budget, and what it
    moves each way: whether offload paid there."""
    device = next(
        (r for r in records if r.strategy == "plan-device" and r.budget == plan.budget), None
    )
    if plan.strategy != "plan" or device is None or not (plan.step_time_ms and device.step_time_ms):
        return ""
    ratio = plan.step_time_ms / device.step_time_ms
    moved = (plan.device_to_host_bytes or 0) / 1e9
    return f"; {ratio:.3f}× the step of {device.name}, moving {moved:.2f} GB each way"


def _moved(record: Record) -> str:
    """What an ``offload-hidden`` plan's schedule moves, against what its compiled step moves."""
    if record.plan_moved_bytes is None:
        return ""
    # In MiB: a small model's copies are a fraction of a GiB's thousandth.
    said = f"; its schedule moves {record.plan_moved_bytes / 2**20:,.1f} MiB each way"
    if record.device_to_host_bytes:  # nothing moves on a CPU
        said += f", its compiled step {record.device_to_host_bytes / 2**20:,.1f} MiB to the host"
    return said


def _against_envelope(plan: Record, records: list[Record]) -> str:
    """A measured plan's step over the uniform envelope at its budget, and its peak against it.

    The budget is the plan's ``budget_bytes``: its share of ``none``'s runtime peak, which
    the planner fitted the compiled step to beside what ``none``'s process held beyond its
    own (:func:`~jaxoffload.bench.planning.budget_bytes`). Both figures read runtime peaks,
    the plan's and the uniform strategies': without them (CPU), nothing is said.
    """
    peak = plan.peak_bytes_in_use
    if not peak or plan.step_time_ms is None or plan.budget_bytes is None:
        return ""
    budget = plan.budget_bytes
    uniform = uniform_points(records, "peak_bytes_in_use")
    envelope = envelope_step(list(uniform.values()), budget)
    if envelope is None:
        versus = f"no uniform strategy of this run ({', '.join(uniform)}) fits its budget"
    else:
        ratio = plan.step_time_ms / envelope
        versus = f"{ratio:.2f}× the envelope of {', '.join(uniform)} at its budget"
    within = "within" if peak <= budget else "over"
    return f"; {versus}; peak {_gib(peak)} GiB, {within} its budget of {_gib(budget)} GiB"
