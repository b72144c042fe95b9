"""A long training run under one strategy: is the step's memory and time steady?

    python benchmarks/probes/soak.py --model flax-resnet50 --strategy offload --batch 256 \
        --image-size 224 --dtype bfloat16 --steps 300 --out soak.json

Trains ``jaxoffload bench``'s workload for ``--steps`` steps on its fixed batch
and records, after every step, the loss, the step time, the device's
``bytes_in_use`` and ``peak_bytes_in_use`` (GPU), and the process's resident
memory. A leak shows as a peak or a resident size that still grows after the
first steps.
"""

import argparse
import datetime
import json
import resource
import sys
import time

import flax
import jax

import jaxoffload
from jaxoffload.bench.step import train_step
from jaxoffload.bench.workload import Workload


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def soak(workload: Workload, steps: int) -> list[dict]:
    step, state, batch, _ = train_step(workload)
    rows = []
    for n in range(1, steps + 1):
        start = time.perf_counter()
        state, loss = step(state, batch)
        loss = float(loss)  # waits for the step
        stats = jax.devices()[0].memory_stats() or {}
        rows.append(
            {
                "step": n,
                "loss": loss,
                "step_ms": (time.perf_counter() - start) * 1e3,
                "bytes_in_use": stats.get("bytes_in_use"),
                "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
                "rss_bytes": _rss_bytes(),
            }
        )
        if n % 50 == 0 or n == steps:
            print(f"step {n}: loss {loss:.4f}, {rows[-1]['step_ms']:.1f} ms", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flax-resnet18")
    parser.add_argument("--strategy", default="offload")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    workload = Workload(
        model=args.model,
        strategy=args.strategy,
        batch=args.batch,
        image_size=args.image_size,
        dtype=args.dtype,
    )
    rows = soak(workload, args.steps)
    device = jax.devices()[0]
    record = {
        "command": " ".join(["python", *sys.argv]),
        **workload.record_fields(),
        "device": device.device_kind,
        "jax_version": jax.__version__,
        "flax_version": flax.__version__,
        "jaxoffload_version": jaxoffload.__version__,
        "date": datetime.date.today().isoformat(),
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
