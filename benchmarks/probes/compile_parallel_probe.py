"""Where compile time goes on a GPU: one block's programs in turn and at once, whole steps too.

    python benchmarks/probes/compile_parallel_probe.py MODEL BATCH WHOLE_STEPS(0|1) [plain-first]

With ``plain-first``, the plain step is compiled before the blocks' programs, as the planner
does, to see whether its autotuned kernels make the blocks' programs cheap to compile at once.

Prints timed lines; its output on the H200 is
benchmarks/results/compile-contention-resnet50-h200.log.
"""

import sys
import time

from jax.extend import core as jex_core

import jaxoffload
from jaxoffload import Lean, Plan, Remat, Store
from jaxoffload.bench.step import linen_model, training
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import (
    compile_all,
    default_options,
    discover,
    lower_step,
    struct_of,
    vjp_programs,
    without_host_placement,
)

T0 = time.perf_counter()


def say(s):
    print(f"[{time.perf_counter() - T0:6.1f}] {s}", flush=True)


model_name, batch, whole = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
w = Workload(model=model_name, batch=batch, image_size=224, dtype="bfloat16", strategy="none")
m = linen_model(w, plannable=True)
_, state, b, _ = training(w, m, abstract=True)


def step(model, state, batch):
    return training(w, model, abstract=None)[0](state, batch)


paths, calls = discover(m, step, (state, b), None)
first_of_each = {}  # the first call of each distinct block program
for call in calls:
    first_of_each.setdefault((str(call.forward), call.device_inputs), call)
distinct = list(first_of_each.values())
say(f"traced: {len(paths)} blocks, {len(distinct)} distinct")
strategies = list(dict.fromkeys(s.costed() for s in default_options()))


def lowered_of(call):
    out = []
    with without_host_placement():
        fun = jex_core.jaxpr_as_fun(call.forward)
        structs = [struct_of(v.aval, rebind=True) for v in call.forward.jaxpr.invars]
        for n, s in enumerate(strategies):
            wrapped = jaxoffload.wrap(fun, s, device_argnums=call.device_inputs)
            f, both, fa, ba = vjp_programs(wrapped, structs)
            if n == 0:
                out.append(("fwd", f.trace(*fa).lower()))
            out.append((repr(s)[:30], both.trace(*ba).lower()))
    return out


if sys.argv[4:] == ["plain-first"]:
    t = time.perf_counter()
    plain = Plan(tuple((p, Store()) for p in paths))
    lower_step(m, step, (state, b), plain, (0,)).compile()
    say(f"plain step compiled first: {time.perf_counter() - t:.1f}s")
t = time.perf_counter()
low = lowered_of(distinct[1])
say(f"block 1: lowered {len(low)} in {time.perf_counter() - t:.1f}s")
for name, lowered in low:
    t = time.perf_counter()
    lowered.compile()
    say(f"  serial compile {name}: {time.perf_counter() - t:.1f}s")
low = lowered_of(distinct[2])
t = time.perf_counter()
compile_all([x for _, x in low])
say(f"block 2: {len(low)} parallel: {time.perf_counter() - t:.1f}s")
low = lowered_of(distinct[3])
t = time.perf_counter()
[x.compile() for _, x in low]
say(f"block 3: {len(low)} serial total: {time.perf_counter() - t:.1f}s")
if whole:
    plans = [
        Plan(tuple((p, s) for p in paths), o)
        for s, o in [(Store(), Store()), (Lean(), Lean()), (Remat(), Lean()), (Lean(), Store())]
    ]
    t = time.perf_counter()
    ls = [lower_step(m, step, (state, b), p, (0,)) for p in plans]
    say(f"4 steps lowered {time.perf_counter() - t:.1f}s")
    t = time.perf_counter()
    ls[0].compile()
    say(f"step Store serial compile {time.perf_counter() - t:.1f}s")
    t = time.perf_counter()
    ls[1].compile()
    say(f"step Lean serial compile {time.perf_counter() - t:.1f}s")
    t = time.perf_counter()
    compile_all(ls[2:])
    say(f"2 steps parallel {time.perf_counter() - t:.1f}s")
    ls = [lower_step(m, step, (state, b), p, (0,)) for p in plans]
    t = time.perf_counter()
    compile_all(ls)
    say(f"4 steps parallel (fresh lowerings, caches warm) {time.perf_counter() - t:.1f}s")
