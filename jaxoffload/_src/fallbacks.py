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
      times_ms: each pair timed in turns, in order: a cut's time, forward and
        backward, and jax's choice's beside it, each by its ``repr``.
      strategy: the fallback taken.
    """

    inputs: str
    times_ms: list[dict[str, float]]
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
        *cuts, reference = strategy.fallbacks()
        programs = Programs(closed, device_argnums, wrap)
        # Each cut is timed beside jax's choice, leanest first, until one is within the limit:
        # where the lean cut is, as it mostly is, the others are never compiled. A cut whose
        # program is one already timed is not timed again.
        times_ms, chosen, slower = [], reference, set()
        for cut in cuts:
            if programs.text(cut) in slower:
                continue
            cut_ms, reference_ms = time_candidates([cut, reference], programs)
            times_ms.append({repr(cut): cut_ms, repr(reference): reference_ms})
            if cut_ms <= (1 + strategy.max_slowdown) * reference_ms:
                chosen = cut
                break
            slower.add(programs.text(cut))
        if program is None:  # a constant is a tracer: this call is not seen again
            return chosen
        inputs = ", ".join(
            f"{v.aval.dtype}{list(v.aval.shape)}"
            for k, v in enumerate(closed.jaxpr.invars)
            if k not in device_argnums
        )
        CHOSEN[key] = Choice(inputs, times_ms, chosen)
    return CHOSEN[key].strategy


class Programs:
    """A call's forward and backward passes under each candidate, each lowered and compiled
    at most once: fallbacks that make the same program (a cut that recomputes no product
    anyway, say) are compiled once, and each compile autotunes its kernels."""

    def __init__(self, closed, device_argnums: tuple[int, ...], wrap: Callable[..., Any]):
        self.fun = jex_core.jaxpr_as_fun(closed)
        self.structs = [struct_of(v.aval) for v in closed.jaxpr.invars]
        self.device_argnums, self.wrap = device_argnums, wrap
        self.texts: dict[Strategy, str] = {}  # each candidate's program as text
        self.lowered: dict[str, tuple[Any, Any]] = {}  # each distinct program and its arguments
        self.executables: dict[str, Any] = {}

    def text(self, candidate: Strategy) -> str:
        """The candidate's program as text, lowered on first asking."""
        if candidate not in self.texts:
            wrapped = self.wrap(self.fun, candidate, device_argnums=self.device_argnums)
            # Lowered while the user's step is traced: the zeros it runs on are concrete.
            with jax.ensure_compile_time_eval():
                _, both, _, args = timing.vjp_programs(wrapped, self.structs)
                lowered = both.trace(*args).lower()
            text = self.texts[candidate] = lowered.as_text()
            self.lowered.setdefault(text, (lowered, args))
        return self.texts[candidate]

    def executable(self, text: str) -> Any:
        """The program of this text, compiled on first asking."""
        if text not in self.executables:
            (self.executables[text],) = timing.compile_all([self.lowered[text][0]], parallel=False)
        return self.executables[text]


def time_candidates(candidates: list[Strategy], programs: Programs) -> list[float]:
    """The ms of the call's forward and backward passes under each candidate, timed in turns."""
    with jax.ensure_compile_time_eval():  # runs while the user's step is traced
        texts = [programs.text(c) for c in candidates]
        distinct = list(dict.fromkeys(texts))
        timed = timing.timed_together(
            [(programs.executable(t), programs.lowered[t][1]) for t in distinct], runs=5
        )
    ms = {text: t for text, (t, _) in zip(distinct, timed)}
    return [ms[text] for text in texts]
