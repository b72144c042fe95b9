"""Planning: a strategy per block that fits a memory budget at the least step time.

:func:`plan` takes a model (a linen one whose blocks are
:func:`jaxoffload.linen.plannable`, or an NNX one and the class of its blocks),
its training step and a budget, and returns a :class:`~jaxoffload.Plan`: one
strategy value per block, which :meth:`~jaxoffload.Plan.apply` puts on the
model. The costs come from the device (:mod:`jaxoffload._src.planner.costs`),
and every plan returned was compiled and checked against the budget.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import jax
from flax import nnx

from jaxoffload._src import nnx as offload_nnx
from jaxoffload._src.errors import NoPlanFits
from jaxoffload._src.jaxprs import format_bytes
from jaxoffload._src.planner.costs import (
    BlockCost,
    BlockCosts,
    cost_blocks,
    estimate_peak_bytes,
    estimate_step_ms,
    measure_link,
    zeros,
)
from jaxoffload._src.planner.plan import Plan
from jaxoffload._src.planner.program import compile_step, device_bytes, discover, program
from jaxoffload._src.strategies import Lean, Offload, Remat, Store, Strategy, brief, check_strategy

__all__ = ["Planner", "default_options", "plan"]


# Timings closer than this are noise: a block's Store and Lean often differ by less.
_NOISE = 0.02


def _fastest_leanest(block: BlockCosts, options) -> Strategy:
    """The option that keeps the fewest bytes among those as fast as the fastest, within noise."""

    def ms(s):
        return block.cost(s).forward_ms + block.cost(s).backward_ms

    def kept(s):
        c = block.cost(s)
        return c.device_bytes + c.input_bytes + c.output_bytes + c.host_bytes

    quickest = min(ms(s) for s in options)
    return min((s for s in options if ms(s) <= quickest * (1 + _NOISE)), key=kept)


def _search(blocks, options, budget, link) -> tuple[Strategy, ...] | None:
    """The fastest choice, by the models, whose estimated peak fits ``budget``; ``None`` if none.

    Greedy descent from two starts (each block at its fastest option, the
    leanest among options equally fast within timing noise; and every block
    lean): while the estimate is over budget, make the change that frees the
    most estimated peak per millisecond added; then make any change that is
    faster, by more than noise, and still fits. Every uniform choice is a
    candidate too, so the result is never slower, by the models, than one
    strategy for all blocks.
    """
    n = len(blocks)

    def peak(choice):
        return estimate_peak_bytes(blocks, choice)

    def ms(choice):
        return estimate_step_ms(blocks, choice, link)

    def descend(choice):
        choice = list(choice)
        current = peak(choice)
        while current > budget:
            base_ms, best = ms(choice), None
            for i in range(n):
                for s in options:
                    if s == choice[i]:
                        continue
                    trial = [*choice[:i], s, *choice[i + 1 :]]
                    freed = current - peak(trial)
                    if freed <= 0:
                        continue
                    rate = freed / max(ms(trial) - base_ms, 1e-6)
                    if best is None or rate > best[0]:
                        best = (rate, trial)
            if best is None:
                return None
            choice = best[1]
            current = peak(choice)
        improved = True
        while improved:
            improved = False
            for i in range(n):
                for s in options:
                    trial = [*choice[:i], s, *choice[i + 1 :]]
                    if peak(trial) <= budget and ms(trial) < ms(choice) * (1 - _NOISE):
                        choice, improved = trial, True
        return tuple(choice)

    fastest = tuple(_fastest_leanest(b, options) for b in blocks)
    candidates = [descend(fastest)]
    if Lean() in options:
        candidates.append(descend((Lean(),) * n))
    candidates += [(s,) * n for s in options]
    fitting = [c for c in candidates if c is not None and peak(c) <= budget]
    return min(fitting, key=ms) if fitting else None


def default_options() -> tuple[Strategy, ...]:
    """The strategies a block may take: every kind, and offload with windows 1 and 2.

    Host placement does nothing on a CPU (host and device memory are one),
    so there the options that offload are left out.
    """
    options: list[Strategy] = [Store(), Lean(), Remat()]
    if jax.default_backend() != "cpu":
        options += [Offload(), Offload(window=2), Offload(recompute=True)]
    return tuple(options)


def plan(
    model: Any,
    step: Callable[..., Any],
    *args: Any,
    budget: int | float | Sequence[int | float],
    blocks: Any = None,
    options: Sequence[Strategy] | None = None,
    donate_argnums: int | Sequence[int] = (),
    runs: int = 5,
    max_rounds: int = 3,
    progress: bool | Callable[[str], None] = True,
) -> Plan | list[Plan]:
    """A strategy per plannable block that fits ``budget`` at the least step time.

    The costs come from the device. Each distinct block is timed alone under
    each option, and its residuals are read from traces; the host link is
    measured once. A model of the step's peak over time
    (:func:`estimate_peak_bytes`), calibrated against the compiled plain
    step, picks the plan; the plan's compiled program is then checked
    against the budget, and a plan over it is replanned under a tighter
    model budget.

    Args:
      model: an unbound linen Module whose blocks are
        :func:`jaxoffload.linen.plannable`, or an NNX Module. An NNX model
        is put back as it was when planning ends.
      step: the training step as ``step(model, *args)``, not jitted: the
        planner calls it with the model under each candidate plan. An NNX
        step may update its Modules (``optimizer.update(model, grads)``).
      *args: ``step``'s other arguments, as arrays or
        :class:`jax.ShapeDtypeStruct`\\ s (a training state, a batch), or
        NNX Modules such as an ``nnx.Optimizer``.
      budget: device bytes (an int), or a share of the plain model's (a
        float in (0, 1]). Device bytes are the compiled step's arguments and
        temporaries. A sequence of budgets gives a list of plans, and
        measures the costs once. The budget is per device: with arguments
        sharded over a mesh (a batch over ``data``), the compiled bytes are
        one device's (``memory_analysis`` of a sharded program), and under
        Explicit mesh axes the blocks are sized and timed per device too.
      blocks: for an NNX model, which submodules are its blocks: a Module
        class, a tuple of them, or a function ``(path, module) -> bool``.
        A linen model's blocks are its plannable ones.
      options: the strategies a block may take; :func:`default_options` by
        default.
      donate_argnums: the arguments (after ``model``) that the training loop
        donates, as in its ``jax.jit``: the compiled checks do the same.
      runs: timed runs per block and option.
      max_rounds: compiled checks before giving up.
      progress: print progress to stderr, or a function that takes each line.

    Returns:
      A :class:`Plan` whose compiled step fits ``budget``.

    Raises:
      NoPlanFits: if no plan's compiled step fits; the message gives the
        least that was reached.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> import jaxoffload
      >>> Dense = jaxoffload.linen.plannable(nn.Dense)
      >>> class Net(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         h = nn.relu(Dense(256)(x))
      ...         return Dense(8)(h)
      >>> def step(model, params, x):
      ...     return jax.grad(lambda p: model.apply(p, x).sum())(params)
      >>> x = jnp.ones((64, 256))
      >>> params = Net().init(jax.random.key(0), x)
      >>> p = jaxoffload.plan(Net(), step, params, x, budget=1.0, runs=1, progress=False)
      >>> [path for path, _ in p.blocks]
      ['Dense_0', 'Dense_1']
    """
    say = _progress_printer(progress)
    budgets = list(budget) if isinstance(budget, Sequence) else [budget]
    for b in budgets:
        _check_budget(b)
    # Batch-sharded arguments over an Explicit mesh: the blocks' traced types carry their
    # sharding, so the blocks are timed and sized per device under that mesh.
    mesh = _explicit_mesh(args)
    with (
        offload_nnx.classes_kept(model) if isinstance(model, nnx.Module) else nullcontext(),
        jax.set_mesh(mesh) if mesh is not None else nullcontext(),
    ):
        planner = Planner(
            model,
            step,
            args,
            options,
            blocks=blocks,
            runs=runs,
            say=say,
            donate_argnums=donate_argnums,
        )
        plans = [planner.plan_for(b, max_rounds=max_rounds) for b in budgets]
    return plans if isinstance(budget, Sequence) else plans[0]


class Planner:
    """What planning measures once per model and step: blocks, costs, link and calibration."""

    def __init__(self, model, step, args, options, *, runs, say, blocks=None, donate_argnums=()):
        self.model, self.step, self.args, self.say = model, step, args, say
        self.donate_argnums = donate_argnums
        self.executables: dict[Plan, Any] = {}
        self.measured_ms: dict[Plan, float] = {}
        options = (
            default_options() if options is None else tuple(check_strategy(s) for s in options)
        )
        if not options:
            raise ValueError("options is empty: a block needs at least one strategy to take.")
        self.options = options
        say("tracing the step to find the plannable blocks")
        self.paths, calls = discover(model, step, args, blocks)
        _check_blocks(self.paths, calls, nnx_model=isinstance(model, nnx.Module))
        self.link = None
        if any(s.to_host for s in options):
            link = measure_link()
            self.link = (link["d2h_gbps"], link["h2d_gbps"])
            say(f"host link: {self.link[0]:.1f} GB/s out, {self.link[1]:.1f} GB/s back")
        self.blocks = cost_blocks(self.paths, calls, options, runs=runs, say=say)
        self.plain = Plan(tuple((p, Store()) for p in self.paths))
        # What the compiled programs take: the same arrays under every plan.
        self.arrays = program(model, step, args, self.plain)[1]
        self.lean_outside = dataclasses.replace(self.plain, outside=Lean())
        say("compiling the plain step, and again with the code outside the blocks lean")
        # Every compiled plan is a candidate for every budget.
        self.checked = {p: self.compiled(p) for p in (self.plain, self.lean_outside)}
        # What the step holds besides the blocks' residuals and work.
        blocks_peak = estimate_peak_bytes(self.blocks, self.plain.strategies)
        self.constant = {p.outside: self.checked[p] - blocks_peak for p in self.checked}
        say(f"plain step: {format_bytes(self.checked[self.plain])}")
        self._calibrate()

    def _calibrate(self) -> None:
        """Fits, per kind of strategy, the compiled bytes per traced byte, from uniform plans.

        XLA's buffers are not the traces' residuals: it fuses some away and
        keeps others longer. Each uniform plan (every block lean, every block
        rematerialised, every block offloaded), compiled, is also a candidate.
        """
        # One scale per class, not per value: a class's values keep residuals the same way.
        scales = {Store: 1.0}
        for kind in (Lean, Remat, Offload):
            if kind not in {type(s) for s in self.options}:
                continue
            strategy = next(s for s in self.options if type(s) is kind)
            uniform = Plan(tuple((p, strategy) for p in self.paths), Lean())
            self.say(f"compiling every block {brief(strategy)}, to calibrate")
            self.checked[uniform] = self.compiled(uniform)
            traced = estimate_peak_bytes(self.blocks, uniform.strategies)
            held = self.checked[uniform] - self.constant[Lean()]
            scales[kind] = min(4.0, max(0.25, held / traced)) if traced > 0 else 1.0
        self.say("compiled bytes per traced byte: " + ", ".join(
            f"{k.__name__} {v:.2f}" for k, v in scales.items()
        ))  # fmt: skip
        self.blocks = [
            dataclasses.replace(
                b,
                costs={
                    s: dataclasses.replace(c, scale=scales[type(s)]) for s, c in b.costs.items()
                },
            )
            for b in self.blocks
        ]

    def compiled(self, candidate: Plan) -> int:
        executable = compile_step(self.model, self.step, self.args, candidate, self.donate_argnums)
        self.executables[candidate] = executable
        return device_bytes(executable)

    def step_ms(self, candidate: Plan, runs: int = 3) -> float:
        """The compiled candidate's step time, run on zeros; ``inf`` if it cannot run here."""
        if candidate not in self.measured_ms:
            limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
            executable = self.executables.get(candidate)
            if executable is None or (limit and self.checked[candidate] > 0.9 * limit):
                return math.inf
            times = []
            try:
                for _ in range(runs + 1):
                    # Donated arguments are used up: fresh zeros for every run.
                    args = jax.block_until_ready(jax.tree.map(zeros, self.arrays))
                    start = time.perf_counter()
                    jax.block_until_ready(executable(*args))
                    times.append(time.perf_counter() - start)
                    del args
            except jax.errors.JaxRuntimeError:  # out of memory here: not a candidate to time
                return math.inf
            self.measured_ms[candidate] = statistics.median(times[1:]) * 1e3
        return self.measured_ms[candidate]

    def ms(self, choice) -> float:
        return estimate_step_ms(self.blocks, choice, self.link)

    def plan_for(self, budget, *, max_rounds: int) -> Plan:
        say, blocks = self.say, self.blocks
        plain_bytes = self.checked[self.plain]
        budget_bytes = int(budget * plain_bytes) if isinstance(budget, float) else int(budget)
        say(f"planning for {format_bytes(budget_bytes)}")
        targets = {outside: budget_bytes - c for outside, c in self.constant.items()}
        rounds = tries = 0
        tighten = 1.0
        while rounds < max_rounds and tries < 4 * max_rounds:
            tries += 1
            found = {o: _search(blocks, self.options, t, self.link) for o, t in targets.items()}
            found = {o: c for o, c in found.items() if c is not None}
            if not found:
                break
            # A stored outside is taken at equal estimated time: its cost is not timed.
            outside = min(found, key=lambda o: (self.ms(found[o]), o != Store()))
            candidate = Plan(tuple(zip(self.paths, found[outside])), outside)
            if candidate not in self.checked:
                rounds += 1
                say(f"round {rounds}: compiling {_summary(candidate.strategies)}")
                self.checked[candidate] = self.compiled(candidate)
            if self.checked[candidate] <= budget_bytes:
                break
            say(
                f"{format_bytes(self.checked[candidate])} compiled: over the budget; planning tighter"
            )
            # Tighter each time the same plan comes back, so the search moves on.
            over = (self.checked[candidate] - budget_bytes + budget_bytes // 100) * tighten
            tighten *= 2
            targets = {o: t - over for o, t in targets.items()}
        fitting = [p for p, got in self.checked.items() if got <= budget_bytes]
        if not fitting:
            raise NoPlanFits(
                f"no plan of {[brief(s) for s in self.options]} fits {format_bytes(budget_bytes)} "
                f"(the plain step takes {format_bytes(plain_bytes)}; the least compiled was "
                f"{format_bytes(min(self.checked.values()))}). Try a smaller batch"
                + (", or plan on a GPU, where blocks can offload." if self.link is None else ".")
            )
        # The compiled candidates that fit are run: the measured step decides.
        say(f"timing the {len(fitting)} compiled plans that fit")
        best = min(fitting, key=lambda p: (self.step_ms(p), self.ms(p.strategies)))
        say(
            f"chose {_summary(best.strategies)}, outside {brief(best.outside)}: compiled "
            f"{format_bytes(self.checked[best])}, step {self.step_ms(best):.1f} ms"
        )
        return dataclasses.replace(
            best,
            budget_bytes=budget_bytes,
            estimated_bytes=self.constant[best.outside]
            + estimate_peak_bytes(blocks, best.strategies),
            compiled_bytes=self.checked[best],
            estimated_step_ms=self.ms(best.strategies),
            measured_step_ms=self.step_ms(best),
            notes=tuple(_note(b.cost(s)) for b, s in zip(blocks, best.strategies)),
        )


def _check_budget(budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int | float):
        raise TypeError(f"budget must be bytes (an int) or a share (a float), got {budget!r}.")
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ValueError(
            f"a budget given as a float is a share of the plain step's memory, in (0, 1]; got "
            f"{budget}. Give bytes as an int."
        )
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"budget must be positive, got {budget} bytes.")


def _check_blocks(paths, calls, *, nnx_model: bool) -> None:
    if not paths:
        raise ValueError(
            "the step calls none of the blocks that blocks= selects: select the submodules "
            "that the model's __call__ calls."
            if nnx_model
            else "the step calls no plannable block: wrap the model's block class with "
            "jaxoffload.linen.plannable, e.g. block_cls=jaxoffload.linen.plannable(Block)."
        )
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        raise ValueError(
            f"blocks {twice} are called more than once per step; a plan gives each instance "
            "one strategy, so wrap the repeated call in a Module of its own."
        )
    if len(calls) != len(paths):
        raise ValueError(
            f"the step differentiates {len(calls)} wrapped calls but {len(paths)} plannable "
            "blocks; a plannable block must not contain or sit beside other jaxoffload-wrapped "
            "Modules."
        )


def _note(cost: BlockCost) -> str:
    parts = [f"keeps {cost.device_bytes + cost.input_bytes + cost.output_bytes:,} B"]
    if cost.host_bytes:
        parts.append(f"moves {cost.host_bytes:,} B")
    parts.append(f"{cost.forward_ms + cost.backward_ms:.2f} ms")
    return ", ".join(parts)


def _summary(choice) -> str:
    counts: dict[str, int] = {}
    for s in choice:
        counts[brief(s)] = counts.get(brief(s), 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in counts.items())


def _progress_printer(progress) -> Callable[[str], None]:
    if callable(progress):
        return progress
    if not progress:
        return lambda line: None
    start = time.perf_counter()
    return lambda line: print(
        f"[plan {time.perf_counter() - start:6.1f} s] {line}", file=sys.stderr, flush=True
    )


def _explicit_mesh(args) -> jax.sharding.Mesh | None:
    """The mesh of the first argument sharded over Explicit axes: planning runs under it."""
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and any(
            t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types
        ):
            return sharding.mesh
    return None
