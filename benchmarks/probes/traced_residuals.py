"""What a model's blocks keep under Store() and Lean(), from traces alone (no device memory).

    python benchmarks/probes/traced_residuals.py MODEL BATCH IMAGE_SIZE

Every block takes the strategy, and the code outside them Lean() (so that Store() blocks are
StoredCalls); the residuals of every call are summed, leaving out the Module variables that
are kept anyway. The outside is the same in both. Runs on a CPU: a check of the lean cut, not
of XLA's buffers.
"""

import functools
import sys

import jaxoffload
from jaxoffload import Lean, Plan, Store
from jaxoffload.bench.step import linen_model, training
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import discover

model_name, batch, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
w = Workload(model=model_name, batch=batch, image_size=size, dtype="bfloat16", strategy="none")
model = linen_model(w, plannable=True)
_, state, images, _ = training(w, model, abstract=True)


def step(model, state, batch):
    return training(w, model, abstract=None)[0](state, batch)


paths, _ = discover(model, step, (state, images), None)
kept = {}
for strategy in (Store(), Lean()):
    plan = Plan(tuple((p, strategy) for p in paths), Lean())
    calls = jaxoffload.offloaded_calls(functools.partial(step, plan.apply(model)), state, images)
    blocks = calls[1:-1]  # the outside's first and last regions are not blocks
    kept[strategy] = sum(r.nbytes for c in blocks for r in c.residuals if "variable" not in str(r))
print(
    f"{model_name} b{batch} {size}²: {len(paths)} blocks; with Store() blocks the step keeps {kept[Store()]:,} B, "
    f"Lean() {kept[Lean()]:,} B ({kept[Lean()] / kept[Store()]:.2f} of Store's)"
)
