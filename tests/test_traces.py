"""Reading device traces: compute and copy busy times, and how much of each copy ran under compute."""

import pathlib
import warnings

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import pytest
from hypothesis import given

import jaxoffload
from jaxoffload._src import overlap

# Five steps of one program on an H200 (jax 0.11.2): a 1 GiB copy to pinned host memory beside
# 16 independent 8192² bf16 matrix products, written by benchmarks/probes/overlap_probe.py
# ("minimal", d2h+compute). XLA:GPU started the copy three products before the end.
H200_TRACE = pathlib.Path(__file__).parent / "data" / "h200_copy_beside_matmuls.xplane.pb"


def test_a_gpu_trace_gives_each_steps_busy_times_and_overlap():
    o = jaxoffload.overlap_in_trace(H200_TRACE)
    assert o.device == "/device:GPU:0" and o.steps == 5
    assert o.d2h_bytes == 2**30 and o.h2d_bytes == 0 and o.h2d_overlap_fraction is None
    # The copy ran at the link's speed, about 55 GB/s, on a stream of its own.
    assert 18 < o.d2h_busy_ms < 21 and 50 < o.d2h_bytes / o.d2h_busy_ms / 1e6 < 60
    assert 20 < o.compute_busy_ms < 23
    # Barely a fifth of it ran while a kernel did: the step is nearly the sum of the two.
    assert 0.15 < o.d2h_overlap_fraction < 0.25
    assert o.step_ms == pytest.approx(
        o.compute_busy_ms + o.d2h_busy_ms - o.d2h_overlap_ms, rel=0.03
    )
    fields = o.fields()
    assert fields["d2h_overlap_fraction"] == round(o.d2h_overlap_fraction, 4)
    assert {"compute_busy_ms", "d2h_busy_ms", "h2d_busy_ms", "h2d_overlap_fraction"} <= set(fields)
    assert "21% of it under compute" in o.summary()
    # The timeline is one step's, from its start: one copy and the kernels.
    kinds = [a.kind for a in o.timeline]
    assert kinds.count("d2h") == 1 and kinds.count("compute") > 16
    assert min(a.start_ns for a in o.timeline) == 0


def test_the_steps_marked_in_a_trace_split_its_activity():
    activities, steps, device = overlap.read_trace(H200_TRACE)
    assert len(steps) == 5 and device == "/device:GPU:0"
    # Every activity falls in a step: the device's clock is the host's.
    assert all(any(s <= a.start_ns < e for s, e in steps) for a in activities)
    whole = overlap.overlap_of(activities)  # unmarked: one step
    assert whole.steps == 1 and whole.d2h_bytes == 5 * 2**30


def test_a_cpu_step_has_compute_and_no_copy():
    f = jax.jit(lambda x: jnp.tanh(x @ x))
    x = jnp.ones((128, 128))
    o = jaxoffload.measure_overlap(lambda: f(x), steps=3, warmup=1)
    assert o.device == "/host:CPU" and o.steps == 3
    assert o.compute_busy_ms > 0 and o.d2h_busy_ms == o.h2d_busy_ms == 0
    assert o.d2h_overlap_fraction is None and o.h2d_overlap_fraction is None
    assert "copies to the host: none" in o.summary()


def test_a_step_that_offloads_on_cpu_moves_nothing_there(tmp_path):
    layer = jaxoffload.offload(lambda w, x: jnp.tanh(x @ w), device_argnums=0)
    step = jax.jit(jax.grad(lambda w, x: layer(w, x).sum()))
    w, x = jnp.ones((64, 64)) / 64, jnp.ones((8, 64))
    with warnings.catch_warnings():  # on CPU, once per process: maybe given already
        warnings.simplefilter("ignore", jaxoffload.OffloadWarning)
        o = jaxoffload.measure_overlap(lambda: step(w, x), steps=2, warmup=1, log_dir=tmp_path)
    assert o.d2h_bytes == o.h2d_bytes == 0
    # The trace stays where it was asked to go, for TensorBoard or Perfetto.
    assert list(tmp_path.rglob("*.xplane.pb"))
    assert jaxoffload.overlap_in_trace(tmp_path).steps == 2


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="steps must be an int of at least 1, got 0"):
        jaxoffload.measure_overlap(lambda: None, steps=0)
    with pytest.raises(TypeError, match="run_step must be a function that runs one step"):
        jaxoffload.measure_overlap(jnp.ones(3))
    with pytest.raises(FileNotFoundError, match="no .xplane.pb under"):
        jaxoffload.overlap_in_trace("/nonexistent-trace-folder")


intervals = st.lists(
    st.tuples(st.integers(0, 100), st.integers(0, 30)).map(lambda p: (p[0], p[0] + p[1])),
    max_size=12,
)


@given(intervals, intervals)
def test_shared_time_is_the_time_both_cover(a, b):
    covered = lambda xs, t: any(s <= t < e for s, e in xs)  # noqa: E731
    assert overlap.busy_ns(a) == sum(covered(a, t) for t in range(140))
    assert overlap.shared_ns(a, b) == sum(covered(a, t) and covered(b, t) for t in range(140))
