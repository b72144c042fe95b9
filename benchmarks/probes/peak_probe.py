"""Where a measuring process's runtime peak comes from: making the state, compiling, or the step.

    python benchmarks/probes/peak_probe.py MODEL BATCH STRATEGY CACHE_DIR|-

With CACHE_DIR, compiled programs go to (and come from) jax's persistent cache there: run it
twice, and the second process loads the step rather than compile (and autotune) it.
"""

import sys
import time

import jax

from jaxoffload.bench.step import train_step
from jaxoffload.bench.workload import Workload

model, batch, strategy, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
if cache != "-":
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
device = jax.devices()[0]
start = time.perf_counter()


def say(what):
    stats = device.memory_stats()
    print(
        f"{time.perf_counter() - start:6.1f}s {what}: in use {stats['bytes_in_use'] / 2**30:.3f} "
        f"GiB, peak {stats['peak_bytes_in_use'] / 2**30:.3f} GiB",
        flush=True,
    )


w = Workload(model, batch, 224, "bfloat16", strategy)
step, state, b, _ = train_step(w)
jax.block_until_ready(state)
say("state and batch made")
compiled = step.trace(state, b).lower().compile()
memory = compiled.memory_analysis()
print(
    f"compiled temp {memory.temp_size_in_bytes / 2**30:.3f} "
    f"args {memory.argument_size_in_bytes / 2**30:.3f}"
)
say("compiled")
for _ in range(3):
    state, loss = compiled(state, b)
jax.block_until_ready(loss)
say("3 steps")
times = []
for _ in range(10):
    began = time.perf_counter()
    state, loss = compiled(state, b)
    jax.block_until_ready(loss)
    times.append((time.perf_counter() - began) * 1e3)
print("step ms, median of 10:", sorted(times)[5])
