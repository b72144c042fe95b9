"""bench --trace: each record says how its step's copies ran against compute, and the command
draws a timeline of one traced step."""

import json

from jaxoffload.bench.measure import TRACED_STEPS, measure
from jaxoffload.bench.plots import plot_timelines
from jaxoffload.bench.record import Record
from jaxoffload.bench.workload import Workload


def test_a_traced_record_has_the_overlap_fields_and_a_timeline(tmp_path):
    workload = Workload(
        model="flax-resnet18", batch=2, image_size=32, dtype="float32", strategy="offload"
    )
    record = measure(workload, steps=1, warmup=1, trace=True)
    # On a CPU the step computes and nothing moves: no copy time, no share to give.
    assert record.traced_steps == TRACED_STEPS and record.compute_busy_ms > 0
    assert record.d2h_busy_ms == record.h2d_busy_ms == 0 == record.traced_d2h_bytes
    assert record.d2h_overlap_fraction is None and record.h2d_overlap_fraction is None
    assert record.timeline["compute"] and record.timeline["d2h"] == record.timeline["h2d"] == []
    # The fields survive JSON, the null fractions with them.
    data = json.loads(json.dumps(record.to_json()))
    assert "d2h_overlap_fraction" in data and data["d2h_overlap_fraction"] is None
    assert Record.from_json(data) == record
    path = plot_timelines([record], tmp_path / "timeline.png")
    assert path is not None and path.stat().st_size > 0


def test_no_timeline_no_picture(tmp_path):
    assert plot_timelines([Record(strategy="none", step_time_ms=1.0)], tmp_path / "t.png") is None
    # A record read back from a GPU run draws its copies beside the compute.
    gpu = Record.of(
        strategy="offload", step_time_ms=3.0, traced_step_ms=2.5, d2h_overlap_fraction=0.5,
        h2d_overlap_fraction=1.0,
        timeline={"compute": [[0.0, 1.0], [1.5, 2.5]], "d2h": [[0.5, 1.5]], "h2d": [[2.0, 2.4]]},
    )  # fmt: skip
    assert plot_timelines([gpu], tmp_path / "t.png") == tmp_path / "t.png"


def test_each_step_is_queued_before_the_one_before_it_is_waited_for():
    from jaxoffload.bench.measure import timed_steps

    events = []

    class Loss:
        def __init__(self, n):
            self.n = n

        def block_until_ready(self):
            events.append(("wait", self.n))

    def step(state, batch):
        events.append(("launch", state))
        return state + 1, Loss(state)

    state, loss, times = timed_steps(step, 0, None, steps=3)
    # As a training loop dispatches: the next step is launched while the last one runs.
    assert events == [
        ("launch", 0), ("launch", 1), ("wait", 0), ("launch", 2), ("wait", 1), ("wait", 2)
    ]  # fmt: skip
    assert state == 3 and loss.n == 2 and len(times) == 3 and all(t >= 0 for t in times)
