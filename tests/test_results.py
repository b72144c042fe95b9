"""benchmarks/results/ holds what the docs cite, each record listed in its MANIFEST, and nothing else.

Git keeps the runs that later ones replaced; the folder keeps the records behind the figures
that README.md, benchmarks/README.md and docs/design.md show now.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MANIFEST = (RESULTS / "MANIFEST.md").read_text()
DOCS = {
    "README.md": (ROOT / "README.md").read_text(),
    "benchmarks/README.md": (ROOT / "benchmarks" / "README.md").read_text(),
    "docs/design.md": (ROOT / "docs" / "design.md").read_text(),
}


def _records() -> list[str]:
    """The folder's records: a file, files of one name (``a.json``, ``a.png``), or a folder."""
    return sorted({p.name.split(".")[0] for p in RESULTS.iterdir() if p.name != "MANIFEST.md"})


def test_every_record_has_a_manifest_line():
    rows = [line for line in MANIFEST.splitlines() if line.startswith("| `")]
    missing = [name for name in _records() if not any(f"`{name}" in row for row in rows)]
    assert not missing, f"results without a MANIFEST line (command, commit, machine): {missing}"
    # Each line says the machine and the commit.
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] in ("H200", "H100", "CPU", "CPU, compiling for the H200"), row
        assert re.search(r"`[0-9a-f]{7}`", cells[2]), row


def test_every_record_is_cited_by_the_docs():
    uncited = [name for name in _records() if not any(name in d for d in DOCS.values())]
    assert not uncited, f"results that no doc cites (git keeps them; remove them): {uncited}"


def test_every_path_the_docs_cite_exists():
    # README.md names its records too (the test above counts them), in its own words.
    cited = [
        (doc, match.group(1).rstrip(".,;:)"))
        for doc in ("benchmarks/README.md", "docs/design.md")
        for match in re.finditer(r"(?:benchmarks/)?results/([\w./-]+)", DOCS[doc])
    ]
    assert cited
    missing = [f"{doc}: {path}" for doc, path in cited if not (RESULTS / path).exists()]
    assert not missing, missing
