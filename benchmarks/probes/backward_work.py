"""Each block's backward pass as traced: the most bytes it holds at once, its residuals aside.

    python benchmarks/probes/backward_work.py MODEL:BATCH [MODEL:BATCH ...] > FILE.json

For the bench's plain-Flax MODEL at BATCH (224², bf16), each plannable block's backward
pass under ``Store`` (``jax.vjp``'s), walked in its traced order: the values it makes and
the cotangents it reads, each from its definition to its last use, nested calls at their
own peak. It is what the peak model could count as a block's backward work, in place of
its input and output (``peak.BACKWARD``); ``peak_loo.py --backward FILE`` refits the model
so. Traces only; compiles nothing. Writes ``{MODEL: [{"path", "bytes"}, ...]}``.
"""

import json
import sys

from jax.extend import core as jex_core

from jaxoffload.bench.planning import planning_inputs
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import discover, nbytes, struct_of, trace_vjp


def held_at_once(jaxpr, skip=frozenset()) -> int:
    """The most bytes alive at once in ``jaxpr``'s order, not counting ``skip``."""
    last = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jex_core.Var):
                last[v] = k
    for v in jaxpr.outvars:
        if isinstance(v, jex_core.Var):
            last[v] = len(jaxpr.eqns)
    live = {v: nbytes(v.aval) for v in jaxpr.invars if v not in skip and v in last}
    most = sum(live.values())
    for k, eqn in enumerate(jaxpr.eqns):
        nested = jex_core.jaxprs_in_params(eqn.params)
        inner = max((held_at_once(j) for j in nested), default=0)
        made = sum(nbytes(v.aval) for v in eqn.outvars)
        most = max(most, sum(live.values()) + max(inner, made))
        live.update({v: nbytes(v.aval) for v in eqn.outvars if v in last})
        for v in {v for v in eqn.invars if isinstance(v, jex_core.Var)}:
            if last.get(v) == k:
                live.pop(v, None)
    return most


def backward_work(model: str, batch: int) -> list[dict]:
    workload = Workload(model, batch, 224, "bfloat16", "none", block_costs="traced")
    flax_model, step, args, blocks = planning_inputs(workload)
    paths, calls = discover(flax_model, step, args, blocks)
    rows, seen = [], {}
    for path, call in zip(paths, calls):
        program = str(call.forward)
        if program not in seen:
            avals = [struct_of(v.aval, rebind=True) for v in call.forward.jaxpr.invars]
            traced = trace_vjp(jex_core.jaxpr_as_fun(call.forward), *avals)
            backward = traced.backward.jaxpr
            seen[program] = held_at_once(backward, set(backward.invars[: len(traced.residuals)]))
        rows.append({"path": path, "bytes": seen[program]})
    return rows


if __name__ == "__main__":
    found = {}
    for arg in sys.argv[1:]:
        model, batch = arg.split(":")
        found[model] = backward_work(model, int(batch))
    json.dump(found, sys.stdout, indent=1)
