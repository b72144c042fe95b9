"""Runs a probe with each ``Lean(max_slowdown=...)`` block timing printed. A GPU probe, not a test.

    [FAST=1] [AUTOTUNE=N] [PAR=1] [SPLIT=1] [KEEP=all|dot|weights] \
        python benchmarks/probes/timed_fallbacks.py PROBE.py [ARGS ...]

Each time :mod:`jaxoffload._src.fallbacks` times a block's fallbacks, one line: ``FALLBACK n``,
the shape of the block's first operand, each pair timed and its ms, the fallback taken, the seconds
the timing took (lowering, compiling and running) and those of each compile.
``AUTOTUNE=N`` compiles a block's programs at ``xla_gpu_autotune_level=N`` (XLA's default is 4,
which also initialises the candidates' buffers and checks their results; 1 only times them); ``PAR=1``
compiles them in parallel; ``FAST=1`` is ``AUTOTUNE=0 PAR=1``. ``SPLIT=1`` times each cut's
forward and backward passes as two programs, the residuals passed from one to the other as a
step holds them, where the library times one program that runs both (in which XLA need not
keep a residual as a step does). ``KEEP`` is ``keep_products.py``'s rule.
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


def split_times(candidates, programs):
    """:func:`fallbacks.time_candidates`, each candidate's passes timed as two programs."""
    import jax
    import numpy as np

    timing = fallbacks.timing
    cache = programs.__dict__.setdefault("split", {})
    with jax.ensure_compile_time_eval():
        for c in candidates:
            if c in cache:
                continue
            wrapped = programs.wrap(programs.fun, c, device_argnums=programs.device_argnums)
            outs = jax.eval_shape(wrapped, *programs.structs)
            floats = [jax.dtypes.issubdtype(o.dtype, np.inexact) for o in outs]

            def backward(vjp_fun, cotangents, floats=floats, outs=outs):
                return vjp_fun(timing.padded(cotangents, floats, outs))

            args = [timing.zeros(s) for s in programs.structs]
            cotangents = [timing.zeros(o) for f, o in zip(floats, outs) if f]
            forward = jax.jit(lambda *a, f=wrapped: jax.vjp(f, *a))
            (fwd,) = compile_all([forward.trace(*args).lower()])
            _, vjp_fun = fwd(*args)
            (bwd,) = compile_all([jax.jit(backward).trace(vjp_fun, cotangents).lower()])
            cache[c] = (fwd, bwd, args, cotangents)

        def both(c):
            fwd, bwd, args, cotangents = cache[c]
            return lambda: bwd(fwd(*args)[1], cotangents)

        timed = timing.timed_together([(both(c), ()) for c in candidates], runs=5)
    return [t for t, _ in timed]


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
    if os.environ.get("SPLIT"):
        fallbacks.time_candidates = split_times
    if os.environ.get("KEEP"):
        sys.path.insert(0, os.path.dirname(__file__))
        import keep_products

        keep = os.environ["KEEP"]
        cut.prices = keep_products.keeping(keep_products.KEPT[keep], weights=keep == "weights")
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
