"""The gradient check against a float32 highest-precision reference (bench/precision.py)."""

import jax

from jaxoffload import Lean, Offload, Plan, Remat
from jaxoffload.bench import precision
from jaxoffload.bench.record import Record
from jaxoffload.bench.step import linen_model, train_step
from jaxoffload.bench.workload import Workload

MODEL, SIZE = "flax-resnet18", 32


def _record(strategy, dtype="bfloat16", **fields):
    return {
        "model": MODEL,
        "image_size": SIZE,
        "dtype": dtype,
        "strategy": strategy,
        "window": 1,
        "plan": None,
        "step_time_ms": 1.0,
        **fields,
    }


def _a_plan(first) -> dict:
    """``first`` on the first block, Lean on the rest, by the plannable model's block paths."""
    w = Workload(model=MODEL, batch=2, image_size=SIZE, dtype="float32", strategy="none")
    model = linen_model(w, plannable=True)
    images = train_step(w, abstract=True)[2][0]
    shapes = jax.eval_shape(lambda x: model.init(jax.random.key(0), x, True), images)
    paths = sorted(
        (p for p in shapes["params"] if p.startswith("ResNetBlock")),
        key=lambda p: int(p.rsplit("_", 1)[1]),
    )
    return Plan(
        tuple((p, first if n == 0 else Lean()) for n, p in enumerate(paths)), Lean()
    ).to_dict()


def test_strategies_and_plans_are_checked_against_float32_beside_store():
    records = [
        _record("none"),
        _record("lean"),
        _record("plan", budget=0.5, planned=_a_plan(Remat())),
        _record("plan-device", budget=0.5, planned=_a_plan(Remat())),
        # A chosen strategy is checked as it ran, with its record's choice.
        _record("offload-hidden", planned=_a_plan(Offload(window=2, max_bytes=10**5))),
        _record("grad-accum", micro_batch=2),  # no whole-batch gradient: left out
        {**_record("remat"), "step_time_ms": None, "out_of_memory": True},
    ]
    records[-1].pop("step_time_ms")
    lines = precision.errors_against_float32([Record.from_json(r) for r in records], batch=4)
    strategies = ["none", "lean", "plan", "plan-device", "offload-hidden"]
    assert [line["strategy"] for line in lines] == strategies
    store = lines[0]
    assert store["ratio_to_store"] == 1.0 and store["grad_err_f32"] > 1e-4  # bf16 is not exact
    for line in lines:
        assert line["holds"], line
        assert line["store_grad_err_f32"] == store["grad_err_f32"]


def test_the_reference_is_what_float32_computes_on_the_same_images():
    """The control that makes the check able to fail: float32 against itself is exact."""
    (line,) = precision.errors_against_float32(
        [Record.from_json(_record("none", dtype="float32"))], batch=4
    )
    assert line["grad_err_f32"] < 1e-5


def test_the_command_writes_a_json_line_per_strategy(tmp_path, monkeypatch):
    """Lines, not a JSON list of objects with a strategy, which is what a bench's records are."""
    import json

    found = [
        {"strategy": "none", "budget": None, "grad_err_f32": 0.05, "ratio_to_store": 1.0, "holds": True},
        {"strategy": "plan", "budget": 0.5, "grad_err_f32": 0.06, "ratio_to_store": 1.2, "holds": False},
    ]  # fmt: skip
    monkeypatch.setattr(precision, "errors_against_float32", lambda records, batch: found)
    results, out = tmp_path / "records.json", tmp_path / "precision.jsonl"
    results.write_text(json.dumps([_record("none"), _record("plan", budget=0.5)]))
    precision.main([str(results), "--out", str(out)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == found
