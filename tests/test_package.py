"""What ``import jaxoffload`` loads: the library, not the benchmark harness; and when."""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import jaxoffload


def _modules_after(statement: str) -> set[str]:
    # A fresh interpreter: this test process has imported the harness already.
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.fixture(scope="module")
def library_modules() -> set[str]:
    # Every public name read: the face imports each when it is first read.
    return _modules_after("from jaxoffload import *")


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


def test_import_jaxoffload_imports_no_jax_until_a_name_is_read():
    # `python -m jaxoffload` runs the package first: the command refuses a bad flag before
    # jax is imported (tests/test_cli.py times it).
    modules = _modules_after("import jaxoffload")
    assert "jax" not in modules and "jaxoffload._src.transform" not in modules
    assert "jax" in _modules_after("import jaxoffload; jaxoffload.Offload")


def test_the_face_imports_for_type_checkers_what_it_imports_when_read():
    """The names that ``jaxoffload.__getattr__`` imports, and from where, are the imports
    under ``TYPE_CHECKING``, one for one."""
    tree = ast.parse(pathlib.Path(jaxoffload.__file__).read_text())
    (checking,) = [
        node
        for node in tree.body
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
    ]
    imported = {}
    for node in checking.body:
        for alias in node.names:
            assert alias.asname == alias.name, ast.unparse(node)  # re-exported as itself
            module = f"{node.module}.{alias.name}" if node.module == "jaxoffload" else node.module
            imported[alias.name] = module
    (sources,) = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "_SOURCES"
    ]
    assert imported == sources
    assert set(jaxoffload.__all__) <= set(imported)
