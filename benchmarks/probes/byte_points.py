"""Compiled bytes of many mixed plans, for calibrating models of a step's peak offline.

    OUT=folder [PLANS=40] [SEED=0] python benchmarks/probes/byte_points.py MODEL BATCH IMAGE_SIZE

Builds the planner of the bench's plain-Flax MODEL (traced block costs), then
compiles PLANS plans it would not propose by itself: random mixes of Store,
Lean, Remat and the blocks' hidden offloads, and runs of Remat from the first
or the last block. Writes OUT/points-MODEL-bBATCH-IMAGE_SIZE.json: every
block's bytes under each strategy, as :mod:`jaxoffload._src.planner.costs` traces
them, and every plan compiled, with its strategies (as ``brief`` writes them) and
compiled bytes (``jaxoffload.internal.compiled_points``; ``peak_loo.py`` reads it).
Compile-only apart from the planner's own few timed steps. A GPU tool, not a test.
"""

import json
import os
import sys
import time

import numpy as np

from jaxoffload import Lean, Plan, Remat, Store
from jaxoffload.bench.planning import planner_of
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import compiled_points

model, batch, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
count, seed = int(os.environ.get("PLANS", 40)), int(os.environ.get("SEED", 0))
w = Workload(model, batch, size, "bfloat16", "none", block_costs="traced")
start = time.perf_counter()


def say(line):
    print(f"[{time.perf_counter() - start:6.1f}] {line}", file=sys.stderr, flush=True)


P = planner_of(w, say)
n = len(P.paths)
rng = np.random.default_rng(seed)
hidden = [[o.strategy for o in options if o.strategy.max_bytes] for options in P.choices]


def plan(strategies, outside=None):
    return Plan(tuple(zip(P.paths, strategies)), outside or Lean())


plans = []
for k in range(1, n):  # runs of Remat from either end, the rest Lean
    if k % max(1, n // 6) == 0:
        plans.append(plan([Remat()] * k + [Lean()] * (n - k)))
        plans.append(plan([Lean()] * (n - k) + [Remat()] * k))
while len(plans) < count:
    shares = rng.dirichlet(np.ones(4))  # Store, Lean, Remat, a hidden offload
    picks = []
    for i in range(n):
        kind = rng.choice(4, p=shares)
        if kind == 3 and hidden[i]:
            picks.append(hidden[i][rng.integers(len(hidden[i]))])
        else:
            picks.append([Store(), Lean(), Remat(), Lean()][kind])
    plans.append(plan(picks, Store() if rng.random() < 0.2 else Lean()))
plans = list(dict.fromkeys(plans))[:count]


def write():
    points = {"model": model, "batch": batch, **compiled_points(P)}
    with open(os.path.join(os.environ["OUT"], f"points-{model}-b{batch}-{size}.json"), "w") as f:
        json.dump(points, f)


write()
for first in range(0, len(plans), 8):
    P.compile(plans[first : first + 8])
    write()
say(f"done: {len(P.compiled)} plans compiled")
