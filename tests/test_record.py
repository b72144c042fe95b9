"""The bench's typed record: JSON in and out, old records read back as they were written."""

import dataclasses
import json
import pathlib
import sys

import pytest
from rich.console import Console

from jaxoffload.bench import cli
from jaxoffload.bench.console import print_table, say_notes
from jaxoffload.bench.folder import earlier_records
from jaxoffload.bench.options import BenchError
from jaxoffload.bench.plots import plot_records, plot_timelines
from jaxoffload.bench.record import Record, SizeSearch

RESULTS = pathlib.Path(__file__).parents[1] / "benchmarks" / "results"
# Records that earlier versions of the bench wrote, named for what they hold and the commit that
# wrote them: the results folder keeps only the current ones, and these keep every format read.
OLD_RECORDS = pathlib.Path(__file__).parent / "data" / "records"


def _record_files() -> list[pathlib.Path]:
    """The committed files that hold bench records: JSON lists of objects with a strategy."""
    files = []
    for path in [*sorted(RESULTS.rglob("*.json")), *sorted(OLD_RECORDS.glob("*.json"))]:
        data = json.loads(path.read_text())
        if isinstance(data, list) and data and all("strategy" in r for r in data):
            files.append(path)
    return files


RECORD_FILES = _record_files()


def test_a_record_round_trips_through_json():
    record = Record.of(
        model="flax-resnet50", batch=256, image_size=224, dtype="bfloat16", strategy="plan",
        window=(1, 2, 2, 2), plan=None, budget=0.5, peak_bytes_in_use=None,
        step_times_ms=[40.1, 40.3], planned={"blocks": [["ResNetBlock_0", {"kind": "Lean"}]]},
    ).with_fields(
        searches={"batch": SizeSearch.of(size=512, step_ms=80.0, stopped=None, probes=[[256, 9]])}
    )  # fmt: skip
    record = dataclasses.replace(record, search_errors={"image_size": "boom"}, extra={"run": 3})
    written = json.loads(json.dumps(record.to_json()))
    assert Record.from_json(written) == record
    # The keys are the fields' names, the size search's flat, null only where carried as null.
    assert written["max_batch"] == 512 and written["max_batch_stopped"] is None
    assert written["max_image_size_error"] == "boom" and written["run"] == 3
    assert written["window"] == [1, 2, 2, 2] and written["peak_bytes_in_use"] is None
    assert "max_batch_images_per_s" not in written and "grad_rel_err" not in written


def test_the_committed_records_load_and_write_back_as_they_were():
    assert len(RECORD_FILES) >= 20, RECORD_FILES
    for path in RECORD_FILES:
        data = json.loads(path.read_text())
        records = [Record.from_json(r) for r in data]
        assert json.loads(json.dumps([r.to_json() for r in records])) == data, path
        assert all(r.strategy == d["strategy"] for r, d in zip(records, data))
        # Every key that the bench has written is a field: none is left in `extra`.
        assert [r.extra for r in records if r.framework == "jax"] == [{}] * len(records), path


@pytest.mark.parametrize("path", RECORD_FILES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_committed_run_prints_and_plots(path, tmp_path, capsys):
    """A run's table, notes and plots come from its records alone, as ``plot_bench`` and a
    resumed run read them back: also a record that lacks what later versions write (a
    ``plan-device`` record without its budget, ``hidden-resnet50-h200``)."""
    records = [Record.from_json(r) for r in json.loads(path.read_text())]
    jax_records = [r for r in records if r.framework in ("jax", None)]
    print_table(jax_records)
    say_notes(jax_records, Console(file=sys.stderr))
    plot_records(records, tmp_path / "pareto.png")
    plot_timelines(records, tmp_path / "timeline.png")
    assert records[0].strategy in capsys.readouterr().out


@pytest.mark.parametrize(
    "path",
    [
        RESULTS / "earlier-front-resnet50-h200" / "records.json",  # plans at three budgets
        RESULTS / "largest-batch-resnet50-h200" / "records.json",  # largest batches, under a cap
        OLD_RECORDS / "unet-largest-side-5a18319.json",  # largest image sides
        RESULTS / "grad-accum-resnet50-h200" / "records.json",  # accumulated gradients
    ],
    ids=lambda p: p.parent.name if p.name == "records.json" else p.stem,
)
def test_old_records_load_for_resume(path, tmp_path):
    """``--resume`` keeps the committed runs' records, given the flags they were run with.

    (Records from before ``--devices`` and ``--steps`` were recorded, such as issue 16's,
    are refused by ``--resume``, as they were before records were typed.)
    """
    data = json.loads(path.read_text())
    (tmp_path / "records.json").write_text(json.dumps(data))
    first = data[0]
    argv = ["bench", "--model", first["model"], "--batch", str(first["batch"]),
            "--image-size", str(first["image_size"]), "--dtype", first["dtype"],
            "--steps", str(first.get("steps", 3)), "--out", str(tmp_path), "--resume"]  # fmt: skip
    if first.get("memory_cap_gib"):
        argv += ["--memory-cap", str(first["memory_cap_gib"])]
    if first.get("micro_batch"):
        argv += ["--micro-batch", str(first["micro_batch"])]
    planned = [r for r in data if r["strategy"] in ("plan", "offload-hidden")]
    if planned:  # as they were costed: before records kept it, by timing the blocks
        argv += ["--block-costs", planned[0].get("block_costs") or "timed"]
    args = cli.build_parser().parse_args(argv)
    kept = earlier_records(tmp_path / "records.json", args)
    assert list(kept) == [Record.from_json(r).name for r in data if "error" not in r]
    written = json.loads(json.dumps([r.to_json() for r in kept.values()]))
    assert written == [r for r in data if "error" not in r]


def test_resume_refuses_plans_costed_otherwise_than_this_command_costs_them(tmp_path):
    """A run's plans are costed alike: records from before traced costs were the default
    were planned with timed ones, and resuming them with the default is refused."""
    path = RESULTS / "earlier-front-resnet50-h200" / "records.json"
    (tmp_path / "records.json").write_text(path.read_text())
    first = json.loads(path.read_text())[0]
    argv = ["bench", "--model", first["model"], "--batch", str(first["batch"]),
            "--image-size", str(first["image_size"]), "--dtype", first["dtype"],
            "--steps", str(first.get("steps", 3)), "--out", str(tmp_path), "--resume"]  # fmt: skip
    args = cli.build_parser().parse_args(argv)
    with pytest.raises(BenchError, match="planned with --block-costs timed, and this command "
                       "plans with --block-costs traced: give --block-costs timed"):  # fmt: skip
        earlier_records(tmp_path / "records.json", args)
