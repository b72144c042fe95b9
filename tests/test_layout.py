"""The house: imports run one way, down the layers that docs/design.md declares.

Read from the source with ``ast``, function-level imports included, so that an
import hidden inside a function to dodge a cycle is seen too.
"""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib
import re

import pytest

import jaxoffload
import jaxoffload.linen
import jaxoffload.nnx
import jaxoffload.strategies

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxoffload"
DESIGN = (ROOT / "docs" / "design.md").read_text()
STRATEGY_CLASSES = {"Store", "Lean", "Remat", "Offload"}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


PATHS = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}
SOURCES = {m: ast.parse(p.read_text(), str(p)) for m, p in PATHS.items()}


def _declared(section: str) -> str:
    """The fenced block under the heading ``section`` of docs/design.md."""
    match = re.search(rf"{re.escape(section)}\n.*?```text\n(.*?)```", DESIGN, re.S)
    assert match, f"docs/design.md has no ```text block under {section!r}"
    return match.group(1)


def _layers() -> list[list[str]]:
    """The layers, top first: each module may import only from the layers below its own."""
    rows = [line.split("#")[0].split() for line in _declared("## The rooms").splitlines()]
    return [row for row in rows if row]


def _layer_of(module: str, layers: list[list[str]]) -> int:
    """The layer of ``module``: the row naming it, or a package above it (``jaxoffload.bench``)."""
    best = None
    for n, row in enumerate(layers):
        for name in row:
            under = name.endswith(".*") and (module == name[:-2] or module.startswith(name[:-1]))
            if module == name or under:
                best = n if best is None else best
    assert best is not None, f"{module} is in no layer of docs/design.md's map"
    return best


def _imports(module: str, tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """``(imported module, names, line)`` for every jaxoffload import in ``tree``, at any depth."""
    found = []
    package = module if module in _PACKAGES else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                (a.name, [], node.lineno) for a in node.names if a.name.startswith("jaxoffload")
            ]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                )
            if not base.startswith("jaxoffload"):
                continue
            names = [a.name for a in node.names]
            # `from package import module` imports the module.
            for name in names:
                if f"{base}.{name}" in SOURCES:
                    found.append((f"{base}.{name}", [], node.lineno))
                else:
                    found.append((base, [name], node.lineno))
    return found


_PACKAGES = {
    _module_name(p.parent) for p in PACKAGE.rglob("__init__.py") if "__pycache__" not in p.parts
}


def _graph() -> dict[str, set[str]]:
    return {m: {i for i, _, _ in _imports(m, t) if i != m} for m, t in SOURCES.items()}


def test_every_module_is_in_a_layer():
    layers = _layers()
    for module in SOURCES:
        _layer_of(module, layers)


