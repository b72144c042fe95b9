"""What a block keeps for its backward pass, as small frozen values.

A strategy is a value, as a ``jax.checkpoint_policies`` policy is: it can be
printed, compared, hashed and stored. :func:`jaxoffload.wrap` applies one to a
function and :func:`jaxoffload.linen.wrap` to a Flax module:

- :class:`Store`: keep jax's residuals on the device (the plain model);
- :class:`Lean`: keep the fewest bytes on the device, recomputing cheap
  values (BatchNorm's normalised copies, masks) in the backward pass;
- :class:`Remat`: ``jax.checkpoint`` with a policy;
- :class:`Offload`: keep the lean residuals in pinned host memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax

from jaxoffload._src import checks

__all__ = [
    "Lean",
    "Offload",
    "Remat",
    "Store",
    "StoredCall",
    "Strategy",
    "brief",
    "check_strategy",
    "strategy_from_dict",
    "strategy_to_dict",
    "stored_within",
]

Function = Callable[..., Any]


class Strategy:
    """What every strategy answers: the questions that the transform and the planner ask.

    A strategy is asked, not inspected, as a ``jax.checkpoint_policies``
    policy is; the defaults here are a plain block's answers, and each
    strategy overrides the ones where it differs.

    Attributes:
      is_identity: wrapping a function with it returns the function itself.
      to_host: its residuals wait in pinned host memory.
      window: how many consecutive wrapped calls may have transfers in
        flight (1 waits for the call's own).
      fetch_window: how many wrapped calls ahead of its own the backward pass
        fetches a call's residuals; ``None`` for ``window``.
      max_bytes: the most bytes a call moves to the host; ``None`` for no cap.
      cuts: its residuals are the cheapest cut of the call's forward graph,
        with lean rules for ReLUs and max-pools (:mod:`jaxoffload._src.cut`).
      recomputes: its backward pass recomputes what it does not keep, by a
        ``jax.checkpoint`` policy.
      required_names: the names, given with ``checkpoint_name``, that the function must mark.
      max_slowdown: if set, each distinct call is timed on the device when it
        is first differentiated, under each of :meth:`fallbacks`, and takes the
        first within this share of the last one's time.
    """

    is_identity: bool = False
    to_host: bool = False
    window: int = 1
    fetch_window: int | None = None
    max_bytes: int | None = None
    cuts: bool = False
    recomputes: bool = False
    required_names: tuple[str, ...] = ()
    max_slowdown: float | None = None

    def __new__(cls, *args, **kwargs):
        # The base answers a plain block's questions, but names no strategy: a plan or a
        # wrapped block under it would print as <Strategy object at 0x...> and do nothing.
        if cls is Strategy:
            raise TypeError(
                "Strategy is the base class of the strategies, what each of them answers, not "
                "a strategy to use: write Store(), Lean(), Remat() or Offload()."
            )
        # A misspelled field is named with the one meant: Python names neither.
        checks.unknown_field(cls.__name__, (f.name for f in dataclasses.fields(cls)), kwargs)
        return super().__new__(cls)

    def fallbacks(self) -> tuple[Strategy, ...]:
        """With ``max_slowdown``: what a call may take instead, leanest first, jax's own last."""
        return ()

    def checkpointed(self, fun: Function) -> Function | None:
        """``fun`` under the ``jax.checkpoint`` whose policy picks its residuals, if any."""
        return None

    def placement(self, nbytes: int, shape: tuple[int, ...]) -> tuple[str, str]:
        """Where a residual of this size waits (``"device"`` or ``"pinned_host"``), and why."""
        return "device", type(self).__name__

    def costed(self) -> Strategy:
        """The strategy as a planner measures it: window 1, no byte cap; the same compute."""
        return self

    def timed_as(self) -> Strategy:
        """The strategy whose compute a planner times for this one: itself, as costed."""
        return self.costed()

    def moved(self, sizes: tuple[int, ...]) -> list[bool]:
        """Which of the residuals that may move, of these sizes, do: all, unless capped."""
        return [True] * len(sizes)

    def with_cap(self, window: int, max_bytes: int, fetch_window: int | None = None):
        """The strategy moving at most ``max_bytes``, with these windows; ``None`` if nothing moves."""
        return None


@dataclasses.dataclass(frozen=True)
class Store(Strategy):
    """Keep every residual that ``jax.vjp`` keeps, on the device: the plain model.

    Example:
      >>> Store()
      Store()
    """

    is_identity = True


@dataclasses.dataclass(frozen=True)
class StoredCall(Strategy):
    """:class:`Store` as a wrapped call: jax's residuals, kept behind a call boundary.

    A plan puts it on its ``Store()`` blocks where the code around them is
    wrapped (an ``outside`` such as ``Lean()``): inlined there, a plain block
    would be cut as part of the enclosing call, and keep what its cut keeps,
    not what ``Store()`` says. Not a strategy to write; plans write ``Store()``.
    """


def stored_within(strategy: Strategy, outside: Strategy) -> Strategy:
    """A block's strategy as applied inside code under ``outside``: a ``Store()`` block
    inside a wrapped outside is a :class:`StoredCall`, so that the outside cannot cut it."""
    return StoredCall() if strategy.is_identity and not outside.is_identity else strategy


def _check_share(name: str, value: Any) -> float:
    """``value`` as a float, if it is a share of the block's forward FLOPs: from 0 to 1."""
    return checks.share(
        name,
        value,
        of="the block's forward FLOPs",
        low="to recompute no convolution or matrix product",
        high="to allow recomputing as many FLOPs as the forward pass has",
    )


@dataclasses.dataclass(frozen=True)
class Lean(Strategy):
    """Keep the fewest residual bytes on the device; recompute the cheap rest.

    The kept values are a minimum cut of the block's forward graph
    (:mod:`jaxoffload._src.cut`): elementwise work is recomputed in the backward
    pass, where it fuses into loops that run anyway; reductions' small
    outputs are kept; convolutions and matrix products are recomputed only
    where that saves the most bytes, within ``max_recompute``. ReLUs and
    max-pools get leaner rules than jax's (:mod:`jaxoffload._src.rewrite`). The
    block's inputs and outputs cost nothing to keep: the layers around it
    keep them anyway.

    Where a block's lean cut is slower than jax's choice, ``max_slowdown``
    makes it take jax's choice instead, measured: each distinct block is
    compiled and timed alone, forward and backward, when a step first
    differentiates it (once per process; an init times nothing): this cut
    beside :class:`Store`, then, if slower by more than ``max_slowdown``, a cut
    that recomputes no convolution or matrix product; failing both, it stores.
    A block timed alone is not the block in a step: see the README first.

    Its residuals are chosen in a ``jax.custom_vjp`` rule, as :class:`Offload`'s are:
    it is differentiated in reverse mode (a gradient of a gradient too), not forward
    (``jax.jvp``, ``jax.hessian``), where :class:`Remat` and :class:`Store` serve.

    Attributes:
      max_recompute: the FLOPs of convolutions and matrix products that the
        backward pass may recompute, as a share of the block's forward pass's,
        from 0 (none) to 1 (as many as the forward pass has).
      max_slowdown: the most that a block's lean cut may add to its time, as
        a share of Store's, measured; ``None`` (the default) times nothing.

    Example:
      >>> Lean(), Lean(max_recompute=0.0), Lean(max_slowdown=0.03)
      (Lean(max_recompute=0.25), Lean(max_recompute=0.0), Lean(max_recompute=0.25, max_slowdown=0.03))
    """

    max_recompute: float = 0.25
    max_slowdown: float | None = None
    cuts = True

    def __post_init__(self):
        object.__setattr__(self, "max_recompute", _check_share("max_recompute", self.max_recompute))
        # A share of Store's time; None times nothing. NaN compared with no time, and inf
        # timed every fallback to take the lean cut anyway, as None does untimed.
        slowdown = checks.real(
            "max_slowdown",
            self.max_slowdown,
            minimum=0,
            none=True,
            example=0.03,
            meaning="a share of Store's time; None times nothing",
        )
        object.__setattr__(self, "max_slowdown", slowdown)

    def __repr__(self) -> str:  # as before max_slowdown, unless it is set
        slowdown = "" if self.max_slowdown is None else f", max_slowdown={self.max_slowdown!r}"
        return f"Lean(max_recompute={self.max_recompute!r}{slowdown})"

    def fallbacks(self) -> tuple[Strategy, ...]:
        if self.max_slowdown is None:
            return ()
        untimed = (Lean(self.max_recompute), Lean(0.0), Store())
        return tuple(dict.fromkeys(untimed))


@dataclasses.dataclass(frozen=True)
class Remat(Strategy):
    """Recompute in the backward pass: ``jax.checkpoint`` (``nn.remat``) with ``policy``.

    Attributes:
      policy: a ``jax.checkpoint_policies`` policy; ``None`` saves nothing
        but the inputs.
      prevent_cse: as in ``jax.checkpoint``.

    Example:
      >>> import jax
      >>> Remat(jax.checkpoint_policies.dots_saveable) == Remat(jax.checkpoint_policies.dots_saveable)
      True
    """

    policy: Callable[..., Any] | None = None
    prevent_cse: bool = True
    recomputes = True

    def __post_init__(self):
        if self.policy is not None and not callable(self.policy):
            named = isinstance(self.policy, str) and hasattr(jax.checkpoint_policies, self.policy)
            fix = f"jax.checkpoint_policies.{self.policy}" if named else "None"
            raise TypeError(
                f"policy must be a jax.checkpoint_policies policy or None, got "
                f"{checks.written(self.policy)}; write policy={fix}."
            )
        object.__setattr__(self, "prevent_cse", checks.flag("prevent_cse", self.prevent_cse))

    def checkpointed(self, fun: Function) -> Function:
        return jax.checkpoint(fun, policy=self.policy, prevent_cse=self.prevent_cse)


@dataclasses.dataclass(frozen=True)
class Offload(Strategy):
    """Keep the residuals in pinned host memory between the two passes.

    By default what moves is what :class:`Lean` would keep, so cheap values
    are recomputed rather than moved, and a block never moves more bytes
    than its lean residuals. ``names`` and ``recompute`` choose fewer values
    and recompute the rest.

    Attributes:
      names: move only the :func:`~jax.ad_checkpoint.checkpoint_name` values
        with these names, and the block's inputs; recompute the rest.
      recompute: move only the block's inputs, and recompute everything else
        (offload and recompute, like ``nn.remat`` with its inputs on the host).
      min_bytes: residuals smaller than this stay on the device.
      max_recompute: as in :class:`Lean`.
      window: how many consecutive wrapped blocks may have transfers in
        flight (see :func:`jaxoffload.offload`); 1 waits for the block's own.
      max_bytes: move at most this many bytes, the largest residuals first
        while they fit; the rest stays on the device, and where the cap would
        leave there what an uncapped block keeps, the block keeps
        :class:`Lean`'s residuals instead (it recomputes less), and its inputs
        and outputs, which the layers around keep, stay. With a window, a cap
        of what the link moves while the next blocks compute keeps the
        transfers hidden (:func:`jaxoffload.plan` sets such caps).
      fetch_window: how many blocks ahead of its own the backward pass may
        fetch this block's residuals (1: as its own starts), each holding one
        more block's residuals on the device; ``None`` for ``window``. It is the
        earliest a fetch starts: XLA's scheduler may start it later, and the
        fetches take the one host link in the order it starts them.

    Example:
      >>> Offload(window=2)
      Offload(names=None, recompute=False, min_bytes=0, max_recompute=0.25, window=2, max_bytes=None, fetch_window=None)
    """

    names: tuple[str, ...] | None = None
    recompute: bool = False
    min_bytes: int = 0
    max_recompute: float = 0.25
    window: int = 1
    max_bytes: int | None = None
    fetch_window: int | None = None

    def __post_init__(self):
        names = self.names
        if names is not None:
            if isinstance(names, str):
                raise TypeError(
                    f"names must be a sequence of strings, got the string {names!r}; "
                    f"write names=({names!r},)."
                )
            if not isinstance(names, Iterable):
                raise TypeError(
                    f"names must be a sequence of strings, got {checks.written(names)}; write "
                    "names=('a', 'b') with the names given to checkpoint_name, or None."
                )
            names = tuple(names)
            bad = [n for n in names if not isinstance(n, str)]
            if bad:
                raise TypeError(f"names must be strings, got {bad!r}.")
            object.__setattr__(self, "names", names)
        object.__setattr__(self, "recompute", checks.flag("recompute", self.recompute))
        if self.recompute and names is not None:
            raise ValueError(
                "recompute=True moves only the inputs and recomputes the rest; it takes no "
                f"names (got names={names!r})."
            )
        fields = {
            "min_bytes": checks.integer("min_bytes", self.min_bytes, minimum=0, meaning="bytes"),
            "max_recompute": _check_share("max_recompute", self.max_recompute),
            "window": checks.integer("window", self.window, minimum=1),
            "fetch_window": checks.integer(
                "fetch_window", self.fetch_window, minimum=1, none=True,
                meaning="calls ahead; None for window",
            ),
            "max_bytes": checks.integer(
                "max_bytes", self.max_bytes, minimum=0, none=True, example=2**30,
                meaning="bytes; None for no cap, 2**30 for 1 GiB",
            ),
        }  # fmt: skip
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    to_host = True

    @property
    def cuts(self) -> bool:  # type: ignore[override]
        return self.names is None and not self.recompute

    @property
    def recomputes(self) -> bool:  # type: ignore[override]
        return not self.cuts

    @property
    def required_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.names or ()

    def checkpointed(self, fun: Function) -> Function | None:
        if self.cuts:
            return None
        names = () if self.recompute else self.names
        return jax.checkpoint(fun, policy=jax.checkpoint_policies.save_only_these_names(*names))

    def placement(self, nbytes: int, shape: tuple[int, ...]) -> tuple[str, str]:
        if not shape:
            return "device", "a scalar"
        if nbytes < self.min_bytes:
            return "device", f"smaller than min_bytes={self.min_bytes}"
        return "pinned_host", "offloaded"

    def costed(self) -> Offload:
        return dataclasses.replace(self, window=1, fetch_window=None, max_bytes=None)

    def timed_as(self) -> Strategy:
        # Without its copies, an offload computes what its twin on the device does.
        if self.names is not None:
            return self.costed()
        return Lean(self.max_recompute) if self.cuts else Remat()

    def moved(self, sizes: tuple[int, ...]) -> list[bool]:
        if self.max_bytes is None:
            return [True] * len(sizes)
        moved, room = [False] * len(sizes), self.max_bytes
        for n in sorted(range(len(sizes)), key=lambda n: -sizes[n]):  # the largest first
            if sizes[n] <= room:
                moved[n], room = True, room - sizes[n]
        return moved

    def with_cap(self, window: int, max_bytes: int, fetch_window: int | None = None):
        fields = {"window": window, "max_bytes": max_bytes, "fetch_window": fetch_window}
        return dataclasses.replace(self, **fields) if max_bytes else None


_KINDS = (Store, Lean, Remat, Offload)


def check_strategy(strategy: Any) -> Strategy:
    """Returns ``strategy`` if it is a strategy value, and raises a clear error if not."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        raise TypeError(
            f"a strategy is a value: write {strategy.__name__}(), not {strategy.__name__}."
        )
    hint = ""
    if isinstance(strategy, str):
        hint = " Strategy names such as 'lean' are for the command line; write Lean()."
    raise TypeError(
        f"expected a strategy (Store(), Lean(), Remat(...) or Offload(...)), got {strategy!r}.{hint}"
    )


def strategy_to_dict(strategy: Strategy) -> dict[str, Any]:
    """A strategy as a JSON-ready dict: ``{"kind": "Offload", "window": 2, ...}``.

    A ``Remat`` policy is saved by its name in ``jax.checkpoint_policies``;
    a parameterised policy (``save_only_these_names(...)``) has none.

    Example:
      >>> strategy_to_dict(Offload(window=2))["window"]
      2
      >>> strategy_from_dict(strategy_to_dict(Lean(max_recompute=0.1)))
      Lean(max_recompute=0.1)
    """
    strategy = check_strategy(strategy)
    fields = {f.name: getattr(strategy, f.name) for f in dataclasses.fields(strategy)}
    if "policy" in fields:
        fields["policy"] = _policy_name(fields["policy"])
    if fields.get("names") is not None:
        fields["names"] = list(fields["names"])
    return {"kind": type(strategy).__name__, **fields}


def strategy_from_dict(fields: dict[str, Any]) -> Strategy:
    """The strategy that :func:`strategy_to_dict` wrote.

    Raises:
      ValueError: if ``fields`` is no strategy's: its kind unknown, a field
        misspelled or missing its value's kind, or a value refused.

    Example:
      >>> strategy_from_dict({"kind": "Offload", "windw": 2})
      Traceback (most recent call last):
      ...
      ValueError: Offload has no field 'windw' (did you mean 'window'?); its fields are fetch_window, max_bytes, max_recompute, min_bytes, names, recompute, window.
    """
    kinds = {cls.__name__: cls for cls in _KINDS}
    if not isinstance(fields, dict):
        raise ValueError(
            f'a strategy is written as an object such as {{"kind": "Lean"}}, got {fields!r}.'
        )
    fields = dict(fields)
    kind = fields.pop("kind", None)
    if kind not in kinds:
        raise ValueError(f"unknown strategy kind {kind!r}; expected one of {sorted(kinds)}.")
    known = (f.name for f in dataclasses.fields(kinds[kind]))
    checks.unknown_field(kind, known, fields, ValueError)
    if fields.get("policy") is not None:
        name = fields["policy"]
        policy = getattr(jax.checkpoint_policies, str(name), None)
        if not callable(policy):
            raise ValueError(f"jax.checkpoint_policies has no policy {name!r}.")
        fields["policy"] = policy
    try:
        return kinds[kind](**fields)
    except TypeError as e:  # a field of the wrong kind: the same sentence, for a file
        raise ValueError(str(e)) from e


def _policy_name(policy: Callable[..., Any] | None) -> str | None:
    if policy is None:
        return None
    for name in dir(jax.checkpoint_policies):
        if getattr(jax.checkpoint_policies, name) is policy:
            return name
    raise ValueError(
        f"Remat policy {policy!r} has no name in jax.checkpoint_policies, so it cannot be "
        "saved; parameterised policies (save_only_these_names(...)) cannot be written to JSON."
    )


def brief(strategy: Strategy) -> str:
    """A strategy as a short phrase, its fields at their defaults left out: ``Offload(window=2)``.

    Example:
      >>> brief(Offload(window=2)), brief(Lean())
      ('Offload(window=2)', 'Lean()')
    """
    defaults = type(strategy)()
    changed = [
        f"{f.name}={_name_or_repr(getattr(strategy, f.name))}"
        for f in dataclasses.fields(strategy)
        if getattr(strategy, f.name) != getattr(defaults, f.name)
    ]
    return f"{type(strategy).__name__}({', '.join(changed)})"


def _name_or_repr(value: Any) -> str:
    return getattr(value, "__name__", None) or repr(value)
