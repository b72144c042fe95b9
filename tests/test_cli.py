"""The jaxoffload command: arguments, errors, and what it writes."""

import argparse
import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import bench_record, stand_in_children

import jaxoffload
from jaxoffload import Lean, Offload, Plan
from jaxoffload.bench import cli, options, planning
from jaxoffload.bench.catalog import PLANS
from jaxoffload.bench.child import Children, OutOfMemory
from jaxoffload.bench.command import memory_cap_env
from jaxoffload.bench.console import Progress, gradient_flags, records_table, say_notes
from jaxoffload.bench.measure import CACHE_DIR, plan_fields, requested_host_bytes
from jaxoffload.bench.options import BenchError
from jaxoffload.bench.planning import budget_bytes
from jaxoffload.bench.plots import plot_records
from jaxoffload.bench.record import Record
from jaxoffload.bench.run import add_transfer_bounds, measure_all
from jaxoffload.bench.step import train_step
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import brief, hidden_copies, measure_link

REQUIRED = {
    "model", "batch", "image_size", "dtype", "strategy", "framework", "device", "jax_version",
    "compiled_temp_bytes", "compiled_host_temp_bytes", "peak_bytes_in_use", "step_time_ms",
    "images_per_s", "grad_rel_err", "date",
}  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "alexnet"], "Unknown model 'alexnet'; choose one of flax-resnet18"),
        (["--strategies", "none,swap"], "unknown strategies ['swap']"),
        (["--strategies", ","], "--strategies ',' names no strategy; choose from none, lean"),
        (["--strategies", "none,lean,lean"],
         "--strategies names lean more than once: each strategy is measured once"),
        (["--budget", "0.5,0.35,0.50"],
         "argument --budget: 0.5 given more than once: each budget is planned and measured once"),
        (["--batch", "0"], "batch must be at least 1"),
        (["--image-size", "16"], "image_size must be at least 32"),
        (["--steps", "0"], "--steps must be at least 1"),
        (["--repeat", "0"], "--repeat must be at least 1"),
        (["--memory-cap", "12"], "--memory-cap needs a GPU"),
        (["--max-batch"], "--max-batch needs a GPU"),
        (["--max-image-size"], "--max-image-size needs a GPU"),
        (["--max-batch", "--memory-cap", "8"], "--memory-cap and --max-batch need a GPU"),
        (["--model", "flax-nnx-resnet18", "--max-batch"],
         "--max-batch searches the linen models, and flax-nnx-resnet18 is an NNX one"),
        (["--max-image-size", "--time-limit", "0"], "--time-limit must be a positive number"),
        (["--time-limit", "60"], "--time-limit 60 has no effect without a size search"),
        (["--strategies", "none,offload-hidden", "--window", "2"], "--window 2 has no effect"),
        (["--window", "0"], "window must be an int of at least 1"),
        (["--window", "two"], "expected a window or comma-separated windows, got 'two'"),
        (["--model", "resnet18", "--window", "1,2"], "window has 2 entries, but resnet18 has 4"),
        (["--model", "vgg11", "--window", "1,2,2,2"], "vgg11 takes one window, not one per stage"),
        (["--model", "flax-nnx-resnet18", "--strategies", "none,offload-hidden"],
         "flax-nnx-resnet18 is an NNX model: not supported yet"),
        (["--model", "resnet18", "--strategies", "offload-hidden", "--block-costs", "traced"],
         "--block-costs traced is for the plain-Flax linen models"),
        (["--strategies", "none,jax-offload"], "names none"),
        (["--strategies", "none,plan-device"], "'plan-device' plans at each --budget"),
        (["--strategies", "grad-accum", "--batch", "100", "--micro-batch", "24"],
         "--batch 100 is not a multiple of --micro-batch 24: use 96 or 120"),
        (["--strategies", "grad-accum"], "'grad-accum' needs --micro-batch M"),
        (["--strategies", "none,lean", "--micro-batch", "4"],
         "--micro-batch 4 has no effect on none, lean: only grad-accum, grad-accum-lean take it"),
        (["--devices", "3"], "--batch 8 does not split over --devices 3: use 6 or 9"),
        (["--devices", "4", "--budget", "0.5"],
         "--budget with --devices or --spatial is not supported yet"),
        (["--spatial", "2", "--strategies", "none,offload-hidden"],
         "offload-hidden with --devices or --spatial is not supported yet"),
        (["--spatial", "3"], "--image-size 32 does not split over --spatial 3: use 30 or 33"),
        (["--spatial", "0"], "--spatial must be at least 1, got 0"),
    ],
)  # fmt: skip
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["bench", *argv])
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "costs"),
    [
        (["--model", "flax-resnet18", "--strategies", "offload-hidden", "--budget", "0.5"],
         ["traced", "traced"]),
        (["--model", "resnet18", "--strategies", "offload-hidden"], ["timed"]),
        (["--model", "flax-resnet18", "--strategies", "offload-hidden", "--budget", "0.5",
          "--block-costs", "timed"], ["timed", "timed"]),
    ],
)  # fmt: skip
def test_blocks_are_costed_by_their_traced_flops_unless_only_timing_can_cost_them(argv, costs):
    """As jaxoffload.plan does by default; a reference model's offload-hidden times its blocks."""
    args = cli.build_parser().parse_args(["bench", *argv])
    fields = options.workload_fields(args, options.checked_strategies(args))
    assert [Workload(**f).block_costs for f in fields if "block_costs" in f] == costs


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch", "0"], "batch must be at least 1, got 0."),
        (["--model", "alexnet"], "Unknown model 'alexnet'; choose one of flax-resnet18"),
        (["--devices", "3"], "--batch 8 does not split over --devices 3: use 6 or 9."),
        (["--memory-cap", "0"], "--memory-cap must be positive, got 0.0"),
    ],
)
def test_a_bad_flag_is_refused_at_once_before_jax_is_imported(argv, message):
    """jax takes 10-15 s to import on a GPU machine: the command checks its flags first."""
    refused = (
        "import sys\n"
        "from jaxoffload.bench import cli\n"
        "try:\n"
        "    cli.main(['bench', *sys.argv[1:]])\n"
        "except SystemExit as exit:\n"
        "    print(exit.code, 'jax' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", refused, *argv], capture_output=True, text=True, timeout=120
    )
    assert done.stdout.split() == ["2", "False"], (done.stdout, done.stderr)
    assert message in done.stderr
    # As a user types it; on this project's loaded 2-core CI machine it takes about 1 s.
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "jaxoffload", "bench", *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert time.monotonic() - start <= 2.0
    assert done.returncode == 2 and f"jaxoffload bench: error: {message}" in done.stderr


