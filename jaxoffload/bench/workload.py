"""A workload: one training configuration that the bench measures, checked when it is made."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxoffload import Lean, Offload, Plan, Remat, Store, Strategy
from jaxoffload.bench import models
from jaxoffload.bench.record import label
from jaxoffload.internal import BLOCK_COSTS

__all__ = [
    "ACCUMULATED_STRATEGIES",
    "COMPUTE_TWIN",
    "DTYPES",
    "PLANNED_STRATEGIES",
    "STRATEGIES",
    "Workload",
]


DTYPES = ("float32", "bfloat16")


# The command line's strategy names, and the values they stand for.
STRATEGIES: dict[str, Strategy] = {
    "none": Store(),
    "lean": Lean(),
    # Lean where it is at most 3% slower than Store, timed block by block; else a fallback.
    "lean-timed": Lean(max_slowdown=0.03),
    "remat": Remat(),
    "remat-dots": Remat(jax.checkpoint_policies.dots_saveable),
    "offload": Offload(),
    "offload-inputs": Offload(recompute=True),
    # jax's own offload, of the convolution outputs that the reference models name.
    "jax-offload": Remat(
        jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[models.common.CONV_NAME],
            offload_src="device",
            offload_dst="pinned_host",
        )
    ),
}


# Strategies whose per-block values a planner picks (see hidden_offload_workload).
PLANNED_STRATEGIES = {
    "offload-hidden": "Offload() only the blocks whose transfers the compute can hide "
    "(jaxoffload.bench.hidden), the others Lean()",
    "plan": "the jaxoffload.plan of a budget (bench --budget)",
}


# Strategies whose step runs another's over micro-batches, accumulating their gradients
# (see _value_and_grad): the name, and the strategy whose step each micro-batch runs.
# "grad-accum-lean" is the peer of a strategy that fits larger micro-batches than Store.
ACCUMULATED_STRATEGIES = {"grad-accum": "none", "grad-accum-lean": "lean"}


# For each strategy that moves residuals to the host, the strategy that runs the
# same layers without moving anything: its times are the compute in the
# transfer bound (see :func:`add_transfer_bounds`).
COMPUTE_TWIN = {
    "jax-offload": "none",
    "offload": "lean",
    "offload-inputs": "remat",
    "offload-hidden": "lean",
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """One training configuration to measure.

    Attributes:
      model: a name in ``jaxoffload.bench.models.MODEL_NAMES``.
      batch: images per step, over all the devices.
      image_size: height and width of the square input.
      dtype: compute dtype, ``"float32"`` or ``"bfloat16"``.
      strategy: a key of :data:`STRATEGIES`, :data:`PLANNED_STRATEGIES` or
        :data:`ACCUMULATED_STRATEGIES`.
      blocks: how many blocks, from the input end, use ``strategy``; the rest
        use ``"none"``. ``None`` means all of them. Reference models only.
      num_classes: classifier outputs (per pixel, for a segmentation model);
        ``None`` means the model's own default
        (:func:`jaxoffload.bench.models.default_num_classes`: 1000, 2 for
        ``flax-unet``).
      window: the ``Offload`` window of offloading blocks, or one per stage of
        a reference ResNet.
      plan: one strategy name per block, overriding ``strategy`` and
        ``blocks``; set by the planner of ``"offload-hidden"``.
      budget: for the ``"plan"`` strategy, the budget as a share of the
        ``"none"`` run's runtime peak.
      block_costs: for ``"plan"``, how the planner costs the blocks:
        ``"timed"`` or ``"traced"`` (see :func:`jaxoffload.plan`).
      planned: for ``"plan"``, the :class:`jaxoffload.Plan` as
        :meth:`~jaxoffload.Plan.to_dict` writes it; set by
        :meth:`jaxoffload.bench.child.Children.plan_budgets`.
      micro_batch: for ``"grad-accum"`` and ``"grad-accum-lean"``
        (:data:`ACCUMULATED_STRATEGIES`), the images of each micro-batch, over
        all the devices; ``batch`` must be a multiple of it.
      num_devices: data parallel over the first ``num_devices`` devices: the
        batch split over a mesh axis ``data``, the parameters and the optimizer
        state replicated.
      spatial: each image's rows split over this many devices more, along a
        mesh axis ``space`` (the mesh is ``num_devices`` by ``spatial``), so
        that every activation is split along its height and the partitioner
        exchanges the halos of each convolution.
    """

    model: str
    batch: int
    image_size: int
    dtype: str
    strategy: str
    blocks: int | None = None
    num_classes: int | None = None
    window: int | tuple[int, ...] = 1
    plan: tuple[str, ...] | None = None
    budget: float | None = None
    block_costs: str = "timed"
    planned: dict[str, Any] | None = None
    micro_batch: int | None = None
    num_devices: int = 1
    spatial: int = 1

    def __post_init__(self):
        self._check_names_and_sizes()
        self._check_splits()
        if self.num_classes is None:
            object.__setattr__(self, "num_classes", models.default_num_classes(self.model))
        if isinstance(self.window, list):  # read back from JSON
            object.__setattr__(self, "window", tuple(self.window))
        if isinstance(self.plan, list):
            object.__setattr__(self, "plan", tuple(self.plan))
        if (self.strategy == "plan") != (self.budget is not None):
            raise ValueError("the 'plan' strategy takes a budget, and only it does.")
        if self.strategy == "plan":
            self._check_budget_plan()
        else:
            self._check_block_strategies()

    def _check_names_and_sizes(self) -> None:
        if self.model not in models.MODEL_NAMES:
            raise ValueError(
                f"Unknown model {self.model!r}; choose one of {', '.join(models.MODEL_NAMES)}."
            )
        names = [*STRATEGIES, *PLANNED_STRATEGIES, *ACCUMULATED_STRATEGIES]
        if self.strategy not in names:
            raise ValueError(
                f"Unknown strategy {self.strategy!r}; choose one of {', '.join(names)}."
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        if self.batch < 1:
            raise ValueError(f"batch must be at least 1, got {self.batch}.")
        if self.image_size < 32:
            raise ValueError(f"image_size must be at least 32, got {self.image_size}.")

    def _check_splits(self) -> None:
        """The batch splits over the devices, and into micro-batches that split over them too."""
        accumulated = self.strategy in ACCUMULATED_STRATEGIES
        if accumulated and self.micro_batch is None:
            raise ValueError(
                f"{self.strategy!r} needs --micro-batch M: the images of each micro-batch whose "
                "gradients it accumulates, a divisor of --batch."
            )
        if not accumulated and self.micro_batch is not None:
            raise ValueError(
                f"micro_batch is for {', '.join(ACCUMULATED_STRATEGIES)}, not {self.strategy!r}."
            )
        for name, value in [("--devices", self.num_devices), ("--micro-batch", self.micro_batch),
                            ("--spatial", self.spatial)]:  # fmt: skip
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if self.image_size % self.spatial:
            raise ValueError(
                f"--image-size {self.image_size} does not split over --spatial {self.spatial}: "
                f"use {_multiples_near(self.image_size, self.spatial)}."
            )
        n = self.num_devices
        if self.batch % n:
            raise ValueError(
                f"--batch {self.batch} does not split over --devices {n}: use "
                f"{_multiples_near(self.batch, n)}."
            )
        if self.micro_batch is None:
            return
        if self.micro_batch % n:
            raise ValueError(
                f"--micro-batch {self.micro_batch} does not split over --devices {n}: use "
                f"{_multiples_near(self.micro_batch, n)}."
            )
        if self.batch % self.micro_batch:
            raise ValueError(
                f"--batch {self.batch} is not a multiple of --micro-batch {self.micro_batch}: use "
                f"{_multiples_near(self.batch, self.micro_batch)}."
            )

    @property
    def name(self) -> str:
        """The strategy, with the budget for plans, as its record is named: ``plan@0.5``."""
        return label(self.strategy, self.budget)

    @property
    def devices(self) -> int:
        """The devices that the step runs on: ``num_devices`` by ``spatial``."""
        return self.num_devices * self.spatial

    def mesh(self) -> jax.sharding.Mesh:
        """The step's mesh: ``data`` (Explicit, as ``jax.make_mesh`` makes it), and with
        ``spatial`` > 1 ``data`` by ``space``, both Auto: the partitioner splits each
        convolution along the rows, where Explicit axes would ask every one for its
        output sharding."""
        if self.spatial == 1:
            return jax.make_mesh((self.num_devices,), ("data",))
        auto = (jax.sharding.AxisType.Auto,) * 2
        return jax.make_mesh((self.num_devices, self.spatial), ("data", "space"), axis_types=auto)

    def _check_budget_plan(self) -> None:
        """A ``"plan"`` workload plans a plain-Flax model at a share of ``"none"``'s peak."""
        if not models.is_plain(self.model):
            raise ValueError(
                f"'plan' plans the plain-Flax models' plannable blocks; {self.model} is a "
                "reference model."
            )
        if not 0 < self.budget <= 1:
            raise ValueError(f"budget is a share of 'none's peak in (0, 1], got {self.budget}.")
        if self.block_costs not in BLOCK_COSTS:
            raise ValueError(f"block_costs is one of {BLOCK_COSTS}, got {self.block_costs!r}.")

    def _check_block_strategies(self) -> None:
        """The model takes the strategy, its blocks and its windows."""
        plain = models.is_plain(self.model)
        if plain and (self.strategy in PLANNED_STRATEGIES or self.blocks is not None):
            raise ValueError(
                f"{self.model} wraps one block class, so all its blocks take one strategy: "
                f"{self.strategy!r}{' with blocks' if self.blocks is not None else ''} needs a "
                "reference model."
            )
        if plain and self.strategy == "jax-offload":
            raise ValueError(
                f"'jax-offload' offloads the values that the reference models name with "
                f"checkpoint_name; {self.model} names none."
            )
        if isinstance(self.window, tuple) and self.model not in models.RESNETS:
            raise ValueError(f"{self.model} takes one window, not one per stage.")
        self._windows()

    @property
    def block_strategies(self) -> tuple[Strategy, ...]:
        """One strategy value per block, with the windows applied to the offloading ones."""
        n = models.num_blocks(self.model)
        if self.strategy == "plan":
            if self.planned is None:
                raise ValueError("'plan' needs its plan: see Children.plan_budgets.")
            return Plan.from_dict(self.planned).strategies
        if self.plan is not None:
            names = self.plan
        elif self.strategy in PLANNED_STRATEGIES:
            raise ValueError(f"{self.strategy!r} needs a plan: see hidden_offload_workload.")
        else:
            k = n if self.blocks is None else self.blocks
            if not 0 <= k <= n:
                raise ValueError(f"blocks must be between 0 and {n}, got {k}.")
            strategy = ACCUMULATED_STRATEGIES.get(self.strategy, self.strategy)
            names = (strategy,) * k + ("none",) * (n - k)
        return tuple(
            dataclasses.replace(STRATEGIES[s], window=w) if STRATEGIES[s].to_host
            else STRATEGIES[s]
            for s, w in zip(names, self._windows())
        )  # fmt: skip

    def _windows(self) -> list[int]:
        """The window of each block; ``Offload`` checks each value."""
        n = models.num_blocks(self.model)
        if not isinstance(self.window, tuple):
            return [Offload(window=self.window).window] * n
        stages = models.RESNETS[self.model][0]
        if len(self.window) != len(stages):
            raise ValueError(
                f"window has {len(self.window)} entries, but {self.model} has {len(stages)} stages."
            )
        return [
            Offload(window=w).window for w, size in zip(self.window, stages) for _ in range(size)
        ]

    @property
    def offloaded_blocks(self) -> int | None:
        """How many blocks offload; ``None`` for a planned strategy not yet planned."""
        if self.strategy in PLANNED_STRATEGIES and self.plan is None and self.planned is None:
            return None
        return sum(s.to_host for s in self.block_strategies)


def _multiples_near(n: int, m: int) -> str:
    """The positive multiples of ``m`` nearest to ``n``, either side, for an error message.

    Example:
      >>> _multiples_near(100, 24), _multiples_near(10, 24)
      ('96 or 120', '24')
    """
    below = n // m * m
    return f"{below} or {below + m}" if below else f"{m}"
