"""The command's plots: memory against step time, and the speed at the largest sizes found.

They need matplotlib (the ``bench`` extra); without it, no plot is drawn.
"""

from __future__ import annotations

import pathlib
from typing import Any

from jaxoffload.bench.catalog import PLANS
from jaxoffload.bench.envelope import envelope_step, pareto_front, uniform_points
from jaxoffload.bench.options import SIZE_SEARCHES
from jaxoffload.bench.record import Record

__all__ = ["plot_records", "plot_sizes", "plot_timelines"]


def plot_records(records: list[Record], path: pathlib.Path) -> pathlib.Path | None:
    """Plots memory against step time, one point per record, with the Pareto front and the envelope.

    The envelope is the least step the uniform strategies reach at each memory
    (:func:`~jaxoffload.bench.envelope.envelope_step`), drawn up from the leanest
    of them. Plans are stars; where memory is the runtime peak, each plan's budget
    (``budget_bytes``) is a dotted line of its colour, so that a plan reads against
    its budget and against the envelope where the line crosses it. Records of other
    frameworks (``framework`` other than ``"jax"``, such as
    ``jaxoffload/bench/torch_reference.py``'s) are drawn as squares and named
    with their framework. The memory axis starts at 0, unless the points differ by less
    than a tenth of the largest, as the strategies' compiled temps do on CPU: then it spans
    them, and says that it does not start at 0. Returns ``path``, or ``None`` if
    matplotlib is missing or no record has a step time.
    """
    plt = _pyplot()
    done = [r for r in records if r.step_time_ms is not None]
    if plt is None or not done:
        return None
    # Without a runtime peak (CPU), the compiled temp is the memory reading; the
    # budgets, in the planner's bytes, are then not on the axis.
    key = "peak_bytes_in_use" if all(r.peak_bytes_in_use for r in done) else "compiled_temp_bytes"
    # A plan's budget line, where its record has one (plan-device's did not, before 0.2.0).
    with_budget = [r for r in done if r.strategy in PLANS and r.budget_bytes is not None]
    plans = with_budget if key == "peak_bytes_in_use" else []
    memories = [getattr(r, key) for r in done] + [r.budget_bytes for r in plans]
    unit, scale = ("GiB", 2**30) if max(memories) >= 2**30 else ("MiB", 2**20)
    points = [(r.step_time_ms, getattr(r, key) / scale) for r in done]
    bottom, top = _memory_limits([m / scale for m in memories])
    fig, ax = plt.subplots(figsize=(8, 4.2), constrained_layout=True)
    budget_colors = []
    for r, (x, y) in zip(done, points):
        jax_record = r.framework in ("jax", None)
        label = r.name if jax_record else f"{r.framework} {r.strategy}"
        marker = "s" if not jax_record else "*" if r.strategy in PLANS else "o"
        dot = ax.scatter(x, y, s=90 if marker == "*" else 45, marker=marker, label=label, zorder=3)
        if r in plans:
            budget_colors.append((r.budget_bytes / scale, dot.get_facecolor()[0]))
    for n, (budget, color) in enumerate(budget_colors):  # one legend entry for them all
        ax.axhline(budget, color=color, ls=":", lw=1, label=None if n else "a plan's budget")
    front = pareto_front(points)
    ax.plot(*zip(*[points[i] for i in front]), "k--", lw=1, label="Pareto front")
    uniform = uniform_points(done, key).values()
    _plot_envelope(ax, [(m / scale, step) for m, step in uniform], top)
    first = done[0]
    _set_time_axis(ax, [x for x, _ in points])
    memory = "runtime peak" if key == "peak_bytes_in_use" else "compiled device temp"
    ylabel = f"{memory} ({unit})" + (", not from 0" if bottom > 0 else "")
    if first.platform == "cpu":  # XLA:CPU keeps every buffer in one memory: nothing moves
        ylabel += "\nCPU: host and device memory are one"
    ax.set(
        xlabel="step time (ms)",
        ylabel=ylabel,
        title=f"{first.model} b{first.batch} {first.image_size}² {first.dtype}, {first.device}",
    )
    ax.set_ylim(bottom, top)
    # Outside the axes, so that it never hides a point.
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sizes(records: list[Record], axis: str, path: pathlib.Path) -> pathlib.Path | None:
    """Plots the speed at the largest size found against that size, a labelled point per search.

    ``axis`` is a key of :data:`SIZE_SEARCHES`: images/s against the largest batch, or
    ms per megapixel against the largest image side. The planned model's point is a
    star. Returns ``path``, or ``None`` if matplotlib is missing or no search found a
    size that it timed.
    """
    plt = _pyplot()
    _, speed, unit = SIZE_SEARCHES[axis]
    found = [
        (r, search)
        for r in records
        if (search := r.searches.get(axis)) and search.size and getattr(search, speed)
    ]
    if plt is None or not found:
        return None
    fig, ax = plt.subplots(figsize=(6, 4.2), constrained_layout=True)
    for r, search in found:
        x, y = search.size, getattr(search, speed)
        star = r.strategy in PLANS
        ax.scatter(x, y, s=90 if star else 45, marker="*" if star else "o", zorder=3)
        ax.annotate(r.name, (x, y), xytext=(5, 3), textcoords="offset points", fontsize="small")
    label = axis.replace("_", " ")
    first = found[0][0]
    held = f"{first.image_size}²" if axis == "batch" else f"batch {first.batch}"
    cap = f", {first.memory_cap_gib:g} GiB cap" if first.memory_cap_gib else ""
    ax.set(
        xlabel=f"largest {label} that fits",
        ylabel=f"{unit} at that {label}",
        title=f"{first.model} {held} {first.dtype}, {first.device}{cap}",
    )
    ax.set_xlim(0, 1.15 * max(search.size for _, search in found))
    ax.set_ylim(0, 1.15 * max(getattr(search, speed) for _, search in found))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# A timeline's rows, top to bottom, as its records name them, and their colours.
