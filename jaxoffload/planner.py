"""Planning: a strategy per block that fits a memory budget at the least step time.

:func:`plan` takes a model (a linen one whose blocks are
:func:`jaxoffload.linen.plannable`, or an NNX one and the class of its blocks),
its training step and a budget, and returns a :class:`Plan`: one strategy
value per block, which :meth:`Plan.apply` puts on the model. The costs come
from the device: each distinct block is timed under each strategy, the host
link is measured, and the plan's compiled program is checked against the
budget. :func:`plan_hidden_offload` is the older, offload-only planner of the
reference models.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jex_core

from jaxoffload import linen as offload_linen
from jaxoffload import nnx as offload_nnx
from jaxoffload import transform
from jaxoffload.strategies import (
    Lean,
    Offload,
    Remat,
    Store,
    Strategy,
    check_strategy,
    strategy_from_dict,
    strategy_to_dict,
)

__all__ = [
    "BlockCost",
    "HiddenPlan",
    "NoPlanFits",
    "Plan",
    "compiled_bytes",
    "estimate_peak_bytes",
    "estimate_step_ms",
    "measure_link",
    "plan",
    "plan_hidden_offload",
]


@dataclasses.dataclass(frozen=True)
class HiddenPlan:
    """Which blocks offload, and the ``Offload`` window they need.

    Attributes:
      offload: one flag per block, from the input end.
      window: the ``Offload`` window, counted in blocks.
      offloaded_bytes: the bytes that cross the link each way.
      freed_bytes: the device bytes that the offloading blocks free, by the
        planner's estimate.
      extra_ms: the recomputation that they add, by the planner's estimate.
    """

    offload: tuple[bool, ...]
    window: int
    offloaded_bytes: int
    freed_bytes: int = 0
    extra_ms: float = 0.0


def plan_hidden_offload(
    block_bytes: Sequence[int],
    *,
    fwd_ms: float,
    bwd_ms: float,
    d2h_gbps: float,
    h2d_gbps: float,
    block_costs: Sequence[float] | None = None,
    freed_bytes: Sequence[int] | None = None,
    extra_ms: Sequence[float] | None = None,
    max_extra_ms: float = math.inf,
    margin: float = 0.8,
    max_window: int = 8,
) -> HiddenPlan:
    """Picks blocks whose transfers fit behind the compute of the blocks next to them.

    With an ``Offload`` window ``w``, a block's host copy runs while the next
    ``w - 1`` blocks compute their forward pass (its residuals exist only
    once it has run), and its fetch while they compute their backward pass. A block can be
    chosen when both transfers fit in ``margin`` of that compute, and chosen
    blocks are at least ``w`` apart, so that no two transfers share the link.
    Each block's share of the compute time, forward and backward, is its share
    of ``block_costs``, or an equal share without them. Measured times are the
    better costs (:func:`jaxoffload.bench.benchmark.time_offloaded_calls`): FLOPs
    (:attr:`jaxoffload.OffloadedCall.flops`) give every ResNet-50 identity
    bottleneck the same share, though on an H200 a 56² one computes 3.9 times as long as
    a 7² one.

    Among those, the plan frees the most device bytes whose recomputation
    (``extra_ms``) stays within ``max_extra_ms``; it is exact (a dynamic
    programme over the blocks). The window that frees the most wins; ties go
    to the smaller window, which holds fewer fetched residuals at once.

    Args:
      block_bytes: residual bytes that each block moves when it offloads.
      fwd_ms: forward compute time of the whole model, without offload.
      bwd_ms: the rest of a training step's compute time.
      d2h_gbps: device-to-host bandwidth, in 10⁹ bytes per second.
      h2d_gbps: host-to-device bandwidth, likewise.
      block_costs: each block's forward compute, in any unit (milliseconds,
        FLOPs); ``None`` for equal.
      freed_bytes: the device bytes that each block frees when it offloads;
        ``None`` for ``block_bytes``. A block that recomputes what it does not
        move frees more than it moves, and one whose neighbours keep its
        input or output frees less.
      extra_ms: the time that each block adds when it offloads, such as its
        recomputation; ``None`` for none.
      max_extra_ms: the most time that the chosen blocks may add together.
      margin: the share of the hiding compute that transfers may use.
      max_window: the largest window tried.

    Returns:
      The plan. It offloads nothing if no block's transfers can hide.

    Example:
      >>> plan = plan_hidden_offload([40e6, 800e6, 60e6, 100e6], fwd_ms=8, bwd_ms=16,
      ...                            d2h_gbps=50, h2d_gbps=50)
      >>> plan.offload, plan.window
      ((True, False, True, False), 2)
      >>> plan_hidden_offload([40e6, 800e6, 60e6, 100e6], fwd_ms=8, bwd_ms=16, d2h_gbps=50,
      ...                     h2d_gbps=50, extra_ms=[0.1, 0, 0.5, 0], max_extra_ms=0.2).offload
      (True, False, False, False)
    """
    if not 0 < margin <= 1:
        raise ValueError(f"margin must be in (0, 1], got {margin}.")
    for name, value in [("fwd_ms", fwd_ms), ("bwd_ms", bwd_ms), ("d2h_gbps", d2h_gbps),
                        ("h2d_gbps", h2d_gbps)]:  # fmt: skip
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}.")
    if not max_extra_ms >= 0:
        raise ValueError(f"max_extra_ms must be non-negative, got {max_extra_ms}.")
    n = len(block_bytes)
    block_costs = _per_block("block_costs", block_costs, n, 1.0)
    if not sum(block_costs) > 0:
        raise ValueError(f"block_costs must give {n} non-negative numbers, not all 0.")
    freed = (
        list(block_bytes) if freed_bytes is None else _per_block("freed_bytes", freed_bytes, n, 0)
    )
    extra = _per_block("extra_ms", extra_ms, n, 0.0)
    share = [c / sum(block_costs) for c in block_costs]
    best = HiddenPlan((False,) * n, 1, 0)
    for window in range(2, min(max_window, n) + 1):
        hidden = set()
        # The last window - 1 blocks have no later blocks to hide behind.
        for i in range(n - window + 1):
            later = sum(share[i + 1 : i + window])
            fwd_bytes = margin * fwd_ms * later * d2h_gbps * 1e6
            bwd_bytes = margin * bwd_ms * later * h2d_gbps * 1e6
            if 0 < block_bytes[i] <= min(fwd_bytes, bwd_bytes) and freed[i] > 0:
                hidden.add(i)
        chosen = _most_freed(hidden, freed, extra, window, max_extra_ms)
        plan = HiddenPlan(
            tuple(i in chosen for i in range(n)),
            window,
            int(sum(block_bytes[i] for i in chosen)),
            int(sum(freed[i] for i in chosen)),
            float(sum(extra[i] for i in chosen)),
        )
        if plan.freed_bytes > best.freed_bytes:
            best = plan
    return best


def _per_block(name, values, n, default) -> list:
    if values is None:
        return [default] * n
    values = list(values)
    if len(values) != n or min(values, default=0) < 0:
        raise ValueError(f"{name} must give {n} non-negative numbers; got {values}.")
    return values


def _most_freed(candidates, freed, extra, window, budget) -> tuple[int, ...]:
    """The candidates, at least ``window`` apart, that free the most within ``budget``.

    From the last block back, each block keeps the plans for the blocks
    after it that no other plan beats on both freed bytes and added time.
    """
    n = len(freed)
    # after[i]: (added time, freed bytes, chosen blocks) for blocks i..n-1.
    after = {i: [(0.0, 0, ())] for i in range(n, n + window + 1)}
    for i in reversed(range(n)):
        options = list(after[i + 1])
        if i in candidates:
            options += [
                (spent + extra[i], total + freed[i], (i, *chosen))
                for spent, total, chosen in after[i + window]
                if spent + extra[i] <= budget
            ]
        options.sort(key=lambda o: (o[0], -o[1]))
        after[i] = [o for k, o in enumerate(options) if all(o[1] > p[1] for p in options[:k])]
    return max(after[0], key=lambda o: (o[1], -o[0]))[2]


# ---- plans ------------------------------------------------------------------------------


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
      budget_bytes: the budget the plan was made for, if any.
      estimated_bytes: the planner's model of the step's device bytes.
      compiled_bytes: the compiled step's device bytes (arguments and
        temporaries), as the planner checked them.
      estimated_step_ms: the planner's model of the step's time: the blocks'
        measured compute, and the transfers that it cannot hide.
      measured_step_ms: the compiled plan's step, as the planner timed it.
      notes: per block, what the planner measured for its choice.

    Example:
      >>> import jaxoffload
      >>> p = Plan((("Block_0", jaxoffload.Lean()), ("Block_1", jaxoffload.Offload(window=2))))
      >>> p.strategy_for("Block_1")
      Offload(names=None, recompute=False, min_bytes=0, max_recompute=0.25, window=2)
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

    def __post_init__(self):
        blocks = tuple((path, check_strategy(s)) for path, s in self.blocks)
        bad = [path for path, _ in blocks if not isinstance(path, str)]
        if bad:
            raise TypeError(f"block paths must be strings such as 'Block_0', got {bad!r}.")
        seen = [path for n, (path, _) in enumerate(blocks) if path in dict(blocks[:n])]
        if seen:
            raise ValueError(f"a plan gives each block one strategy; {seen} appear twice.")
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "outside", check_strategy(self.outside))
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
        are untouched; a ``Store()`` puts a block back as it was.

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
        if isinstance(model, nnx.Module):
            return offload_nnx.apply_plan(self, model)
        return offload_linen.apply_plan(self, model)

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
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan that :meth:`to_dict` wrote."""
        return cls(
            tuple((path, strategy_from_dict(s)) for path, s in data["blocks"]),
            strategy_from_dict(data.get("outside", {"kind": "Store"})),
            **{k: data.get(k) for k in ("budget_bytes", "estimated_bytes", "compiled_bytes")},
            estimated_step_ms=data.get("estimated_step_ms"),
            measured_step_ms=data.get("measured_step_ms"),
            notes=tuple(data.get("notes", ())),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str) -> None:
        """Writes the plan to ``path`` as JSON."""
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> Plan:
        """Reads a plan that :meth:`save` wrote."""
        with open(path) as f:
            return cls.from_json(f.read())

    def __str__(self) -> str:
        rows = [("block", "strategy", "measured")]
        notes = self.notes if len(self.notes) == len(self.blocks) else ("",) * len(self.blocks)
        rows += [(path, _short(s), note) for (path, s), note in zip(self.blocks, notes)]
        rows.append(("(outside the blocks)", _short(self.outside), ""))
        widths = [max(len(r[k]) for r in rows) for k in range(2)]
        lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c}".rstrip() for a, b, c in rows]
        figures = [
            f"{name} {_gib(value)}"
            for name, value in (
                ("budget", self.budget_bytes),
                ("estimated", self.estimated_bytes),
                ("compiled", self.compiled_bytes),
            )
            if value is not None
        ]
        if self.estimated_step_ms is not None:
            figures.append(f"estimated step {self.estimated_step_ms:.1f} ms")
        if self.measured_step_ms is not None:
            figures.append(f"measured step {self.measured_step_ms:.1f} ms")
        return "\n".join(lines + ([", ".join(figures)] if figures else []))


