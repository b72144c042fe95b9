"""Where does ``Offload`` lose time when it moves almost nothing? A GPU probe, not a test.

    python benchmarks/probes/construction_probe.py VARIANT OUT

Flax's ImageNet ResNet-50 (the bench's ``flax-resnet50``), b256, bf16, 224², every block under
``Lean()`` (VARIANT ``lean``) or ``Offload(window=2, max_bytes=10_000_000)`` (``off10``), which
moves only the blocks' small residuals. An ``off10`` variant can take parts of the construction
away, joined by ``-``: ``nogate`` (no call's outputs wait for earlier copies), ``noanchor`` (the
backward pass's cotangents wait for no token), ``nooutbar`` (the copies' token is no element
of the outputs), ``bare`` (all three), ``nopack`` (every value travels alone), ``nofdo`` (the
copies not priced for the scheduler), ``min1m`` (values under a MiB stay on the device: the
construction with nothing to move). A ``+nocb`` suffix turns XLA's command buffers off.

Each compiles with the in-flight limit 64 (and priced copies), runs 5 + 20 steps, traces 5
and writes OUT/VARIANT.json (``RUN`` suffixes it): the step's median, the compiled program's
counts, the traced busy times, and each kernel's traced time per step (``by_name_ns``), which
tell where the time went. Each variant runs in a process of its own.
"""

import collections
import glob
import gzip
import json
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
from overlap_probe import pipelined_ms  # beside this script

import jaxoffload
from jaxoffload import Lean, Offload
from jaxoffload.bench import models, workload
from jaxoffload.bench import step as bench_step
from jaxoffload.internal import transfers, with_copy_costs

LINK_GBPS = float(os.environ.get("LINK_GBPS", 52.0))


def take_apart(parts):
    """Replaces the parts of the construction that ``parts`` names with what does nothing."""
    if {"nogate", "bare"} & parts:
        move_out = transfers.move_out
        transfers.move_out = lambda out, saved, to_host, gates, window: move_out(
            out, saved, to_host, [], window
        )
    if {"noanchor", "bare"} & parts:
        transfers.after_tokens = lambda tree, tokens: tree
    if {"nooutbar", "bare"} & parts:
        transfers.scalar_of = lambda tree: transfers.empty_token()
    if "nopack" in parts:
        transfers.PACK_BELOW = 0


def kernel_times(folder, steps):
    """Each kernel's (and copy's) traced time per step, by the name the GPU tracer gives it."""
    path = max(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True),
               key=os.path.getmtime)  # fmt: skip
    times = collections.Counter()
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                for event in line.events:
                    times[event.name[:80]] += event.duration_ns / steps
    return dict(times.most_common(300))


def main(variant, out):
    name, _, cb = variant.partition("+")
    parts = set(name.split("-"))
    take_apart(parts)
    options = {"xla_gpu_experimental_parallel_async_compute_limit": 64}
    if cb == "nocb":
        options["xla_gpu_enable_command_buffer"] = ""
    w = workload.Workload(model="flax-resnet50", batch=256, image_size=224, dtype="bfloat16",
                          strategy="lean")  # fmt: skip
    min_bytes = 1 << 20 if "min1m" in parts else 0
    strategy = (
        Lean() if "lean" in parts else Offload(window=2, max_bytes=10_000_000, min_bytes=min_bytes)
    )
    model = models.create("flax-resnet50", strategy=(strategy,) * 16, dtype=jnp.bfloat16,
                          num_classes=1000)  # fmt: skip
    step, state, batch, _ = bench_step.training(w, model, abstract=False)
    lowered = jax.jit(step, donate_argnums=0).lower(state, batch)
    start = time.perf_counter()
    compiled = lowered.compile(options)
    priced = with_copy_costs(options, compiled.as_text(), LINK_GBPS)
    if priced != options and "nofdo" not in parts:  # no copies, no profile
        compiled = lowered.compile(priced)
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    tag = variant.replace("+", "_") + os.environ.get("RUN", "")
    with gzip.open(os.path.join(out, f"hlo-{tag}.txt.gz"), "wt") as f:
        f.write(text)
    holder = {"state": state}

    def run():
        holder["state"], loss = compiled(holder["state"], batch)
        return loss

    for _ in range(5):
        jax.block_until_ready(run())
    times = []
    for _ in range(20):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append((time.perf_counter() - start) * 1e3)
    pipelined, pipelined_times = pipelined_ms(compiled, holder, batch)
    folder = os.path.join(out, "trace-" + tag)
    overlap = jaxoffload.measure_overlap(run, steps=5, warmup=1, log_dir=folder)
    record = {
        "variant": variant,
        "step_ms": sorted(times)[len(times) // 2],
        "times": times,
        "pipelined_step_ms": pipelined,
        "pipelined_times": pipelined_times,
        "compile_s": compile_s,
        "peak_bytes_in_use": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
        "copy_starts": text.count("copy-start("),
        "fusions": len(re.findall(r"^\s*\S+ = \S+ fusion\(", text, re.M)),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
        **overlap.fields(),
        "kernels_in_step": sum(a.kind == "compute" for a in overlap.timeline),
        "by_name_ns": kernel_times(folder, steps=5),
    }
    with open(os.path.join(out, f"{tag}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(tag, {k: v for k, v in record.items() if k not in ("times", "by_name_ns")}, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
