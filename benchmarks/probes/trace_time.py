"""Seconds to trace and to lower a plain-Flax model's training step under three mixed plans,
then to trace it under uniform plans and as the plain model, each twice (caches warm the second).

    python benchmarks/probes/trace_time.py [MODEL] [BATCH] [IMAGE_SIZE]

Blocks take Lean(), Remat() and Store() in turn, shifted by one for each plan; shapes do
not change the trace, so a CPU answers for a GPU's batch. Tracing is what a planner pays
per compiled candidate before XLA starts, one candidate after another.
"""

import sys
import time

import jax

from jaxoffload import Lean, Plan, Remat, Store
from jaxoffload.bench.step import linen_model, training
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import discover, program

model = sys.argv[1] if len(sys.argv) > 1 else "flax-resnet50"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 256
size = int(sys.argv[3]) if len(sys.argv) > 3 else 224
w = Workload(model, batch, size, "bfloat16", "none")
m = linen_model(w, plannable=True)
_, state, b, _ = training(w, m, abstract=True)


def step(model, state, batch):
    return training(w, model, abstract=None)[0](state, batch)


start = time.perf_counter()
paths, _ = discover(m, step, (state, b), None)
print(f"found {len(paths)} blocks in {time.perf_counter() - start:.2f} s (every block Lean())")
kinds = (Lean(), Remat(), Store())
for shift in range(3):
    plan = Plan(tuple((p, kinds[(i + shift) % 3]) for i, p in enumerate(paths)), Lean())
    start = time.perf_counter()
    fun, arrays, donate = program(m, step, (state, b), plan, (0,))
    traced = jax.jit(fun, donate_argnums=donate).trace(*arrays)
    mid = time.perf_counter()
    traced.lower()
    print(
        f"plan {shift}: traced in {mid - start:.2f} s, lowered in {time.perf_counter() - mid:.2f} s"
    )

uniform = {
    "Store() x all, outside Store()": Plan(tuple((p, Store()) for p in paths), Store()),
    "Store() x all, outside Lean()": Plan(tuple((p, Store()) for p in paths), Lean()),
    "Lean() x all, outside Lean()": Plan(tuple((p, Lean()) for p in paths), Lean()),
    "Remat() x all, outside Lean()": Plan(tuple((p, Remat()) for p in paths), Lean()),
}
for label, plan in uniform.items():
    for _ in range(2):
        start = time.perf_counter()
        fun, arrays, donate = program(m, step, (state, b), plan, (0,))
        jax.jit(fun, donate_argnums=donate).trace(*arrays)
        print(f"{label}: traced in {time.perf_counter() - start:.2f} s")
plain = linen_model(w, plannable=False)
_, plain_state, plain_batch, _ = training(w, plain, abstract=True)
for _ in range(2):
    start = time.perf_counter()
    jax.jit(lambda s, b: step(plain, s, b)).trace(plain_state, plain_batch)
    print(f"the plain model: traced in {time.perf_counter() - start:.2f} s")
