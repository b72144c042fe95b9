"""A workload: one training configuration that the bench measures, checked when it is made."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxoffload import Lean, Offload, Plan, Remat, Store, Strategy
from jaxoffload.bench import models
from jaxoffload.bench.catalog import (
    ACCUMULATED_STRATEGIES,
    CHOSEN_STRATEGIES,
    PLANS,
    check_workload,
    default_block_costs,
)
from jaxoffload.bench.record import label

__all__ = ["STRATEGIES", "Workload"]


# The command line's strategy names, and the values they stand for: the names are
# jaxoffload.bench.catalog.BLOCK_STRATEGIES, those that move residuals TO_HOST.
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


@dataclasses.dataclass(frozen=True)
class Workload:
    """One training configuration to measure.

    Attributes:
      model: a name in ``jaxoffload.bench.catalog.MODEL_NAMES``.

    Made, it checks its fields (:func:`jaxoffload.bench.catalog.check_workload`, as the
    command checks its flags).
      batch: images per step, over all the devices.
      image_size: height and width of the square input.
      dtype: compute dtype, ``"float32"`` or ``"bfloat16"``.
      strategy: a key of :data:`STRATEGIES`, or of
        :data:`~jaxoffload.bench.catalog.CHOSEN_STRATEGIES` or
        :data:`~jaxoffload.bench.catalog.ACCUMULATED_STRATEGIES`.
      blocks: how many blocks, from the input end, use ``strategy``; the rest
        use ``"none"``. ``None`` means all of them. Reference models only.
      num_classes: classifier outputs (per pixel, for a segmentation model);
        ``None`` means the model's own default
        (:func:`jaxoffload.bench.models.default_num_classes`: 1000, 2 for
        ``flax-unet``).
      window: the ``Offload`` window of offloading blocks, or one per stage of
        a reference ResNet.
      block_names: one strategy name per block, overriding ``strategy`` and
        ``blocks``; set by ``"offload-hidden"``'s choice on a reference model
        (:func:`jaxoffload.bench.planning.reference_hidden_workload`). A record
        keeps them under its ``plan`` key (:meth:`record_fields`).
      budget: for the strategies of :data:`~jaxoffload.bench.catalog.PLANS`, the budget as
        a share of the ``"none"`` run's runtime peak.
      block_costs: for those, and ``"offload-hidden"`` on a plain-Flax model,
        how the planner costs the blocks: ``"traced"`` or ``"timed"`` (see
        :func:`jaxoffload.plan`); ``None``, :func:`~jaxoffload.bench.catalog.default_block_costs`.
      planned: where the blocks take a :class:`jaxoffload.Plan` (:attr:`runs_plan`), the
        plan as :meth:`~jaxoffload.Plan.to_dict` writes it; set by
        :meth:`jaxoffload.bench.child.Children.plan_budgets` for ``"plan"``, and by
        :meth:`~jaxoffload.bench.child.Children.hidden_offload` for ``"offload-hidden"``.
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
    block_names: tuple[str, ...] | None = None
    budget: float | None = None
    block_costs: str | None = None
    planned: dict[str, Any] | None = None
    micro_batch: int | None = None
    num_devices: int = 1
    spatial: int = 1

    def __post_init__(self):
        if self.block_costs is None:
            object.__setattr__(self, "block_costs", default_block_costs(self.model, self.strategy))
        check_workload(
            self.model, self.batch, self.image_size, self.dtype, self.strategy,
            blocks=self.blocks, window=self.window, budget=self.budget,
            block_costs=self.block_costs, micro_batch=self.micro_batch,
            num_devices=self.num_devices, spatial=self.spatial,
        )  # fmt: skip
        if self.num_classes is None:
            object.__setattr__(self, "num_classes", models.default_num_classes(self.model))
        if isinstance(self.window, list):  # read back from JSON
            object.__setattr__(self, "window", tuple(self.window))
        if isinstance(self.block_names, list):
            object.__setattr__(self, "block_names", tuple(self.block_names))
        if self.strategy not in PLANS:
            self._windows()  # Offload checks each window too, as its blocks will be given them

    def record_fields(self) -> dict[str, Any]:
        """The workload's fields as a record's JSON keys name them: ``block_names`` as ``plan``."""
        fields = dataclasses.asdict(self)
        fields["plan"] = fields.pop("block_names")
        return fields

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

    @property
    def runs_plan(self) -> bool:
        """Whether the blocks take a :class:`jaxoffload.Plan` (``planned``), applied to the
        plain-Flax model (a linen one made plannable): ``"plan"``'s, and
        ``"offload-hidden"``'s on a plain-Flax linen model, whose blocks each take their own
        ``Offload`` cap."""
        linen = models.is_plain(self.model) and not models.is_nnx(self.model)
        return self.strategy in PLANS or (self.strategy == "offload-hidden" and linen)

    @property
    def block_plan(self) -> Plan:
        """The :class:`jaxoffload.Plan` that the blocks take (:attr:`runs_plan`), from ``planned``.

        Raises:
          ValueError: if it is not planned yet, naming what plans it.
        """
        if not self.runs_plan:
            raise ValueError(f"{self.strategy!r} on {self.model} takes no jaxoffload.Plan.")
        if self.planned is None:
            see = "plan_budgets" if self.strategy in PLANS else "hidden_offload"
            raise ValueError(f"{self.strategy!r} needs its plan: see Children.{see}.")
        return Plan.from_dict(self.planned)

    @property
    def block_strategies(self) -> tuple[Strategy, ...]:
        """One strategy value per block, with the windows applied to the offloading ones."""
        n = models.num_blocks(self.model)
        if self.runs_plan:
            return self.block_plan.strategies
        if self.block_names is not None:
            names = self.block_names
        elif self.strategy in CHOSEN_STRATEGIES:
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
        """How many blocks offload; ``None`` for a chosen strategy not yet chosen."""
        if self.strategy in CHOSEN_STRATEGIES and self.block_names is None and self.planned is None:
            return None
        return sum(s.to_host for s in self.block_strategies)
