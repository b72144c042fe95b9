"""Runs a probe with each ``Lean(max_slowdown=...)`` block timing printed. A GPU probe, not a test.

    [FAST=1] [AUTOTUNE=N] [PAR=1] [KEEP=all|dot|weights] \
        python benchmarks/probes/timed_fallbacks.py PROBE.py [ARGS ...]

Each time :mod:`jaxoffload._src.fallbacks` times a block's fallbacks, one line: ``FALLBACK n``,
the shape of the block's first operand, each pair timed and its ms, the fallback taken, the seconds
the timing took (lowering, compiling and running) and those of each compile.
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

_fastest_enough = fallbacks.fastest_enough
_spent = {"s": 0.0, "n": 0}
_compiles: list[float] = []


def logged(strategy, closed, device_argnums, wrap):
    start = time.perf_counter()
    chosen = _fastest_enough(strategy, closed, device_argnums, wrap)
    took = time.perf_counter() - start
    if not _compiles:  # this program was timed already
        return chosen
    _spent["s"] += took
    _spent["n"] += 1
    pairs = list(fallbacks.CHOSEN.values())[-1].times_ms
    print(
        f"FALLBACK {_spent['n']} {tuple(closed.jaxpr.invars[0].aval.shape)}",
        [", ".join(f"{c}: {ms:.3f}" for c, ms in pair.items()) for pair in pairs],
        f"took {chosen!r}; {took:.2f}s total {_spent['s']:.1f}s compiles",
        [f"{s:.2f}" for s in _compiles],
        flush=True,
    )
    _compiles.clear()
    return chosen


if __name__ == "__main__":
    fallbacks.fastest_enough = logged
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
