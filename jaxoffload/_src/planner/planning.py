"""The :func:`plan` call: a strategy per block that fits a memory budget at the least step time.

:func:`plan` checks what it is given, and runs a
:class:`~jaxoffload._src.planner.search.Planner` over the model's blocks
for each budget. Every plan returned was compiled, with
:func:`~jaxoffload._src.xla_options.compiler_options` as a step that moves bytes should be,
and checked against its budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import jax
from flax import nnx

from jaxoffload._src import checks
from jaxoffload._src import nnx as offload_nnx
from jaxoffload._src.errors import NoPlanFits
from jaxoffload._src.jaxprs import format_bytes
from jaxoffload._src.planner import budget as budget_lib
from jaxoffload._src.planner.arguments import check_planning
from jaxoffload._src.planner.budget import check_budgets, check_room
from jaxoffload._src.planner.messages import progress_printer
from jaxoffload._src.planner.plan import Plan
from jaxoffload._src.planner.program import explicit_mesh
from jaxoffload._src.planner.search import Planner
from jaxoffload._src.strategies import Strategy

__all__ = ["plan"]


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
    per_round: int | None = None,
    block_costs: str = "traced",
    progress: bool | Callable[[str], None] = True,
    held_bytes: int | None = None,
) -> Plan | list[Plan | NoPlanFits]:
    """A strategy per plannable block that fits ``budget`` at the least step time.

    The costs come from the device. The plain step is compiled and timed, and
    its time is shared among the blocks under each option by their traced
    FLOPs (``block_costs``), then calibrated to uniform steps compiled and
    timed; each block's residuals are read from traces, and the host link is
    measured once. Where anything moves, each block also gets hidden
    offloads (``Offload(window=w, max_bytes=cap)``, a cap of what the link
    moves while the next blocks compute). For every memory target, the
    fastest choice of one option per block is the front
    (:func:`~jaxoffload._src.planner.front.front`). The compiled step is the
    oracle: a model of its peak over time, calibrated to the plans compiled so
    far (:mod:`~jaxoffload._src.planner.peak`), proposes the fastest candidates that should fit, and they are compiled,
    several at once and for every budget together, until no candidate is
    left that the model says is faster than the fastest that fits. The plan
    returned is the fastest of the compiled ones that fit, as timed where
    the steps time steadily; its ``estimated_bytes`` is what the model
    calibrated to the other compiled plans predicts of it.

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
      budget: device bytes (an int, or a whole number such as ``16e9``), or a
        share of the plain step's peak (a float in (0, 1]), as this process
        sees the device: the compiled step (its arguments and temporaries)
        and ``held_bytes``, what the process holds besides the step's
        arguments. So ``16 * 2**30`` is that many bytes of the device, of which the
        compiled step gets what the process does not hold already, and
        ``0.35`` is 0.35 of the plain step's compiled bytes and
        ``held_bytes`` together; the progress lines and the plan's
        ``budget_bytes`` and ``held_bytes`` say which bytes. Where the device
        reports no memory in use (a CPU), the budget is of the compiled step
        alone. A sequence of budgets gives a list of plans, and
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
      max_rounds: rounds of compiled checks per budget.
      per_round: the candidates that one round compiles for each budget; the
        budgets' candidates compile at once, each on a thread of its own.
        ``None``: four for one budget, two each for several
        (:func:`~jaxoffload._src.planner.rounds.per_budget`).
      block_costs: ``"traced"``, each block's times from its traced FLOPs at
        the plain step's measured ms per FLOP, which compiles no block program;
        or ``"timed"``, each distinct block program compiled and timed alone
        under each option, which adds their compiles to planning. The
        calibration to whole steps corrects both.
      progress: print progress to stderr, or a function that takes each line.
      held_bytes: what the training process holds on the device besides the
        step's arguments, counted in every budget. ``None`` reads this
        process's: each device's ``memory_stats()["bytes_in_use"]`` less the
        arrays among ``args`` (and an NNX model's variables), which the
        compiled step counts already (:func:`~jaxoffload._src.planner.budget.held_bytes`);
        give the arguments as the arrays that training passes, or give
        ``held_bytes`` where training runs in another process. 0 counts the
        compiled step alone.

    Returns:
      A :class:`Plan` whose compiled step fits ``budget``. For a sequence of
      budgets, a list with one entry per budget: its :class:`Plan`, or, where
      no plan fits, the :class:`NoPlanFits` that says what was reached (not
      raised, so that the plans that fit are not lost).

    Raises:
      NoPlanFits: for a single budget, if no plan's compiled step fits; the
        message gives the least that was reached.
      TypeError, ValueError: for an argument written wrong, before anything
        is traced; a budget in bytes below the step's own arguments among them.

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
    # Everything is checked before the first trace: planning compiles for minutes.
    options, runs = check_planning(
        "jaxoffload.plan", model, step, args, blocks=blocks, options=options, runs=runs,
        donate_argnums=donate_argnums, block_costs=block_costs, progress=progress,
    )  # fmt: skip
    budgets, many = check_budgets(budget, "the plain step's memory")
    max_rounds = checks.integer("max_rounds", max_rounds, minimum=1, example=3)
    per_round = checks.integer("per_round", per_round, minimum=1, none=True, example=4)
    held_bytes = checks.integer("held_bytes", held_bytes, minimum=0, none=True, meaning="bytes")
    given = held_bytes is not None
    # Read before planning allocates anything of its own: what the training loop holds.
    held = held_bytes if given else budget_lib.held_bytes(model, args)
    check_room(budgets, args, "the plain step's memory", held or 0)
    say = progress_printer(progress)
    if held is None:
        say(
            f"this {jax.default_backend()} device reports no memory in use: each budget is of "
            "the compiled step alone"
        )
    else:
        how = "as given" if given else "bytes in use less the step's arguments"
        say(f"held besides the step's arguments, in every budget: {format_bytes(held)} ({how})")
    # Batch-sharded arguments over an Explicit mesh: the blocks' traced types carry their
    # sharding, so the blocks are timed and sized per device under that mesh.
    mesh = explicit_mesh(args)
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
            block_costs=block_costs,
            held_bytes=held,
        )
        try:
            if not many:
                return planner.plan_for(budgets[0], max_rounds=max_rounds, per_round=per_round)
            return planner.plans_for(budgets, max_rounds=max_rounds, per_round=per_round)
        finally:
            planner.settle()
