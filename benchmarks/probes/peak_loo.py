"""Each compiled plan's bytes as the peak model fitted to all the others predicts them.

    python benchmarks/probes/peak_loo.py POINTS.json [POINTS.json ...] [-v] [--backward FILE]

POINTS is what :func:`jaxoffload.internal.compiled_points` writes: a planner's blocks (each
strategy's traced bytes) and every plan it compiled, with its compiled bytes.
``deviceless.py plan --points`` and ``byte_points.py`` write such files, and a bench's
``records.json`` keeps one under a plan record's ``planner_points`` (read from there too;
records from before the blocks' bytes were written whole kept each option's kept bytes
alone, which this cannot read). For every plan, the library's
:func:`~jaxoffload._src.planner.peak.calibrate_peak` is fitted to all the other plans and
predicts it: the errors, by whether a plan moves bytes, say how well the model's structure
holds on that family. ``-v`` lists each plan. ``--backward FILE`` (what ``backward_work.py``
writes) counts each block's backward work as its traced backward pass holds it, in place of
its input and output. Reads JSON only; compiles nothing.
"""

import json
import sys

import numpy as np

from jaxoffload import Lean, Offload, Remat, Store
from jaxoffload.internal import (
    BACKWARD,
    BlockCost,
    BlockCosts,
    brief,
    calibrate_peak,
    cap_key,
    live_bytes,
)

KINDS = {"Lean": Lean, "Offload": Offload, "Remat": Remat, "Store": Store}


def strategy(text):
    """A strategy from what ``brief`` wrote: ``Offload(window=2)``."""
    return eval(text, {"__builtins__": {}}, KINDS)  # noqa: S307 (our own files' constructor calls)


def blocks_of(points):
    """The planner's blocks, as far as :func:`live_bytes` reads them."""
    blocks = []
    for b in points["blocks"]:
        costs, capped = {}, {}
        for name, c in b["costs"].items():
            s = strategy(name)
            cost = BlockCost(c["device"], c["input"], c["output"], c["host"], c["recompute"], 0, 0)
            if s.max_bytes is None:
                costs[s] = cost
            else:
                capped[cap_key(s)] = cost
        blocks.append(BlockCosts(b["path"], *b["edges"], costs, capped=capped))
    return blocks


def with_backward(live, blocks, work):
    """``live`` (:func:`live_bytes`'s points) with each block's backward work ``work[i]``
    where the library counts its input and output."""
    n = len(blocks)
    for i, point in zip(reversed(range(n)), live[n:]):
        point[BACKWARD] += work[i] - blocks[i].input_bytes - blocks[i].output_bytes
    return live


def errors(points, verbose=False, work=None):
    """Each plan's ``(error, moves)``: predicted from the others over compiled, less 1."""
    blocks = blocks_of(points)
    plans = [
        ([strategy(s) for s in p["strategies"]], strategy(p["outside"]), p["compiled_bytes"])
        for p in points["plans"]
    ]
    fitted = [
        (
            with_backward(live_bytes(blocks, st), blocks, work) if work else live_bytes(blocks, st),
            out.is_identity,
            any(s.to_host for s in st),
            got,
        )
        for st, out, got in plans
    ]
    scale = float(max(got for *_, got in fitted))
    found = []
    for n, (live, stores, moves, got) in enumerate(fitted):
        model = calibrate_peak(fitted[:n] + fitted[n + 1 :], scale)
        found.append((model(live, stores) / got - 1, moves))
        if verbose:
            st, out, _ = plans[n]
            print(f"  {got / 2**30:7.3f} GiB {found[-1][0]:+6.1%}  {' '.join(map(brief, st))}"
                  f" | outside {brief(out)}")  # fmt: skip
    return found


def main():
    args = sys.argv[1:]
    verbose = "-v" in args
    backward = None
    if "--backward" in args:
        k = args.index("--backward")
        with open(args[k + 1]) as f:
            backward = json.load(f)
        del args[k : k + 2]
    for path in (a for a in args if a != "-v"):
        with open(path) as f:
            points = json.load(f)
        if isinstance(points, list):  # a bench's records: the plans' planner points
            points = next(r["planner_points"] for r in points if r.get("planner_points"))
        work = None
        if backward is not None:
            by_path = {row["path"]: row["bytes"] for row in backward[points["model"]]}
            work = [by_path[p] for p in points["paths"]]
        found = errors(points, verbose, work)
        line = f"{path}: {len(found)} plans"
        for label, keep in (("all", None), ("staying", False), ("moving", True)):
            e = np.abs([err for err, moves in found if keep is None or moves == keep])
            if len(e):
                line += f"; {label} {len(e)}: mean {e.mean():.1%}, max {e.max():.1%}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
