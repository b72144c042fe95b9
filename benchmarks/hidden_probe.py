"""Probe of VGG19's `offload-hidden` plans on a GPU: one variant per process, one JSON line each.

    python benchmarks/hidden_probe.py VARIANT

VARIANT is "lean1", "lean2" or "lean4" (`lean` at window 1, 2 or 4), "plan4" or
"plan2" (blocks 0, 8 and 12 offloaded, the rest `lean`, at window 4 or 2: the plan
that equal per-block compute shares gave), or "plan08" (blocks 0 and 8 at window 4,
which FLOP shares give). VGG19, batch 128, 224², bf16, the median of 20 steps. Lines
are appended to $OUT/hidden_probe.jsonl.
"""

import json
import os
import sys

from jaxoffload import benchmark

variant = sys.argv[1]
blocks = {"plan4": (0, 8, 12), "plan2": (0, 8, 12), "plan08": (0, 8)}.get(variant)
window = int(variant[-1]) if variant.startswith("lean") else {"plan2": 2}.get(variant, 4)
plan = None if blocks is None else tuple("offload" if i in blocks else "lean" for i in range(16))
workload = benchmark.Workload(
    "vgg19", 128, 224, "bfloat16", "lean" if plan is None else "offload-hidden",
    window=window, plan=plan,
)  # fmt: skip
record = benchmark.measure(workload, steps=20)
line = json.dumps(
    {
        "variant": variant,
        "ms": record["step_time_ms"],
        "temp": record["compiled_temp_bytes"],
        "peak": record["peak_bytes_in_use"],
    }
)
print(line, flush=True)
with open(os.path.join(os.environ["OUT"], "hidden_probe.jsonl"), "a") as f:
    f.write(line + "\n")
