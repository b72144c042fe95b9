"""memory_report: reading what a compiled program keeps where, and saying when nothing moved."""

import pathlib
import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import host_copies, normal
from jax.ad_checkpoint import checkpoint_name

import jaxoffload
from jaxoffload._src import report as report_lib
from jaxoffload._src import transfers

DATA = pathlib.Path(__file__).parent / "data"


def _grad(layer):
    return jax.jit(jax.grad(lambda w, x: layer(w, x).sum(), argnums=1))


def _tanh(w, x):
    return jnp.tanh(x @ w)


def test_plain_program_requests_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning when nothing was asked for
        r = jaxoffload.memory_report(_grad(_tanh), normal(0, (16, 16)), normal(1, (4, 16)))
    assert (r.requested, r.moved, r.dropped) == (False, False, False)
    assert r.requested_transfers == 0 and r.argument_bytes == 4 * (16 * 16 + 4 * 16)


def test_cpu_says_host_placement_has_no_effect():
    f = jaxoffload.offload(_tanh, device_argnums=0)
    args = normal(0, (16, 16)), normal(1, (4, 16))
    moved = [r for r in jaxoffload.saved_residuals(f, *args) if r.placement == "pinned_host"]
    with pytest.warns(jaxoffload.OffloadWarning, match="no effect on CPU"):
        r = jaxoffload.memory_report(_grad(f), *args)
    assert r.platform == "cpu"
    # The two small residuals travel as one packed buffer, of their bytes together.
    assert len(moved) == 2 and r.requested_transfers == host_copies(moved) == 1
    assert r.requested_bytes == len(moved) * 4 * 4 * 16
    # XLA:CPU compiles the placement away: nothing moves, and that is not a "drop".
    assert not r.moved and not r.dropped
    assert "no effect on CPU" in r.summary()
    # Even on_dropped="raise" only warns on CPU: there is nothing to fix.
    with pytest.warns(jaxoffload.OffloadWarning):
        jaxoffload.memory_report(_grad(f), *args, on_dropped="raise")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxoffload.memory_report(_grad(f), *args, on_dropped="ignore")


def test_jax_offload_policy_is_seen_as_a_request():
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["y"],
        offload_src="device",
        offload_dst="pinned_host",
    )

    def layer(w, x):
        return jnp.sin(checkpoint_name(x @ w, "y"))

    r = jaxoffload.memory_report(
        _grad(jax.checkpoint(layer, policy=policy)), normal(0, (8, 8)), normal(1, (4, 8)),
        on_dropped="ignore",
    )  # fmt: skip
    assert r.requested_transfers == 1


def _gpu_report(**counts):
    fields = dict.fromkeys(jaxoffload.MemoryReport.__dataclass_fields__, 0)
    return jaxoffload.MemoryReport(**{**fields, "platform": "gpu", **counts})


def test_a_dropped_offload_warns_or_raises_on_gpu():
    dropped = _gpu_report(requested_transfers=3, requested_bytes=3 << 20)
    assert dropped.dropped and "dropped" in dropped.summary()
    with pytest.warns(jaxoffload.OffloadWarning, match="XLA dropped them"):
        report_lib.complain_if_dropped(dropped, "warn")
    with pytest.raises(jaxoffload.OffloadDroppedError, match="3 host transfers"):
        report_lib.complain_if_dropped(dropped, "raise")
    kept = _gpu_report(requested_transfers=3, device_to_host=3, host_to_device=3)
    assert not kept.dropped
    report_lib.complain_if_dropped(kept, "raise")  # nothing to complain about


def test_reads_host_copies_from_h200_hlo():
    # Lines of the program compiled on an H200 for benchmarks/offload_sweep.py (k=16).
    counts = report_lib.read_host_transfers((DATA / "h200_offload_excerpt.hlo.txt").read_text())
    image = 128 * 224 * 224 * 3 * 2
    assert counts == {
        "device_to_host": 1,
        "device_to_host_bytes": image,
        "host_buffers": 1,  # the copy's destination; the tuple and GTE alias it
        "host_buffer_bytes": image,
        "host_to_device": 1,
        "host_to_device_bytes": 128 * 14 * 14 * 512 * 2,
    }


