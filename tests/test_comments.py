"""No measured figures in the package's comments and docstrings: they go stale there.

A figure measured on one machine at one commit belongs beside its record: docs/design.md
cites the record under benchmarks/results/ (listed in its MANIFEST.md). Comments say why.
Read with ``tokenize`` (comments) and ``ast`` (docstrings), so code and strings are not read.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxoffload"

# A number, or a range of two, followed by a unit of time, memory or bandwidth. Seconds need a
# space before the ``s`` ("30 s"), so that a decade ("the 2020s") or a name ("b2s") is no figure.
FIGURE = re.compile(
    r"(?<![\w.])\d[\d.,_]*(?:\s*(?:-|–|to)\s*\d[\d.,_]*)?"
    r"(?:\s*(?:ms|GiB|MiB|GB/s|GB|MB)(?![\w/])|\s+s\b)"
)

# (file under jaxoffload/, text): figures that are no measurement. Keep this short.
NOT_MEASURED = {
    # A budget string a user may write, in the docstring of the hint that answers it.
    ("_src/planner/budget.py", "8 GiB"),
}


def _comments_and_docstrings(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and every module, class and function docstring."""
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                found.append((node.body[0].lineno, docstring))
    return found


def measured_figures(package: pathlib.Path) -> list[str]:
    """``file:line: figure`` for each figure in the comments and docstrings under ``package``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        where = path.relative_to(package).as_posix()
        for line, text in _comments_and_docstrings(path.read_text()):
            for match in FIGURE.finditer(text):
                if (where, match.group(0)) not in NOT_MEASURED:
                    found.append(f"{where}:{line}: {match.group(0)!r}")
    return found


_SAMPLE = """
took 17 ms, held 0.2 GiB at 52 GB/s in 30 s; import jax (10-15 s), traced in 3.3 to 2.5 s;
430 MiB. Not these: "A ConvNet for the 2020s", b2s, 16 * 2**30, the 3x3 stem, 5% or 1e-3.
"""


def test_the_pattern_finds_figures_and_only_figures():
    found = [m.group(0) for m in FIGURE.finditer(_SAMPLE)]
    assert found == ["17 ms", "0.2 GiB", "52 GB/s", "30 s", "10-15 s", "3.3 to 2.5 s", "430 MiB"]


def test_no_measured_figure_in_comments_or_docstrings():
    found = measured_figures(PACKAGE)
    assert not found, (
        "measured figures in comments or docstrings (cite a record in docs/design.md instead):\n"
        + "\n".join(found)
    )


def test_every_allowed_figure_is_still_there():
    """An allow-list entry whose text has gone is stale: it would hide the next figure there."""
    for where, text in NOT_MEASURED:
        texts = _comments_and_docstrings((PACKAGE / where).read_text())
        assert any(text in t for _, t in texts), (where, text)
