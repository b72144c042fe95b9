"""What ``import jaxoffload`` loads: the library, not the benchmark harness."""

import json
import subprocess
import sys

import pytest


def _modules_after(statement: str) -> set[str]:
    # A fresh interpreter: this test process has imported the harness already.
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.fixture(scope="module")
def library_modules() -> set[str]:
    return _modules_after("import jaxoffload")


def test_import_jaxoffload_loads_no_harness(library_modules):
    assert "jaxoffload._src.transform" in library_modules  # the check sees the library's modules
    assert not [
        m for m in library_modules if m == "jaxoffload.bench" or m.startswith("jaxoffload.bench.")
    ]
    # matplotlib is the harness's alone (the `bench` extra). rich and optax are not checked:
    # flax itself imports both (flax.linen's summary uses rich, flax.nnx uses optax).
    assert not [m for m in library_modules if m.split(".")[0] == "matplotlib"]


def test_import_jaxoffload_adds_nothing_to_flax_but_itself(library_modules):
    # Beyond what flax loads and the standard library, `import jaxoffload` loads only itself:
    # a harness dependency imported by the core would show here.
    loaded_by_flax = {m.split(".")[0] for m in _modules_after("import flax.linen, flax.nnx")}
    added = {m.split(".")[0] for m in library_modules} - loaded_by_flax
    assert added - set(sys.stdlib_module_names) == {"jaxoffload"}, added
