"""The benchmark drivers and the committed results: records, schemas, plots and the peer."""

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).parents[1]
REQUIRED = {
    "model", "batch", "image_size", "dtype", "strategy", "offloaded_blocks", "framework",
    "device", "jax_version", "compiled_temp_bytes", "compiled_host_temp_bytes",
    "peak_bytes_in_use", "step_time_ms", "grad_rel_err", "date",
}  # fmt: skip


def test_sweep_writes_records(tmp_path):
    out = tmp_path / "sweep.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "offload_sweep.py"), "--model=vgg11",
         "--batch=2", "--image-size=32", "--dtype=float32", "--ks=0,8", "--steps=1",
         f"--out={out}"],
        check=True, cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    records = json.loads(out.read_text())
    assert [(r["strategy"], r["offloaded_blocks"]) for r in records] == [
        ("none", 0), ("offload-plain", 8), ("remat", 0),
    ]  # fmt: skip
    for r in records:
        assert REQUIRED <= set(r), REQUIRED - set(r)
        assert r["grad_rel_err"] <= 1e-6  # float32: the same gradients
        assert r["compiled_temp_bytes"] > 0 and r["step_time_ms"] > 0
    assert records[1]["requested_host_bytes"] > 0  # offload asked for host memory
    assert records[0]["requested_host_bytes"] == 0


def test_plot_of_the_committed_h200_sweep(tmp_path):
    out = tmp_path / "sweep.png"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plot_sweep.py"),
         str(ROOT / "benchmarks" / "results" / "vgg19_offload_sweep_h200.json"), f"--out={out}"],
        check=True, capture_output=True,
    )  # fmt: skip
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_committed_h200_records_meet_the_core_acceptance():
    records = json.loads(
        (ROOT / "benchmarks" / "results" / "vgg19_offload_sweep_h200.json").read_text()
    )
    sweep = {r["offloaded_blocks"]: r for r in records if r["strategy"] in ("none", "offload")}
    assert sorted(sweep) == [0, 4, 8, 12, 16]
    for r in records:
        assert REQUIRED <= set(r) and r["device"] == "NVIDIA H200"
    temps = [sweep[k]["compiled_temp_bytes"] for k in sorted(sweep)]
    assert sweep[16]["compiled_temp_bytes"] <= 0.5 * sweep[0]["compiled_temp_bytes"]
    assert sweep[16]["peak_bytes_in_use"] < sweep[0]["peak_bytes_in_use"]
    # Monotone within XLA's buffer packing (k=12 and k=16 differ by 12,544 bytes).
    assert all(b <= a + 2**20 for a, b in zip(temps, temps[1:]))
    for k in (4, 8, 12, 16):
        assert sweep[k]["compiled_host_temp_bytes"] == sweep[k]["device_to_host_bytes"] > 0
        assert sweep[k]["grad_rel_err"] <= 1e-2  # bf16


def _results(name):
    return json.loads((ROOT / "benchmarks" / "results" / name).read_text())


def test_committed_bench_and_peer_records_reproduce_the_findings_order():
    # ../shared/FINDINGS.md §3, §3b and §5, re-measured by `jaxoffload bench` and the peer.
    peer_fields = (REQUIRED - {"jax_version", "offloaded_blocks"}) | {"torch_version"}
    for model, batch in (("vgg19", 128), ("resnet50", 256)):
        jax_runs = {r["strategy"]: r for r in _results(f"bench_{model}_b{batch}_h200.json")}
        torch_runs = {r["strategy"]: r for r in _results(f"torch_{model}_b{batch}_h200.json")}
        assert set(jax_runs) == {"none", "remat", "remat-dots", "jax-offload", "offload"}
        assert set(torch_runs) == {"plain", "checkpoint", "save_on_cpu"}
        for r in jax_runs.values():
            assert REQUIRED | {"images_per_s"} <= set(r) and r["device"] == "NVIDIA H200"
            assert (r["model"], r["batch"], r["image_size"], r["dtype"]) == (
                model, batch, 224, "bfloat16",
            )  # fmt: skip
        for r in torch_runs.values():
            assert peer_fields <= set(r) and r["device"] == "NVIDIA H200"
        step = {s: r["step_time_ms"] for s, r in jax_runs.items()}
        temp = {s: r["compiled_temp_bytes"] for s, r in jax_runs.items()}
        # Remat is cheaper in memory and dearer in time than none; jax's offload
        # policy moves bytes yet raises device temp, and is the slowest recompute-free step.
        assert temp["remat"] < temp["remat-dots"] < temp["none"] < temp["jax-offload"]
        assert step["none"] < step["remat"] < step["jax-offload"]
        assert jax_runs["jax-offload"]["device_to_host_bytes"] > 0
        # save_on_cpu: 10x or more the plain step, below the plain peak.
        assert torch_runs["save_on_cpu"]["step_time_ms"] > 8 * torch_runs["plain"]["step_time_ms"]
        assert (
            torch_runs["save_on_cpu"]["peak_bytes_in_use"]
            < torch_runs["plain"]["peak_bytes_in_use"]
        )


def test_plot_of_the_committed_scoreboard_with_its_peer(tmp_path):
    out = tmp_path / "vgg19.png"
    results = ROOT / "benchmarks" / "results"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plot_bench.py"),
         str(results / "bench_vgg19_b128_h200.json"), str(results / "torch_vgg19_b128_h200.json"),
         f"--out={out}"],
        check=True, capture_output=True,
    )  # fmt: skip
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mixed = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plot_bench.py"),
         str(results / "bench_vgg19_b128_h200.json"),
         str(results / "torch_resnet50_b256_h200.json"), f"--out={out}"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert mixed.returncode == 2 and "different workloads" in mixed.stderr


def test_gradient_error_stores_then_compares(tmp_path):
    from jaxoffload.benchmark import gradient_error

    reference = str(tmp_path / "reference.npz")
    grads = [np.ones((2, 3)), np.full(4, 2.0)]
    assert gradient_error(grads, reference) == 0.0  # the first run stores its gradient
    assert gradient_error([g * 1.5 for g in grads], reference) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="another model"):
        gradient_error([np.ones(3)], reference)


def test_the_torch_peer_explains_itself_without_torch():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "peers" / "torch_reference.py"), "--help"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "save_on_cpu" in done.stdout
