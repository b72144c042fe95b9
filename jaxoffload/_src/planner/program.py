"""A training step under a plan, as a program: the blocks it calls, and its compiled bytes."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from jaxoffload._src import calls as calls_lib
from jaxoffload._src import nnx as offload_nnx
from jaxoffload._src.planner.apply import Discovery
from jaxoffload._src.planner.plan import Plan
from jaxoffload._src.residuals import OffloadedCall
from jaxoffload._src.strategies import Lean
from jaxoffload._src.xla_options import compiler_options

__all__ = [
    "check_discovered",
    "compile_step",
    "compiled_bytes",
    "device_bytes",
    "discover",
    "explicit_mesh",
    "lower_step",
    "program",
    "trace_step",
]


def discover(model, step, args, blocks) -> tuple[list[str], list[OffloadedCall]]:
    """The paths of the blocks that ``step`` calls, in call order, and each one's wrapped call."""
    if isinstance(model, nnx.Module):
        every_block_lean = Plan(tuple((p, Lean()) for p in offload_nnx.block_paths(model, blocks)))
        with offload_nnx.calls_recorded() as paths:
            fun, arrays, _ = program(model, step, args, every_block_lean)
            calls = calls_lib.offloaded_calls(fun, *arrays)
        return paths, calls
    if blocks is not None:
        raise TypeError(
            "blocks= selects the blocks of an NNX model; a linen model's blocks are those whose "
            "class is jaxoffload.linen.plannable (block_cls=jaxoffload.linen.plannable(Block))."
        )
    discovery = Discovery()
    fun, arrays, _ = program(model, step, args, discovery)
    return discovery.paths, calls_lib.offloaded_calls(fun, *arrays)


def compiled_bytes(
    model: Any,
    step: Callable[..., Any],
    *args: Any,
    plan: Plan,
    donate_argnums: int | Sequence[int] = (),
) -> int:
    """The device bytes of ``step``'s compiled program under ``plan``: arguments and temporaries.

    Outputs are not counted: a training step donates its state, so its
    outputs reuse the arguments' buffers. ``donate_argnums`` counts the
    arguments after ``model``, as the training loop's ``jax.jit`` does.
    """
    return device_bytes(compile_step(model, step, args, plan, donate_argnums))


def program(model, step, args, plan: Plan | None, donate_argnums=()):
    """``step`` with ``model`` under ``plan`` (``None``: as given), as a function of arrays:
    ``(fun, arrays, donate)``."""
    under = model if plan is None else plan.apply(model)
    if isinstance(model, nnx.Module):
        return offload_nnx.functional(step, under, args, donate_argnums)
    return functools.partial(step, under), args, donate_argnums


def trace_step(model, step, args, plan: Plan | None, donate_argnums):
    """``step`` under ``plan`` (``None``: the model as given), traced: its jaxpr, and ready to lower."""
    fun, arrays, donate = program(model, step, args, plan, donate_argnums)
    return jax.jit(fun, donate_argnums=donate).trace(*arrays)


def lower_step(model, step, args, plan: Plan | None, donate_argnums):
    """``step`` under ``plan``, traced and lowered: ready to compile."""
    return trace_step(model, step, args, plan, donate_argnums).lower()


def compile_step(model, step, args, plan: Plan | None, donate_argnums):
    """``step`` under ``plan``, traced, lowered and compiled, as users compile a step that
    moves bytes (:func:`~jaxoffload._src.xla_options.compiler_options`)."""
    return lower_step(model, step, args, plan, donate_argnums).compile(compiler_options())


def device_bytes(executable) -> int:
    """A compiled step's device bytes: its arguments and temporaries."""
    memory = executable.memory_analysis()
    return int(memory.temp_size_in_bytes + memory.argument_size_in_bytes)


def check_discovered(paths, calls, *, nnx_model: bool) -> None:
    """Raises if the step calls no plannable block, one twice, or wrapped calls beside them."""
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
            "one strategy, so wrap the repeated call in a Module of its own. A block under "
            "nn.scan (or another transform that traces its body more than once) counts as "
            "called each time: make the Module that holds the nn.scan the plannable block."
        )
    if len(calls) != len(paths):
        raise ValueError(
            f"the step differentiates {len(calls)} wrapped calls but {len(paths)} plannable "
            "blocks. A plannable block must not contain or sit beside other jaxoffload-wrapped "
            "Modules; and where all of a block's convolutions and products run inside "
            "jax.checkpoint calls of its own (nn.remat, nn.checkpoint), which keep their own "
            "policy, a plan has nothing left to choose for it: make the Module inside the "
            "nn.remat plannable instead, or call it without nn.remat."
        )


def explicit_mesh(args) -> jax.sharding.Mesh | None:
    """The mesh of the first argument sharded over Explicit axes: planning runs under it."""
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and any(
            t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types
        ):
            return sharding.mesh
    return None
