"""Runs a probe with each fetched residual waited on at its first use. A probe, not a test.

    python benchmarks/probes/fetch_at_use.py PROBE.py [ARGS ...]
    python benchmarks/probes/fetch_at_use.py overlaps PROGRAM.hlo [...]

The library's backward pass puts an offloading call's fetched residuals through the barrier
that makes its recomputation wait for the cotangent (``transfers.recompute_after``), so the
call's backward pass starts only once every one of its fetches is done. A fetch is already
ordered after the cotangent (or, with ``fetch_window``, after a later call's) by the barrier
that starts it, so its value needs no second one: here only the values kept on the device go
through it, and XLA may wait for each fetch where the backward pass first reads it, under the
call's own convolutions. Then PROBE.py runs as it is: ``compile_probe.py`` (through
``deviceless.py run`` for the H200 without it) or ``overlap_probe.py`` on a GPU.

``overlaps`` reads scheduled programs that ``compile_probe.py --hlo`` wrote: for each copy to
the device of a MB or more, the library calls (convolutions, GEMMs) and kernels that the
schedule places between its start and its done.
"""

import re
import runpy
import sys

from jaxoffload.internal import device_bytes_of, transfers


def recompute_after(cotangent, saved, fetched):
    """``transfers.recompute_after`` with the fetched values left out of the barrier."""
    saved, cotangent = transfers.barrier_arrays((saved, cotangent))
    return saved, fetched, cotangent


def overlaps(path: str) -> list[tuple[int, int, int, int]]:
    """Per fetch of 1 MB or more: ``(bytes, library calls between, kernels between, start)``."""
    text = open(path).read()
    entry = re.search(r"\nENTRY [^\n]*\{\n(.*?)\n\}\n", text, re.S).group(1).split("\n")
    pattern = re.compile(
        r"(?:ROOT )?(%?[\w.\-]+) = (.*?) (copy-start|copy-done|custom-call|fusion)\(([^)]*)"
    )
    starts, kernels, found = {}, [], []
    for k, line in enumerate(entry):
        m = pattern.match(line.strip())
        if not m:
            continue
        name, shape, op, operands = m.groups()
        if op == "copy-start":
            starts[name] = k
        elif op == "copy-done":
            start = starts.get(operands.split(",")[0].strip())
            n = device_bytes_of(shape)  # 0 for a copy to the host, whose result is there
            if start is not None and n >= 2**20:
                found.append((n, start, k))
        else:
            kernels.append((k, op == "custom-call"))
    return [
        (n, sum(c for k, c in kernels if a < k < b), sum(a < k < b for k, _ in kernels), a)
        for n, a, b in found
    ]


if __name__ == "__main__":
    if sys.argv[1] == "overlaps":
        for path in sys.argv[2:]:
            rows = overlaps(path)
            under = sum(n for n, calls, *_ in rows if calls)
            print(f"{path}: {len(rows)} fetches, {sum(n for n, *_ in rows):,} bytes; "
                  f"{under:,} bytes with a library call before their done")  # fmt: skip
            for n, calls, kernels, start in rows:
                print(f"  {n:>13,} B from {start}: {calls} library calls, {kernels} kernels")
    else:
        transfers.recompute_after = recompute_after
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
