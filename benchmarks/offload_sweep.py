"""Offload the first k blocks of a model and measure device memory and step time.

Each variant runs in its own process (``jaxoffload.benchmark``), so that
``peak_bytes_in_use`` is that variant's alone. After reading its peak, each
process compares its gradient with the plain model's (k = 0) on the same batch.

    python benchmarks/offload_sweep.py --out benchmarks/results/vgg19_offload_sweep_h200.json
    python benchmarks/offload_sweep.py --model vgg11 --batch 2 --image-size 32   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jaxoffload import benchmark, models


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vgg19", choices=models.MODEL_NAMES)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--dtype", default="bfloat16", choices=benchmark.DTYPES)
    p.add_argument("--ks", default="0,4,8,12,16", help="numbers of leading blocks to offload")
    p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure nn.remat on every block")  # fmt: skip
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--out", default=None, help="JSON file for the records")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    common = dict(model=args.model, batch=args.batch, image_size=args.image_size, dtype=args.dtype)
    workloads = [
        benchmark.Workload(**common, strategy="none" if k == 0 else "offload-plain", blocks=k)
        for k in map(int, args.ks.split(","))
    ]
    if args.remat:
        workloads.append(benchmark.Workload(**common, strategy="remat"))
    if workloads[0].strategy != "none":
        raise SystemExit("--ks must start with 0: k = 0 is the gradient reference.")

    def on_start(w):
        print(f"[{time.strftime('%H:%M:%S')}] {w.strategy} k={w.blocks} ...", file=sys.stderr)

    records = benchmark.measure_all(workloads, steps=args.steps, on_start=on_start)
    command = "python benchmarks/offload_sweep.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    for r in records:
        r["command"] = command
    print_table(records)
    write(args.out, records)


def write(path: str | None, records: list[dict]) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(records, f, indent=1)
            f.write("\n")


def print_table(records: list[dict]) -> None:
    gib = lambda b: f"{b / 2**30:.2f}" if b is not None else "-"  # noqa: E731
    print(
        f"{'strategy':9} {'k':>3} {'temp GiB':>9} {'host GiB':>9} {'peak GiB':>9} "
        f"{'d2h':>5} {'h2d':>5} {'step ms':>8} {'grad err':>9}"
    )
    for r in records:
        print(
            f"{r['strategy']:9} {r['offloaded_blocks']:>3} {gib(r['compiled_temp_bytes']):>9} "
            f"{gib(r['compiled_host_temp_bytes']):>9} {gib(r['peak_bytes_in_use']):>9} "
            f"{r['device_to_host_copies']:>5} {r['host_to_device_copies']:>5} "
            f"{r['step_time_ms']:>8.1f} {r['grad_rel_err']:>9.2e}"
        )


if __name__ == "__main__":
    main()
