"""Planner diagnosis in one process: block costs, plans at three budgets, and every compiled
plan with the model's bytes and ms beside the compiled bytes and the timed ms.

    OUT=folder [SHARES=0.75,0.5,0.35] python benchmarks/plan_probe.py MODEL BATCH IMAGE_SIZE

writes OUT/plan-MODEL-bBATCH-IMAGE_SIZE.jsonl (one JSON object a line: "block", "plan",
"noplan", "all" for every compiled plan after each budget, "cand" for the uniform plans and
two Lean variants) and prints timed progress lines on stderr. A GPU tool, not a test.
"""

import json
import os
import sys
import time

import jax

from jaxoffload import Lean, NoPlanFits, Offload, Plan, Remat, Store
from jaxoffload._src import timing
from jaxoffload._src.planner import search
from jaxoffload._src.planner.messages import summary
from jaxoffload._src.planner.program import device_bytes, lower_step
from jaxoffload.bench import benchmark

model, batch, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
w = benchmark.Workload(model=model, batch=batch, image_size=size, dtype="bfloat16", strategy="none")
m = benchmark.linen_model(w, plannable=True)
_, state, b, _ = benchmark.training(w, m, abstract=True)


def step(model, state, batch):
    return benchmark.training(w, model, abstract=None)[0](state, batch)


start = time.perf_counter()


def say(line):
    print(f"[{time.perf_counter() - start:6.1f}] {line}", file=sys.stderr, flush=True)


out = open(os.path.join(os.environ["OUT"], f"plan-{model}-b{batch}-{size}.jsonl"), "w")


def emit(**kw):
    out.write(json.dumps(kw) + "\n")
    out.flush()


def _mb(c):
    try:
        return P.model_bytes(c)
    except Exception:
        return None


def _ms(c):
    try:
        return P.estimated_ms(c)
    except Exception:
        return None


P = search.Planner(m, step, (state, b), None, runs=5, say=say, donate_argnums=(0,))
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


def dump(tag):
    for c in P.compiled:
        if c in P.measured_ms:
            emit(
                kind="all",
                tag=tag,
                summary=summary(c.strategies),
                outside=repr(c.outside),
                model_bytes=_mb(c),
                compiled=P.compiled[c],
                predicted=P.predicted.get(c),
                loo=P.predict(c) if _mb(c) is not None else None,
                model_ms=_ms(c),
                measured_ms=P.measured_ms[c],
            )


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
uniform = {"Store": P.plain}
for name, s in [
    ("Lean", Lean()),
    ("Remat", Remat()),
    ("Offload", Offload()),
    ("LeanSlow3", Lean(max_slowdown=0.03)),
    ("Lean0", Lean(max_recompute=0.0)),
]:
    outside = Store() if name == "Remat" else Lean()
    uniform[name] = Plan(tuple((p, s) for p in P.paths), outside)
if jax.default_backend() == "cpu":
    del uniform["Offload"]
extras = [uniform.pop("LeanSlow3"), uniform.pop("Lean0")]
P._compile(list(uniform.values()))

for c, ex in zip(
    extras,
    timing.compile_all([lower_step(P.model, P.step, P.args, c, P.donate_argnums) for c in extras]),
):
    P.executables[c] = ex
    P.compiled[c] = device_bytes(ex)
uniform["LeanSlow3"], uniform["Lean0"] = extras
for name, c in uniform.items():
    try:
        ms = P.step_ms(c)
    except Exception as e:
        ms = str(e)[:200]
    emit(
        kind="cand",
        name=name,
        summary=summary(c.strategies),
        outside=repr(c.outside),
        model_bytes=_mb(c),
        predicted=P.predicted.get(c),
        compiled=P.compiled[c],
        model_ms=_ms(c),
        measured_ms=ms,
    )
    say(
        f"{name}: {summary(c.strategies)} compiled {P.compiled[c] / 2**30:.2f} GiB, model {(_mb(c) or 0) / 2**30:.2f}, ms {ms}"
    )
dump("end")
say("done")