def _short(strategy: Strategy) -> str:
    """A strategy as a short, readable phrase: ``Offload(window=2)``."""
    defaults = type(strategy)()
    changed = [
        f"{f.name}={_policy_or(getattr(strategy, f.name))}"
        for f in dataclasses.fields(strategy)
        if getattr(strategy, f.name) != getattr(defaults, f.name)
    ]
    return f"{type(strategy).__name__}({', '.join(changed)})"


def _policy_or(value: Any) -> str:
    return getattr(value, "__name__", None) or repr(value)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if abs(nbytes) >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


# ---- costs ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """What one block costs under one strategy, measured on the device and read from traces.

    Attributes:
      device_bytes: residuals that stay on the device, other than its input
        and outputs.
      input_bytes: its input, if it keeps it on the device (else 0).
      output_bytes: its outputs, if it keeps them on the device (else 0).
      host_bytes: residuals that wait in host memory: what moves each way.
      recompute_bytes: what its backward pass recomputes and holds at once.
      forward_ms: its forward pass, alone on the device.
      backward_ms: its backward pass, recomputation included, transfers not.
      scale: what the compiled step holds per byte that the traces give,
        for this kind of strategy (:func:`plan` fits it).
    """

    device_bytes: int
    input_bytes: int
    output_bytes: int
    host_bytes: int
    recompute_bytes: int
    forward_ms: float
    backward_ms: float
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class BlockCosts:
    """One plannable block: its path, the sizes at its edges, and its cost under each strategy."""

    path: str
    input_bytes: int
    output_bytes: int
    costs: dict[Strategy, BlockCost]

    def cost(self, strategy: Strategy) -> BlockCost:
        return self.costs[_costed_as(strategy)]


def _costed_as(strategy: Strategy) -> Strategy:
    """Windows change when transfers happen, not what a block keeps or computes."""
    return dataclasses.replace(strategy, window=1) if isinstance(strategy, Offload) else strategy


def _window(strategy: Strategy) -> int:
    return strategy.window if isinstance(strategy, Offload) else 1


def estimate_peak_bytes(blocks: Sequence[BlockCosts], choice: Sequence[Strategy]) -> int:
    """The most device bytes that the blocks' residuals and work hold at once, over the step.

    A model of time, not a sum: the forward pass runs the blocks in order,
    each adding what it keeps; the backward pass runs them in reverse, each
    holding what it keeps, what it fetched, what it recomputes and the
    gradients at its edges, while the blocks before it hold theirs. An
    activation between two blocks counts once, if either keeps it. With an
    ``Offload`` window ``w``, a block's device copies live until ``w - 1``
    blocks later, and its fetched residuals from the backward pass of the
    block ``w - 1`` later. What the rest of the step holds (parameters,
    gradients, the stem) is a constant that :func:`plan` measures.
    """
    c = [b.cost(s) for b, s in zip(blocks, choice)]
    w = [_window(s) for s in choice]
    n = len(c)
    kept, host = [], [x.host_bytes * x.scale for x in c]
    for k in range(n):
        boundary = c[k].input_bytes > 0 or (k > 0 and c[k - 1].output_bytes > 0)
        kept.append(c[k].scale * (c[k].device_bytes + (blocks[k].input_bytes if boundary else 0)))

    def in_flight(i):  # host bytes of earlier blocks whose transfers overlap block i
        return sum(host[j] for j in range(max(0, i - max(w) + 1), i) if j + w[j] > i)

    peak = live = 0.0
    for i in range(n):
        edges = blocks[i].input_bytes + blocks[i].output_bytes
        running = edges + c[i].scale * c[i].device_bytes + host[i]
        peak = max(peak, live + in_flight(i) + running)
        live += kept[i]
    live += c[-1].output_bytes if n else 0
    for i in reversed(range(n)):
        live -= kept[i]
        edges = blocks[i].input_bytes + blocks[i].output_bytes
        work = kept[i] + host[i] + c[i].scale * c[i].recompute_bytes + edges
        peak = max(peak, live + in_flight(i) + work)
    return int(peak)


def estimate_step_ms(
    blocks: Sequence[BlockCosts], choice: Sequence[Strategy], link: tuple[float, float] | None
) -> float:
    """The blocks' time in a step: their compute, and the transfers it cannot hide.

    A block's copies to the host overlap the forward passes of the next
    ``w - 1`` blocks (its window ``w``), and its fetches their backward
    passes; what sticks out is added. Each phase takes at least its
    transfers' time on the link.

    Args:
      link: ``(d2h_gbps, h2d_gbps)``; ``None`` if nothing moves.
    """
    c = [b.cost(s) for b, s in zip(blocks, choice)]
    w = [_window(s) for s in choice]
    forward = sum(x.forward_ms for x in c)
    backward = sum(x.backward_ms for x in c)
    moved = [x.host_bytes for x in c]
    if not any(moved):
        return forward + backward
    if link is None:
        raise ValueError("a plan that moves bytes needs the link's bandwidth.")
    out_ms = [m / (link[0] * 1e6) for m in moved]
    back_ms = [m / (link[1] * 1e6) for m in moved]
    n = len(c)
    exposed_out = sum(
        max(0.0, out_ms[i] - sum(c[j].forward_ms for j in range(i + 1, min(n, i + w[i]))))
        for i in range(n)
    )
    exposed_back = sum(
        max(0.0, back_ms[i] - sum(c[j].backward_ms for j in range(i + 1, min(n, i + w[i]))))
        for i in range(n)
    )
    return max(forward + exposed_out, sum(out_ms)) + max(backward + exposed_back, sum(back_ms))


def _nbytes(aval) -> int:
    """Bytes of one device's shard: an Explicit mesh's sharding is in the aval's type."""
    shape = aval.shape
    sharding = getattr(aval, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and any(sharding.spec):
        shape = sharding.shard_shape(shape)
    return math.prod(shape) * np.dtype(aval.dtype).itemsize


def _struct(aval) -> jax.ShapeDtypeStruct:
    """``aval``'s shape and dtype, and its sharding on the concrete mesh in context, if any."""
    sharding = getattr(aval, "sharding", None)
    mesh = jax.sharding.get_mesh()
    if isinstance(sharding, jax.sharding.NamedSharding) and not mesh.empty:
        return jax.ShapeDtypeStruct(
            aval.shape, aval.dtype, sharding=jax.sharding.NamedSharding(mesh, sharding.spec)
        )
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _explicit_mesh(args) -> jax.sharding.Mesh | None:
    """The mesh of the first argument sharded over Explicit axes: planning runs under it."""
    for leaf in jax.tree.leaves(args):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding) and any(
            t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types
        ):
            return sharding.mesh
    return None