def test_reads_synchronous_copies_whose_operands_are_printed_by_name():
    # XLA prints operands without their types; the source type is looked up.
    hlo = """
  %p = bf16[2,4]{1,0} parameter(0)
  %to_host = bf16[2,4]{1,0:S(5)} copy(%p), metadata={op_name="x"}
  %back = bf16[2,4]{1,0} copy(%to_host)
  %same = bf16[2,4]{1,0} copy(%back)
  %pair = (f32[3]{0}, f32[3]{0}) copy(%tuple.1)
  %s = f32[] parameter(1)
  %s_start = (f32[]{:S(5)}, f32[], u32[]) copy-start(%s)
"""
    counts = report_lib.read_host_transfers(hlo)
    assert counts == {
        "device_to_host": 2,
        "device_to_host_bytes": 20,
        "host_buffers": 2,
        "host_buffer_bytes": 20,
        "host_to_device": 1,
        "host_to_device_bytes": 16,
    }


def test_bad_arguments():
    with pytest.raises(TypeError, match="jax.jit-wrapped"):
        jaxoffload.memory_report(_tanh, normal(0, (2, 2)), normal(0, (2, 2)))
    with pytest.raises(ValueError, match="on_dropped"):
        jaxoffload.memory_report(_grad(_tanh), normal(0, (2, 2)), normal(0, (2, 2)), on_dropped="x")


class _Compiled:
    """A compiled program's stand-in: its device temp, as ``memory_analysis`` gives it."""

    def __init__(self, temp):
        self.temp = temp

    def memory_analysis(self):
        return type("Analysis", (), {"temp_size_in_bytes": self.temp})()


def _moved(temp, moved):
    fields = dict.fromkeys(
        ("argument_bytes", "output_bytes", "host_temp_bytes", "host_buffers", "host_to_device",
         "host_to_device_bytes", "host_buffer_bytes"),
        0,
    )  # fmt: skip
    return report_lib.MemoryReport(
        platform="gpu", temp_bytes=temp, requested_transfers=1, requested_bytes=moved,
        device_to_host=1, device_to_host_bytes=moved, **fields,
    )  # fmt: skip


def test_copies_that_free_little_are_reported_with_both_figures():
    # Moving 4 GiB that frees 0.25 GiB: the figures of a GPU test's chain (the
    # twin is the same program with host placement off).
    report = _moved(int(1.75 * 2**30), 4 * 2**30)
    with pytest.warns(jaxoffload.OffloadWarning, match=r"1\.75 GiB against 2\.00 GiB"):
        warned = report_lib.with_twin(report, _Compiled(2 * 2**30))
    assert warned.freed_bytes == 2**28 and warned.frees_little
    assert "the copies free 0.25 GiB" in warned.summary()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        freeing = report_lib.with_twin(report, _Compiled(4 * 2**30))  # frees 2.25 of 4 GiB
        report_lib.with_twin(report, _Compiled(2 * 2**30), on_dropped="ignore")
    assert not freeing.frees_little


def test_the_twin_is_the_program_without_host_placement():
    f = jaxoffload.offload(_tanh, device_argnums=0)
    args = normal(0, (16, 16)), normal(1, (4, 16))
    assert "<host>" in str(jax.make_jaxpr(jax.grad(lambda w, x: f(w, x).sum()))(*args))
    with transfers.without_host_placement():
        twin = jax.make_jaxpr(jax.grad(lambda w, x: f(w, x).sum()))(*args)
    assert "<host>" not in str(twin)
    # The same ordering barriers: only the placement changes.
    plain = jax.make_jaxpr(jax.grad(lambda w, x: f(w, x).sum()))(*args)
    assert str(twin).count("optimization_barrier") == str(plain).count("optimization_barrier")


def test_a_step_under_nnx_jit_is_reported_as_one_under_jax_jit(monkeypatch):
    # nnx.jit's trace wraps jax's: the report asked it for a jaxpr it does not hold, and
    # an NNX user's memory_report(nnx.jit(step), model, x) ended in an AttributeError.
    from flax import nnx

    module = jaxoffload.nnx.wrap(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), jaxoffload.Offload())
    step = nnx.jit(nnx.grad(lambda m, x: jnp.tanh(m(x)).sum()))
    x = normal(1, (4, 16))
    report = jaxoffload.memory_report(step, module, x, on_dropped="ignore")
    assert report.platform == "cpu" and report.requested_transfers >= 1
    # Where something moves (here, as a GPU's program reads), the twin compiles too.
    read = report_lib.read_host_transfers
    monkeypatch.setattr(
        report_lib, "read_host_transfers", lambda text: {**read(text), "device_to_host": 1}
    )
    twinned = jaxoffload.memory_report(step, module, x, on_dropped="ignore")
    assert twinned.moved and twinned.twin_temp_bytes is not None
