"""The plan: one strategy per block of a model, as a value that prints, compares and saves."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Sequence
from typing import Any

from jaxoffload._src import checks
from jaxoffload._src.jaxprs import format_bytes
from jaxoffload._src.planner.apply import apply_plan
from jaxoffload._src.strategies import (
    Store,
    Strategy,
    brief,
    check_strategy,
    strategy_from_dict,
    strategy_to_dict,
)

__all__ = ["Plan"]

# What Plan.to_dict writes besides "blocks" and "outside": figures, and notes.
_FIGURES = (
    "budget_bytes",
    "estimated_bytes",
    "compiled_bytes",
    "estimated_step_ms",
    "measured_step_ms",
    "notes",
    "held_bytes",
)
_FIELDS = ("blocks", "outside", *_FIGURES)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One strategy per plannable block of a model, and one for the code between the blocks.

    A plan is a value: it prints as a table, compares, hashes, and saves to
    JSON. :meth:`apply` puts it on a model, so the training loop is the one
    that trained the plain model. :func:`plan` makes one for a budget; one
    can also be written by hand.

    Attributes:
      blocks: ``(path, strategy)`` pairs in call order. A path is the
        block's Flax path joined by ``/``: ``"BottleneckResNetBlock_3"`` in
        linen, ``"blocks/3"`` in NNX.
      outside: the strategy of the code outside the blocks (a stem, a
        classifier), applied as wrapped Modules nest.
      budget_bytes: the budget the plan was made for, if any, in device bytes: what the
        compiled step and ``held_bytes`` fit together. A share given to :func:`plan` is
        of the plain step's peak as the planning process saw it, its compiled bytes and
        ``held_bytes``.
      estimated_bytes: the planner's model of the step's device bytes, calibrated to the
        other plans it compiled.
      compiled_bytes: the compiled step's device bytes (arguments and
        temporaries), as the planner checked them.
      estimated_step_ms: the planner's model of the step's time: the blocks'
        measured compute, and the transfers that it cannot hide.
      measured_step_ms: the compiled plan's step, as the planner timed it.
      notes: per block, what the planner measured for its choice.
      held_bytes: what the planning process held on the device besides the step's
        arguments (an undonated copy of the initial state, say), counted in the budget
        beside the compiled step: ``compiled_bytes + held_bytes <= budget_bytes``. 0
        where the device reports no memory in use, as a CPU does: then the budget is of
        the compiled step alone. ``None`` for a plan that the planner did not make.

    Example:
      >>> import jaxoffload
      >>> p = Plan((("Block_0", jaxoffload.Lean()), ("Block_1", jaxoffload.Offload(window=2))))
      >>> p.strategy_for("Block_1")
      Offload(names=None, recompute=False, min_bytes=0, max_recompute=0.25, window=2, max_bytes=None, fetch_window=None)
      >>> Plan.from_json(p.to_json()) == p
      True
    """

    blocks: tuple[tuple[str, Strategy], ...]
    outside: Strategy = Store()
    budget_bytes: int | None = dataclasses.field(default=None, compare=False)
    estimated_bytes: int | None = dataclasses.field(default=None, compare=False)
    compiled_bytes: int | None = dataclasses.field(default=None, compare=False)
    estimated_step_ms: float | None = dataclasses.field(default=None, compare=False)
    measured_step_ms: float | None = dataclasses.field(default=None, compare=False)
    notes: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    held_bytes: int | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        def pair(b):
            return isinstance(b, Sequence) and not isinstance(b, str) and len(b) == 2

        given = self.blocks
        if isinstance(given, str) or not isinstance(given, Sequence) or not all(map(pair, given)):
            raise TypeError(
                "blocks must be (path, strategy) pairs, such as (('Block_0', Lean()),), got "
                f"{given!r}."
            )
        blocks = tuple((path, check_strategy(s)) for path, s in self.blocks)
        bad = [path for path, _ in blocks if not isinstance(path, str)]
        if bad:
            raise TypeError(f"block paths must be strings such as 'Block_0', got {bad!r}.")
        seen = [path for n, (path, _) in enumerate(blocks) if path in dict(blocks[:n])]
        if seen:
            raise ValueError(f"a plan gives each block one strategy; {seen} appear twice.")
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "outside", check_strategy(self.outside))
        for name in ("budget_bytes", "estimated_bytes", "compiled_bytes", "held_bytes"):
            value = checks.integer(name, getattr(self, name), minimum=0, none=True)
            object.__setattr__(self, name, value)
        for name in ("estimated_step_ms", "measured_step_ms"):
            value = checks.real(name, getattr(self, name), minimum=0, finite=False, none=True)
            object.__setattr__(self, name, value)
        if isinstance(self.notes, str) or not all(isinstance(n, str) for n in self.notes):
            raise TypeError(f"notes must be strings, one per block, got {self.notes!r}.")
        object.__setattr__(self, "notes", tuple(self.notes))

    def strategy_for(self, path: str) -> Strategy:
        """The strategy of the block at ``path``.

        Raises:
          ValueError: if the plan has no such block: it was made for another model.
        """
        for p, strategy in self.blocks:
            if p == path:
                return strategy
        known = ", ".join(p for p, _ in self.blocks[:6]) + (", ..." if len(self.blocks) > 6 else "")
        raise ValueError(
            f"the plan has no block {path!r}; it was made for a model whose plannable blocks "
            f"are {known or 'none'}. Plan this model with jaxoffload.plan."
        )

    @property
    def strategies(self) -> tuple[Strategy, ...]:
        """The blocks' strategies, in call order."""
        return tuple(s for _, s in self.blocks)

    def apply(self, model: Any) -> Any:
        """``model``, whose blocks take this plan's strategies.

        A linen ``model`` is an unbound Module whose blocks are
        :func:`jaxoffload.linen.plannable`; the result is a new Module of the
        same class name and fields: its variables are ``model``'s, and
        ``init``, ``apply`` and the training step are unchanged.

        An NNX ``model`` is changed in place and returned, as
        :func:`jaxoffload.nnx.wrap` changes a Module instance: the submodule
        at each of the plan's paths takes its strategy, and ``model`` itself
        the ``outside`` one. Its variables, and the Optimizer that holds them,
        are untouched; a ``Store()`` puts a block back as it was. Inside a
        wrapped ``outside`` (``Lean()``, say), a ``Store()`` block is a call of
        its own that keeps what jax keeps, so that the outside's cut does not
        reach into it.

        Example:
          >>> import jax, jax.numpy as jnp, flax.linen as nn
          >>> import jaxoffload
          >>> Dense = jaxoffload.linen.plannable(nn.Dense)
          >>> class Net(nn.Module):
          ...     @nn.compact
          ...     def __call__(self, x):
          ...         return Dense(2)(nn.relu(Dense(4)(x)))
          >>> plan = Plan((("Dense_0", jaxoffload.Lean()), ("Dense_1", jaxoffload.Remat())))
          >>> v = plan.apply(Net()).init(jax.random.key(0), jnp.ones((1, 3)))
          >>> sorted(v["params"])
          ['Dense_0', 'Dense_1']
        """
        return apply_plan(self, model)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data; :meth:`from_dict` reads it back."""
        return {
            "blocks": [[path, strategy_to_dict(s)] for path, s in self.blocks],
            "outside": strategy_to_dict(self.outside),
            "budget_bytes": self.budget_bytes,
            "estimated_bytes": self.estimated_bytes,
            "compiled_bytes": self.compiled_bytes,
            "estimated_step_ms": self.estimated_step_ms,
            "measured_step_ms": self.measured_step_ms,
            "notes": list(self.notes),
            "held_bytes": self.held_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan that :meth:`to_dict` wrote.

        Raises:
          ValueError: if ``data`` is not a plan, saying what is wrong and at which block.
        """
        return cls._read(data, "the data")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan that :meth:`to_json` wrote; a ``ValueError`` says what is wrong if not."""
        if not isinstance(text, str | bytes):
            raise TypeError(
                f"Plan.from_json takes the text that Plan.to_json wrote, got {text!r}; for a "
                "file, write Plan.load(path)."
            )
        named = text.strip() if isinstance(text, str) else ""
        if named.endswith(".json") or (named and os.path.isfile(named)):
            raise ValueError(
                f"Plan.from_json takes the text that Plan.to_json wrote, got {named!r}, which "
                f"names a file: write Plan.load({named!r})."
            )
        return cls._read(_parsed(text, "the JSON text"), "the JSON text")

    def save(self, path: str) -> None:
        """Writes the plan to ``path`` as JSON."""
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> Plan:
        """Reads a plan that :meth:`save` wrote.

        Raises:
          ValueError: if the file holds no plan: damaged or cut-off JSON, or data that
            is not a plan's. The message names the file, what is wrong, and the block.
        """
        with open(path) as f:
            text = f.read()
        return cls._read(_parsed(text, str(path)), str(path))

    @classmethod
    def _read(cls, data: Any, source: str) -> Plan:
        """The plan in ``data``, read from ``source`` (a file, for the errors)."""
        what = 'what Plan.save writes: an object whose "blocks" are [path, strategy] pairs'
        if not isinstance(data, dict):
            raise ValueError(f"{source} holds no plan: {what}, but it holds {_json_kind(data)}.")
        if "blocks" not in data:
            raise ValueError(
                f'{source} holds no plan: {what}, but it has no "blocks" (its keys: '
                f"{', '.join(map(repr, data)) or 'none'})."
            )
        unknown = [k for k in data if k not in _FIELDS]
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), _FIELDS, n=1)
            raise ValueError(
                f"{source}: a plan has no field {unknown[0]!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; its fields are {', '.join(_FIELDS)}."
            )
        if not isinstance(data["blocks"], list):
            raise ValueError(f'{source}: "blocks" must be a list of [path, strategy] pairs.')
        blocks = []
        for n, entry in enumerate(data["blocks"]):
            if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
                raise ValueError(
                    f"{source}, block {n}: a block is a [path, strategy] pair such as "
                    f'["Block_0", {{"kind": "Lean"}}], got {entry!r}.'
                )
            path, fields = entry
            blocks.append((path, _strategy(fields, f"{source}, block {n} ({path!r})")))
        outside = _strategy(data.get("outside", {"kind": "Store"}), f"{source}, outside the blocks")
        try:
            return cls(tuple(blocks), outside, **{k: data[k] for k in _FIGURES if k in data})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e

    def __str__(self) -> str:
        rows = [("block", "strategy", "measured")]
        notes = self.notes if len(self.notes) == len(self.blocks) else ("",) * len(self.blocks)
        rows += [(path, brief(s), note) for (path, s), note in zip(self.blocks, notes)]
        rows.append(("(outside the blocks)", brief(self.outside), ""))
        widths = [max(len(r[k]) for r in rows) for k in range(2)]
        lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}".rstrip() for a, b, c in rows]
        figures = [
            f"{name} {format_bytes(value)}"
            for name, value in (
                ("budget", self.budget_bytes),
                ("estimated", self.estimated_bytes),
                ("compiled", self.compiled_bytes),
            )
            if value is not None
        ]
        if self.budget_bytes is not None and self.held_bytes is not None:
            # What the budget counts, so that it reads against what the device shows.
            figures[0] += (
                f" for the compiled step and {format_bytes(self.held_bytes)} held besides it"
                if self.held_bytes
                else " for the compiled step alone"
            )
        if self.estimated_step_ms is not None:
            figures.append(f"estimated step {self.estimated_step_ms:.1f} ms")
        if self.measured_step_ms is not None:
            figures.append(f"measured step {self.measured_step_ms:.1f} ms")
        return "\n".join(lines + ([", ".join(figures)] if figures else []))


def _parsed(text: str, source: str) -> Any:
    """The JSON in ``text``; a ``ValueError`` that names ``source`` if it is damaged."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{source} holds no plan: its JSON is damaged or cut off at line {e.lineno}, column "
            f"{e.colno} ({e.msg}). Save the plan again (Plan.save), or plan the model again."
        ) from e


def _strategy(fields: Any, where: str) -> Strategy:
    """The strategy written in ``fields``; a ``ValueError`` that says ``where`` if not."""
    try:
        return strategy_from_dict(fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


def _json_kind(data: Any) -> str:
    """What JSON value ``data`` is, in words: ``a list``, ``a string``."""
    kinds = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(data), "a number")
