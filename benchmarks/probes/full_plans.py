"""Full-offload plans with per-block fetch windows, for a GPU session to time. A CPU tool, not a test.

    python benchmarks/probes/full_plans.py MODEL BATCH OUT [WINDOW]

Traces the bench's plain-Flax MODEL at BATCH (224², bf16) on any machine, reads what each
plannable block moves under ``Offload()``, and writes two plans to OUT, every block under
``Offload(window=WINDOW)`` (default 1) and the code outside them ``Lean()``:

- ``MODEL-full-wWINDOW.json``: every fetch as its own block's backward pass starts;
- ``MODEL-fetch-ahead-wWINDOW.json``: a block's fetch one block ahead (``fetch_window=2``)
  where it and the block fetched before it move no more together than the block that moves
  the most: fetching ahead then holds no more than that block's fetch holds alone.

On ResNet-50 b256 the second is ``plans/fullfw4.json`` but for the last block; ``fullfw3`` (one block more) ran at a
lower runtime peak on the H200 (``docs/design.md``, "Copies that hide"), so the rule is a
start, to be measured per model.
"""

import json
import os
import sys

from jaxoffload import Lean, Offload, Plan
from jaxoffload.bench.planning import planning_inputs
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import discover, trace_blocks, traced_blocks

model_name, batch, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
window = int(sys.argv[4]) if len(sys.argv) > 4 else 1
w = Workload(model=model_name, batch=batch, image_size=224, dtype="bfloat16", strategy="none")
model, step, args, blocks = planning_inputs(w)
paths, calls = discover(model, step, args, blocks)
costs = traced_blocks(paths, calls, trace_blocks(calls, (Offload(),)), ms_per_flop=1.0)
moved = [b.cost(Offload()).host_bytes for b in costs]
largest = max(moved)
# Block i's fetch ahead holds it beside block i + 1's, which is fetched before it.
ahead = [i + 1 < len(moved) and moved[i] + moved[i + 1] <= largest for i in range(len(moved))]
os.makedirs(out, exist_ok=True)
for name, fetch in (("full", [1] * len(moved)), ("fetch-ahead", [2 if a else 1 for a in ahead])):
    choices = [Offload(window=window, fetch_window=f) for f in fetch]
    path = os.path.join(out, f"{model_name}-{name}-w{window}.json")
    Plan(tuple(zip(paths, choices)), Lean()).save(path)
    print(path)
print(json.dumps({"blocks": paths, "moved_bytes": moved, "fetch_ahead": ahead}))
