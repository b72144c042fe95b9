"""Runs a probe with each ``Lean(max_slowdown=...)`` block timing printed. A GPU probe, not a test.

    [FAST=1] [AUTOTUNE=N] [PAR=1] [KEEP=all|dot|weights] \
        python benchmarks/probes/timed_fallbacks.py PROBE.py [ARGS ...]

Each time :mod:`jaxoffload._src.fallbacks` times a block, one line: ``FALLBACK n``, the width of
the block's first input, its equations, each fallback's ms (``Lean()``, ``Lean(max_recompute=0.0)``,
``Store()``), the seconds the timing took and the seconds each of its compiles took.
``AUTOTUNE=N`` compiles a block's programs at ``xla_gpu_autotune_level=N`` (XLA's default is 4,
which also initialises the candidates' buffers and checks their results; 1 only times them); ``PAR=1``
compiles them in parallel; ``FAST=1`` is ``AUTOTUNE=0 PAR=1``. ``KEEP`` is
``keep_products.py``'s rule.
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
_compiles: list[float] = []


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
        f"{took:.2f}s total {_spent['s']:.1f}s compiles",
        [f"{s:.2f}" for s in _compiles],
        flush=True,
    )
    _compiles.clear()
    return times


if __name__ == "__main__":
    fallbacks.time_candidates = logged
    fast = bool(os.environ.get("FAST"))
    level = os.environ.get("AUTOTUNE", "0" if fast else "")
    options = {"xla_gpu_autotune_level": int(level)} if level else None
    in_parallel = fast or bool(os.environ.get("PAR"))
    compile_timed = fallbacks.timing.compile_timed

    def compile_all(lowered, parallel=True):
        done = compile_timed(list(lowered), parallel=in_parallel, options=options)
        _compiles.extend(s for _, s in done)
        return [e for e, _ in done]

    fallbacks.timing.compile_all = compile_all
    if os.environ.get("KEEP"):
        sys.path.insert(0, os.path.dirname(__file__))
        import keep_products

        keep = os.environ["KEEP"]
        cut.prices = keep_products.keeping(keep_products.KEPT[keep], weights=keep == "weights")
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