def _residual_bytes(fun, structs, device_inputs) -> tuple[int, int, int, int]:
    """``(device, input, output, host)`` bytes of the residuals that ``jax.vjp(fun)`` keeps and reads."""
    trees = {}

    def forward(*args):
        out, vjp_fun = jax.vjp(fun, *args)
        leaves, trees["vjp"] = jax.tree.flatten(vjp_fun)
        trees["out"] = jax.tree.structure(out)
        return out, leaves

    jaxpr = jax.make_jaxpr(forward)(*structs).jaxpr
    num_out = trees["out"].num_leaves
    outputs, residuals = jaxpr.outvars[:num_out], jaxpr.outvars[num_out:]
    used = transform._used_residuals(trees["vjp"], [a.aval for a in residuals], trees["out"], jaxpr)
    inputs = {v: k for k, v in enumerate(jaxpr.invars)}
    device = kept_input = kept_output = host = 0
    for v in dict.fromkeys(a for a, u in zip(residuals, used) if u):
        if not isinstance(v, jex_core.Var) or inputs.get(v, -1) in device_inputs:
            continue
        size = _nbytes(v.aval)
        if getattr(v.aval, "memory_space", None) == jax.memory.Space.Host:
            host += size
        elif v in inputs:
            kept_input += size
        elif v in outputs:
            kept_output += size
        else:
            device += size
    return device, kept_input, kept_output, host


