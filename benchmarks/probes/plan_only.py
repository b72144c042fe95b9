"""The bench's planning alone, from a cold compilation cache: what ``bench --budget`` plans.

    OUT=folder python benchmarks/probes/plan_only.py MODEL BATCH PEAK_BYTES SHARES

Plans the bench's plain-Flax MODEL at BATCH (224², bf16, ``--block-costs traced``)
for each share in SHARES (``0.75,0.5,0.35``) of PEAK_BYTES (Store's runtime
peak, from a bench record), as :func:`jaxoffload.bench.plan_budgets`
does, and writes a record to OUT (each budget's plan or why none
fits, the planning time, the plans compiled), named for MODEL and SHARES
(``planonly-flax-resnet50-0.75-0.5-0.35.json``). The planner's progress goes to
stderr; one line a budget to stdout. Its step times are the planner's own, timed
in this process: the bench measures each plan in a fresh one. With PER_ROUND=N in
the environment, each round compiles at most N candidates per budget instead of
``jaxoffload.plan``'s default (the file's name then ends ``-perN``). A GPU
tool, not a test.
"""

import json
import os
import sys
import time

from jaxoffload.bench.planning import plan_budgets
from jaxoffload.bench.workload import Workload

model, batch, peak = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
shares = [float(x) for x in sys.argv[4].split(",")]
w = Workload(
    model=model, batch=batch, image_size=224, dtype="bfloat16", strategy="none",
    block_costs="traced",
)  # fmt: skip
per_round = int(os.environ["PER_ROUND"]) if "PER_ROUND" in os.environ else None
start = time.perf_counter()
results = plan_budgets(w, [int(s * peak) for s in shares], per_round=per_round)
record = {
    "model": model,
    "batch": batch,
    "peak": peak,
    "shares": shares,
    "results": results,
    "commit": os.environ.get("JAXOFFLOAD_COMMIT"),
    "wall_s": time.perf_counter() - start,
    "per_round": per_round,
}
# Named for its budgets too, so that one OUT holds the runs of several.
name = f"planonly-{model}-" + "-".join(map(str, shares))
name += f"-per{per_round}" if per_round is not None else ""
with open(os.path.join(os.environ["OUT"], f"{name}.json"), "w") as f:
    json.dump(record, f, default=str)
for share, r in zip(shares, results):
    p = r.get("planned")
    if p is None:
        print(share, r.get("no_plan"), r.get("planning_s"))
        continue
    got, budget, said = p["compiled_bytes"], p["budget_bytes"], p["estimated_bytes"]
    print(
        f"{share}: compiled {got / 2**30:.2f} / budget {budget / 2**30:.2f} GiB "
        f"({got / budget:.0%}), estimated {said / 2**30:.2f} ({said / got - 1:+.0%}), "
        f"step {p['measured_step_ms']:.1f} ms, planning {r['planning_s']:.0f} s"
    )
