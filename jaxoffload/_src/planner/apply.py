"""Putting a plan on a model, linen or NNX, through one interface.

A plan here is anything that answers :class:`Strategies`: a
:class:`~jaxoffload.Plan`, or the stand-in that the planner traces a model
with to find its blocks (:class:`Discovery`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import flax.linen as nn
from flax import nnx

from jaxoffload._src import context
from jaxoffload._src import linen as offload_linen
from jaxoffload._src import nnx as offload_nnx
from jaxoffload._src.argnums import is_static
from jaxoffload._src.strategies import Lean, Store, Strategy, stored_within

__all__ = ["Discovery", "Strategies", "apply_plan", "check_model"]


class Strategies(Protocol):
    """What applying a plan asks of it: a strategy per block path, and one for the rest."""

    outside: Strategy

    def strategy_for(self, path: str) -> Strategy: ...


def apply_plan(plan: Any, model: Any) -> Any:
    """``model`` under ``plan``: see :meth:`jaxoffload.Plan.apply`."""
    check_model(model, "Plan.apply")
    if isinstance(model, nnx.Module):
        return _apply_nnx(plan, model)
    return _apply_linen(plan, model)


def check_model(model: Any, called: str) -> None:
    """Raises unless ``model`` is an unbound linen Module or an NNX Module, as ``called`` needs."""
    if isinstance(model, nnx.Module):
        return
    if isinstance(model, type) and issubclass(model, nn.Module | nnx.Module):
        raise TypeError(
            f"{called} takes a Module instance, got the class {model.__name__}: write "
            f"{model.__name__}(...) with its fields."
        )
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"{called} takes a linen Module instance or an NNX Module, got {type(model).__name__}."
        )
    if model.scope is not None:
        name = type(model).__name__
        raise TypeError(
            f"{called} takes an unbound linen Module, but this {name} is bound to variables "
            "(by .bind(...), or as self inside a method). Pass the unbound model, as you pass it "
            f"to init: {name}(...) itself, or model.unbind()[0], and give the variables to "
            + ("the step as its arguments." if called == "jaxoffload.plan" else "apply.")
        )


class Discovery:
    """Stands in for a linen plan while tracing: every block lean, and its path noted."""

    outside = Store()

    def __init__(self):
        self.paths: list[str] = []

    def strategy_for(self, path: str) -> Strategy:
        self.paths.append(path)
        return Lean()

    def apply(self, model: nn.Module) -> nn.Module:
        return apply_plan(self, model)


class _Within:
    """``plan`` as its blocks take it inside its ``outside`` (:func:`stored_within`), and the
    paths that the blocks asked it for."""

    def __init__(self, plan: Strategies):
        self.plan, self.asked = plan, set()

    @property
    def outside(self) -> Strategy:
        return self.plan.outside

    def strategy_for(self, path: str) -> Strategy:
        self.asked.add(path)
        return stored_within(self.plan.strategy_for(path), self.plan.outside)


def _check_all_asked(plan: Any, asked: set[str], name: str) -> None:
    """Raises if ``plan`` names blocks that the model's call never asked for: the plan was
    made for another model, or the model's blocks are not plannable, and would run plain."""
    missing = [path for path, _ in getattr(plan, "blocks", ()) if path not in asked]
    if not missing:
        return
    if not asked:
        raise ValueError(
            f"the plan names the blocks {missing}, but {name} called no plannable block, so "
            "none would take its strategy: make the block class plannable, as in "
            "block_cls=jaxoffload.linen.plannable(Block), and plan the model again."
        )
    raise ValueError(
        f"the plan names {missing}, which {name} did not call; the plannable blocks it called "
        f"are {', '.join(sorted(asked))}. The plan was made for another model: plan this one "
        "with jaxoffload.plan."
    )


def _apply_linen(plan: Strategies, model: nn.Module) -> nn.Module:
    """A new unbound Module of ``model``'s class name and fields, whose calls put ``plan`` in effect.

    Plannable blocks (:func:`jaxoffload.linen.plannable`) read the plan in
    effect when Flax builds them inside the model's ``__call__``.
    """
    base = type(model)
    wrapped_by_static: dict[tuple[int, ...], Any] = {}

    def __call__(self, *args, **kwargs):
        within = _Within(plan)
        with context.plan_in_effect(within):
            if plan.outside.is_identity:
                out = base.__call__(self, *args, **kwargs)
            else:
                # Arguments that hold no arrays (``train=True``), and NumPy bools, are
                # static, as nn.remat's static_argnums would make them.
                static = tuple(n + 1 for n, a in enumerate(args) if is_static(a))
                if static not in wrapped_by_static:
                    wrapped_by_static[static] = offload_linen.wrap(
                        base, plan.outside, static_argnums=static
                    )
                out = wrapped_by_static[static].__call__(self, *args, **kwargs)
        _check_all_asked(plan, within.asked, base.__name__)
        return out

    planned = type(
        base.__name__,
        (base,),
        {"__call__": __call__, "__qualname__": base.__qualname__, "__module__": base.__module__},
    )
    fields = {
        f.name: getattr(model, f.name)
        for f in dataclasses.fields(model)
        if f.init and f.name not in ("parent", "name")
    }
    return planned(**fields, name=model.name)


def _apply_nnx(plan: Any, model: nnx.Module) -> nnx.Module:
    """``model`` under ``plan``, changed in place: each block at a plan's path takes its strategy."""
    modules = offload_nnx.submodules(model)
    missing = [path for path, _ in plan.blocks if path not in modules]
    if missing:
        known = ", ".join(list(modules)[:8]) + (", ..." if len(modules) > 8 else "") or "none"
        raise ValueError(
            f"the plan names {missing}, which {type(model).__name__} does not have; its "
            f"submodules are {known}. Plan this model with jaxoffload.plan."
        )
    for path, strategy in plan.blocks:
        applied = stored_within(strategy, plan.outside)
        offload_nnx.wrap_instance(modules[path], applied, (), path=path)
    offload_nnx.wrap_instance(model, plan.outside, ())
    return model