def _median_ms(fn, *args, runs: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _zeros(struct) -> jax.Array:
    if jax.dtypes.issubdtype(struct.dtype, jax.dtypes.prng_key):
        keys = jax.random.split(jax.random.key(0), math.prod(struct.shape))
        return keys.reshape(struct.shape)
    sharding = getattr(struct, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
        return jnp.zeros(struct.shape, struct.dtype, device=sharding)
    return jnp.zeros(struct.shape, struct.dtype)


def _time_block(fun, structs, runs: int) -> tuple[float, float]:
    """``(forward_ms, forward_and_backward_ms)`` of ``fun`` alone on the default device."""
    args = [_zeros(s) for s in structs]
    out_structs = jax.eval_shape(fun, *structs)
    floats = [jax.dtypes.issubdtype(o.dtype, np.inexact) for o in out_structs]

    def both(args, cotangents):
        out, vjp_fun = jax.vjp(fun, *args)
        it = iter(cotangents)
        full = [
            next(it) if f else np.zeros(o.shape, jax.dtypes.float0) for f, o in zip(floats, out)
        ]
        return vjp_fun(full)

    cotangents = [_zeros(o) for f, o in zip(floats, out_structs) if f]
    forward_ms = _median_ms(jax.jit(fun), *args, runs=runs)
    both_ms = _median_ms(jax.jit(both), args, cotangents, runs=runs)
    return forward_ms, both_ms


def _cost_blocks(paths, calls, options, *, runs, say) -> list[BlockCosts]:
    """Each block's cost under each option: traced once and timed once per distinct program."""
    costed = [_costed_as(s) for s in options]
    costed = list(dict.fromkeys([Store(), *costed]))
    by_program: dict[tuple, dict[Strategy, BlockCost]] = {}
    programs = [(str(call.forward), call.device_inputs) for call in calls]
    distinct = list(dict.fromkeys(programs))
    blocks = []
    for path, call, program in zip(paths, calls, programs):
        fun = jex_core.jaxpr_as_fun(call.forward)
        invars, outvars = call.forward.jaxpr.invars, call.forward.jaxpr.outvars
        structs = [_struct(v.aval) for v in invars]
        input_bytes = sum(
            _nbytes(v.aval) for k, v in enumerate(invars) if k not in call.device_inputs
        )
        output_bytes = sum(_nbytes(v.aval) for v in outvars)
        if program not in by_program:
            say(f"timing block program {distinct.index(program) + 1}/{len(distinct)} ({path})")
            by_program[program] = _cost_program(fun, structs, call.device_inputs, costed, runs)
        blocks.append(BlockCosts(path, input_bytes, output_bytes, by_program[program]))
    return blocks


def _cost_program(fun, structs, device_inputs, strategies, runs) -> dict[Strategy, BlockCost]:
    store_forward_ms = None
    measured = {}
    for strategy in strategies:
        wrapped = transform.wrap(fun, strategy, device_argnums=device_inputs)
        device, kept_input, kept_output, host = _residual_bytes(wrapped, structs, device_inputs)
        # Compute alone: the link's share is the planner's model (estimate_step_ms).
        with transform.without_host_placement():
            forward_ms, both_ms = _time_block(wrapped, structs, runs)
        if store_forward_ms is None:
            store_forward_ms = forward_ms
        measured[strategy] = (device, kept_input, kept_output, host, both_ms)
    store_device = measured[Store()][0]
    costs = {}
    for strategy, (device, kept_input, kept_output, host, both_ms) in measured.items():
        recomputes = isinstance(strategy, Remat) or (
            isinstance(strategy, Offload) and strategy.recompute
        )
        costs[strategy] = BlockCost(
            device, kept_input, kept_output, host,
            max(0, store_device - device) if recomputes else 0,
            store_forward_ms, max(0.0, both_ms - store_forward_ms),
        )  # fmt: skip
    return costs


def measure_link(nbytes: int = 2**30, runs: int = 3) -> dict[str, float]:
    """The host link's bandwidth: ``jax.device_put`` between device and pinned host memory.

    Args:
      nbytes: size of the array moved each way.
      runs: timed moves each way; the median counts.

    Returns:
      ``{"d2h_gbps": ..., "h2d_gbps": ...}``, in 10⁹ bytes per second.
    """
    device = jax.devices()[0]
    on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    x = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), on_device)
    host = jax.device_put(x, on_host).block_until_ready()
    d2h = _median_ms(lambda: jax.device_put(x, on_host), runs=runs)
    h2d = _median_ms(lambda: jax.device_put(host, on_device), runs=runs)
    return {"d2h_gbps": x.nbytes / d2h / 1e6, "h2d_gbps": x.nbytes / h2d / 1e6}


