"""The README's examples run as written, in order, and print what it says they print.

One test runs every ``python`` block, concatenated in order, in a fresh process with nothing
added. The others run, in this process, the blocks that one example needs (each in a fresh
namespace, in the README's order) and check what it makes.
"""

import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

import jaxoffload

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, re.S)
PYTHON = [code for kind, code in BLOCKS if kind == "python"]


def _block(word):
    """The one ``python`` block that holds ``word``."""
    (code,) = [code for code in PYTHON if word in code]
    return code


def _run(*words):
    """A fresh namespace after the blocks that hold ``words``, run in the README's order."""
    codes = [_block(word) for word in words]
    assert codes == sorted(codes, key=PYTHON.index), f"{words} are not in the README's order"
    namespace = {}
    for code in codes:
        exec(code, namespace)
    return namespace


# The blocks, by a word each holds: the quick start, then the sections in order.
QUICK_START = "class Block(nn.Module)"
TRAINING = "def train_step("
NESTING = "Nested = "
FUNCTION = "def layer(w, x)"
OVERLAP = "measure_overlap("
PLANNING = "linen.plannable(Block)"
FIT = "largest_size("
NNX = "class NNXBlock"
NNX_PLANNING = "nnx.Optimizer("


def test_every_block_runs_in_order_in_one_fresh_process(tmp_path):
    code = "\n".join(PYTHON)
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "Traceback" not in run.stderr
    # What the README says its blocks print.
    assert run.stdout.startswith("platform cpu: device temp ")
    (listed,) = [text for kind, text in BLOCKS if kind == "text" and "pinned_host" in text]
    assert listed in run.stdout
    assert "compute busy" in run.stdout and "copies to the host: none" in run.stdout
    assert "no plan of ['Store()', 'Lean()', 'Remat()'] fits" in run.stdout  # print(plans[0])
    plan = jaxoffload.Plan.load(tmp_path / "plan.json")
    assert str(plan) in run.stdout  # print(plan), as saved
    assert [path for path, _ in plan.blocks] == ["Block_0", "Block_1"]
    assert re.search(r"^size \d+: \d+ compiled within 64\.0 MiB", run.stdout, re.M)  # print(fit)


def test_the_quick_start_reports_a_users_model(capsys):
    namespace = _run(QUICK_START)
    assert sorted(namespace["variables"]["params"]) == ["Block_0", "Block_1", "Conv_0", "Dense_0"]
    report = namespace["report"]
    assert isinstance(report, jaxoffload.MemoryReport) and report.temp_bytes > 0
    assert not report.requested and not report.moved  # Lean() keeps its bytes on the device
    printed = capsys.readouterr().out
    assert printed == report.summary() + "\n" and printed.startswith("platform cpu: device temp ")


def test_the_training_example_trains_the_wrapped_model():
    namespace = _run(QUICK_START, TRAINING)
    assert jnp.isfinite(namespace["loss"])
    params, before = namespace["params"], namespace["variables"]["params"]
    assert jax.tree.structure(params) == jax.tree.structure(before)
    moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), params, before)
    assert all(jax.tree.leaves(moved))  # every parameter took the step
    stats = namespace["batch_stats"]
    assert float(abs(stats["Block_0"]["BatchNorm_0"]["mean"]).sum()) > 0  # statistics updated


def test_the_nesting_example_trains_with_train_by_keyword():
    namespace = _run(QUICK_START, TRAINING)
    plain_loss = namespace["loss"]
    exec(_block(NESTING), namespace)  # the next block, in the same namespace
    nested = namespace["nested"]
    assert type(nested).__name__ == "Net" and nested.block.__name__ == "Block"
    # Lean() outside the blocks and Offload() in them change what is kept, not the arithmetic.
    assert jnp.allclose(namespace["loss"], plain_loss, rtol=1e-5)


def test_the_function_example_prints_what_the_readme_shows(capsys):
    namespace = _run(QUICK_START)
    capsys.readouterr()  # the quick start's report
    exec(_block(FUNCTION), namespace)
    printed = capsys.readouterr().out
    (text,) = [code for kind, code in BLOCKS if kind == "text" and "pinned_host" in code]
    assert printed == text
    listed = "\n".join(
        str(r)
        for r in jaxoffload.saved_residuals(namespace["layer"], jnp.ones((8, 8)), jnp.ones((4, 8)))
    )
    assert listed == text.strip()


