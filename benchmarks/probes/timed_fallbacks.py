"""Runs a probe with each ``Lean(max_slowdown=...)`` block timing printed. A GPU probe, not a test.

    [FAST=1] [KEEP=all|dot|weights] python benchmarks/probes/timed_fallbacks.py PROBE.py [ARGS ...]

Each time :mod:`jaxoffload._src.fallbacks` times a block, one line: ``FALLBACK n``, the width of
the block's first input, its equations, each fallback's ms (``Lean()``, ``Lean(max_recompute=0.0)``,
``Store()``) and the seconds the timing took. ``FAST=1`` compiles a block's programs in parallel
with autotuning off (``xla_gpu_autotune_level=0``); ``KEEP`` is ``keep_products.py``'s rule.
Then PROBE.py runs as it is: ``overlap_probe.py resnet50 lean-timed OUT`` with ``MODEL`` and
``BATCH`` in the environment.
"""

import os
import runpy
import sys
import time

from jaxoffload.internal import cut, fallbacks

_time_candidates = fallbacks.time_candidates
_spent = {"s": 0.0, "n": 0}


def logged(candidates, closed, device_argnums, wrap):
    start = time.perf_counter()
    times = _time_candidates(candidates, closed, device_argnums, wrap)
    took = time.perf_counter() - start
    _spent["s"] += took
    _spent["n"] += 1
    shapes = [tuple(v.aval.shape) for v in closed.jaxpr.invars][:1]
    print(
        f"FALLBACK {_spent['n']} {shapes} {len(closed.jaxpr.eqns)}",
        [f"{ms:.3f}" for ms in times],
        f"{took:.2f}s total {_spent['s']:.1f}s",
        flush=True,
    )
    return times


if __name__ == "__main__":
    fallbacks.time_candidates = logged
    if os.environ.get("FAST"):
        compile_timed = fallbacks.timing.compile_timed
        options = {"xla_gpu_autotune_level": 0}
        fallbacks.timing.compile_all = lambda lowered, parallel=True: [
            e for e, _ in compile_timed(list(lowered), parallel=True, options=options)
        ]
    if os.environ.get("KEEP"):
        sys.path.insert(0, os.path.dirname(__file__))
        import keep_products

        keep = os.environ["KEEP"]
        cut.prices = keep_products.keeping(keep_products.KEPT[keep], weights=keep == "weights")
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