# ---- the search -------------------------------------------------------------------------


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


# ---- planning ---------------------------------------------------------------------------


class NoPlanFits(ValueError):
    """No mix of the planner's options fits the budget."""


def default_options() -> tuple[Strategy, ...]:
    """The strategies a block may take: every kind, and offload with windows 1 and 2.

    Host placement does nothing on a CPU (host and device memory are one),
    so there the options that offload are left out.
    """
    options: list[Strategy] = [Store(), Lean(), Remat()]
    if jax.default_backend() != "cpu":
        options += [Offload(), Offload(window=2), Offload(recompute=True)]
    return tuple(options)


class _Discovery:
    """Stands in for a linen plan while tracing: every block lean, and its path noted."""

    outside = Store()

    def __init__(self):
        self.paths: list[str] = []

    def strategy_for(self, path: str) -> Strategy:
        self.paths.append(path)
        return Lean()

    def apply(self, model):
        return offload_linen.apply_plan(self, model)


def _discover(model, step, args, blocks) -> tuple[list[str], list[transform.OffloadedCall]]:
    """The paths of the blocks that ``step`` calls, in call order, and each one's wrapped call."""
    if isinstance(model, nnx.Module):
        every_block_lean = Plan(tuple((p, Lean()) for p in offload_nnx.block_paths(model, blocks)))
        with offload_nnx.calls_recorded() as paths:
            fun, arrays, _ = _program(model, step, args, every_block_lean)
            calls = transform.offloaded_calls(fun, *arrays)
        return paths, calls
    if blocks is not None:
        raise TypeError(
            "blocks= selects the blocks of an NNX model; a linen model's blocks are those whose "
            "class is jaxoffload.linen.plannable (block_cls=jaxoffload.linen.plannable(Block))."
        )
    discovery = _Discovery()
    fun, arrays, _ = _program(model, step, args, discovery)
    return discovery.paths, transform.offloaded_calls(fun, *arrays)


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
    return _device_bytes(_compile(model, step, args, plan, donate_argnums))


