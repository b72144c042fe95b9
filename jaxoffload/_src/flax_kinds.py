"""What a face was given: linen and NNX Modules told apart, and the face that takes each.

``jaxoffload.wrap`` takes functions of arrays, ``jaxoffload.linen.wrap`` linen
Module classes and methods, ``jaxoffload.nnx.wrap`` NNX Modules and functions of
them. Given another face's target, each would fail deep inside Flax or jax
(``TraceContextError``, ``CallCompactUnboundModuleError``) with no word of why:
these checks name what was passed and the call to write instead.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import flax.linen as linen
import jax
from flax import nnx

from jaxoffload._src.strategies import Strategy, brief

__all__ = [
    "check_function_target",
    "check_linen_target",
    "check_nnx_target",
    "linen_class",
    "refuse_nnx_arguments",
]


def linen_class(target: Any) -> type | None:
    """The linen Module class that ``target`` is, or is a ``functools.partial`` of; else ``None``."""
    cls = target.func if isinstance(target, functools.partial) else target
    return cls if isinstance(cls, type) and issubclass(cls, linen.Module) else None


def _kind(target: Any) -> tuple[str, str] | None:
    """``(kind, class name)`` where ``target`` is a Flax Module or Module class; else ``None``."""
    cls = linen_class(target)
    if cls is not None:
        return "linen class", cls.__name__
    if isinstance(target, linen.Module):
        return "linen Module", type(target).__name__
    if isinstance(target, type) and issubclass(target, nnx.Module):
        return "NNX class", target.__name__
    if isinstance(target, nnx.Module):
        return "NNX Module", type(target).__name__
    return None


# What each kind is called in an error; {n} is the class's name.
_GOT = {
    "linen class": "the linen Module class {n}",
    "linen Module": "the linen Module {n}(...)",
    "NNX class": "the NNX Module class {n}",
    "NNX Module": "the NNX Module {n}(...)",
}


def _refuse(target: Any, strategy: Strategy, face: str, fixes: dict[str, str]) -> None:
    """Raises if ``target`` is of a kind in ``fixes``: ``face``, what it got, then the fix.

    A fix may name the class (``{n}``) and the strategy as written (``{s}``).
    """
    found = _kind(target)
    if found is not None and found[0] in fixes:
        kind, name = found
        fix = fixes[kind].format(n=name, s=brief(strategy))
        raise TypeError(f"{face}, but got {_GOT[kind].format(n=name)}{fix}")


_BUILDS = ": it would be called to build a Module, not to apply one. "
_NNX_FIX = (
    "Write jaxoffload.nnx.wrap(module, {s}) with your {n} instance: it wraps the Module in place"
)


def check_function_target(fun: Any, strategy: Strategy) -> None:
    """Raises if ``fun``, given to the function face, is a linen or NNX Module (class or instance)."""
    _refuse(fun, strategy, "jaxoffload.wrap and jaxoffload.offload take a function of arrays", {
        "linen class": _BUILDS + "Write jaxoffload.linen.offload({n}) or jaxoffload.linen.wrap("
        "{n}, {s}): they return a Module class with {n}'s variables.",
        "linen Module": ", whose variables (parameters, batch_stats) a function transform cannot "
        "see. Write jaxoffload.linen.offload({n})(...) where you wrote {n}(...), or wrap a pure "
        "function such as {n}(...).apply.",
        "NNX Module": " as the function: its variable updates (BatchNorm statistics, RNG counts) "
        "would be lost. " + _NNX_FIX + " and writes its updates back.",
        "NNX class": _BUILDS + "Build the Module, then write jaxoffload.nnx.wrap(module, {s}).",
    })  # fmt: skip
    if inspect.ismethod(fun) and isinstance(fun.__self__, nnx.Module):
        raise TypeError(_nnx_argument_error(type(fun.__self__).__name__))


def refuse_nnx_arguments(args: tuple, kwargs: dict) -> None:
    """Raises if a call of the function face passes NNX Modules, whose updates it would lose."""
    is_module = lambda x: isinstance(x, nnx.Module)  # noqa: E731
    modules = [x for x in jax.tree.leaves((args, kwargs), is_leaf=is_module) if is_module(x)]
    if modules:
        raise TypeError(_nnx_argument_error(type(modules[0]).__name__))


def _nnx_argument_error(name: str) -> str:
    return (
        f"jaxoffload.wrap and jaxoffload.offload take arrays, but got the NNX Module {name}: its "
        "variable updates (BatchNorm statistics, RNG counts) would be lost. Use "
        "jaxoffload.nnx.wrap(f, strategy) or jaxoffload.nnx.offload, which write them back."
    )


def check_nnx_target(f: Any, strategy: Strategy) -> None:
    """Raises if ``f``, given to the NNX face, is a linen Module or an NNX Module class."""
    face = "jaxoffload.nnx.wrap and jaxoffload.nnx.offload take NNX Modules and functions of them"
    _refuse(f, strategy, face, {
        "linen class": ". Write jaxoffload.linen.wrap({n}, {s}): it returns a linen Module class "
        "with {n}'s variables.",
        "linen Module": ", whose variables live in a Flax scope. Write "
        "jaxoffload.linen.wrap({n}, {s})(...) where you wrote {n}(...).",
        "NNX class": ": it would wrap the constructor, and the Modules it builds would run "
        "plain. Build the Module, then write jaxoffload.nnx.wrap(module, {s}): it wraps the "
        "instance in place.",
    })  # fmt: skip


def check_linen_target(target: Any, strategy: Strategy) -> None:
    """Raises if ``target``, given to the linen face, is a Module instance or an NNX Module."""
    face = (
        "jaxoffload.linen.wrap and jaxoffload.linen.offload take a linen Module class or a method"
    )
    _refuse(target, strategy, face, {
        "linen Module": ": a Module class is wrapped, not an instance. Write "
        "jaxoffload.linen.wrap({n}, {s})(...) rather than jaxoffload.linen.wrap({n}(...), {s}).",
        "NNX Module": ". " + _NNX_FIX + ".",
        "NNX class": ". " + _NNX_FIX + ".",
    })  # fmt: skip