def test_the_bench_s_names_are_those_of_its_values_and_models():
    """The catalog names, without importing jax, what the bench's values and models are."""
    from jaxoffload._src.planner import BLOCK_COSTS
    from jaxoffload.bench import catalog, models, record, size_search
    from jaxoffload.bench.options import SIZE_SEARCHES
    from jaxoffload.bench.workload import STRATEGIES

    assert tuple(STRATEGIES) == catalog.BLOCK_STRATEGIES
    assert catalog.TO_HOST == tuple(s for s, value in STRATEGIES.items() if value.to_host)
    assert catalog.BLOCK_COSTS == BLOCK_COSTS
    assert tuple(size_search.AXES) == tuple(SIZE_SEARCHES) == record.SEARCH_AXES
    # Every model named is built, with the blocks its kind says.
    for name in catalog.MODEL_NAMES:
        assert models.num_blocks(name) > 0, name
        if name in catalog.NNX_MODELS:
            with pytest.raises(ValueError, match="build it with create_nnx"):
                models.create(name)
        else:
            assert models.create(name).__class__.__name__ in ("ResNet", "VGG", "MobileNetV2",
                                                               "ConvNeXt", "EfficientNet", "UNet"), name  # fmt: skip


def test_unknown_dtype_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err


def test_bench_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "jaxoffload", "bench", "--batch=2", "--steps=1",
         "--strategies=offload-inputs", f"--out={out}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    records = json.loads((out / "records.json").read_text())
    # 'none' is added first: it is the gradient reference.
    assert [r["strategy"] for r in records] == ["none", "offload-inputs"]
    for r in records:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["grad_rel_err"] <= 1e-6
    assert records[1]["requested_host_bytes"] > 0 and records[1]["offloaded_blocks"] == 8
    # The offloading record has its own link figures, and the twin's temp (on
    # CPU nothing moves, so no twin is compiled).
    assert records[1]["d2h_gbps"] > 0 and records[1]["twin_temp_bytes"] is None
    assert records[1]["copies_free_little"] is False
    assert (out / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert "offload-inputs" in done.stdout and "images/s" in done.stdout
    assert "host placement has no effect" in done.stderr
    # Piped, progress is a line per step; a complete run leaves no reference gradient.
    assert "[1/2] none on flax-resnet18, batch 2: compile and 1 steps\n" in done.stderr
    assert re.search(r"^\[2/2\] offload-inputs: [\d.]+ ms a step \([\d.]+ s\)$", done.stderr, re.M)
    assert records[0]["steps"] == 1 and not (out / cli.REFERENCE).exists()


def _children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, from /proc."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended while being read
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _ended(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie is dead: what is left is its exit status


def _bench_measuring_its_second_strategy(out: pathlib.Path) -> tuple[subprocess.Popen, list[int]]:
    """Starts ``jaxoffload bench`` in a session of its own and returns it once 'none' is
    written and the child measuring 'lean' runs, with that child's process id."""
    # Started as a terminal or a scheduler starts it, with SIGINT handled: a suite started in
    # the background by a shell without job control ignores SIGINT, and an ignored signal
    # stays ignored across exec (a handled one does not).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        command = subprocess.Popen(
            [sys.executable, "-m", "jaxoffload", "bench", "--batch=2", "--steps=1",
             "--strategies=none,lean,remat", f"--out={out}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 600
    while not (out / "records.json").exists() or not _children_of(command.pid):
        if command.poll() is not None or time.monotonic() > deadline:
            command.kill()
            raise AssertionError(("no record within 600 s", command.communicate()))
        time.sleep(0.05)
    return command, _children_of(command.pid)


def _assert_they_end_within(pids: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not all(map(_ended, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(_ended, pids)), pids


def test_an_interrupt_sent_to_the_command_alone_stops_it_at_once_keeping_what_was_measured(
    tmp_path,
):
    """A scheduler's SIGINT goes to the command's process, not its group: the child that
    measures never sees it. The command stops that child and exits within 3 s, with every
    record finished already in records.json."""
    out = tmp_path / "out"
    command, measuring = _bench_measuring_its_second_strategy(out)
    try:
        os.kill(command.pid, signal.SIGINT)
        sent = time.monotonic()
        _, err = command.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if command.poll() is None:
            command.kill()
    assert command.returncode == 130 and took <= 3.0, (command.returncode, took, err)
    assert "interrupted" in err and "run the same command with --resume" in err
    records = json.loads((out / "records.json").read_text())
    assert [r["strategy"] for r in records] == ["none"] and records[0]["step_time_ms"] > 0
    # The child was stopped, not left measuring for no one.
    _assert_they_end_within(measuring, 3.0)


def test_a_command_killed_outright_leaves_no_child_measuring(tmp_path):
    """SIGKILL (or an interrupt that lands while a child is being started, before the
    command knows it) gives the command no chance to stop its child: the child ends
    with it."""
    command, measuring = _bench_measuring_its_second_strategy(tmp_path / "out")
    command.kill()
    command.communicate()
    _assert_they_end_within(measuring, 3.0)


def test_memory_cap_fraction():
    # A child's allocator gets 75% of a 100 GiB device by default: 75 GiB.
    env = memory_cap_env(12.5, 75 * 2**30)
    assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.125000"}
    with pytest.raises(BenchError, match="more than this GPU has"):
        memory_cap_env(200, 75 * 2**30)
    with pytest.raises(BenchError, match="positive"):
        memory_cap_env(0, 75 * 2**30)


def test_the_command_starts_no_device_client_itself(monkeypatch):
    # On a GPU, a client in the parent would take memory from every measuring child.
    import jax

    calls = []
    monkeypatch.setattr(jax, "devices", lambda *a: calls.append(a) or [])
    with pytest.raises(SystemExit):
        cli.main(["bench", "--memory-cap", "8"])  # refused on CPU, after probing in a child
    assert calls == []


def test_out_of_memory_records(tmp_path):
    # Simulate a reference that does not fit: the others get no gradient error.
    seen = []

    def fake(workload, *, steps, reference, env, **options):
        seen.append(reference)
        if workload.strategy == "none":
            raise OutOfMemory("RESOURCE_EXHAUSTED")
        return Record.of(strategy=workload.strategy, grad_rel_err=None)

    workloads = [Workload("flax-resnet18", 2, 32, "float32", s) for s in ("none", "remat")]
    records = measure_all(workloads, steps=1, children=stand_in_children(measure=fake))
    assert records[0].out_of_memory and records[0].strategy == "none"
    assert seen[0] is not None and seen[1] is None  # no stale reference for 'remat'
    assert plot_records([records[0]], tmp_path / "p.png") is None
    from rich.console import Console

    console = Console(width=120, record=True, file=open(os.devnull, "w"))
    console.print(records_table([records[0]]))
    assert "out of memory" in console.export_text()


def test_a_step_compiled_first_is_measured_from_the_cache_and_a_compile_peak_is_said():
    # On a GPU, compiling autotunes on the device: its peak must not be the step's.
    from rich.console import Console

    workload = Workload("flax-resnet18", 2, 32, "float32", "none")
    (record,) = measure_all([workload], steps=1, compile_first=True)
    assert record.compiled_from_cache is True
    gib = 2**30
    records = [
        Record(strategy="lean", peak_bytes_in_use=9 * gib, compile_peak_bytes=9 * gib),
        Record(strategy="remat", peak_bytes_in_use=5 * gib, compile_peak_bytes=gib),
    ]
    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    say_notes(records, console)
    said = console.export_text()
    assert "runtime peak of lean was reached while compiling" in said and "remat" not in said


def test_planning_compiles_into_a_cold_cache_of_its_own_that_its_plans_load_from():
    seen = []
    planned = jaxoffload.Plan((("Block_0", jaxoffload.Lean()),)).to_dict()
    children = stand_in_children(
        plan_budgets=lambda w, budgets, held, env: (
            seen.append(("plan", env)) or [{"planned": planned}]
        ),
        compile=lambda w, env: seen.append(("compile", env)) or {},
        measure=lambda w, **k: Record.from_json({
            "strategy": w.strategy, "step_time_ms": 1.0, "compiled_temp_bytes": 8,
            "compiled_argument_bytes": 0, "peak_bytes_in_use": 8,
        }),
    )  # fmt: skip
    workloads = [
        Workload("flax-resnet18", 2, 32, "float32", "none"),
        Workload("flax-resnet18", 2, 32, "float32", "plan", budget=0.5),
    ]
    measure_all(workloads, steps=1, env={"A": "1"}, compile_first=True, children=children)
    (none, _), (plan, _), (planned, _) = [(env[CACHE_DIR], kind) for kind, env in seen]
    assert [kind for kind, _ in seen] == ["compile", "plan", "compile"]
    assert plan == planned != none  # planning's cache is its own, cold, and the plan's
    assert all(env["A"] == "1" for _, env in seen)


def test_each_planned_strategy_plans_in_a_cold_cache_of_its_own_with_its_own_options(
    monkeypatch,
):
    """'plan-device' plans each budget beside 'plan', with Store(), Lean() and Remat() alone,
    in a planning process and cache of its own, from which its plans load."""
    seen = []
    planned = jaxoffload.Plan((("Block_0", jaxoffload.Lean()),)).to_dict()
    children = stand_in_children(
        plan_budgets=lambda w, budgets, held, env: (
            seen.append((w.strategy, env[CACHE_DIR])) or [{"planned": planned}]
        ),
        compile=lambda w, env: seen.append((f"compile {w.name}", env[CACHE_DIR])) or {},
        measure=lambda w, **k: Record.from_json({
            "strategy": w.strategy, "budget": w.budget, "step_time_ms": 1.0,
            "compiled_temp_bytes": 8, "compiled_argument_bytes": 0, "peak_bytes_in_use": 8,
        }),
    )  # fmt: skip
    args = cli.build_parser().parse_args(
        ["bench", "--model", "flax-resnet18", "--strategies", "none,plan-device", "--budget", "0.5"]
    )
    workloads = [Workload(**f) for f in options.workload_fields(args, ["none", "plan-device"])]
    records = measure_all(workloads, steps=1, compile_first=True, children=children)
    assert [r.name for r in records] == ["none", "plan@0.5", "plan-device@0.5"]
    assert [what for what, _ in seen] == [
        "compile none", "plan", "compile plan@0.5", "plan-device", "compile plan-device@0.5"
    ]  # fmt: skip
    caches = [cache for _, cache in seen]
    assert caches[1] == caches[2] != caches[3] == caches[4] != caches[0]
    made = []
    monkeypatch.setattr(planning, "Planner", lambda *a, **k: made.append(a[3]))
    for w in workloads[1:]:
        planning.planner_of(w, print, inputs=(None, None, None, None))
    assert made == [None, (jaxoffload.Store(), jaxoffload.Lean(), jaxoffload.Remat())]


def _children(**methods):
    """Stand-ins for the bench's child processes (``methods``), and for the child that
    compiles each step first on a faked GPU, where the step's measurement is a stand-in too
    (the real one is tested in
    test_a_step_compiled_first_is_measured_from_the_cache_and_a_compile_peak_is_said)."""
    return stand_in_children(compile=lambda w, env: {"compile_s": 0.0}, **methods)


def test_copies_that_free_little_are_said(tmp_path, capsys):
    def fake(workload, *, steps, reference, env, **options):
        offload = workload.strategy == "offload"
        return Record.from_json({
            "strategy": workload.strategy, "grad_rel_err": 0.0, "step_time_ms": 1.0,
            "compiled_temp_bytes": 4 * 2**30, "compiled_host_temp_bytes": 0,
            "peak_bytes_in_use": None, "images_per_s": 2.0, "model": "flax-vgg19", "batch": 2,
            "image_size": 32, "dtype": "float32", "device": "cpu",
            "twin_temp_bytes": 4 * 2**30 if offload else None,
            "device_to_host_bytes": 2**31 if offload else 0, "copies_free_little": offload,
        })  # fmt: skip

    children = _children(measure=fake, probe=lambda env=None: {"platform": "gpu"})
    cli.main(["bench", "--strategies", "none,offload", "--out", str(tmp_path)], children=children)
    err = " ".join(capsys.readouterr().err.split())
    assert "'offload' moves 2.000 GiB to the host" in err and "against 4.000 GiB" in err


def test_a_failing_strategy_is_recorded_and_the_others_still_run(tmp_path, capsys):
    def fake(workload, *, steps, reference, env, **options):
        if workload.strategy == "remat":
            raise RuntimeError("the measuring process failed (exit code 1): boom")
        return Record.from_json(
            {
                "strategy": workload.strategy,
                "grad_rel_err": 0.0,
                "step_time_ms": 1.0,
                "compiled_temp_bytes": 1,
                "compiled_host_temp_bytes": 0,
                "peak_bytes_in_use": None,
                "images_per_s": 2.0,
                "model": "resnet18",
                "batch": 2,
                "image_size": 32,
                "dtype": "float32",
                "device": "cpu",
            }
        )

    children = stand_in_children(measure=fake, probe=lambda env=None: {"platform": "cpu"})
    with pytest.raises(SystemExit) as exit_info:
        argv = ["bench", "--strategies", "none,remat,offload", "--out", str(tmp_path)]
        cli.main(argv, children=children)
    assert exit_info.value.code == 2
    assert "1 failed (records.json has the rest" in capsys.readouterr().err
    records = json.loads((tmp_path / "records.json").read_text())
    assert [r["strategy"] for r in records] == ["none", "remat", "offload"]
    assert "boom" in records[1]["error"] and records[2]["step_time_ms"] == 1.0


def test_transfer_bound_uses_the_twins_compute_and_the_records_own_link():
    records = [
        Record(strategy="none", step_time_ms=30.0, forward_ms=10.0),
        Record(strategy="remat", step_time_ms=40.0),
        Record(strategy="jax-offload", step_time_ms=300.0, d2h_gbps=50.0, h2d_gbps=25.0,
               device_to_host_bytes=5 * 10**9, host_to_device_bytes=10**8),
        Record(strategy="offload", out_of_memory=True),
    ]  # fmt: skip
    add_transfer_bounds(records)
    offload = records[2].to_json()
    # forward: max(10 ms, 5 GB / 50 GB/s = 100 ms); backward: max(20 ms, 0.1 GB / 25 GB/s = 4 ms).
    assert offload["bound_ms"] == pytest.approx(120.0)
    assert offload["bound_ratio"] == pytest.approx(2.5)
    assert (offload["fwd_compute_ms"], offload["bwd_compute_ms"]) == (10.0, 20.0)
    assert offload["offloaded_bytes"] == 5 * 10**9 and offload["compute_twin"] == "none"
    assert "bound_ms" not in records[1].to_json() and "bound_ms" not in records[3].to_json()


def test_measure_link_moves_bytes_both_ways():
    link = measure_link(nbytes=2**20, runs=1)
    assert set(link) == {"d2h_gbps", "h2d_gbps", "link_devices"} and min(link.values()) > 0
    assert link["link_devices"] == 1  # the first device, alone


def test_requested_host_bytes_match_the_traced_step_and_allocate_nothing():
    workload = Workload("flax-vgg11", 2, 32, "float32", "offload")
    step, state, batch, _ = train_step(workload)
    report = jaxoffload.memory_report(step, state, batch, on_dropped="ignore")
    assert requested_host_bytes(workload) == report.requested_bytes > 0
    # At ImageNet size it only traces: no state is allocated.
    big = Workload("flax-vgg19", 128, 224, "bfloat16", "offload")
    assert requested_host_bytes(big) > 1.5 * 10**9
    none = Workload("flax-vgg11", 2, 32, "float32", "none")
    assert requested_host_bytes(none) == 0


def test_planned_strategy_failures_and_empty_plans_are_reported(tmp_path, capsys):
    failing = ""  # which process runs out of memory: "plan", "measure" or neither

    def fake_plan(workload, *, env, **budget):
        if failing == "plan":
            raise OutOfMemory("RESOURCE_EXHAUSTED")
        return dataclasses.replace(workload, block_names=("lean",) * 8, window=2)

    def fake_measure(workload, *, steps, reference, env, **options):
        planned = workload.strategy == "offload-hidden"
        if planned and failing == "measure":
            raise OutOfMemory("RESOURCE_EXHAUSTED")
        return Record.from_json({
            "strategy": workload.strategy, "grad_rel_err": 0.0, "step_time_ms": 1.0,
            "compiled_temp_bytes": 1, "compiled_host_temp_bytes": 0, "peak_bytes_in_use": None,
            "images_per_s": 2.0, "model": "vgg11", "batch": 2, "image_size": 32,
            "dtype": "float32", "device": "cpu", "forward_ms": 0.5, "d2h_gbps": 1.0,
            "h2d_gbps": 1.0, "plan": list(workload.block_names) if planned else None,
            "offloaded_blocks": 0, "window": workload.window, "device_to_host_bytes": 0,
            "host_to_device_bytes": 0,
        })  # fmt: skip

    children = stand_in_children(
        hidden_offload=fake_plan, measure=fake_measure, probe=lambda env=None: {"platform": "cpu"}
    )
    argv = ["bench", "--model", "vgg11", "--strategies", "offload-hidden"]
    # A plan that offloads nothing is said, not left for the reader to spot.
    cli.main([*argv, "--out", str(tmp_path / "empty")], children=children)
    assert "'offload-hidden' offloads nothing here" in capsys.readouterr().err
    # A chosen strategy that fails still gives its record: with its choice if the
    # choosing process finished, with no block count if it did not.
    for failing in ("measure", "plan"):
        cli.main([*argv, "--out", str(tmp_path / failing)], children=children)
        record = json.loads((tmp_path / failing / "records.json").read_text())[-1]
        assert record["out_of_memory"], failing
        assert record["offloaded_blocks"] == (0 if failing == "measure" else None), failing


def test_repeat_times_every_workload_again_in_alternation_as_it_ran_first(tmp_path, capsys):
    """--repeat 3: after the first round, which plans, two more rounds time each workload
    (the plan as planned, nothing else measured), in the same order; each record's step is
    the median of its processes'. A resumed run gives a record the runs it lacks."""
    planned = jaxoffload.Plan((("Block_0", jaxoffload.Lean()),)).to_dict()
    calls, times = [], iter(range(40, 100))

    def measure(w, *, steps, reference, env, **options):
        calls.append((w.name, w.planned, reference is None, options.get("trace", False)))
        ms = float(next(times))
        planning = {"budget": w.budget, "block_costs": w.block_costs}
        return bench_record(w, step_time_ms=ms, compiled_argument_bytes=1, **planning)

    children = stand_in_children(
        probe=lambda: {"platform": "cpu", "device_count": 1},
        plan_budgets=lambda w, budgets, held, env: [{"planned": planned}],
        measure=measure,
    )
    argv = ["bench", "--model", "flax-resnet18", "--strategies", "none,lean", "--budget", "0.5"]
    out = ["--out", str(tmp_path), "--repeat", "3", "--trace"]
    cli.main([*argv, *out], children=children)
    names = ["none", "lean", "plan@0.5"]
    assert [name for name, *_ in calls] == names * 3
    assert all(p == planned for name, p, *_ in calls if name == "plan@0.5")
    # The first round compares gradients and traces; the others time steps alone.
    assert [(unref, traced) for _, _, unref, traced in calls] == [(False, True)] * 3 + [
        (True, False)
    ] * 6
    records = {r["strategy"]: r for r in json.loads((tmp_path / "records.json").read_text())}
    assert records["lean"]["step_time_ms_runs"] == [41.0, 44.0, 47.0]
    assert records["lean"]["step_time_ms"] == 44.0
    assert records["plan"]["step_time_ms"] == 45.0 and records["plan"]["budget"] == 0.5
    assert "lean: run 3 47.0 ms; median 44.0 ms a step" in capsys.readouterr().err
    # Resumed with --repeat 4, each record gets its fourth run, and no more.
    calls.clear()
    cli.main([*argv, *out[:2], "--repeat", "4", "--resume"], children=children)
    assert [name for name, *_ in calls] == names
    records = {r["strategy"]: r for r in json.loads((tmp_path / "records.json").read_text())}
    assert len(records["none"]["step_time_ms_runs"]) == 4


@pytest.mark.parametrize("strategy", PLANS)
def test_every_budget_s_plan_records_its_budget_and_the_planner_s_figures(strategy):
    """'plan-device' is a budget's plan as 'plan' is: its record says its budget, which the
    table and the envelope read it at, and what the planner compiled and estimated."""
    planned = jaxoffload.Plan(
        (("Block_0", jaxoffload.Remat()),), jaxoffload.Lean(), budget_bytes=100,
        estimated_bytes=90, compiled_bytes=95, estimated_step_ms=2.0,
    ).to_dict()  # fmt: skip
    fields = {"model": "flax-resnet18", "batch": 8, "image_size": 32, "dtype": "float32"}
    workload = Workload(**fields, strategy=strategy, budget=0.5, planned=planned)
    record = plan_fields(workload)
    assert record["budget"] == 0.5 and record["budget_bytes"] == 100
    assert (record["plan_compiled_bytes"], record["plan_estimated_bytes"]) == (95, 90)
    assert "plan_moved_bytes" not in record


def test_offload_hidden_on_a_plain_flax_model_runs_the_link_timeline_s_schedule(monkeypatch):
    """Its plan is hidden_copies' for the plannable blocks at the twin's link, applied as one
    capped Offload per block; its record carries the plan, as a plan's record does."""
    given = []  # what the planner asked hidden_copies, and what it answered

    def recorded(forward, backward, sizes, link, **options):
        copies = hidden_copies(forward, backward, sizes, link, **options)
        given.append((forward, backward, sizes, link, copies))
        return copies

    monkeypatch.setattr(planning, "hidden_copies", recorded)

    def fake_measure(workload, *, steps, reference, env, **options):
        link = {"d2h_gbps": 2.0, "h2d_gbps": 3.0} if workload.strategy == "lean" else {}
        return bench_record(
            workload, step_time_ms=90.0, forward_ms=30.0, **link, **plan_fields(workload)
        )

    children = stand_in_children(
        measure=fake_measure,
        hidden_offload=lambda w, *, env, **budget: planning.hidden_offload_workload(w, **budget),
    )
    fields = {"model": "flax-resnet18", "batch": 8, "image_size": 32, "dtype": "float32"}
    hidden = Workload(**fields, strategy="offload-hidden", block_costs="traced")
    workloads = [Workload(**fields, strategy="none"), Workload(**fields, strategy="lean"), hidden]
    record = measure_all(workloads, steps=1, children=children)[-1]

    ((forward, backward, sizes, link, copies),) = given
    assert link == (2.0, 3.0) and len(forward) == len(backward) == len(sizes) == 8
    # The blocks' times are their FLOP shares of the twin's 90 ms step.
    assert 0 < sum(forward) + sum(backward) <= 90.0
    plan = Plan.from_dict(record.planned)
    assert [path for path, _ in plan.blocks] == [f"ResNetBlock_{i}" for i in range(8)]
    expected = [
        Lean()
        if c is None
        else Offload(window=c.window, max_bytes=c.moved, fetch_window=c.fetch_window)
        for c in copies
    ]
    assert list(plan.strategies) == expected and plan.outside == Lean()
    # The last block has no compute after it to hide its copies; the first blocks do.
    assert expected[-1] == Lean() and expected[0].to_host
    assert record.strategy == "offload-hidden" and record.block_costs == "traced"
    assert record.plan_choices == [brief(s) for s in expected] and record.plan_outside == "Lean()"
    # The caps are what the schedule moves; the planned step moves at most that. A cap that
    # covers a block's lean residuals may keep the offloading cut, which moves other values:
    # the plan's estimate counts what each cap's own trace moves.
    moved = sum(c.moved for c in copies if c is not None)
    assert record.plan_moved_bytes == moved > 0
    requested = requested_host_bytes(dataclasses.replace(hidden, planned=record.planned))
    assert 0 < requested <= moved
    # The plan's notes say what each cap's trace moves: what the planned step asks for.
    noted = [float(m) for n in plan.notes for m in re.findall(r"moves ([\d.]+) of", n)]
    assert sum(noted) == pytest.approx(requested / 1e6, abs=0.01 * len(noted))
    # Every copy runs while blocks compute: the blocks' time is their compute alone.
    assert record.plan_estimated_step_ms == pytest.approx(sum(forward) + sum(backward))


def test_offload_hidden_s_choices_are_said_and_so_is_a_plan_that_moves_nothing():
    from rich.console import Console

    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    moving = Record(
        strategy="offload-hidden", offloaded_blocks=1, plan_outside="Lean()",
        plan_choices=["Offload(window=2, max_bytes=4096)", "Lean()"], plan_moved_bytes=2**30,
    )  # fmt: skip
    still = dataclasses.replace(moving, offloaded_blocks=0, plan_choices=["Lean()"] * 2)
    say_notes([moving], console)
    said = console.export_text()
    assert "offload-hidden: Offload(window=2, max_bytes=4096) x1, Lean() x1; outside the " in said
    assert "its schedule moves 1,024.0 MiB each way" in said and "offloads nothing" not in said
    say_notes([still], console)
    assert "so it ran as Lean() on every block" in console.export_text()


def test_a_plan_is_set_beside_the_plan_that_keeps_everything_on_the_device():
    from rich.console import Console

    console = Console(width=250, record=True, file=open(os.devnull, "w"))
    plan = Record(
        strategy="plan", budget=0.35, step_time_ms=49.0, device_to_host_bytes=4 * 10**8,
        plan_choices=["Offload()", "Lean()"], plan_outside="Lean()",
    )  # fmt: skip
    device = dataclasses.replace(
        plan, strategy="plan-device", step_time_ms=50.0, device_to_host_bytes=0,
        plan_choices=["Remat()", "Lean()"],
    )  # fmt: skip
    say_notes([plan, device], console)
    said = console.export_text()
    assert (
        "plan@0.35: Offload() x1, Lean() x1; outside the blocks Lean(); 0.980× the step of " in said
    )
    assert "plan-device@0.35, moving 0.40 GB each way" in said
    assert "plan-device@0.35: Remat() x1, Lean() x1; outside the blocks Lean()\n" in said


def test_budgets_parse_and_make_plan_workloads():
    assert cli.parse_budgets("0.75,0.5") == (0.75, 0.5)
    for bad, error in [("0.5,x", "expected shares"), ("1.5", r"in \(0, 1\]")]:
        with pytest.raises(argparse.ArgumentTypeError, match=error):
            cli.parse_budgets(bad)
    with pytest.raises(ValueError, match="takes a budget"):
        Workload("flax-resnet18", 2, 32, "float32", "plan")
    with pytest.raises(ValueError, match="reference model"):
        Workload("resnet18", 2, 32, "float32", "plan", budget=0.5)
    with pytest.raises(ValueError, match="needs its plan"):
        _ = Workload("flax-resnet18", 2, 32, "float32", "plan", budget=0.5).block_strategies


def test_plan_budgets_are_shares_of_the_none_peak_with_what_its_process_held_beside_the_step():
    none = Record(strategy="none", step_time_ms=1.0, compiled_temp_bytes=800,
                  compiled_argument_bytes=100, peak_bytes_in_use=1000)  # fmt: skip
    # Half of the 1000-byte peak; the planner is told of the 100 bytes that the run held
    # beyond the program's, and fits each compiled step within its budget less them.
    assert budget_bytes([0.5, 1.0], [none]) == ([500, 1000], 100)
    assert budget_bytes([0.5], [dataclasses.replace(none, peak_bytes_in_use=None)]) == ([450], 0)


def test_gradient_errors_are_flagged_against_the_same_arithmetic_control():
    records = [
        Record(strategy="none", grad_rel_err=0.0),
        Record(strategy="remat", grad_rel_err=1e-3),
        Record(strategy="lean", grad_rel_err=1.9e-3),
        Record(strategy="offload", grad_rel_err=5e-3),
        Record(strategy="plan", budget=0.5, grad_rel_err=None),
    ]
    assert [r.strategy for r in gradient_flags(records)] == ["offload"]
    # Without the control, or where it is exact, nothing can be read as rounding.
    assert gradient_flags([r for r in records if r.strategy != "remat"]) == []
    assert gradient_flags([dataclasses.replace(records[1], grad_rel_err=0.0), records[3]]) == []


def _never(*args, **kwargs):
    raise AssertionError("measured before --out was checked")


@pytest.mark.parametrize("kind", ["file", "read-only folder"])
def test_an_unusable_out_is_refused_before_anything_is_measured(kind, tmp_path, capsys):
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("an earlier result")
        message = f"--out {out} is a file, not a folder: give a folder (made if need be)"
    else:
        out.mkdir(mode=0o500)
        if os.access(out, os.W_OK):  # root writes anywhere, but not into sysfs
            out = pathlib.Path("/sys")
        message = f"--out {out}: cannot write records there (Permission denied)"
    children = stand_in_children(probe=_never, measure=_never)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--out", str(out)], children=children)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "holds"),
    [
        ('{"strategy": "none"}', "holds an object with the keys ['strategy'], not a list of "
         "bench records"),
        ('[{"strategy": "none"}, "lean"]', 'holds a string ("lean") at index 1 of its list, '
         "where a bench record (an object with a 'strategy' string) belongs"),
        ("3", "holds a number (3), not a list of bench records"),
    ],
)  # fmt: skip
def test_resume_refuses_a_records_file_that_holds_no_list_of_records(text, holds, tmp_path, capsys):
    (tmp_path / "records.json").write_text(text)
    children = stand_in_children(probe=_never, measure=_never)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--out", str(tmp_path), "--resume"], children=children)
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        f"jaxoffload bench: error: --resume: {tmp_path / 'records.json'} {holds}: give the --out "
        "folder of an earlier bench run, or leave out --resume to measure afresh"
    ) in err
    assert "Traceback" not in err


def test_an_interrupted_run_keeps_its_records_and_resumes_with_the_rest(tmp_path, capsys):
    measured, interrupt = [], "remat"

    def fake(workload, *, steps, reference, env, **options):
        if workload.strategy == interrupt:
            raise KeyboardInterrupt  # Ctrl-C, or the machine going away, mid-run
        measured.append(workload.strategy)
        if workload.strategy == "none":
            pathlib.Path(reference).write_bytes(b"its gradient")  # as measure() does
        return bench_record(workload, run=len(measured))

    children = stand_in_children(measure=fake, probe=lambda env=None: {"platform": "cpu"})
    argv = ["bench", "--batch", "2", "--steps", "1", "--out", str(tmp_path)]
    argv += ["--strategies", "none,lean,remat,offload"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv, children=children)
    assert exit_info.value.code == 130
    assert "run the same command with --resume" in capsys.readouterr().err
    records = json.loads((tmp_path / "records.json").read_text())
    assert [(r["strategy"], r["run"], r["steps"]) for r in records] == [
        ("none", 1, 1),
        ("lean", 2, 1),
    ]

    # The same command resumed measures only the rest, and keeps what was measured.
    measured.clear()
    interrupt = ""
    cli.main([*argv, "--resume"], children=children)
    assert measured == ["remat", "offload"]
    assert "kept none, lean; measuring remat, offload" in capsys.readouterr().err
    records = json.loads((tmp_path / "records.json").read_text())
    assert [(r["strategy"], r["run"]) for r in records] == [
        ("none", 1), ("lean", 2), ("remat", 1), ("offload", 2)
    ]  # fmt: skip
    # A complete run removes the reference gradient: resumed with nothing to compare,
    # 'none' is kept; a strategy added later is compared with a new 'none' run.
    measured.clear()
    cli.main([*argv, "--resume"], children=children)
    assert measured == []
    cli.main([*argv[:-1], "none,lean,remat,offload,remat-dots", "--resume"], children=children)
    assert measured == ["none", "remat-dots"]

    # Records of another configuration are not mixed in.
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--resume", "--batch", "4"], children=children)
    assert exit_info.value.code == 2
    assert (
        f"--resume: {tmp_path / 'records.json'} holds 'none' measured with --batch 2, and this "
        "command has --batch 4: give that run's arguments, or leave out --resume"
    ) in capsys.readouterr().err


def test_grad_accum_and_devices_reach_the_workloads_the_notes_and_resume(tmp_path, capsys):
    measured = []

    def fake(workload, *, steps, reference, env, **options):
        measured.append((workload.strategy, workload.micro_batch, workload.num_devices))
        if workload.micro_batch is None:
            return bench_record(workload)
        note = "against none's step on a whole batch of 8, accumulated over two micro-batches of 4"
        return bench_record(
            workload, accumulation_steps=2, grad_rel_err=0.5, grad_rel_err_note=note
        )

    probe = {"platform": "cpu", "device_count": 4}
    children = _children(measure=fake, probe=lambda env=None: probe)
    argv = ["bench", "--strategies", "grad-accum", "--micro-batch", "4", "--devices", "4"]
    argv += ["--steps", "1", "--out", str(tmp_path)]
    cli.main(argv, children=children)
    # No reference is added: the accumulation checks itself against its own whole step.
    assert measured == [("grad-accum", 4, 4)]
    out, err = capsys.readouterr()
    assert "flax-resnet18, batch 8, 32², float32, 4 devices" in out
    assert (
        "grad-accum (2 micro-batches of 4): grad err 5.0e-01 against none's step on a whole "
        "batch of 8" in " ".join(err.split())
    )
    with pytest.raises(SystemExit):
        cli.main([*argv, "--resume", "--micro-batch", "8"], children=children)
    assert (
        "holds 'grad-accum' measured with --micro-batch 4, and this command has --micro-batch 8"
        in capsys.readouterr().err
    )
    probe = {"platform": "cpu", "device_count": 1}
    with pytest.raises(SystemExit):
        cli.main(argv, children=children)
    assert (
        "--devices 4: jax sees 1 cpu devices here; on CPU, "
        "XLA_FLAGS=--xla_force_host_platform_device_count=4 gives more"
    ) in capsys.readouterr().err


def test_a_size_search_runs_in_a_process_of_its_own_which_says_why_it_cannot_on_cpu():
    workload = Workload("flax-resnet18", 2, 32, "float32", "none")
    with pytest.raises(RuntimeError, match="needs a device that reports its memory limit"):
        Children().largest(workload, "image_size", time_limit_s=1.0)


H200 = {"platform": "gpu", "device": "NVIDIA H200", "bytes_limit": 75 * 2**30, "device_count": 1}


def _size_search(searches, fail=()):
    """Stands in for each search's process: records ``(strategy, axis, plan)``; sizes are made up.

    A search named in ``fail`` (``(name, axis)``, name ``"plan"`` for the planned model) raises
    what it gives.
    """

    def fake(workload, axis, *, plan, env, time_limit_s, min_speed=None):
        name = "plan" if plan else workload.strategy
        assert plan or min_speed is None  # a floor is the planned search's alone
        searches.append((name, axis, time_limit_s, env))
        for failing, failure in fail:
            if failing == (name, axis):
                raise failure
        size = {"batch": 64, "image_size": 96}[axis] * (3 if plan else 1)
        speed = {"batch": "images_per_s", "image_size": "ms_per_megapixel"}[axis]
        floor = {f"max_{axis}_min_speed": min_speed} if plan else {}
        return Record.from_json({
            "strategy": name, f"max_{axis}": size, f"max_{axis}_{speed}": 100.0 + size,
            f"max_{axis}_step_ms": 5.0, f"max_{axis}_stopped": None, **floor,
        })  # fmt: skip

    return fake


def test_size_searches_reach_each_uniform_strategy_and_the_planned_model(
    monkeypatch, tmp_path, capsys
):
    searches = []
    # --budget's plan fits nothing here: its record is a plan@0.5 beside the searches' plan.
    no_plan = {"no_plan": "no plan fits", "least_share": 0.9, "platform": "gpu", "planning_s": 1.0}
    children = _children(
        largest=_size_search(searches),
        measure=lambda workload, **_: bench_record(
            workload, device="NVIDIA H200", compiled_argument_bytes=0
        ),
        plan_budgets=lambda *a, **k: [no_plan],
        probe=lambda env=None: H200,
    )
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    argv = ["bench", "--model", "flax-resnet50", "--strategies", "none,lean,grad-accum",
            "--micro-batch", "4", "--budget", "0.5", "--steps", "1", "--out", str(tmp_path)]  # fmt: skip
    cli.main(
        [*argv, "--max-batch", "--max-image-size", "--memory-cap", "16", "--time-limit", "42"],
        children=children,
    )
    cap = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.160000"}  # 16 of the device's 100 GiB
    # Not grad-accum (its micro-batch sets its memory), nor --budget's plan (made for one batch).
    assert searches == [
        (name, axis, 42.0, cap)
        for name in ("none", "lean", "plan")
        for axis in ("batch", "image_size")
    ]
    records = {
        Record.from_json(r).name: r for r in json.loads((tmp_path / "records.json").read_text())
    }
    assert list(records) == ["none", "lean", "grad-accum", "plan@0.5", "plan"]
    plan = records["plan"]
    assert "budget" not in plan and records["plan@0.5"]["budget"] == 0.5
    assert (plan["max_batch"], plan["max_batch_images_per_s"], plan["max_image_size"]) == (
        192, 292.0, 288
    )  # fmt: skip
    assert "max_batch" not in records["grad-accum"] and "max_batch" not in records["plan@0.5"]
    # What check_front.py fit reads: H200 records of flax-resnet50 under a 16 GiB cap with a
    # max_batch, for none and plan, and a grad-accum record.
    h200 = [r for r in records.values() if "h200" in str(r.get("device", "")).lower()]
    capped = {r["strategy"]: r for r in h200 if r.get("max_batch") and r["memory_cap_gib"] == 16}
    assert sorted(capped) == ["lean", "none", "plan"]
    assert "grad-accum" in [r["strategy"] for r in h200]
    assert {r["model"] for r in capped.values()} == {"flax-resnet50"}
    assert capped["plan"]["max_batch_images_per_s"] and capped["none"]["max_batch_images_per_s"]
    table = re.sub(" +", " ", capsys.readouterr().out)  # printed to a file: nothing squeezed
    assert "┃ max batch ┃ images/s at max ┃ max image size ┃ ms/MP at max ┃" in table
    assert re.search(r"│ plan\b[│ -]*│ 192 │ 292\.0 │ 288 │ 388\.0 │", table)
    assert re.search(r"│ grad-accum\b.*│ - │ - │ - │ - │", table)
    for plot in ("max_batch.png", "max_image_size.png"):
        assert (tmp_path / plot).read_bytes()[:4] == b"\x89PNG"


def test_a_speed_floor_reaches_the_planned_search_alone_and_resuming_with_another_reruns_it(
    tmp_path, capsys
):
    searches = []
    children = _children(
        largest=_size_search(searches),
        measure=lambda w, **_: bench_record(w),
        probe=lambda env=None: H200,
    )
    argv = ["bench", "--strategies", "none", "--steps", "1", "--out", str(tmp_path), "--max-batch"]
    cli.main([*argv, "--min-speed", "0.7"], children=children)
    records = {
        Record.from_json(r).name: r for r in json.loads((tmp_path / "records.json").read_text())
    }
    assert records["plan"]["max_batch_min_speed"] == 0.7
    assert "max_batch_min_speed" not in records["none"]
    searches.clear()
    cli.main([*argv, "--min-speed", "0.5", "--resume"], children=children)
    assert [s[:2] for s in searches] == [("plan", "batch")]
    with pytest.raises(SystemExit):
        cli.main(["bench", "--min-speed", "0.7", "--out", str(tmp_path)], children=children)
    assert "--min-speed 0.7 is a share" in capsys.readouterr().err


def test_resumed_size_searches_keep_what_was_found_and_search_the_rest(tmp_path, capsys):
    searches, measured = [], []

    def fake_measure(workload, *, reference, **_):
        measured.append(workload.strategy)
        if workload.strategy == "none":
            pathlib.Path(reference).write_bytes(b"its gradient")  # as measure() does
        return bench_record(workload)

    def children(fail=()):
        return _children(
            measure=fake_measure, probe=lambda env=None: H200, largest=_size_search(searches, fail)
        )

    argv = ["bench", "--strategies", "none,lean", "--steps", "1", "--out", str(tmp_path)]
    # Interrupted during the planned model's search: what was found is in records.json.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [*argv, "--max-batch"], children=children([(("plan", "batch"), KeyboardInterrupt)])
        )
    assert exit_info.value.code == 130
    records = json.loads((tmp_path / "records.json").read_text())
    assert [(Record.from_json(r).name, r.get("max_batch")) for r in records] == [
        ("none", 64), ("lean", 64), ("plan", None)
    ]  # fmt: skip
    # Resumed, only that search runs; it fails, which is said and recorded, not lost.
    searches.clear()
    failing = children([(("plan", "batch"), RuntimeError("boom"))])
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--max-batch", "--resume"], children=failing)
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "kept none, lean; measuring nothing more; searching plan batch." in err
    assert (
        "1 failed (records.json has the rest; --resume runs only these again): plan --max-batch: boom"
        in err
    )
    assert [s[:2] for s in searches] == [("plan", "batch")] and measured == ["none", "lean"]
    # Resumed again, with the other axis too: what was found is kept, the rest searched.
    searches.clear()
    cli.main([*argv, "--max-batch", "--max-image-size", "--resume"], children=children())
    assert [s[:2] for s in searches] == [
        ("none", "image_size"), ("lean", "image_size"), ("plan", "batch"), ("plan", "image_size")
    ]  # fmt: skip
    assert measured == ["none", "lean"]
    records = json.loads((tmp_path / "records.json").read_text())
    assert [(Record.from_json(r).name, r["max_batch"], r["max_image_size"]) for r in records] == [
        ("none", 64, 96), ("lean", 64, 96), ("plan", 192, 288)
    ]  # fmt: skip
    assert "max_batch_error" not in records[2]


def test_progress_off_a_terminal_is_a_plain_line_per_step(tmp_path, capsys):
    def fake(workload, *, steps, reference, env, **options):
        if workload.strategy == "remat":
            raise RuntimeError("the measuring process failed (exit code 1):\nboom")
        return bench_record(workload)

    children = stand_in_children(measure=fake, probe=lambda env=None: {"platform": "cpu"})
    with pytest.raises(SystemExit):  # remat failed
        argv = ["bench", "--strategies", "none,remat", "--steps", "1", "--out", str(tmp_path)]
        cli.main(argv, children=children)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    assert [re.sub(r"\([\d.]+ s\)", "(T s)", line) for line in lines] == [
        "[1/2] none on flax-resnet18, batch 8: compile and 1 steps",
        "[1/2] none: 1.0 ms a step (T s)",
        "[2/2] remat on flax-resnet18, batch 8: compile and 1 steps",
        "[2/2] remat: failed: boom (T s)",
    ]


def test_progress_is_plain_lines_when_only_stdout_is_redirected(monkeypatch):
    # `bench > log`: stderr is still a terminal; plain lines stay in its scrollback, where
    # the bar, erased when done, would leave nothing of the run.
    class Terminal:
        is_terminal = True

    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert Progress(Terminal(), total=1).bar is None


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"jaxoffload {jaxoffload.__version__}\n"
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    shown_defaults = ["images per step, over all the --devices (default: 8)", "(default: float32)"]
    for shown in [*shown_defaults, "(default: bench-out)"]:
        assert shown in help_text
    assert "--memory-cap GIB GPU only (an error on CPU)" in help_text
    assert "--time-limit SECONDS per size search" in help_text and "(default: 300.0)" in help_text
    assert "(default: None)" not in help_text and "(default: False)" not in help_text
