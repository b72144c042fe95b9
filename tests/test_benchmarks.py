"""The benchmark drivers: the compile probe, the plot of bench and peer records, and the peer."""

import json
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).parents[1]


def test_compile_probe_reports_temp_copies_and_the_twin():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "probes" / "compile_probe.py"), "flax-resnet18",
         "2", "offload@2", "--image-size", "32"],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    (offload,) = (json.loads(line) for line in done.stdout.splitlines())
    assert offload["strategy"] == "offload@2" and offload["temp_bytes"] > 0
    # On CPU the offload is requested but nothing moves; the twin is compiled all the same.
    assert offload["requested_bytes"] > 0 and offload["device_to_host_copies"] == 0
    assert offload["twin_temp_bytes"] > 0


def _record(framework, strategy, step, peak):
    return {"model": "flax-resnet50", "batch": 256, "image_size": 224, "dtype": "bfloat16",
            "device": "NVIDIA H200", "framework": framework, "strategy": strategy,
            "step_time_ms": step, "peak_bytes_in_use": peak,
            "compiled_temp_bytes": peak}  # fmt: skip


def test_plot_of_bench_and_peer_records(tmp_path):
    ours = tmp_path / "bench.json"
    ours.write_text(json.dumps([_record("jax", "none", 40, 11e9), _record("jax", "lean", 41, 6e9)]))
    peer = tmp_path / "torch.json"
    peer.write_text(json.dumps([_record("torch", "plain", 55, 11e9)]))
    out = tmp_path / "plot.png"
    plot = [sys.executable, "-m", "jaxoffload.bench.plot_bench"]
    subprocess.run([*plot, str(ours), str(peer), f"--out={out}"], check=True, capture_output=True)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{**_record("torch", "plain", 55, 11e9), "batch": 128}]))
    mixed = subprocess.run(
        [*plot, str(ours), str(other), f"--out={out}"], capture_output=True, text=True
    )
    assert mixed.returncode == 2 and "different workloads" in mixed.stderr


def test_gradient_error_stores_then_compares(tmp_path):
    from jaxoffload.bench.gradients import gradient_error

    reference = str(tmp_path / "reference.npz")
    grads = [np.ones((2, 3)), np.full(4, 2.0)]
    assert gradient_error(grads, reference) == 0.0  # the first run stores its gradient
    assert gradient_error([g * 1.5 for g in grads], reference) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="another model"):
        gradient_error([np.ones(3)], reference)


def test_the_torch_peer_explains_itself_without_torch():
    done = subprocess.run(
        [sys.executable, "-m", "jaxoffload.bench.torch_reference", "--help"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "save_on_cpu" in done.stdout


def test_deviceless_kernels_reads_each_kernels_bytes(tmp_path):
    """``deviceless.py kernels`` on a program compiled here: one loop fusion over 1,024 floats
    reads and writes 4 KiB, and a second program's extra kernel shows as the difference."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones(1024, jnp.float32)
    one = tmp_path / "one.hlo"
    one.write_text(jax.jit(lambda x: jnp.sin(x) * 2).lower(x).compile().as_text())
    two = tmp_path / "two.hlo"
    two.write_text(jax.jit(lambda x: (jnp.sin(x) * 2, jnp.cumsum(x))).lower(x).compile().as_text())
    probe = str(ROOT / "benchmarks" / "probes" / "deviceless.py")
    kernels = runpy_module(probe).kernels
    (fusion,) = kernels(one.read_text())
    assert (fusion["read"], fusion["write"]) == (4096, 4096)
    assert fusion["op"].startswith("forward: ") and fusion["op"].endswith(("sin", "mul"))
    done = subprocess.run(
        [sys.executable, probe, "kernels", str(one), str(two)],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert "one.hlo: 1 kernels, 0.00 GB" in done.stdout
    assert len(kernels(two.read_text())) > 1


def runpy_module(path):
    import runpy

    return types.SimpleNamespace(**runpy.run_path(path))
