"""The README's examples run as written, and print what it says they print."""

import pathlib
import re

import jax
import jax.numpy as jnp

import jaxoffload
from jaxoffload.bench.models import flax_resnet

README = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, re.S)


def _python(n):
    return [code for kind, code in BLOCKS if kind == "python"][n]


def test_the_example_trains_a_users_model():
    namespace = {}
    exec(_python(0), namespace)
    assert jnp.isfinite(namespace["loss"])
    assert sorted(namespace["variables"]["params"]) == ["Block_0", "Block_1", "Block_2",
                                                        "Block_3", "Conv_0", "Dense_0"]  # fmt: skip


def test_the_nnx_example_trains_and_keeps_its_statistics():
    from flax import nnx

    namespace = {"jaxoffload": jaxoffload}
    exec(_python(3), namespace)
    model, head = namespace["nnx_model"], namespace["head"]
    x = jnp.ones((2, 8, 8, 3))
    grads = nnx.jit(nnx.grad(lambda m, x: m(x).sum()))(model, x)
    assert type(model.blocks[0]).__name__ == "NNXBlock" and jax.tree.leaves(grads)
    assert float(abs(model.blocks[0].norm.mean[...]).sum()) > 0  # written back
    assert head(model.head, jnp.ones((2, 4, 4, 32))).shape == (2, 10)


def test_the_planning_example_plans_and_applies(tmp_path, monkeypatch):
    namespace = {}
    exec(_python(0), namespace)
    monkeypatch.chdir(tmp_path)
    exec(_python(4), namespace)  # as written: on CPU, 0.5 does not fit and 1.0 does
    too_small, plan = namespace["plans"]
    assert isinstance(too_small, jaxoffload.NoPlanFits) and "On CPU" in str(too_small)
    assert namespace["plan"] is plan
    assert [path for path, _ in plan.blocks] == ["Block_0", "Block_1", "Block_2", "Block_3"]
    assert plan.compiled_bytes <= plan.budget_bytes
    assert jaxoffload.Plan.load("plan.json") == plan
    assert type(namespace["model"]).__name__ == "Net"


def test_the_nnx_planning_example_plans_in_place():
    namespace = {}
    exec(_python(0), namespace)
    exec(_python(3), namespace)
    exec(_python(5), namespace)
    plan, model = namespace["plan"], namespace["nnx_model"]
    assert isinstance(namespace["plans"][0], jaxoffload.NoPlanFits)
    assert [path for path, _ in plan.blocks] == [f"blocks/{i}" for i in range(4)]
    assert plan.compiled_bytes <= plan.budget_bytes
    assert type(model.blocks[0]).__name__ == "NNXBlock"


def test_the_fit_example_finds_a_batch_that_fits(tmp_path, monkeypatch):
    namespace = {}
    exec(_python(0), namespace)
    monkeypatch.chdir(tmp_path)
    exec(_python(4), namespace)
    exec(_python(6), namespace)
    fit = namespace["fit"]
    probes = dict(fit.probes)
    assert 0 < fit.size < 256 and probes[fit.size] <= 64 * 2**20 < max(probes.values())
    assert fit.per_second > 0 and not fit.confirmed  # a CPU reports no runtime peak


def test_the_nesting_and_function_examples_run():
    namespace = {"jaxoffload": jaxoffload, "jnp": jnp, **vars(flax_resnet)}
    exec(_python(1), namespace)
    exec(_python(2), namespace)
    model = namespace["model"]
    assert type(model).__name__ == "ResNet" and model.block_cls.__name__ == "BottleneckResNetBlock"
    listed = "\n".join(
        str(r)
        for r in jaxoffload.saved_residuals(namespace["layer"], jnp.ones((8, 8)), jnp.ones((4, 8)))
    )
    (text,) = [code for kind, code in BLOCKS if kind == "text" and "pinned_host" in code]
    assert listed == text.strip()


def test_the_overlap_example_reads_a_trace():
    (code,) = [c for kind, c in BLOCKS if kind == "python" and "measure_overlap" in c]
    namespace = {}
    exec(code, namespace)
    overlap = namespace["overlap"]
    assert overlap.steps == 3 and overlap.compute_busy_ms > 0 and overlap.d2h_bytes == 0


def test_the_commands_are_the_ones_ci_runs():
    commands = [code.strip() for kind, code in BLOCKS if kind == "bash"]
    assert commands[0].endswith("jaxoffload bench")
    ci = (pathlib.Path(__file__).parents[1] / ".ci" / "run").read_text()
    assert commands[1].split("&& ")[-1] in ci
