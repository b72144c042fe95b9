"""Where a traced step's kernels wait, and which copies run then. Reads records, not a GPU.

    python benchmarks/probes/timeline_gaps.py RECORD.json [RECORD.json ...] [--min-us 15]

Each RECORD is an ``overlap_probe.py`` record with its ``timeline`` (one traced step: each
kernel and copy as ``[kind, start_ns, end_ns, name, bytes]``). Prints the step's span, the
kernels' busy and idle time, each idle gap of at least ``--min-us`` with the kernels on either
side and the copies that ran in it, and each copy's span.
"""

import argparse
import json


def merged(intervals):
    """The union of ``(start, end)`` intervals, sorted."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def report(path, min_ns):
    timeline = json.load(open(path))["timeline"]
    kernels = sorted((a[1], a[2], a[3]) for a in timeline if a[0] == "compute")
    copies = [a for a in timeline if a[0] != "compute"]
    busy = merged([(start, end) for start, end, _ in kernels])
    gaps = [(a[1], b[0]) for a, b in zip(busy, busy[1:])]
    print(
        f"{path}: span {busy[-1][1] / 1e6:.2f} ms, kernels busy "
        f"{sum(e - s for s, e in busy) / 1e6:.2f} ms, idle {sum(e - s for s, e in gaps) / 1e6:.2f} ms"
    )
    for start, end in gaps:
        if end - start < min_ns:
            continue
        before = max((k for k in kernels if k[1] <= start), key=lambda k: k[1], default=None)
        after = min((k for k in kernels if k[0] >= end), default=None)
        during = [
            f"{c[0]} {(min(c[2], end) - max(c[1], start)) / 1e3:.0f} us"
            for c in copies
            if c[1] < end and c[2] > start
        ]
        print(
            f"  idle {(end - start) / 1e3:.0f} us from {start / 1e6:.2f} ms, after "
            f"{before[2] if before else '-'}, before {after[2] if after else '-'}; copies: "
            f"{', '.join(during) or 'none'}"
        )
    for kind, start, end, name, nbytes in sorted(copies, key=lambda c: c[1]):
        print(f"  {kind} {start / 1e6:.2f}-{end / 1e6:.2f} ms, {nbytes:,} B ({name})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+")
    parser.add_argument("--min-us", type=float, default=15)
    args = parser.parse_args()
    for path in args.records:
        report(path, args.min_us * 1e3)