def test_imports_have_no_cycle():
    graph, state, path = _graph(), {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                cycle = path[path.index(n) :] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_imports_only_go_down_the_declared_layers():
    layers, wrong = _layers(), []
    for module, tree in SOURCES.items():
        for imported, _, line in _imports(module, tree):
            if imported == module or imported not in SOURCES:
                continue
            if _layer_of(imported, layers) <= _layer_of(module, layers):
                wrong.append(f"{module}:{line} imports {imported}")
    assert not wrong, "imports against docs/design.md's layers:\n" + "\n".join(wrong)


def test_the_library_never_imports_the_bench():
    wrong = [
        f"{m}:{line} imports {i}"
        for m, t in SOURCES.items()
        if not m.startswith(("jaxoffload.bench", "jaxoffload.__main__"))
        for i, _, line in _imports(m, t)
        if i.startswith("jaxoffload.bench")
    ]
    assert not wrong, wrong


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_name_crosses_modules():
    wrong = []
    for module, tree in SOURCES.items():
        aliases = {}  # local name -> jaxoffload module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom | ast.Import):
                for a in node.names:
                    full = f"{node.module}.{a.name}" if isinstance(node, ast.ImportFrom) else a.name
                    if full in SOURCES:
                        aliases[a.asname or a.name.split(".")[0]] = full
        for imported, names, line in _imports(module, tree):
            wrong += [f"{module}:{line} imports {imported}.{n}" for n in names if _private(n)]
        wrong += _private_reads(module, tree, aliases)
    assert not wrong, "private names that cross modules:\n" + "\n".join(wrong)


def _private_reads(where: str, tree: ast.AST, modules: dict[str, str]) -> list[str]:
    """Each ``m._x`` in ``tree``, ``m`` a local name bound to one of ``modules``' values."""
    return [
        f"{where}:{node.lineno} reads {modules[node.value.id]}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in modules
        and _private(node.attr)
    ]


def test_no_isinstance_of_a_strategy_class_outside_strategies():
    """A strategy is asked what it does; where code must test its class, a comment says why."""
    wrong = []
    for module, tree in SOURCES.items():
        if module == "jaxoffload._src.strategies":
            continue
        lines = PATHS[module].read_text().splitlines()
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass")
                and len(node.args) == 2
            ):
                continue
            named = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
            if named & STRATEGY_CLASSES:
                said = "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith(
                    "#"
                )
                if not said:
                    wrong.append(f"{module}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not wrong, "isinstance tests of strategy classes, with no comment:\n" + "\n".join(wrong)


def test_modules_are_short_unless_the_design_says_why():
    """At most 500 lines in ``_src``, 600 elsewhere in the package, the bench included."""
    allowed = set(_declared("## Long modules").split())
    long = [
        f"{m} ({n} lines)"
        for m in SOURCES
        if (n := len(PATHS[m].read_text().splitlines()))
        > (500 if m.startswith("jaxoffload._src") else 600)
        and m not in allowed
    ]
    assert not long, long


SEAM = "jaxoffload.internal"
PROBES = {
    f"benchmarks.{p.relative_to(ROOT / 'benchmarks').with_suffix('').as_posix().replace('/', '.')}":
    ast.parse(p.read_text(), str(p))
    for p in sorted((ROOT / "benchmarks").rglob("*.py"))
}  # fmt: skip


def _seam_clients() -> dict[str, ast.AST]:
    """The bench's modules, ``python -m jaxoffload``'s, and the probe scripts of benchmarks/."""
    bench = {
        m: t
        for m, t in SOURCES.items()
        if m.startswith(("jaxoffload.bench", "jaxoffload.__main__"))
    }
    return {**bench, **PROBES}


def test_the_bench_and_the_probes_reach_src_only_through_the_seam():
    assert PROBES, "no probe scripts found under benchmarks/"
    wrong = [
        f"{m}:{line} imports {i}"
        for m, tree in _seam_clients().items()
        for i, _, line in _imports(m, tree)
        if i.startswith("jaxoffload._src")
    ]
    assert not wrong, "imports of _src around jaxoffload.internal:\n" + "\n".join(wrong)
    # The seam itself re-exports _src, and nothing above it.
    assert all(i.startswith("jaxoffload._src") for i, _, _ in _imports(SEAM, SOURCES[SEAM]))


def test_the_seam_names_exactly_what_its_clients_use():
    import jaxoffload.internal

    used = {
        name
        for m, tree in _seam_clients().items()
        for i, names, _ in _imports(m, tree)
        if i == SEAM
        for name in names
    }
    assert used == set(jaxoffload.internal.__all__)
    assert all(getattr(jaxoffload.internal, name) is not None for name in used)


def test_a_strategy_reaches_where_it_acts_through_imports_that_go_down():
    """``linen.wrap``'s strategy value travels face -> lifting -> transform -> residuals, down."""
    graph, layers = _graph(), _layers()
    path = [
        "jaxoffload.linen",
        "jaxoffload._src.linen",
        "jaxoffload._src.transform",
        "jaxoffload._src.residuals",
    ]
    for above, below in zip(path, path[1:]):
        assert below in graph[above], (above, below)
        assert _layer_of(below, layers) > _layer_of(above, layers)
    # Where it takes effect: the residuals it keeps, and the transfers it makes.
    assert "jaxoffload._src.transfers" in graph["jaxoffload._src.transform"]
    assert "jaxoffload._src.strategies" in graph["jaxoffload._src.residuals"]


PUBLIC_SURFACE = {
    jaxoffload: [
        "Fit", "Lean", "MemoryReport", "NoPlanFits", "Offload", "OffloadDroppedError",
        "OffloadWarning", "OffloadedCall", "Overlap", "Plan", "Remat", "Residual", "SpatialGather",
        "Store", "Strategy", "compiler_options", "largest_size", "linen", "measure_overlap",
        "memory_report", "nnx", "offload", "offloaded_calls", "overlap_in_trace", "plan",
        "residuals_per_call",
        "saved_residuals", "spatial_gathers", "wrap",
    ],
    jaxoffload.linen: ["offload", "plannable", "wrap"],
    jaxoffload.nnx: ["offload", "wrap"],
    jaxoffload.strategies: [
        "Lean", "Offload", "Remat", "Store", "Strategy", "check_strategy", "strategy_from_dict",
        "strategy_to_dict",
    ],
}  # fmt: skip


@pytest.mark.parametrize("face", list(PUBLIC_SURFACE), ids=lambda m: m.__name__)
def test_the_public_surface_is_pinned(face):
    assert sorted(face.__all__) == sorted(PUBLIC_SURFACE[face])
    for name in face.__all__:
        assert getattr(face, name) is not None
    # Nothing else public leaks from a face: every other attribute is private or a module.
    extra = [
        n
        for n, v in vars(face).items()
        if not n.startswith("_") and n not in face.__all__ and not inspect.ismodule(v)
    ]
    assert not extra, extra


def test_offload_takes_every_field_of_Offload_in_each_face():
    """``offload``'s keyword list is written out for typing; this keeps it in step with the value."""
    fields = inspect.signature(jaxoffload.Offload).parameters
    for offload in (jaxoffload.offload, jaxoffload.linen.offload, jaxoffload.nnx.offload):
        parameters = inspect.signature(offload).parameters
        for name, field in fields.items():
            assert name in parameters, (offload.__module__, name)
            assert parameters[name].default == field.default, (offload.__module__, name)
            assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY


TESTS = {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted((ROOT / "tests").glob("*.py"))}


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


def _module_named(node: ast.AST, modules: dict[str, str]) -> str | None:
    """The package's module that ``node`` names, through a local name in ``modules`` or in full."""
    dotted = _dotted(node)
    if dotted is None:
        return None
    head, _, rest = dotted.partition(".")
    full = modules.get(head, head) + (f".{rest}" if rest else "")
    return full if full in SOURCES else None


def _private_names_reached_by_tests() -> list[str]:
    """Where a test imports, reads or patches a private name of one of the package's modules.

    Each of these counts, with ``m`` a module of the package, bound by an import in the test
    file (``from jaxoffload._src import m``, ``import jaxoffload._src.m as m``) or written out
    (``jaxoffload._src.m``):

    - ``from m import _x``;
    - ``m._x``, read, called or assigned;
    - ``monkeypatch.setattr(m, "_x", ...)``, ``getattr(m, "_x")``, ``mock.patch.object(m,
      "_x")``: any call given a module and a private name;
    - ``monkeypatch.setattr("jaxoffload.m._x", ...)``, ``mock.patch("jaxoffload.m._x")``: a
      private name written out in a string;
    - ``obj._x``, where ``obj`` was made by a class or function imported from the package
      (``pool = Pool.of(...)``; ``pool._route(...)``).

    The tests' own names (their helpers in ``tests/``, their classes) and dunder names do not
    count.
    """
    found = []
    for test, tree in TESTS.items():
        modules = {}  # local name -> the package's module it is bound to
        imported = set()  # local names of the package's classes and functions
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxoffload"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in SOURCES:
                        modules[a.asname or a.name] = full
                    else:
                        imported.add(a.asname or a.name)
                        if _private(a.name):
                            found.append(f"{test}:{node.lineno} imports {node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in SOURCES and a.asname:
                        modules[a.asname] = a.name
        module_of = functools.partial(_module_named, modules=modules)
        made = set()  # local names bound to what the package's names made
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                called = _dotted(node.value.func)
                if called and called.split(".")[0] in imported:
                    made |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr) and not module_of(node):
                if (m := module_of(node.value)) is not None:
                    found.append(f"{test}:{node.lineno} reads {m}.{node.attr}")
                elif isinstance(node.value, ast.Name) and node.value.id in made:
                    found.append(f"{test}:{node.lineno} reads {node.value.id}.{node.attr}")
            if not isinstance(node, ast.Call):
                continue
            args = node.args
            if (
                len(args) >= 2
                and (m := module_of(args[0])) is not None
                and isinstance(args[1], ast.Constant)
                and _private(str(args[1].value))
            ):
                found.append(f"{test}:{node.lineno} patches {m}.{args[1].value}")
            for arg in args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    where, _, name = arg.value.rpartition(".")
                    if where in SOURCES and _private(name) and arg.value not in SOURCES:
                        found.append(f"{test}:{node.lineno} patches {arg.value}")
    return found


def test_no_test_reaches_a_private_name_of_another_module():
    """A test goes through a module's public names, its internal ones included (names without
    an underscore in ``_src``): a seam, a stand-in or a public entry point, never a private
    name read or patched from outside the module that owns it."""
    reached = _private_names_reached_by_tests()
    assert len(reached) == 0, "\n".join(reached)


def test_the_count_of_private_names_sees_each_form(tmp_path):
    """The check above finds what it looks for: one of each form, in a test written here."""
    sample = """
from jaxoffload._src import cut
from jaxoffload._src.layers import Pool, _first_max
import jaxoffload._src.report as report_lib
import jaxoffload._src.fallbacks

def test(monkeypatch):
    cut._price(1)
    report_lib._read_hlo("")
    jaxoffload._src.fallbacks._CHOSEN.clear()
    monkeypatch.setattr(cut, "_SOLVED", {})
    monkeypatch.setattr("jaxoffload._src.context._said", set())
    pool = Pool.of(1)
    pool._route_by_phases(1)
    cut.__name__, cut.cheapest, Local._own, jaxoffload._src.cut  # none of these counts
    monkeypatch.setattr("jaxoffload._src", "jaxoffload._src.cut.cheapest")
"""
    TESTS["sample"] = ast.parse(sample)
    try:
        reached = [r for r in _private_names_reached_by_tests() if r.startswith("sample:")]
    finally:
        del TESTS["sample"]
    assert sorted(r.split()[-1] for r in reached) == [
        "jaxoffload._src.context._said",
        "jaxoffload._src.cut._SOLVED",
        "jaxoffload._src.cut._price",
        "jaxoffload._src.fallbacks._CHOSEN",
        "jaxoffload._src.layers._first_max",
        "jaxoffload._src.report._read_hlo",
        "pool._route_by_phases",
    ], reached


def test_no_test_reaches_a_private_name_of_the_bench_or_the_seam():
    """The bench's tests go through its public names: a stand-in where a GPU or a child
    process would be (``jaxoffload.bench.child.Children``), never a patched private name."""
    assert "test_cli" in TESTS  # the check reads the tests
    bench = ("jaxoffload.bench", "jaxoffload.internal", "jaxoffload.__main__")
    reached = [r for r in _private_names_reached_by_tests() if r.split()[-1].startswith(bench)]
    assert len(reached) == 0, "\n".join(reached)


# Names that said another idea than their module's, or used a word of docs/design.md's
# "Words" in another meaning: renamed, and kept out.
RETIRED_MODULES = {"targets", "entry", "fitted", "measured", "traces", "steps", "schedule", "fit"}
RETIRED_NAMES = {
    "apart", "fit_peak", "FIT_ROUNDS", "HiddenPlan", "plan_hidden_offload", "plan_hidden",
    "PLANNED_STRATEGIES",
}  # fmt: skip


def test_retired_names_stay_retired():
    """docs/design.md's "Words": one meaning per word, in the modules' names too."""
    # jaxoffload._src.planner.fit keeps its name: a size that fits is what "fit" means.
    modules = [
        m
        for m in SOURCES
        if m.rpartition(".")[2] in RETIRED_MODULES and m != "jaxoffload._src.planner.fit"
    ]
    assert not modules, modules
    used = []
    for module, tree in {**SOURCES, **PROBES}.items():
        for node in ast.walk(tree):
            names = {
                ast.Name: lambda n: [n.id],
                ast.Attribute: lambda n: [n.attr],
                ast.arg: lambda n: [n.arg],
                ast.FunctionDef: lambda n: [n.name],
                ast.ClassDef: lambda n: [n.name],
                ast.alias: lambda n: [n.name.rpartition(".")[2], n.asname],
            }.get(type(node), lambda n: [])(node)
            used += [
                f"{module}:{getattr(node, 'lineno', '?')} {n}" for n in names if n in RETIRED_NAMES
            ]
    assert not used, "\n".join(used)