_ROWS = (("compute", "compute", "tab:blue"), ("d2h", "to host", "tab:orange"),
         ("h2d", "from host", "tab:green"))  # fmt: skip


def plot_timelines(records: list[Record], path: pathlib.Path) -> pathlib.Path | None:
    """Draws one traced step of each record that has a ``timeline`` (``bench --trace``).

    One panel per record, on one time axis: a row for the compute and one per copy
    direction, so that a copy drawn under compute is one that hid, and one drawn where the
    compute row is empty is one the step waited for. The title gives each copy direction's
    share under compute. Returns ``path``, or ``None`` without matplotlib or a timeline.
    """
    plt = _pyplot()
    traced = [r for r in records if r.timeline]
    if plt is None or not traced:
        return None
    fig, axes = plt.subplots(
        len(traced), 1, figsize=(9, 0.9 + 0.9 * len(traced)), sharex=True, squeeze=False,
        constrained_layout=True,
    )  # fmt: skip
    for ax, r in zip(axes[:, 0], traced):
        for row, (kind, _, color) in enumerate(_ROWS):
            spans = [(start, end - start) for start, end in r.timeline.get(kind, [])]
            ax.broken_barh(spans, (len(_ROWS) - row - 0.8, 0.6), color=color)
        ax.set_yticks([len(_ROWS) - row - 0.5 for row in range(len(_ROWS))])
        ax.set_yticklabels([name for _, name, _ in _ROWS], fontsize=8)
        shares = [
            f"{name} {share:.0%} hidden"
            for (kind, name, _), share in zip(
                _ROWS[1:], (r.d2h_overlap_fraction, r.h2d_overlap_fraction)
            )  # fmt: skip
            if share is not None
        ]
        ax.set_title(
            f"{r.name}: {r.traced_step_ms:.1f} ms a step" + (f"; {', '.join(shares)}" if shares else ""),
            fontsize=9, loc="left",
        )  # fmt: skip
    axes[-1, 0].set_xlabel("ms from the step's first kernel (one traced step)")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing into files; ``None`` if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_envelope(ax: Any, uniform: list[tuple[float, float]], top: float) -> None:
    """The envelope of the ``uniform`` points, from the leanest up to memory ``top``.

    It is sampled, not drawn as the hull's polyline: on a logarithmic time axis a
    segment of the hull is a curve. The points' own memories are among the samples,
    so that each corner of the hull is drawn where it is.
    """
    import numpy as np

    if not uniform:
        return
    leanest = min(m for m, _ in uniform)
    memories = sorted({*np.linspace(leanest, top, 200).tolist(), *(m for m, _ in uniform)})
    steps = [envelope_step(uniform, m) for m in memories]
    ax.plot(steps, memories, color="0.45", lw=1.5, zorder=2, label="uniform envelope")


def _memory_limits(memories: list[float]) -> tuple[float, float]:
    """The memory axis's limits: from 0, unless the memories differ by less than a tenth of
    the largest (as the strategies' do on CPU, or at a small batch): then around them, so
    that what differs shows."""
    least, most = min(memories), max(memories)
    if least < 0.9 * most:
        return 0.0, 1.05 * most
    margin = 0.25 * (most - least) or 0.01 * most
    return least - margin, most + margin


def _set_time_axis(ax: Any, times: list[float]) -> None:
    """A step-time axis: logarithmic where the times span more than ten times, else from 0."""
    import matplotlib.ticker

    if max(times) > 10 * min(times):  # offload and recompute differ by orders of magnitude
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        # Label 20, 50, 200, 500...: every minor tick would crowd the axis.
        ax.xaxis.set_minor_formatter(
            matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else "")
        )
    else:
        ax.set_xlim(0, 1.15 * max(times))
