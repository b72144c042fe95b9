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
from collections.abc import Callable
from typing import Any

import jax

__all__ = [
    "Lean",
    "Offload",
    "Remat",
    "Store",
    "Strategy",
    "check_strategy",
    "strategy_from_dict",
    "strategy_to_dict",
]


@dataclasses.dataclass(frozen=True)
class Store:
    """Keep every residual that ``jax.vjp`` keeps, on the device: the plain model.

    Example:
      >>> Store()
      Store()
    """


def _check_share(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}.")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Lean:
    """Keep the fewest residual bytes on the device; recompute the cheap rest.

    The kept values are a minimum cut of the block's forward graph
    (:mod:`jaxoffload.cut`): elementwise work is recomputed in the backward
    pass, where it fuses into loops that run anyway; reductions' small
    outputs are kept; convolutions and matrix products are recomputed only
    where that saves the most bytes, within ``max_recompute``. ReLUs and
    max-pools get leaner rules than jax's (:mod:`jaxoffload.rewrite`). The
    block's inputs and outputs cost nothing to keep: the layers around it
    keep them anyway.

    Attributes:
      max_recompute: the FLOPs of convolutions and matrix products that the
        backward pass may recompute, as a share of the block's forward pass's.

    Example:
      >>> Lean(), Lean(max_recompute=0.0)
      (Lean(max_recompute=0.25), Lean(max_recompute=0.0))
    """

    max_recompute: float = 0.25

    def __post_init__(self):
        object.__setattr__(self, "max_recompute", _check_share("max_recompute", self.max_recompute))


@dataclasses.dataclass(frozen=True)
class Remat:
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

    def __post_init__(self):
        if self.policy is not None and not callable(self.policy):
            raise TypeError(
                f"policy must be a jax.checkpoint_policies policy or None, got {self.policy!r}."
            )
        if not isinstance(self.prevent_cse, bool):
            raise TypeError(f"prevent_cse must be a bool, got {self.prevent_cse!r}.")


@dataclasses.dataclass(frozen=True)
class Offload:
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

    Example:
      >>> Offload(window=2)
      Offload(names=None, recompute=False, min_bytes=0, max_recompute=0.25, window=2)
    """

    names: tuple[str, ...] | None = None
    recompute: bool = False
    min_bytes: int = 0
    max_recompute: float = 0.25
    window: int = 1

    def __post_init__(self):
        names = self.names
        if names is not None:
            if isinstance(names, str):
                raise TypeError(
                    f"names must be a sequence of strings, got the string {names!r}; "
                    f"write names=({names!r},)."
                )
            names = tuple(names)
            bad = [n for n in names if not isinstance(n, str)]
            if bad:
                raise TypeError(f"names must be strings, got {bad!r}.")
            object.__setattr__(self, "names", names)
        if not isinstance(self.recompute, bool):
            raise TypeError(f"recompute must be a bool, got {self.recompute!r}.")
        if self.recompute and names is not None:
            raise ValueError(
                "recompute=True moves only the inputs and recomputes the rest; it takes no "
                f"names (got names={names!r})."
            )
        min_bytes = self.min_bytes
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be a non-negative int, got {min_bytes!r}.")
        object.__setattr__(self, "max_recompute", _check_share("max_recompute", self.max_recompute))
        window = self.window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int of at least 1, got {window!r}.")


Strategy = Store | Lean | Remat | Offload


def check_strategy(strategy: Any) -> Strategy:
    """Returns ``strategy`` if it is a strategy value, and raises a clear error if not."""
    if isinstance(strategy, Store | Lean | Remat | Offload):
        return strategy
    if isinstance(strategy, type) and issubclass(strategy, Store | Lean | Remat | Offload):
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
    fields = dataclasses.asdict(strategy)
    if isinstance(strategy, Remat):
        fields["policy"] = _policy_name(strategy.policy)
    if isinstance(strategy, Offload) and strategy.names is not None:
        fields["names"] = list(strategy.names)
    return {"kind": type(strategy).__name__, **fields}


def strategy_from_dict(fields: dict[str, Any]) -> Strategy:
    """The strategy that :func:`strategy_to_dict` wrote."""
    kinds = {cls.__name__: cls for cls in (Store, Lean, Remat, Offload)}
    fields = dict(fields)
    kind = fields.pop("kind", None)
    if kind not in kinds:
        raise ValueError(f"unknown strategy kind {kind!r}; expected one of {sorted(kinds)}.")
    if kind == "Remat" and fields.get("policy") is not None:
        name = fields["policy"]
        policy = getattr(jax.checkpoint_policies, name, None)
        if not callable(policy):
            raise ValueError(f"jax.checkpoint_policies has no policy {name!r}.")
        fields["policy"] = policy
    return kinds[kind](**fields)


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
