"""XLA options for offloading steps: copies priced by their bytes on the link, and the options compile anywhere."""

import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxoffload
from jaxoffload._src.xla_options import copy_cost_profile

DATA = pathlib.Path(__file__).parent / "data"


def test_each_host_copy_of_a_real_program_is_priced_by_its_bytes():
    # Two copies of an H200 program: one to the host, one back; and a copy-done, not priced.
    profile = copy_cost_profile((DATA / "h200_offload_excerpt.hlo.txt").read_text(), 50.0)
    lines = profile.splitlines()
    assert len(lines) == 2
    to_host = 128 * 224 * 224 * 3 * 2 / 50e3 + 5  # bytes over 50 GB/s in µs, plus the fixed cost
    back = 128 * 14 * 14 * 512 * 2 / 50e3 + 5
    assert f'costs {{ name: "copy-start.104" cost_us: {to_host:.3f} }}' in lines
    assert f'costs {{ name: "copy-start.53.0" cost_us: {back:.3f} }}' in lines


def test_each_fetch_is_priced_at_the_queue_of_fetches_and_each_copy_out_alone():
    # The fetches share the link: each is priced at them all, so the scheduler starts each
    # as soon as its window lets it (docs/design.md, "Copies that hide").
    out = "%copy-start.1 = (bf16[1000,1000]{1,0:S(5)}, bf16[1000,1000]{1,0}, u32[]) copy-start"
    back = "%copy-start.{n} = (f32[{k},1000]{{1,0}}, f32[{k},1000]{{1,0:S(5)}}, u32[]) copy-start"
    hlo = "\n".join([out, back.format(n=2, k=1000), back.format(n=3, k=250)])
    costs = dict(re.findall(r'name: "([^"]+)" cost_us: ([\d.]+)', copy_cost_profile(hlo, 50.0)))
    queue = (4e6 / 50e3 + 5) + (1e6 / 50e3 + 5)  # both fetches, in µs
    assert costs == {
        "copy-start.1": "45.000",
        "copy-start.2": f"{queue:.3f}",
        "copy-start.3": f"{queue:.3f}",
    }


def test_a_program_without_host_copies_has_an_empty_profile():
    assert (
        copy_cost_profile("%copy-start.1 = (f32[8]{0}, f32[8]{0}, u32[]) copy-start(%x)", 50.0)
        == ""
    )
    with pytest.raises(ValueError, match="link_gbps must be a positive speed, got 0"):
        copy_cost_profile("", 0)


def test_options_compile_an_offloading_step_on_cpu_with_its_gradient():
    layer = jaxoffload.offload(lambda w, x: jnp.tanh(x @ w), device_argnums=0)
    loss = lambda w, x: layer(w, x).sum()  # noqa: E731
    w, x = jnp.ones((8, 8)) / 8, jnp.ones((2, 8))
    with warnings.catch_warnings():  # on CPU, once per process: maybe given already
        warnings.simplefilter("ignore", jaxoffload.OffloadWarning)
        lowered = jax.jit(jax.grad(loss)).lower(w, x)
    # XLA:CPU compiles the placement away: no copy to price, so only the scheduler's option.
    options = jaxoffload.compiler_options(lowered, link_gbps=50.0)
    assert options == jaxoffload.compiler_options()
    got = lowered.compile(options)(w, x)
    plain = jax.grad(lambda w, x: jnp.tanh(x @ w).sum())(w, x)
    assert jnp.allclose(got, plain, atol=1e-6)
    with pytest.raises(TypeError, match=r"takes a lowered step, jax.jit\(step\).lower"):
        jaxoffload.compiler_options(loss)
