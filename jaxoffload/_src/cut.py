"""Which residuals a function keeps: the cheapest cut of its forward graph.

The backward pass of ``jax.vjp`` reads residuals that its forward pass computes:
convolution inputs, ReLU masks, BatchNorm's float32 centred copies. Many of
them are cheap elementwise functions of others, so a function can keep fewer
bytes and recompute the rest in its backward pass, as ``jax.checkpoint`` does.
Which values to keep is a minimum cut of the forward graph (as in PyTorch's
min-cut rematerialisation partitioner): every residual that the backward pass
reads must be kept or recomputable from kept values, and the cut minimises the
bytes kept plus a price for what is recomputed.

Recomputation is priced by what it costs the backward pass:

- elementwise and layout operations are nearly free: they fuse into the
  backward pass's own loops over the same tensors;
- a reduction costs a pass over its input, so its (small) output is kept;
- a convolution or matrix product costs its FLOPs, at a rate chosen so that
  at most ``max_recompute`` of the function's forward FLOPs are recomputed;
  but a grouped (depthwise) convolution, memory-bound, costs passes over its
  input and output, so that its output is kept;
- a product's input that a polynomial transcendental (``erf``, ``tanh``) over a
  tensor of its size makes, such as GELU's output, is kept: the weight's
  gradient reads it from memory, so recomputing it writes it in a kernel of its
  own, and XLA writes the polynomial's value out and reads it back where the
  derivative needs it too (docs/design.md, "Lean, measured");
- anything else (loops, effects, custom calls) is never recomputed.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jax.extend import core as jex_core

from jaxoffload._src.jaxprs import eqn_flops, nbytes

__all__ = ["SOLVED", "Cut", "Price", "SolvedCuts", "ancestors", "cheapest_cut", "price", "prices"]

_INF = math.inf

# Operations whose recomputation fuses into the loops that read their outputs.
_ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh bitcast_convert_type broadcast_in_dim
    cbrt ceil clamp concatenate convert_element_type copy copy_p cos cosh div eq erf erf_inv erfc
    exp exp2 expand_dims expm1 floor ge gt imag integer_pow iota is_finite le lgamma log log1p
    logistic lt max min mul ne neg nextafter not or pad population_count pow real reduce_precision
    rem reshape rev round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical
    sign sin sinh slice sqrt square squeeze stop_gradient sub tan tanh transpose xor name
    optimization_barrier dynamic_slice random_bits random_wrap random_unwrap random_seed
    random_fold_in random_split threefry2x32 device_put""".split()
)
# Operations whose recomputation costs a pass over their inputs.
_PASSES = frozenset(
    """reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin
    cumsum cumprod cummax cummin cumlogsumexp reduce_window_sum reduce_window_max reduce_window_min
    reduce_window select_and_gather_add select_and_scatter_add gather dynamic_update_slice
    scatter scatter-add scatter_add sort""".split()
)
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})
# Elementwise operations that XLA:GPU computes as polynomials over float32 (exp, log and the
# logistic function are an instruction or two, and fuse wherever they are read).
_POLYNOMIAL = frozenset(
    """acos acosh asin asinh atan atan2 atanh cos cosh digamma erf erf_inv erfc lgamma sin sinh
    tan tanh""".split()
)
# Calls whose cost is that of the jaxprs they hold.
_CALLS = frozenset(
    {"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
     "custom_vjp_call_jaxpr", "remat", "checkpoint", "cond"}
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Price:
    """What recomputing one equation costs: FLOPs, bytes of extra passes, or never."""

    flops: int = 0
    passes: int = 0
    never: str | None = None  # why it is never recomputed

    def __add__(self, other: Price) -> Price:
        return Price(
            self.flops + other.flops, self.passes + other.passes, self.never or other.never
        )


def price(eqn) -> Price:
    """What recomputing ``eqn`` in the backward pass costs, by the rules of the module's top."""
    name = eqn.primitive.name
    if eqn.effects:
        return Price(never=f"{name} has effects")
    if name in _ELEMENTWISE:
        return Price()
    if name in _PASSES:
        return Price(passes=sum(nbytes(v.aval) for v in eqn.invars))
    if name == "conv_general_dilated" and eqn.params["feature_group_count"] > 1:
        # A grouped (depthwise) convolution does a few FLOPs per byte, and runs at memory
        # speed: recomputing it costs passes over its input and output, not its FLOPs.
        return Price(passes=sum(nbytes(v.aval) for v in [*eqn.invars, *eqn.outvars]))
    if name in _MATMULS:
        return Price(flops=eqn_flops(eqn))
    if name in _CALLS:
        total = Price()
        for sub in jex_core.jaxprs_in_params(eqn.params):
            for e in sub.eqns:
                total = total + price(e)
        return total
    return Price(never=f"jaxoffload has no recomputation rule for {name}")


def prices(jaxpr, needed: Iterable[Any]) -> dict[int, Price]:
    """Each equation's :func:`price`, by its index, where the backward pass reads ``needed``:
    a matrix product's input that the backward pass reads and that a polynomial
    transcendental over a tensor of its size makes is never recomputed (see the module's
    docstring)."""
    found = {i: price(e) for i, e in enumerate(jaxpr.eqns)}
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    product_inputs = {u for e in jaxpr.eqns if e.primitive.name in _MATMULS for u in e.invars}
    for v in needed:
        if v in product_inputs and v in producer:
            if made_by := _made_by_polynomial(jaxpr, v, producer):
                found[producer[v]] = Price(never=f"a product's input, made by {made_by}")
    return found


def _made_by_polynomial(jaxpr, v, producer) -> str | None:
    """The polynomial transcendental over a tensor of at least half ``v``'s bytes that the
    elementwise chain making ``v`` runs, if any: one over a statistic (a squeeze-and-excitation
    gate's ``tanh``) does not count."""
    todo, seen = [v], set()
    while todo:
        u = todo.pop()
        if u in seen or u not in producer:
            continue
        seen.add(u)
        eqn = jaxpr.eqns[producer[u]]
        name = eqn.primitive.name
        if name in _POLYNOMIAL and 2 * nbytes(eqn.outvars[0].aval) >= nbytes(v.aval):
            return name
        if name in _ELEMENTWISE:
            todo.extend(w for w in eqn.invars if isinstance(w, jex_core.Var))
    return None


@dataclasses.dataclass(frozen=True)
class Cut:
    """The values a function keeps for its backward pass, and what it recomputes there.

    Attributes:
      saved: the kept values, as variables of the forward jaxpr.
      recomputed: indices of the forward jaxpr's equations that the backward
        pass runs again, in order.
      recompute_flops: the FLOPs of the matrix products among them.
      forward_flops: the FLOPs of all the forward pass's matrix products.
      never: for each equation that may not be recomputed, why.
    """

    saved: tuple[Any, ...]
    recomputed: tuple[int, ...]
    recompute_flops: int
    forward_flops: int
    never: dict[int, str]


def cheapest_cut(
    jaxpr,
    needed: Iterable[Any],
    free: Iterable[Any] = (),
    *,
    max_recompute: float = 0.25,
) -> Cut:
    """The residuals to keep so that the backward pass can compute ``needed``.

    Args:
      jaxpr: the forward pass (a ``jax.extend.core.Jaxpr``), whose outputs
        include the residuals of ``jax.vjp``.
      needed: the variables that the backward pass reads.
      free: variables that cost nothing to keep, because they are kept
        anyway (parameters, or a value that the next layer keeps).
      max_recompute: the most FLOPs of matrix products that may be
        recomputed, as a share of the forward pass's.

    Returns:
      The cut that keeps the fewest bytes within that many FLOPs recomputed.
    """
    if not 0 <= max_recompute:
        raise ValueError(f"max_recompute must be non-negative, got {max_recompute}.")
    needed = [v for v in dict.fromkeys(needed) if isinstance(v, jex_core.Var)]
    variables = list(
        dict.fromkeys(
            [*jaxpr.invars, *jaxpr.constvars]
            + [v for e in jaxpr.eqns for v in e.outvars if not isinstance(v, jex_core.DropVar)]
        )
    )
    position = {v: n for n, v in enumerate(variables)}
    free = set(free)
    key = (
        hashlib.sha256(str(jaxpr).encode()).digest(),
        tuple(position[v] for v in needed),
        tuple(sorted(position[v] for v in free if v in position)),
        max_recompute,
    )

    def solve() -> Cut:
        cut = _cheapest_cut(jaxpr, needed, free, max_recompute)
        return dataclasses.replace(cut, saved=tuple(position[v] for v in cut.saved))

    solved = SOLVED.get(key, solve)
    return dataclasses.replace(solved, saved=tuple(variables[n] for n in solved.saved))


class SolvedCuts:
    """Cuts solved so far, by program, their kept values given by position.

    The blocks of a model repeat (a ResNet stage's blocks are one program, traced once per
    block and once per plan): each distinct cut is solved once, keyed by the printed jaxpr
    (its digest: the text of a large block is long), and its kept values mapped onto each
    trace's variables by their positions. The oldest is dropped past ``size`` cuts.
    """

    def __init__(self, size: int = 512):
        self.size = size
        self.solves = 0  # how many cuts were solved, not found
        self._cuts: collections.OrderedDict[tuple, Cut] = collections.OrderedDict()

    def get(self, key: tuple, solve: Callable[[], Cut]) -> Cut:
        """The cut kept under ``key``, or ``solve()``'s, kept there."""
        if key not in self._cuts:
            self._cuts[key] = solve()
            self.solves += 1
            if len(self._cuts) > self.size:
                self._cuts.popitem(last=False)
        return self._cuts[key]


SOLVED = SolvedCuts()


def _cheapest_cut(jaxpr, needed, free, max_recompute) -> Cut:
    relevant = ancestors(jaxpr, needed)
    every = prices(jaxpr, needed)
    priced = {i: every[i] for i in relevant}
    never = {i: p.never for i, p in priced.items() if p.never}
    forward_flops = sum(p.flops for p in every.values() if not p.never)
    allowed_flops = max_recompute * forward_flops
    # Each candidate rate (FLOPs per byte kept) prices matrix products so that
    # recomputing one pays off just above its own ratio of FLOPs to bytes.
    # Equal ratios are told apart by position, so that the allowance can take
    # one of two equal convolutions rather than neither.
    matmuls = [i for i, p in priced.items() if p.flops and not p.never]
    ratios = sorted(
        priced[i].flops * _tie_break(i) / max(1, sum(nbytes(v.aval) for v in jaxpr.eqns[i].outvars))
        for i in matmuls
    )
    # Rates trace the cheapest cuts on the way to the allowance; one that
    # falls between two of them may fit one large product better than the
    # small ones below it, so each product is also tried alone.
    candidates = [(None, None), *((r * (1 + 1e-12), None) for r in ratios), (math.inf, None)]
    candidates += [(math.inf, i) for i in matmuls]
    best = None
    for rate, only in candidates:
        cut = _solve(jaxpr, needed, free, relevant, priced, rate, only)
        flops = sum(priced[i].flops for i in cut[1])
        if flops > allowed_flops:
            continue  # too many: a higher rate can still fit as one product alone
        cost = sum(nbytes(v.aval) for v in cut[0] if v not in free)
        if best is None or (cost, flops) < best[0]:
            best = ((cost, flops), cut, flops)
    _, (saved, recomputed), flops = best
    return Cut(tuple(saved), tuple(sorted(recomputed)), flops, forward_flops, never)


def ancestors(jaxpr, needed: Sequence[Any], known: frozenset | set = frozenset()) -> list[int]:
    """Indices of the equations that ``needed`` depends on, in order, short of ``known`` values."""
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    todo, seen, eqns = list(needed), set(), set()
    while todo:
        v = todo.pop()
        if v in seen or v in known:
            continue
        seen.add(v)
        i = producer.get(v)
        if i is not None and i not in eqns:
            eqns.add(i)
            todo.extend(u for u in jaxpr.eqns[i].invars if isinstance(u, jex_core.Var))
    return sorted(eqns)


def _solve(jaxpr, needed, free, relevant, prices, rate, only=None):
    """One minimum cut, with matrix products priced at ``rate`` FLOPs per byte (``None``: never).

    With ``only``, that one equation is the only matrix product that may be recomputed.
    """
    graph = _FlowGraph()
    source, sink = graph.node(), graph.node()
    value_in, value_out = {}, {}

    def value(v):
        if v not in value_in:
            value_in[v], value_out[v] = graph.node(), graph.node()
            keep = 0 if v in free else max(1, nbytes(v.aval))
            graph.edge(value_in[v], value_out[v], keep)
        return value_in[v], value_out[v]

    produced = set()
    eqn_node = {}
    for i in relevant:
        eqn, cost = jaxpr.eqns[i], prices[i]
        node = eqn_node[i] = graph.node()
        if cost.never or (cost.flops and (rate is None or only not in (None, i))):
            recompute = _INF
        else:
            # A tiny price for free work: keep a value rather than recompute
            # a chain to save nothing.
            recompute = 1e-3 + cost.passes
            if cost.flops:
                recompute += cost.flops * _tie_break(i) / rate
        graph.edge(source, node, recompute)
        for u in eqn.invars:
            if isinstance(u, jex_core.Var):
                graph.edge(value(u)[1], node, _INF)
        for v in eqn.outvars:
            if isinstance(v, jex_core.Var) and not isinstance(v, jex_core.DropVar):
                graph.edge(node, value(v)[0], _INF)
                produced.add(v)
    for v in needed:
        graph.edge(value(v)[1], sink, _INF)
    for v in list(value_in):
        if v not in produced:  # an input or constant: it exists only in the forward pass
            graph.edge(source, value_in[v], _INF)
    side = graph.source_side(source, sink)
    saved = [v for v in value_in if value_in[v] in side and value_out[v] not in side]
    # Recompute only what the needed values depend on, given the saved ones.
    recomputed = ancestors(jaxpr, needed, set(saved))
    assert all(eqn_node[i] not in side for i in recomputed), "a recomputed equation is forward-only"
    # A free value lands on the cut whether or not it is read: keep only those read.
    read = set(needed) | {
        u for i in recomputed for u in jaxpr.eqns[i].invars if isinstance(u, jex_core.Var)
    }
    return [v for v in saved if v in read], recomputed


def _tie_break(i: int) -> float:
    """A factor that tells apart equations of equal price, by position."""
    return 1 + 1e-9 * i


class _FlowGraph:
    """A directed graph with capacities, and Dinic's maximum flow on it."""

    def __init__(self):
        self.heads: list[list[int]] = []  # per node: indices of its edges
        self.to: list[int] = []
        self.capacity: list[float] = []

    def node(self) -> int:
        self.heads.append([])
        return len(self.heads) - 1

    def edge(self, a: int, b: int, capacity: float) -> None:
        for x, y, c in ((a, b, capacity), (b, a, 0.0)):  # an edge and its reverse
            self.heads[x].append(len(self.to))
            self.to.append(y)
            self.capacity.append(c)

    def source_side(self, source: int, sink: int) -> set[int]:
        """The nodes on the source's side of a minimum cut."""
        while (level := self._levels(source)).get(sink) is not None:
            pointer = [0] * len(self.heads)
            while self._augment(source, sink, level, pointer):
                pass
        return set(self._levels(source))

    def _levels(self, source: int) -> dict[int, int]:
        level = {source: 0}
        queue = collections.deque([source])
        while queue:
            a = queue.popleft()
            for e in self.heads[a]:
                b = self.to[e]
                if self.capacity[e] > 1e-9 and b not in level:
                    level[b] = level[a] + 1
                    queue.append(b)
        return level

    def _augment(self, source, sink, level, pointer) -> bool:
        """Pushes flow along one shortest path with spare capacity; False if there is none."""
        path, a = [], source
        while a != sink:
            heads = self.heads[a]
            while pointer[a] < len(heads):
                e = heads[pointer[a]]
                b = self.to[e]
                if self.capacity[e] > 1e-9 and level.get(b) == level[a] + 1:
                    break
                pointer[a] += 1
            else:  # a dead end: retreat
                if not path:
                    return False
                level[a] = -1
                e = path.pop()
                a = self.to[e ^ 1]
                pointer[a] += 1
                continue
            path.append(e)
            a = b
        flow = min(self.capacity[e] for e in path)
        if flow == _INF:
            raise ValueError(
                "the cut is unbounded: a needed value can be neither kept nor recomputed"
            )
        for e in path:
            self.capacity[e] -= flow
            self.capacity[e ^ 1] += flow
        return True
