"""Planner diagnosis in one process: block costs, plans at three budgets, and every compiled
plan with the model's bytes and ms beside the compiled bytes and the timed ms.

    OUT=folder [SHARES=0.75,0.5,0.35] [BLOCK_COSTS=timed|traced] \
        python benchmarks/probes/plan_probe.py MODEL BATCH IMAGE_SIZE

writes OUT/plan-MODEL-bBATCH-IMAGE_SIZE.jsonl (one JSON object a line: "block", "plan",
"noplan", "all" for every compiled plan after each budget, "cand" for the uniform plans and
two Lean variants) and prints timed progress lines on stderr. A GPU tool, not a test.
"""

import json
import os
import sys
import time

from jaxoffload import Lean, NoPlanFits
from jaxoffload.bench.planning import planner_of
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import brief, compile_all, device_bytes, lower_step, step_ms, summary

model, batch, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
costs = os.environ.get("BLOCK_COSTS", "timed")
w = Workload(model, batch, size, "bfloat16", "none", block_costs=costs)
start = time.perf_counter()


def say(line):
    print(f"[{time.perf_counter() - start:6.1f}] {line}", file=sys.stderr, flush=True)


out = open(os.path.join(os.environ["OUT"], f"plan-{model}-b{batch}-{size}.jsonl"), "w")


def emit(**kw):
    out.write(json.dumps(kw) + "\n")
    out.flush()


P = planner_of(w, say)
for blk in P.blocks:
    for s, c in blk.costs.items():
        emit(
            kind="block",
            path=blk.path,
            strategy=repr(s),
            device=c.device_bytes,
            inp=c.input_bytes,
            outp=c.output_bytes,
            host=c.host_bytes,
            recompute=c.recompute_bytes,
            fwd=c.forward_ms,
            bwd=c.backward_ms,
            spread=c.spread,
            edges=(blk.input_bytes, blk.output_bytes),
        )
emit(kind="front", n=len(P.front), options=[[repr(o.strategy) for o in ch] for ch in P.choices[:1]])


def fields(c):
    """What the model said of a compiled plan, beside what it compiled to."""
    return dict(
        summary=summary(c.strategies),
        outside=repr(c.outside),
        model_bytes=P.model_bytes(c),
        compiled=P.compiled[c],
        loo=P.predict(c),
        model_ms=P.estimated_ms(c),
    )


def dump(tag):
    for c in P.compiled:
        if c in P.measured_ms:
            emit(kind="all", tag=tag, **fields(c), measured_ms=P.measured_ms[c])


dump("init")
plain = P.compiled[P.plain]
say(f"plain compiled {plain / 2**30:.2f} GiB")
for share in [float(x) for x in os.environ.get("SHARES", "0.75,0.5,0.35").split(",")]:
    try:
        p = P.plan_for(int(share * plain))
        emit(kind="plan", share=share, plan=p.to_dict(), planning_s=time.perf_counter() - start)
        dump(f"after{share}")
    except NoPlanFits as e:
        emit(kind="noplan", share=share, msg=str(e))
say("uniform plans, and Lean(max_slowdown=0.03) and Lean(max_recompute=0.0)")
for s in P.options:
    # The planner compiled these to calibrate its model by.
    if s.window == 1 and s.max_bytes is None:
        c = P.uniform(s)
        P.compile([c])
        emit(kind="cand", name=brief(s), **fields(c), measured_ms=P.step_ms(c))
# The Lean variants are no options of the planner's: timed here, kept out of its compiled plans.
extras = [P.uniform(Lean(max_slowdown=0.03)), P.uniform(Lean(max_recompute=0.0))]
executables = compile_all(
    [lower_step(P.model, P.step, P.args, c, P.donate_argnums) for c in extras]
)
for c, ex in zip(extras, executables):
    got, ms = device_bytes(ex), step_ms(ex, P.arrays, 3)
    name = summary(c.strategies)
    emit(kind="cand", name=name, summary=name, compiled=got, measured_ms=ms)
    say(f"{name}: compiled {got / 2**30:.2f} GiB, {ms:.1f} ms")
dump("end")
say("done")