def _program(model, step, args, plan, donate_argnums=()):
    """``step`` with ``model`` under ``plan``, as a function of arrays: ``(fun, arrays, donate)``."""
    if isinstance(model, nnx.Module):
        return offload_nnx.functional(step, plan.apply(model), args, donate_argnums)
    return functools.partial(step, plan.apply(model)), args, donate_argnums


def _compile(model, step, args, plan: Plan, donate_argnums):
    fun, arrays, donate = _program(model, step, args, plan, donate_argnums)
    return jax.jit(fun, donate_argnums=donate).trace(*arrays).lower().compile()


def _device_bytes(executable) -> int:
    memory = executable.memory_analysis()
    return int(memory.temp_size_in_bytes + memory.argument_size_in_bytes)


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
        planner = _Planner(
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


class _Planner:
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
        self.paths, calls = _discover(model, step, args, blocks)
        _check_blocks(self.paths, calls, nnx_model=isinstance(model, nnx.Module))
        self.link = None
        if any(isinstance(s, Offload) for s in options):
            link = measure_link()
            self.link = (link["d2h_gbps"], link["h2d_gbps"])
            say(f"host link: {self.link[0]:.1f} GB/s out, {self.link[1]:.1f} GB/s back")
        self.blocks = _cost_blocks(self.paths, calls, options, runs=runs, say=say)
        self.plain = Plan(tuple((p, Store()) for p in self.paths))
        # What the compiled programs take: the same arrays under every plan.
        self.arrays = _program(model, step, args, self.plain)[1]
        self.lean_outside = dataclasses.replace(self.plain, outside=Lean())
        say("compiling the plain step, and again with the code outside the blocks lean")
        # Every compiled plan is a candidate for every budget.
        self.checked = {p: self.compiled(p) for p in (self.plain, self.lean_outside)}
        # What the step holds besides the blocks' residuals and work.
        blocks_peak = estimate_peak_bytes(self.blocks, self.plain.strategies)
        self.constant = {p.outside: self.checked[p] - blocks_peak for p in self.checked}
        say(f"plain step: {_gib(self.checked[self.plain])}")
        self._calibrate()

    def _calibrate(self) -> None:
        """Fits, per kind of strategy, the compiled bytes per traced byte, from uniform plans.

        XLA's buffers are not the traces' residuals: it fuses some away and
        keeps others longer. Each uniform plan (every block lean, every block
        rematerialised, every block offloaded), compiled, is also a candidate.
        """
        scales = {Store: 1.0}
        for kind in (Lean, Remat, Offload):
            if kind not in {type(s) for s in self.options}:
                continue
            strategy = next(s for s in self.options if type(s) is kind)
            uniform = Plan(tuple((p, strategy) for p in self.paths), Lean())
            self.say(f"compiling every block {_short(strategy)}, to calibrate")
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
        executable = _compile(self.model, self.step, self.args, candidate, self.donate_argnums)
        self.executables[candidate] = executable
        return _device_bytes(executable)

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
                    args = jax.block_until_ready(jax.tree.map(_zeros, self.arrays))
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
        say(f"planning for {_gib(budget_bytes)}")
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
            say(f"{_gib(self.checked[candidate])} compiled: over the budget; planning tighter")
            # Tighter each time the same plan comes back, so the search moves on.
            over = (self.checked[candidate] - budget_bytes + budget_bytes // 100) * tighten
            tighten *= 2
            targets = {o: t - over for o, t in targets.items()}
        fitting = [p for p, got in self.checked.items() if got <= budget_bytes]
        if not fitting:
            raise NoPlanFits(
                f"no plan of {[_short(s) for s in self.options]} fits {_gib(budget_bytes)} "
                f"(the plain step takes {_gib(plain_bytes)}; the least compiled was "
                f"{_gib(min(self.checked.values()))}). Try a smaller batch"
                + (", or plan on a GPU, where blocks can offload." if self.link is None else ".")
            )
        # The compiled candidates that fit are run: the measured step decides.
        say(f"timing the {len(fitting)} compiled plans that fit")
        best = min(fitting, key=lambda p: (self.step_ms(p), self.ms(p.strategies)))
        say(
            f"chose {_summary(best.strategies)}, outside {_short(best.outside)}: compiled "
            f"{_gib(self.checked[best])}, step {self.step_ms(best):.1f} ms"
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
        counts[_short(s)] = counts.get(_short(s), 0) + 1
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
