"""Where one step's kernel time goes beside another's. Reads records, not a GPU.

    python benchmarks/probes/kernel_diff.py A.json B.json [--top 25]

A and B are ``overlap_probe.py`` records (``store.json``, ``lean.json``: one model, two
variants, each traced in a process of its own) with their ``kernel_ms``: each kind of kernel's
ms in the median traced step, XLA's fusions named without their numbers. Prints each step's
kernel time (the sum of its kernels' times: kernels that run at once on several streams count
each), and the kinds of kernel whose time differs most between them, B's minus A's.
It says where a strategy's extra time goes (``Lean()`` against ``Store()`` on a ConvNeXt, for
instance): fusion kinds that recompute, or library kernels that run slower.
"""

import argparse
import json


def differences(a, b):
    """``[(kind, a_ms, b_ms, a_count, b_count)]`` of every kind of kernel in either, by
    how far B's time is from A's, the farthest first."""
    none = (0.0, 0)
    rows = [(k, a.get(k, none)[0], b.get(k, none)[0], a.get(k, none)[1], b.get(k, none)[1])
            for k in set(a) | set(b)]  # fmt: skip
    return sorted(rows, key=lambda r: -abs(r[2] - r[1]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    a, b = (json.load(open(p)) for p in (args.a, args.b))
    for name, rec in ((args.a, a), (args.b, b)):
        if "kernel_ms" not in rec:
            raise SystemExit(
                f"{name} has no kernel_ms: a record of overlap_probe.py from before it"
            )
        total = sum(ms for ms, _ in rec["kernel_ms"].values())
        step = rec.get("pipelined_step_ms", float("nan"))
        print(f"{name}: step {step:.2f} ms, kernels' times summed {total:.2f} ms")
    print(f"{'B - A ms':>9} {'A ms':>8} {'B ms':>8} {'A n':>5} {'B n':>5}  kernel")
    for kind, a_ms, b_ms, a_n, b_n in differences(a["kernel_ms"], b["kernel_ms"])[: args.top]:
        print(f"{b_ms - a_ms:+9.3f} {a_ms:8.3f} {b_ms:8.3f} {a_n:5d} {b_n:5d}  {kind[:100]}")


if __name__ == "__main__":
    main()
