"""A strategy's fallbacks, timed on the device: ``Lean(max_slowdown=...)``.

A lean cut recomputes values in the backward pass that jax would keep. On a
GPU most of that work fuses into loops that run anyway, but not all of it: a
depthwise convolution, say, is cheap in FLOPs and slow in time. Where the cut
costs more than ``max_slowdown``, a block takes a fallback instead, the first
within it: a cut that recomputes no product, then jax's own choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jex_core

from jaxoffload._src import timing
from jaxoffload._src.jaxprs import fingerprint, struct_of
from jaxoffload._src.strategies import Strategy

__all__ = ["CHOSEN", "Choice", "fastest_enough", "taken"]


@dataclasses.dataclass
class Choice:
    """What one distinct call was timed at, and the fallback it took.

    Attributes:
      inputs: its inputs other than those on the device anyway, as ``dtype[shape]``.
      times_ms: each fallback's time, forward and backward, by its ``repr``.
      strategy: the fallback taken.
    """

    inputs: str
    times_ms: dict[str, float]
    strategy: Strategy


# What each distinct call took, by its program and strategy: each is timed once per process.
CHOSEN: dict[tuple, Choice] = {}


def taken() -> list[dict[str, Any]]:
    """Each distinct call timed in this process: its inputs, times and fallback, as JSON."""
    return [{**dataclasses.asdict(c), "strategy": repr(c.strategy)} for c in CHOSEN.values()]


def fastest_enough(
    strategy: Strategy, closed, device_argnums: tuple[int, ...], wrap: Callable[..., Any]
) -> Strategy:
    """The first of ``strategy.fallbacks()`` within ``max_slowdown`` of the last one's time.

    Args:
      strategy: a strategy with ``max_slowdown`` set.
      closed: the call, as a closed jaxpr of its flat inputs.
      device_argnums: the inputs that live on the device anyway.
      wrap: :func:`jaxoffload._src.transform.wrap`, which lives above this
        module: the programs timed are the wrapped call under each fallback.
    """
    program = fingerprint(closed)
    key = (program, device_argnums, strategy)
    if program is None or key not in CHOSEN:
        candidates = strategy.fallbacks()
        times = time_candidates(candidates, closed, device_argnums, wrap)
        limit = (1 + strategy.max_slowdown) * times[-1]
        # The last is jax's own choice, within its own limit unless its time is unknown.
        within = (c for c, ms in zip(candidates, times) if ms <= limit)
        chosen = next(within, candidates[-1])
        if program is None:  # a constant is a tracer: this call is not seen again
            return chosen
        inputs = ", ".join(
            f"{v.aval.dtype}{list(v.aval.shape)}"
            for k, v in enumerate(closed.jaxpr.invars)
            if k not in device_argnums
        )
        CHOSEN[key] = Choice(inputs, {repr(c): ms for c, ms in zip(candidates, times)}, chosen)
    return CHOSEN[key].strategy


def time_candidates(candidates, closed, device_argnums, wrap) -> list[float]:
    """The ms of the call's forward and backward passes under each candidate, timed in turns."""
    fun = jex_core.jaxpr_as_fun(closed)
    structs = [struct_of(v.aval) for v in closed.jaxpr.invars]
    # Called while the user's step is traced: the zeros and runs here are concrete.
    with jax.ensure_compile_time_eval():
        lowered, args = [], []
        for candidate in candidates:
            wrapped = wrap(fun, candidate, device_argnums=device_argnums)
            _, both, _, both_args = timing.vjp_programs(wrapped, structs)
            lowered.append(both.trace(*both_args).lower())
            args.append(both_args)
        # Fallbacks that make the same program (a cut that recomputes no product anyway,
        # say) are compiled and timed once: each compile autotunes its kernels.
        texts = [x.as_text() for x in lowered]
        programs = list(dict.fromkeys(texts))
        firsts = [texts.index(text) for text in programs]
        executables = timing.compile_all([lowered[k] for k in firsts], parallel=False)
        timed = timing.timed_together(list(zip(executables, [args[k] for k in firsts])), runs=5)
    ms = {text: t for text, (t, _) in zip(programs, timed)}
    return [ms[text] for text in texts]
