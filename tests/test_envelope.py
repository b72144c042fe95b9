"""The uniform envelope that plans are read against: its rule, its plot and its summary."""

import os

import pytest
from helpers import bench_record
from rich.console import Console

from jaxoffload.bench.console import say_notes
from jaxoffload.bench.envelope import envelope_step, pareto_front
from jaxoffload.bench.plots import plot_records
from jaxoffload.bench.workload import Workload

GIB = 2**30
# (memory, step) of Store, Lean, Remat and Offload, shaped like a ResNet's on a GPU.
UNIFORM = {"none": (10, 40), "lean": (5.5, 41), "remat": (4, 48), "offload": (2.5, 240)}


def test_pareto_front():
    assert pareto_front([(3, 1), (1, 3), (2, 2), (3, 3)]) == [1, 2, 0]
    assert pareto_front([(1, 1), (1, 1)]) == [0, 1]


def test_a_dominated_point_changes_nothing():
    points = list(UNIFORM.values())
    # (11, 60) is beaten by Store: on the hull it would raise the envelope past 10 to 50 at 11.
    for dominated in [(11, 60), (6, 45), (4.5, 50)]:
        for budget in [2.5, 3, 4, 5, 7.5, 10, 11, 12]:
            assert envelope_step([*points, dominated], budget) == envelope_step(points, budget)
    assert envelope_step([*points, (11, 60)], 11) == 40


def test_between_hull_points_the_envelope_is_their_line():
    assert envelope_step(list(UNIFORM.values()), 5) == pytest.approx(48 - 7 * 1 / 1.5)
    assert envelope_step(list(UNIFORM.values()), 3.25) == pytest.approx(144)
    # A point above the line of its neighbours is not on the hull: the line beats it.
    assert envelope_step([(4, 48), (7, 46), (10, 40)], 7) == pytest.approx(44)


def test_outside_the_points_the_envelope_is_none_or_the_fastest():
    points = list(UNIFORM.values())
    assert envelope_step(points, 2.4) is None
    assert envelope_step(points, 2.5) == 240
    assert envelope_step(points, 100) == 40


def _records(peaks: bool) -> list[dict]:
    """Uniform records and two plans, with runtime peaks (as on a GPU) or without (CPU)."""
    records = []
    for strategy, (memory, step) in UNIFORM.items():
        w = Workload("flax-resnet18", 2, 32, "float32", strategy)
        peak = int(memory * GIB) if peaks else None
        records.append(
            bench_record(
                w, step_time_ms=step, compiled_temp_bytes=int(memory * GIB), peak_bytes_in_use=peak
            )
        )
    for budget, peak, step in [(0.5, 4.8, 44.2), (0.35, 3.6, 47.0)]:
        w = Workload("flax-resnet18", 2, 32, "float32", "plan", budget=budget)
        plan = {"budget": budget, "budget_bytes": int(budget * 10 * GIB), "step_time_ms": step,
                "compiled_temp_bytes": int(peak * GIB),
                "peak_bytes_in_use": int(peak * GIB) if peaks else None,
                "plan_choices": ["lean", "remat"], "plan_outside": "lean"}  # fmt: skip
        records.append(bench_record(w, **plan))
    return records


@pytest.mark.parametrize("peaks", [True, False], ids=["runtime-peak", "compiled-temp"])
def test_plot_draws_the_envelope_and_the_budgets(peaks, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read it
    path = plot_records(_records(peaks), tmp_path / "pareto.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
    ax = figures[0].axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    envelope = lines["uniform envelope"]
    assert envelope.get_xdata()[0] == 240 and envelope.get_xdata()[-1] == 40
    # Budgets are drawn only on the runtime-peak axis, where they mean something.
    budgets = [line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() == ":"]
    assert budgets == ([5.0, 3.5] if peaks else [])
    # Points from 2.5 to 10 GiB: the axis starts at 0, in GiB, with no note.
    assert ax.get_ylim()[0] == 0 and ax.get_ylabel().endswith("(GiB)")
    plt.close(figures[0])


def test_on_cpu_the_memory_axis_spans_the_strategies_close_temps(tmp_path, monkeypatch):
    """On CPU the strategies' compiled temps differ by a percent or so: from 0 they would be
    dots at one height. The axis spans them instead, in MiB, and says so and why."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    temps = {"none": 88.41, "lean": 87.38, "remat": 88.63, "offload": 88.15}  # MiB
    records = [
        bench_record(
            Workload("flax-resnet18", 8, 32, "float32", strategy),
            step_time_ms=100.0 + n,
            compiled_temp_bytes=int(mib * 2**20),
            platform="cpu",
        )
        for n, (strategy, mib) in enumerate(temps.items())
    ]
    plot_records(records, tmp_path / "pareto.png")
    ax = figures[0].axes[0]
    bottom, top = ax.get_ylim()
    heights = [y for dots in ax.collections for _, y in dots.get_offsets()]
    assert sorted(heights) == pytest.approx(sorted(temps.values()), abs=1e-3)
    assert 0 < bottom < min(heights) and max(heights) < top
    # The points span most of the axis, not a sliver of it.
    assert (max(heights) - min(heights)) / (top - bottom) >= 0.6
    label = ax.get_ylabel()
    assert "(MiB), not from 0" in label and "CPU: host and device memory are one" in label
    plt.close(figures[0])


def _notes(records) -> str:
    console = Console(width=300, record=True, file=open(os.devnull, "w"))
    say_notes(records, console)
    return console.export_text()


def test_the_summary_gives_each_plan_against_the_envelope_and_its_budget():
    notes = _notes(_records(peaks=True))
    # 0.5: at 5 GiB the envelope is on the Remat-Lean line, 48 - 7 / 1.5 ms.
    ratio = 44.2 / (48 - 7 / 1.5)
    assert (
        f"plan@0.5: lean x1, remat x1; outside the blocks lean; {ratio:.2f}× the envelope of "
        "none, lean, remat, offload at its budget; peak 4.800 GiB, within its budget of 5.000 GiB"
    ) in notes
    assert "peak 3.600 GiB, over its budget of 3.500 GiB" in notes
    # Without runtime peaks (CPU) there is no budget to compare with.
    assert "envelope" not in _notes(_records(peaks=False))
