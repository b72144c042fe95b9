"""Where XLA's scheduler puts each host copy's start, under different prices. A GPU probe.

    python benchmarks/probes/copy_start_probe.py PLAN.json OUT

Compiles Flax's ResNet-50 b256 step under the plan (``MODEL``/``BATCH`` as in
``overlap_probe.py``) with the in-flight limit of 64, once unpriced and then with each copy to
the host priced at its own bytes over the link (``own``), at 1 µs (``tiny``) and at 100 ms
(``huge``), fetches at the queue as the library prices them; with the library's prices as
latencies (``lat``); and with XLA's schedule-early rule on (``early``), unpriced and with
``lat``. No step runs. For each copy it
writes where its start and done sit in the scheduled program (instruction index) and the
index of the instruction that makes the copied value: OUT/copy-starts-PLAN.json.

    python benchmarks/probes/copy_start_probe.py --hlo OUT.json HLO.txt.gz ...

reads the same placements from programs that ``overlap_probe.py`` kept (its ``hlo-*.txt.gz``),
one entry per file, and compiles nothing (a CPU runs it).
"""

import gzip
import json
import os
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(__file__))
from overlap_probe import LINK_GBPS, as_latencies, out_at, placements, resnet50_training  # noqa: E402

from jaxoffload.internal import with_copy_costs  # noqa: E402

LIMIT = {"xla_gpu_experimental_parallel_async_compute_limit": 64}
# XLA's schedule-early rule (kDelayAsyncStartForCompute): it prefers compute over any async
# start that frees a resource, copy-starts included, so that starts go up to their producers.
EARLY = {
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
    "xla_gpu_experimental_collective_start_as_early_as_possible": True,
}


if sys.argv[1] == "--hlo":
    kept = {os.path.basename(f): placements(gzip.open(f, "rt").read()) for f in sys.argv[3:]}
    with open(sys.argv[2], "w") as f:
        json.dump(kept, f, indent=1)
    sys.exit()
plan, out = sys.argv[1], sys.argv[2]
variant, step, state, batch = resnet50_training(plan, abstract=True)
lowered = jax.jit(step, donate_argnums=0).lower(state, batch)
record = {}
t = time.perf_counter()
first = lowered.compile(LIMIT).as_text()
record["unpriced"] = {"compile_s": time.perf_counter() - t, "copies": placements(first)}
priced = with_copy_costs(dict(LIMIT), first, LINK_GBPS)
own = priced.get("fdo_profile", b"").decode()
variants = {  # label: (options beside the limit, the profile, or None for none)
    "early": (EARLY, None),  # the scheduler's schedule-early rule, which copy-starts fall under
}
if own:
    variants.update(
        own=({}, own), tiny=({}, out_at(1.0)(own, first)), huge=({}, out_at(100_000.0)(own, first)),
        lat=({}, as_latencies(own, first)), early_lat=(EARLY, as_latencies(own, first)),
    )  # fmt: skip
for label, (flags, profile) in variants.items():
    options = {**priced, **flags} if profile is not None else {**LIMIT, **flags}
    if profile is not None:
        options["fdo_profile"] = profile.encode()
    t = time.perf_counter()
    try:
        text = lowered.compile(options).as_text()
    except Exception as e:  # noqa: BLE001 (a flag this XLA lacks: say so, go on)
        record[label] = {"error": repr(e)[:500], "copies": []}
        continue
    record[label] = {"compile_s": time.perf_counter() - t, "copies": placements(text)}
for label, r in record.items():
    if "error" in r:
        print(label, r["error"], flush=True)
        continue
    d2h = [(c["made"], c["start"], c["done"]) for c in r["copies"] if not c["fetch"]]
    print(label, f"{r['compile_s']:.1f} s", "to host (made, start, done):", d2h, flush=True)
with open(os.path.join(out, f"copy-starts-{variant}.json"), "w") as f:
    json.dump(record, f, indent=1)