def test_the_overlap_example_reads_a_trace():
    namespace = _run(QUICK_START, FUNCTION, OVERLAP)
    overlap = namespace["overlap"]
    assert overlap.steps == 3 and overlap.compute_busy_ms > 0 and overlap.d2h_bytes == 0


def test_the_planning_example_plans_and_applies(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace = _run(QUICK_START, TRAINING, PLANNING)  # as written: on CPU, 0.5 does not fit
    too_small, plan = namespace["plans"]
    assert isinstance(too_small, jaxoffload.NoPlanFits) and "On CPU" in str(too_small)
    assert namespace["plan"] is plan
    assert [path for path, _ in plan.blocks] == ["Block_0", "Block_1"]
    assert plan.compiled_bytes <= plan.budget_bytes
    assert jaxoffload.Plan.load("plan.json") == plan
    assert type(namespace["model"]).__name__ == "Net"
    printed = capsys.readouterr().out
    assert f"{too_small}\n{plan}\n" in printed


def test_the_fit_example_finds_a_batch_that_fits():
    namespace = _run(QUICK_START, TRAINING, FIT)
    fit = namespace["fit"]
    probes = dict(fit.probes)
    assert 0 < fit.size < 256 and probes[fit.size] <= 64 * 2**20 < max(probes.values())
    assert fit.per_second > 0 and not fit.confirmed  # a CPU reports no runtime peak


def test_the_nnx_example_trains_and_keeps_its_statistics():
    from flax import nnx

    namespace = _run(QUICK_START, NNX)
    model, head = namespace["nnx_model"], namespace["head"]
    x = jnp.ones((2, 8, 8, 3))
    grads = nnx.jit(nnx.grad(lambda m, x: m(x).sum()))(model, x)
    assert type(model.blocks[0]).__name__ == "NNXBlock" and jax.tree.leaves(grads)
    assert float(abs(model.blocks[0].norm.mean[...]).sum()) > 0  # written back
    assert head(model.head, jnp.ones((2, 4, 4, 32))).shape == (2, 10)


def test_the_nnx_planning_example_plans_in_place():
    namespace = _run(QUICK_START, TRAINING, NNX, NNX_PLANNING)
    plan, model = namespace["plan"], namespace["nnx_model"]
    assert isinstance(namespace["plans"][0], jaxoffload.NoPlanFits)
    assert [path for path, _ in plan.blocks] == [f"blocks/{i}" for i in range(2)]
    assert plan.compiled_bytes <= plan.budget_bytes
    assert type(model.blocks[0]).__name__ == "NNXBlock"


def test_the_commands_are_the_ones_ci_runs():
    commands = [code.strip() for kind, code in BLOCKS if kind == "bash"]
    (bench,) = [c for c in commands if "jaxoffload bench" in c]
    (tests,) = [c for c in commands if "pytest" in c]
    assert bench.endswith("&& jaxoffload bench")  # the CLI's defaults: a small CPU run
    ci = (ROOT / ".ci" / "run").read_text()
    install, run = tests.split("&& ")[-2:]
    assert install.strip() in ci and run in ci  # .ci/run installs and tests as the README says


def test_the_sections_come_in_order_and_cite_committed_records():
    headings = re.findall(r"^## (.+)$", README, re.M)
    assert headings == [
        "Install", "Quick start", "Which strategy", "Two commands", "Strategies",
        "Planning for a budget", "Will it fit?", "NNX", "Several devices",
        "What works under which transform", "The bench", "How the figures were measured",
    ]  # fmt: skip
    # The first screen: what it is, install, quick start, which strategy, the two commands.
    first_screen = README.split("## Strategies")[0]
    assert "Lean()" in first_screen and ".summary()" in first_screen
    cited = re.findall(r"<!-- figures: (.*?) -->", README)
    assert cited, "every figure names the record it comes from"
    for paths in cited:
        for path in paths.split(", "):
            assert (ROOT / path).is_file(), f"the README cites {path}, which is not committed"
            assert f"]({path})" in README, f"{path} is cited in a comment only"
    for stale in ("being tuned", "docs/history.md", "predates"):
        assert stale not in README
