"""The paper's point, compiled only: the fewest bytes each way of a plan under a share of Remat's peak.

    python benchmarks/probes/paper_point.py LIMIT_BYTES OUT [BLOCKS]

On the bench's plain-Flax model (``MODEL``, ``BATCH`` as in ``overlap_probe.py``; Flax's
ResNet-50 at b256 by default), every block under ``Remat()`` and the code outside them
``Lean()``, as the planner's uniform ``Remat()`` check is; then the same with the input of
blocks moved to the host (``Offload(recompute=True)``, which moves a block's input and
recomputes the rest in the backward pass), the blocks with the largest inputs first, one more
at a time, up to BLOCKS of them (default 6), until the compiled step (its arguments and
temporaries) is within LIMIT_BYTES. Each plan is compiled with the library's
``compiler_options()``, and nothing runs. Writes one JSON line a plan to stdout and the plans
to OUT/paper-N.json, for a GPU session to time. ``deviceless.py run`` runs it for the H200
on a machine without one.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp

import jaxoffload
from jaxoffload import Lean, Offload, Remat
from jaxoffload.bench import models
from jaxoffload.bench import step as bench_step
from jaxoffload.bench.planning import planning_inputs
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import analyze, discover, trace_blocks, traced_blocks


def compile_plan(plan_dict, name, batch, options=None):
    """The bench model ``name`` at ``batch`` (224², bf16) under the plan, its step traced from
    abstract arguments and compiled with ``options`` (the library's ``compiler_options()`` by
    default): ``(traced, compiled)``."""
    model = jaxoffload.Plan.from_dict(plan_dict).apply(
        models.plannable_model(name, dtype=jnp.bfloat16, num_classes=1000)
    )
    w = Workload(model=name, batch=batch, image_size=224, dtype="bfloat16", strategy="lean")
    step, state, data, _ = bench_step.training(w, model, abstract=True)
    traced = jax.jit(step, donate_argnums=0).trace(state, data)
    options = jaxoffload.compiler_options() if options is None else options
    return traced, traced.lower().compile(options)


def compiled(plan_dict, name, batch, options=None):
    """The plan's compiled step (:func:`compile_plan`): its device bytes (arguments and
    temporaries), and the host bytes its copies move each way."""
    traced, c = compile_plan(plan_dict, name, batch, options)
    m = c.memory_analysis()
    report = analyze(traced, c)
    return {
        "device_bytes": m.argument_size_in_bytes + m.temp_size_in_bytes,
        "to_host_bytes": report.device_to_host_bytes,
        "from_host_bytes": report.host_to_device_bytes,
    }


def main():
    limit, out = int(sys.argv[1]), sys.argv[2]
    most = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    name = os.environ.get("MODEL", "flax-resnet50")
    batch = int(os.environ.get("BATCH", 256))
    os.makedirs(out, exist_ok=True)
    # The blocks in call order, and the input each keeps on the device under Remat().
    w = Workload(model=name, batch=batch, image_size=224, dtype="bfloat16", strategy="none")
    paths, calls = discover(*planning_inputs(w))
    costs = traced_blocks(paths, calls, trace_blocks(calls, (Remat(),)), ms_per_flop=1.0)
    sizes = {b.path: b.cost(Remat()).input_bytes for b in costs}
    largest = sorted(paths, key=lambda p: -sizes[p])
    for n in range(most + 1):
        moved = set(largest[:n])
        blocks = [(p, Offload(recompute=True) if p in moved else Remat()) for p in paths]
        plan = jaxoffload.Plan(tuple(blocks), Lean()).to_dict()
        got = compiled(plan, name, batch)
        line = {"moved_blocks": sorted(moved), "input_bytes": sum(sizes[p] for p in moved), **got}
        line["within"] = got["device_bytes"] <= limit
        print(json.dumps(line), flush=True)
        with open(os.path.join(out, f"paper-{n}.json"), "w") as f:
            json.dump(plan, f, indent=1)
        if line["within"]:
            break


if __name__ == "__main__":
    main()
