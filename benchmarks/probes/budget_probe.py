"""Budgets as a user's script reads them: a script that keeps an undonated copy of its initial
state, planned at shares of its Store step's runtime peak, each plan run in a fresh process.

    OUT=folder python benchmarks/probes/budget_probe.py MODEL BATCH [SHARES] [IMAGE_SIZE]

Every process makes the bench's plain-Flax (linen) MODEL's state and batch on the device
(bf16, 224² by default) and keeps an undonated copy of the state, as users' scripts often
do. The first runs the plain step (Store), donated, 5 times: its runtime peak. The second
calls ``jaxoffload.plan`` at SHARES (default 0.75,0.5,0.35) of that peak, in bytes, and
the planner reads what the process holds besides the step (``memory_stats``); and, for
comparison, at the same shares as floats, which it takes of the plain step's peak as the
process sees it. Then each plan runs in a fresh process of its own, and its runtime peak
is read against its ``budget_bytes``. Writes OUT/budget-MODEL-bBATCH.json; one line a plan
to stdout. A GPU tool, not a test: a CPU reports no runtime peak.
"""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

import jaxoffload
from jaxoffload.bench.step import linen_model, training
from jaxoffload.bench.workload import Workload


def user_script(workload):
    """The model, its step, and its state and batch on the device, with a copy of the state
    that nothing donates."""
    model = linen_model(workload, plannable=True)
    step_of, state, batch, _ = training(workload, model, abstract=False)

    def step(model, state, batch):  # as jaxoffload.plan takes it: the model first
        return training(workload, model, abstract=None)[0](state, batch)

    initial = jax.tree.map(jnp.copy, state)  # kept, say, to restart from
    jax.block_until_ready((state, batch, initial))
    return model, step, state, batch, initial


def run(workload, planned):
    """The runtime peak of 5 donated steps under ``planned`` (``None``: the plain step)."""
    model, step, state, batch, initial = user_script(workload)
    if planned is not None:
        model = jaxoffload.Plan.from_dict(planned).apply(model)
    jitted = jax.jit(functools.partial(step, model), donate_argnums=0)
    for _ in range(5):
        state, loss = jitted(state, batch)
    jax.block_until_ready((loss, initial))
    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def plan(workload, budgets):
    model, step, state, batch, _ = user_script(workload)
    found = jaxoffload.plan(
        model, step, state, batch, budget=budgets, donate_argnums=0, block_costs="traced"
    )
    return [p.to_dict() if isinstance(p, jaxoffload.Plan) else str(p) for p in found]


def child(*args):
    done = subprocess.run(
        [sys.executable, __file__, *args], check=True, stdout=subprocess.PIPE, text=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


if sys.argv[1] == "--child":
    workload = Workload(**json.loads(sys.argv[3]))
    given = json.loads(sys.argv[4])
    print(json.dumps(run(workload, given) if sys.argv[2] == "run" else plan(workload, given)))
    sys.exit()

model_name, batch_size = sys.argv[1], int(sys.argv[2])
shares = [float(s) for s in (sys.argv[3] if len(sys.argv) > 3 else "0.75,0.5,0.35").split(",")]
size = int(sys.argv[4]) if len(sys.argv) > 4 else 224
w = {"model": model_name, "batch": batch_size, "image_size": size, "dtype": "bfloat16"}
w = json.dumps({**w, "strategy": "none"})
store = child("--child", "run", w, "null")
if store is None:
    sys.exit(f"this {jax.default_backend()} device reports no runtime peak: run it on a GPU.")
budgets = [int(s * store) for s in shares] + shares
plans = child("--child", "plan", w, json.dumps(budgets))
results = []
for budget, share, planned in zip(budgets, shares * 2, plans):
    if isinstance(planned, str):  # no plan fits: its message
        results.append({"budget": budget, "share": share, "no_plan": planned})
        print(f"{budget}: {planned}")
        continue
    peak = child("--child", "run", w, json.dumps(planned))
    results.append({"budget": budget, "share": share, "peak": peak, "planned": planned})
    limit = planned["budget_bytes"]
    print(
        f"{budget!r:>12} ({share} of Store's {store / 2**30:.2f} GiB runtime peak): budget "
        f"{limit / 2**30:.2f} GiB = compiled {planned['compiled_bytes'] / 2**30:.2f} + held "
        f"{planned['held_bytes'] / 2**30:.2f}; runtime peak {peak / 2**30:.2f} GiB, "
        + ("within" if peak <= limit else "OVER")
        + f"; {share} of Store's runtime peak: {'within' if peak <= share * store else 'OVER'}"
    )
record = {"store_peak": store, "shares": shares, "results": results}
with open(os.path.join(os.environ["OUT"], f"budget-{model_name}-b{batch_size}.json"), "w") as f:
    json.dump(record, f, default=str)
