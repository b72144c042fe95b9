"""Compile time of one ResNet-50 b256 step under a mixed plan, after the plain step (its
autotuned kernels cached), with jax's default compile options and with LLVM module
parallelism; then each executable's step time, in turns. A GPU probe, not a test:

    python benchmarks/probes/compile_options_probe.py
"""

import time

from jaxoffload import Lean, Plan, Remat, Store
from jaxoffload.bench.step import linen_model, training
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import device_bytes, discover, program, steps_together, trace_step

START = time.perf_counter()


def say(*parts):
    print(f"[{time.perf_counter() - START:7.1f}]", *parts, flush=True)


w = Workload(model="flax-resnet50", batch=256, image_size=224, dtype="bfloat16", strategy="none")
model = linen_model(w, plannable=True)
_, state, batch, _ = training(w, model, abstract=True)


def step(model, state, batch):
    return training(w, model, abstract=None)[0](state, batch)


paths, _ = discover(model, step, (state, batch), None)
plain = Plan(tuple((p, Store()) for p in paths))
kinds = [Lean(), Remat(), Store()]
mixed = Plan(tuple((p, kinds[i % 3]) for i, p in enumerate(paths)), Lean())
began = time.perf_counter()
trace_step(model, step, (state, batch), plain, (0,)).lower().compile()
say("plain compile", round(time.perf_counter() - began, 1))
parallel = {"xla_gpu_enable_llvm_module_compilation_parallelism": True}
executables = {}
for name, options in [
    ("default", None),
    ("default2", None),
    ("llvm-parallel", parallel),
    ("default3", None),
]:
    lowered = trace_step(model, step, (state, batch), mixed, (0,)).lower()  # a fresh lowering
    began = time.perf_counter()
    try:
        executable = lowered.compile(options) if options else lowered.compile()
    except Exception as error:  # an option this jaxlib does not know
        say(name, "failed", repr(error)[:300])
        continue
    executables[name] = executable
    say(
        name, "compile", round(time.perf_counter() - began, 1), "s, bytes", device_bytes(executable)
    )
arrays = program(model, step, (state, batch), plain)[1]
for name, (ms, spread) in zip(executables, steps_together(list(executables.values()), arrays, 11)):
    say(name, f"{ms:.2f} ms ±{spread:.1%}")
