"""Where a U-Net lean process's runtime peak comes from: init, compile or the step.
   python peak_probe.py MODEL BATCH STRATEGY CACHE_DIR|-"""
import sys, time
import jax
model, batch, strategy, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
if cache != "-":
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
from jaxoffload.bench import benchmark
d = jax.devices()[0]
def say(what):
    s = d.memory_stats()
    print(f"{time.perf_counter()-t0:6.1f}s {what}: in use {s['bytes_in_use']/2**30:.3f} GiB, peak {s['peak_bytes_in_use']/2**30:.3f} GiB", flush=True)
t0 = time.perf_counter()
w = benchmark.Workload(model, batch, 224, "bfloat16", strategy)
step, state, b, _ = benchmark.train_step(w)
jax.block_until_ready(state); say("state and batch made")
c = step.trace(state, b).lower().compile()
ma = c.memory_analysis(); print(f"compiled temp {ma.temp_size_in_bytes/2**30:.3f} args {ma.argument_size_in_bytes/2**30:.3f}")
say("compiled")
for _ in range(3):
    state, loss = c(state, b)
jax.block_until_ready(loss); say("3 steps")
times = []
for _ in range(10):
    start = time.perf_counter(); state, loss = c(state, b); jax.block_until_ready(loss)
    times.append((time.perf_counter() - start) * 1e3)
print("step ms, median of 10:", sorted(times)[5])
