"""A plan's offloading blocks under other windows, compiled only: bytes, and kernels beside each copy.

    python benchmarks/probes/offload_windows.py PLAN.json OUT WINDOW[:FETCH] [WINDOW[:FETCH] ...]

Compiles the bench's plain-Flax model (``MODEL``, ``BATCH``; Flax's ResNet-50 at b256 by
default, 224², bf16) under PLAN.json as it is, and then with every ``Offload`` block's
``window`` (and ``fetch_window``, ``None`` without ``:FETCH``) replaced by each one given,
with the library's ``compiler_options()``. A copy hides only while kernels run beside it, so
for each host copy over 1 MB it writes how many kernels the schedule puts between its start
and its done. One JSON line a plan to stdout, and each variant's plan to
OUT/PLAN-wW[-fF].json for a GPU session to time. Nothing runs; ``deviceless.py run`` runs it
for the H200 on a machine without one.
"""

import dataclasses
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))
from overlap_probe import placements  # noqa: E402
from paper_point import compile_plan  # noqa: E402

import jaxoffload  # noqa: E402
from jaxoffload import Offload  # noqa: E402
from jaxoffload.internal import device_bytes_of  # noqa: E402

KERNEL = re.compile(r"= .* (fusion|custom-call)\(")


def compiled(plan, name, batch):
    """The step under ``plan``: its device bytes (arguments and temporaries) and its program."""
    _, c = compile_plan(plan.to_dict(), name, batch)
    m = c.memory_analysis()
    return m.argument_size_in_bytes + m.temp_size_in_bytes, c.as_text()


def beside(hlo):
    """``(direction, bytes, kernels between start and done)`` of each host copy over 1 MB, in
    the entry computation's order."""
    body = hlo[hlo.index("\nENTRY") :].split("\n")
    found = []
    for copy in placements(hlo):
        size = device_bytes_of(copy["shape"])
        if size >= 2**20:
            kernels = sum(bool(KERNEL.search(line)) for line in body[copy["start"] : copy["done"]])
            found.append(("fetch" if copy["fetch"] else "to host", size, kernels))
    return found


def main():
    path, out, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
    name = os.environ.get("MODEL", "flax-resnet50")
    batch = int(os.environ.get("BATCH", 256))
    os.makedirs(out, exist_ok=True)
    with open(path) as f:
        base = jaxoffload.Plan.from_dict(json.load(f))
    stem = os.path.splitext(os.path.basename(path))[0]
    variants = [("as given", base)]
    for spec in specs:
        window, _, fetch = spec.partition(":")
        fields = {"window": int(window), "fetch_window": int(fetch) if fetch else None}
        blocks = tuple(
            (p, dataclasses.replace(s, **fields) if isinstance(s, Offload) else s)
            for p, s in base.blocks
        )
        plan = dataclasses.replace(base, blocks=blocks)
        label = f"w{window}" + (f"-f{fetch}" if fetch else "")
        with open(os.path.join(out, f"{stem}-{label}.json"), "w") as f:
            json.dump(plan.to_dict(), f, indent=1)
        variants.append((label, plan))
    for label, plan in variants:
        got, hlo = compiled(plan, name, batch)
        print(json.dumps({"plan": stem, "variant": label, "device_bytes": got,
                          "copies": beside(hlo)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
