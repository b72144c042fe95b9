"""Measure a training step's memory and time, each configuration in a fresh process.

``peak_bytes_in_use`` never goes down inside a process, so every measured
configuration runs in a child process of its own (:func:`measure_in_subprocess`).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.extend import core as jex_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoffload
from jaxoffload import (
    Lean,
    NoPlanFits,
    Offload,
    OffloadedCall,
    Plan,
    Remat,
    Store,
    Strategy,
    offloaded_calls,
)
from jaxoffload._src.jaxprs import equations
from jaxoffload._src.planner import BLOCK_COSTS, Planner, measure_link, median_ms, zeros
from jaxoffload._src.report import (
    analyze,
    read_spatial_gathers,
    requested_host_transfers,
    with_twin,
)
from jaxoffload._src.strategies import brief
from jaxoffload._src.transfers import without_host_placement
from jaxoffload.bench import models
from jaxoffload.bench.hidden import plan_hidden_offload

__all__ = [
    "ACCUMULATED_STRATEGIES",
    "BLOCK_COSTS",  # from jaxoffload._src.planner
    "COMPUTE_TWIN",
    "PLANNED_STRATEGIES",
    "STRATEGIES",
    "OutOfMemory",
    "Workload",
    "cache_env",
    "compile_in_subprocess",
    "compile_only",
    "device_fields",
    "gradient_error",
    "hidden_offload_workload",
    "largest_in_subprocess",
    "linen_model",
    "measure",
    "measure_link",  # from jaxoffload._src.planner
    "measure_all",
    "measure_in_subprocess",
    "plan_budgets_in_subprocess",
    "plan_in_subprocess",
    "probe_device",
    "requested_host_bytes",
    "spatial_fields",
    "time_offloaded_calls",
    "train_step",
    "training",
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

# The share of a step's compute time that "offload-hidden" may add by recomputation.
HIDDEN_RECOMPUTE_SHARE = 0.02

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
        :func:`plan_budgets_in_subprocess`.
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
                raise ValueError("'plan' needs its plan: see plan_budgets_in_subprocess.")
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


def train_step(workload: Workload, *, abstract: bool = False):
    """The jitted, state-donating training step of a workload, its state and batch.

    Args:
      workload: what to build.
      abstract: return the state and batch as ``jax.ShapeDtypeStruct``s,
        allocating nothing (for tracing at any size).

    Returns:
      ``(step, state, batch, loss_fn)``: ``step(state, batch) -> (state, loss)``
      with ``state = (params, model_state, opt_state)``, and
      ``loss_fn(params, model_state, batch) -> (loss, model_state)``, of one
      micro-batch under an accumulating strategy. With ``num_devices`` > 1 the state
      and batch are placed for data parallelism (:func:`_placed`).
    """
    if models.is_nnx(workload.model):
        step, state, batch, loss_fn = _nnx_training(workload, abstract=abstract)
        return jax.jit(step, donate_argnums=0), state, batch, loss_fn
    step, state, batch, loss_fn = training(workload, linen_model(workload), abstract=abstract)
    return jax.jit(step, donate_argnums=0), state, batch, loss_fn


def linen_model(workload: Workload, *, plannable: bool = False) -> flax.linen.Module:
    """The workload's plain-Flax linen model: under its strategy or its plan, or plannable."""
    dtype = jnp.dtype(workload.dtype)
    if not (plannable or workload.strategy == "plan"):
        return models.create(
            workload.model,
            strategy=workload.block_strategies,
            dtype=dtype,
            num_classes=workload.num_classes,
        )
    model = models.plannable_model(workload.model, dtype=dtype, num_classes=workload.num_classes)
    if plannable:
        return model
    if workload.planned is None:
        raise ValueError("'plan' needs its plan: see plan_budgets_in_subprocess.")
    return Plan.from_dict(workload.planned).apply(model)


def training(workload: Workload, model, *, abstract: bool | None):
    """``(step, state, batch, loss_fn)`` of :func:`train_step` for ``model``, ``step`` not jitted.

    With ``abstract=None``, nothing is initialised: ``state`` and ``batch`` are ``None``.
    """
    tx = _OPTIMIZER
    # Models with dropout draw from this stream; the same key every step keeps
    # the gradients of different strategies comparable.
    rngs = {"dropout": jax.random.key(2)}

    def init():
        x, labels = _batch(workload)
        variables = model.init({"params": jax.random.key(1), **rngs}, x[:1], True)
        params = variables.pop("params")
        return (params, dict(variables), tx.init(params)), (x, labels)

    def loss_fn(params, model_state, batch):
        x, labels = batch
        logits, new_state = model.apply(
            {"params": params, **model_state}, x, True, mutable=list(model_state), rngs=rngs
        )
        return _loss(logits, labels), new_state

    step = _sgd_step(loss_fn, tx, workload.micro_batch)
    if abstract is None:
        return step, None, None, loss_fn
    state, batch = _placed(init, workload, abstract=abstract)
    return step, state, batch, loss_fn


def _nnx_training(workload: Workload, *, abstract: bool | None, model=None):
    """:func:`training` for a plain Flax NNX model: the state is its split, as pytrees.

    ``model`` gives the step its Modules' classes (under a plan, say): its
    variables are not used, the state's are.
    """
    tx = _OPTIMIZER

    def build():
        model = models.create_nnx(
            workload.model,
            strategy=None if workload.strategy == "plan" else _one(workload.block_strategies),
            dtype=jnp.dtype(workload.dtype),
            num_classes=workload.num_classes,
            rngs=nnx.Rngs(1),
        )
        if workload.strategy == "plan" and workload.planned is not None:
            Plan.from_dict(workload.planned).apply(model)
        return model

    graphdef = nnx.split(nnx.eval_shape(build) if model is None else model, nnx.Param, ...)[0]

    def init():
        _, params, rest = nnx.split(build(), nnx.Param, ...)
        return (params, rest, tx.init(params)), _batch(workload)

    def loss_fn(params, model_state, batch):
        x, labels = batch
        # Fresh Variables of this trace: NNX refuses to mutate those of an outer one.
        model = nnx.merge(graphdef, params, model_state, copy=True)
        return _loss(model(x), labels), nnx.split(model, nnx.Param, ...)[2]

    step = _sgd_step(loss_fn, tx, workload.micro_batch)
    if abstract is None:
        return step, None, None, loss_fn
    state, batch = _placed(init, workload, abstract=abstract)
    return step, state, batch, loss_fn


def _placed(init, workload: Workload, *, abstract: bool):
    """``init()``'s ``(state, batch)``, made on the devices that the step reads them on.

    With ``num_devices`` > 1 (data parallel), they are made over a mesh of the
    first devices, ``jax.make_mesh``'s, as in ``tests/test_sharding.py`` and
    :mod:`jaxoffload.bench.distributed_example`: the batch split along its
    axis ``data``, the state replicated. With ``spatial`` > 1 the mesh has an
    axis ``space`` too, of Auto type, as ``tests/test_spatial.py`` has it: the
    images and per-pixel labels are split along their rows over it, and the
    partitioner carries the split through the step. Each device makes its own
    part, so no device ever holds the whole batch. With ``abstract``, they are
    ``jax.ShapeDtypeStruct``s with those shardings, allocating nothing.
    """
    if workload.devices == 1:
        # Eager init dispatches hundreds of small ops: jit makes it one program.
        return jax.eval_shape(init) if abstract else jax.jit(init)()
    mesh = workload.mesh()
    replicated = NamedSharding(mesh, P())

    def split(leaf):  # the batch's axis over "data", an image's rows over "space"
        spec = ("data", "space")[: min(leaf.ndim, 2 if workload.spatial > 1 else 1)]
        return NamedSharding(mesh, P(*spec))

    state, batch = jax.eval_shape(init)
    shardings = jax.tree.map(lambda _: replicated, state), jax.tree.map(split, batch)
    if not abstract:
        return jax.jit(init, out_shardings=shardings)()
    return jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        (state, batch), shardings,
    )  # fmt: skip


def _one(strategies):
    (strategy,) = set(strategies)
    return strategy


# Every workload's optimizer: SGD with momentum, as in the records.
_OPTIMIZER = optax.sgd(1e-3, momentum=0.9)


def _batch(workload: Workload):
    """The workload's images and labels, the same for every strategy and API.

    The labels follow the model's task (:func:`jaxoffload.bench.models.task`):
    one per image for ``"classify"``, a ``(batch, height, width)`` map for
    ``"segment"``.
    """
    key = jax.random.key(0)
    shape = (workload.batch, workload.image_size, workload.image_size, 3)
    x = jax.random.normal(key, shape, jnp.dtype(workload.dtype))
    labels = shape[:1] if models.task(workload.model) == "classify" else shape[:3]
    return x, jax.random.randint(key, labels, 0, workload.num_classes)


def _loss(logits, labels):
    """The mean softmax cross entropy: over images, or over every pixel of a segmentation.

    The logits have one axis more than the labels, their last: ``(batch,
    classes)`` against ``(batch,)``, or ``(batch, height, width, classes)``
    against ``(batch, height, width)``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"the logits {logits.shape} do not match the labels {labels.shape}: a model's task "
            "(jaxoffload.bench.models.task) sets the labels' shape, one per image or per pixel."
        )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return loss.mean()


def _sgd_step(loss_fn, tx, micro_batch: int | None = None):
    """``step(state, batch)`` for ``state = (params, model_state, opt_state)``: one update.

    With ``micro_batch``, of the gradient accumulated over micro-batches
    (:func:`_value_and_grad`).
    """
    value_and_grad = _value_and_grad(loss_fn, micro_batch)

    def step(state, batch):
        params, model_state, opt_state = state
        (loss, model_state), grads = value_and_grad(params, model_state, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), model_state, opt_state), loss

    return step


def _value_and_grad(loss_fn, micro_batch: int | None = None):
    """``jax.value_and_grad(loss_fn, has_aux=True)``, or its mean over micro-batches.

    Accumulated, the micro-batches run in one ``lax.scan``, so that the
    compiled loop holds one micro-batch's activations, and their mean-loss
    gradients are summed and divided by their count: the whole batch's
    gradient, where the loss is a mean over images and nothing else couples
    them. BatchNorm's batch statistics do: each micro-batch is normalised by
    its own, and updates the running averages in turn (``model_state`` is the
    loop's carry). Dropout draws each micro-batch's masks for its own shape.
    The loss returned is the micro-batches' mean.
    """
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
    if micro_batch is None:
        return value_and_grad

    def accumulated(params, model_state, batch):
        count = jax.tree.leaves(batch)[0].shape[0] // micro_batch
        # Micro-batch i is images i, i + count, i + 2 count...: a batch split over devices
        # splits so on each device, and each micro-batch stays split over all of them.
        micro_batches = jax.tree.map(
            lambda a: a.reshape(micro_batch, count, *a.shape[1:]).swapaxes(0, 1), batch
        )

        def add(carry, micro):
            loss_sum, grads_sum, model_state = carry
            (loss, model_state), grads = value_and_grad(params, model_state, micro)
            return (loss_sum + loss, jax.tree.map(jnp.add, grads_sum, grads), model_state), None

        zeros = jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params)
        (loss, grads, model_state), _ = jax.lax.scan(add, (*zeros, model_state), micro_batches)
        return (loss / count, model_state), jax.tree.map(lambda g: g / count, grads)

    return accumulated


def planning_inputs(workload: Workload) -> tuple[Any, Callable[..., Any], tuple, Any]:
    """``(model, step, (state, batch), blocks)``: the workload's plain-Flax model, abstract
    arguments and training step, as a user gives them to :func:`jaxoffload.plan`."""
    dtype = jnp.dtype(workload.dtype)
    if models.is_nnx(workload.model):
        model = nnx.eval_shape(
            lambda: models.create_nnx(
                workload.model, dtype=dtype, num_classes=workload.num_classes, rngs=nnx.Rngs(1)
            )
        )
        _, state, batch, _ = _nnx_training(workload, abstract=True, model=model)

        def step(model, state, batch):
            return _nnx_training(workload, abstract=None, model=model)[0](state, batch)

        return model, step, (state, batch), models.nnx_block_class(workload.model)
    model = linen_model(workload, plannable=True)
    _, state, batch, _ = training(workload, model, abstract=True)

    def step(model, state, batch):
        return training(workload, model, abstract=None)[0](state, batch)

    return model, step, (state, batch), None


def planner_of(workload: Workload, say: Callable[[str], None], inputs=None) -> Planner:
    """The :class:`~jaxoffload._src.planner.search.Planner` of the workload's plain-Flax
    model and training step (``inputs``, by default :func:`planning_inputs`), as ``bench
    --budget`` plans it: the state donated, ``workload.block_costs``."""
    model, step, args, blocks = planning_inputs(workload) if inputs is None else inputs
    return Planner(
        model,
        step,
        args,
        None,
        blocks=blocks,
        runs=5,
        say=say,
        donate_argnums=(0,),
        block_costs=workload.block_costs,
    )


def plan_budgets(workload: Workload, budgets_bytes: Sequence[int]) -> list[dict[str, Any]]:
    """:func:`jaxoffload.plan` of the workload's plain-Flax model at each budget, in bytes.

    Returns:
      One ``{"planned": Plan.to_dict()}`` per budget, or ``{"no_plan": message}``
      where no plan fits; each with ``planning_s``, the seconds that planning
      every budget took (they are planned together, from the model and its abstract
      arguments built, as :func:`jaxoffload.plan` is given them), and ``planned_budgets``;
      the first also with ``planner_points``, every plan compiled
      (:meth:`~jaxoffload._src.planner.search.Planner.compiled_points`).
    """
    inputs = planning_inputs(workload)
    # Planning is what jaxoffload.plan does, from the model and arguments that a user has.
    start = time.perf_counter()

    def say(line: str) -> None:  # the seconds since planning began, to see where time goes
        print(f"[plan] {time.perf_counter() - start:6.1f} s  {line}", file=sys.stderr, flush=True)

    shared = planner_of(workload, say, inputs)
    results = []
    found = shared.plans_for([int(b) for b in budgets_bytes], max_rounds=3)
    # The budgets are planned together: each one's planning time is theirs together.
    planning_s = time.perf_counter() - start
    for planned in found:
        if isinstance(planned, NoPlanFits):
            e = planned
            share = e.least_bytes / e.plain_bytes if e.least_bytes and e.plain_bytes else None
            results.append(
                {"no_plan": str(e), "least_share": share, "platform": jax.default_backend()}
            )
        else:
            results.append({"planned": planned.to_dict()})
        results[-1].update(planning_s=planning_s, planned_budgets=len(budgets_bytes))
        print(results[-1].get("no_plan") or Plan.from_dict(results[-1]["planned"]), file=sys.stderr)
    # What was compiled, once, with the first budget's result: for fitting byte models offline.
    results[0]["planner_points"] = shared.compiled_points()
    return results


def requested_host_bytes(workload: Workload) -> int:
    """The bytes a workload's training step asks to move to host memory, from its jaxpr alone.

    Traces the step with abstract values: no device memory and no compilation,
    so it runs anywhere, at any size. It predicts what a GPU's compiled
    program moves (a record's ``device_to_host_bytes``; docs/history.md
    compares the two).
    """
    step, state, batch, _ = train_step(workload, abstract=True)
    return sum(requested_host_transfers(step.trace(state, batch).jaxpr))


def hidden_offload_workload(
    workload: Workload,
    *,
    fwd_ms: float,
    bwd_ms: float,
    d2h_gbps: float,
    h2d_gbps: float,
    recompute_share: float = HIDDEN_RECOMPUTE_SHARE,
) -> Workload:
    """The workload with the plan of :func:`jaxoffload.bench.hidden.plan_hidden_offload`.

    The plan frees the most device memory whose transfers hide behind
    compute and whose recomputation adds at most ``recompute_share`` of the
    step's compute time (``fwd_ms + bwd_ms``). Per block, from traces alone
    (:func:`jaxoffload.offloaded_calls`):

    - the bytes it moves, and the device bytes it keeps, when it offloads
      and its neighbours are ``"lean"``, as in the plans this makes: two
      traces, in which every other block offloads. A ResNet block between
      lean ones leaves on the device the input that the block before keeps
      anyway;
    - the device bytes it frees: what it keeps as a ``"lean"`` block (a
      third trace), less what it keeps when it offloads, less the residuals
      that are its own outputs, which the next block keeps as its input;
    - its recomputation: its forward time times the extra FLOPs of its
      backward pass over a lean block's, as a share of its forward FLOPs.

    Each block's forward time comes from timing it alone on the default
    device (:func:`time_offloaded_calls`). The step's compute times and the
    bandwidths are measured ones, e.g. those of the ``"lean"`` run.
    """
    n = models.num_blocks(workload.model)

    def traced_calls(plan):
        step, state, batch, _ = train_step(dataclasses.replace(workload, plan=plan), abstract=True)
        traced = offloaded_calls(step, state, batch)
        if len(traced) != n:
            raise RuntimeError(f"expected one offloaded call per block, traced {len(traced)}.")
        return traced

    calls: list[Any] = [None] * n
    for parity in (0, 1):
        alternate = tuple("offload" if i % 2 == parity else "lean" for i in range(n))
        calls[parity::2] = traced_calls(alternate)[parity::2]
    lean = traced_calls(("lean",) * n)
    forward_ms = time_offloaded_calls(calls)
    freed = [
        lean_call.device_bytes
        - sum(r.nbytes for r in lean_call.residuals if r.output)
        - call.device_bytes
        for call, lean_call in zip(calls, lean)
    ]
    extra = [
        ms * max(0, call.grad_flops - lean_call.grad_flops) / call.flops if call.flops else 0.0
        for ms, call, lean_call in zip(forward_ms, calls, lean)
    ]
    plan = plan_hidden_offload(
        [call.host_bytes for call in calls],
        block_costs=forward_ms,
        freed_bytes=[max(0, f) for f in freed],
        extra_ms=extra,
        max_extra_ms=recompute_share * (fwd_ms + bwd_ms),
        fwd_ms=fwd_ms,
        bwd_ms=bwd_ms,
        d2h_gbps=d2h_gbps,
        h2d_gbps=h2d_gbps,
    )
    strategies = tuple("offload" if chosen else "lean" for chosen in plan.offload)
    return dataclasses.replace(workload, plan=strategies, window=plan.window)


def time_offloaded_calls(calls: Sequence[OffloadedCall], runs: int = 5) -> list[float]:
    """Each offloaded call's forward pass, run alone on the default device: median ms.

    A planner's per-block compute. Blocks of the same FLOPs can take very
    different times: BatchNorm and ReLU passes over memory, which scale with
    the activations, take much of a block's time (docs/history.md gives
    ResNet-50's). Calls with the same forward program are timed once. The
    inputs are zeros: a convolution's time does not depend on its values.

    Args:
      calls: from :func:`jaxoffload.offloaded_calls`.
      runs: timed runs per distinct call, after one to compile and warm up.

    Returns:
      One time per call, in call order.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload import offload, offloaded_calls
      >>> layer = offload(lambda w, x: jnp.tanh(x @ w), device_argnums=0)
      >>> step = jax.grad(lambda w, x: layer(w, layer(w, x)).sum())
      >>> calls = offloaded_calls(step, jnp.ones((8, 8)), jnp.ones((4, 8)))
      >>> first, second = time_offloaded_calls(calls, runs=2)
      >>> first == second  # the same program, timed once
      True
    """
    programs = [str(call.forward) for call in calls]
    times: dict[str, float] = {}
    for call, program in zip(calls, programs):
        if program not in times:
            args = [zeros(v.aval) for v in call.forward.jaxpr.invars]
            forward = jax.jit(jex_core.jaxpr_as_fun(call.forward))
            times[program] = median_ms(forward, *args, runs=runs)
    return [times[program] for program in programs]


def measure(
    workload: Workload,
    *,
    steps: int = 10,
    warmup: int = 2,
    reference: str | None = None,
    time_forward: bool = False,
    probe_link: bool = False,
    time_twin: bool = False,
) -> dict[str, Any]:
    """Compiles and runs a workload in this process; returns one record.

    Call it in a fresh process (see :func:`measure_in_subprocess`): the runtime
    peak covers everything the process did before.

    Args:
      workload: what to measure.
      steps: timed steps; the record holds their median.
      warmup: untimed steps first.
      reference: a ``.npz`` path. If the file exists, the record's
        ``grad_rel_err`` compares this workload's gradient at the initial
        parameters with the one stored there; if not, this workload's gradient
        is stored there (measure the ``"none"`` strategy first). The gradient is
        computed after the runtime peak is read. An accumulating workload
        checks its gradient against the whole batch's itself
        (:func:`_accumulation_check`), and reads no reference.
      time_forward: also time the forward pass alone (``forward_ms``), after
        the runtime peak is read.
      probe_link: also measure the host link (``d2h_gbps``, ``h2d_gbps``, see
        :func:`measure_link`), after the runtime peak is read.
      time_twin: if the step moves residuals, also time its twin without
        host placement (``twin_step_ms``, ``twin_forward_ms``), after the
        runtime peak is read: the compute of its transfer bound.

    A planned strategy's workload must carry its plan (:func:`plan_in_subprocess`).
    With ``num_devices`` or ``spatial`` > 1 the memory figures are per device: the
    compiled program's are one device's, and the runtime peak is the largest
    device's; with ``spatial`` > 1, ``spatial_gathers`` lists the all-gathers that
    undo the split (:func:`jaxoffload.spatial_gathers`).
    """
    if (
        workload.strategy in PLANNED_STRATEGIES
        and workload.plan is None
        and workload.planned is None
    ):
        raise ValueError(
            f"{workload.strategy!r} needs a plan first: see plan_in_subprocess, whose "
            "timing runs would otherwise count in this process's peak."
        )
    step, state, batch, loss_fn = train_step(workload)
    devices = jax.devices()[: workload.devices]
    # Donation consumes the initial state: keep a host copy for the gradient check, and
    # where it was (a sharded step's gradients are sharded as its parameters are).
    initial = None
    if reference is not None or workload.micro_batch is not None:
        initial = jax.device_get(state[:2]), jax.tree.map(lambda a: a.sharding, state[:2])
    hits = _cache_hits()[0]
    compiled, report = _compile_and_analyze(step, state, batch)
    from_cache = _cache_hits()[0] > hits if os.environ.get(_CACHE_DIR) else None
    compile_peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    twin = None
    if report.moved:
        # The same program without host placement: what the copies free.
        twin = compile_twin(workload)
        report = with_twin(report, twin[0])
    state, loss, times = _time_steps(compiled, state, batch, warmup=warmup, steps=steps)
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    peak = None if None in peaks else max(peaks)
    device = devices[0]
    extra = {}
    if workload.spatial > 1:  # what the partitioner could not split along the rows
        gathers = read_spatial_gathers(compiled.as_text())
        extra["spatial_gathers"] = [dataclasses.asdict(g) for g in gathers]
    if time_forward:
        extra["forward_ms"] = _forward_ms(loss_fn, state, batch, runs=steps)
    if time_twin and twin is not None:
        state, loss, twin_times = _time_twin(*twin, state, batch, steps=steps)
        extra.update(twin_times)
    del state
    if probe_link:
        extra.update(_probe_link(devices))
    gradient = {"grad_rel_err": None}
    if initial is not None:
        initial = jax.device_put(*initial)
        if workload.micro_batch is not None:
            gradient = _accumulation_check(workload, loss_fn, initial)
        else:
            gradient["grad_rel_err"] = _compare_gradients(loss_fn, initial, batch, reference)
    return {
        **_workload_fields(workload),
        **device_fields(device),
        **_compiled_fields(report),
        "peak_bytes_in_use": peak,
        # What compiling held at its peak (autotuning runs kernels on the device), and
        # whether the step came from the persistent cache that compile_in_subprocess fills.
        "compile_peak_bytes": None if None in compile_peaks else max(compile_peaks),
        "compiled_from_cache": from_cache,
        **_step_fields(workload, times, loss),
        **gradient,
        "date": datetime.date.today().isoformat(),
        **extra,
    }


def _compile_and_analyze(step, state, batch):
    """The compiled step, and what its compiled program holds and moves (:func:`analyze`)."""
    traced = step.trace(state, batch)
    compiled = traced.lower().compile()
    return compiled, analyze(traced, compiled, on_dropped="warn")


# jax's persistent compilation cache, by the environment variables that set it: a child that
# compiles a step leaves it there for the child that measures it.
_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"


@functools.cache
def _cache_hits() -> list[int]:
    """This process's count of persistent-cache hits, counted from the first call on."""
    hits = [0]

    def count(event: str, **_: Any) -> None:
        hits[0] += event == "/jax/compilation_cache/cache_hits"

    jax.monitoring.register_event_listener(count)
    return hits


def cache_env(folder: str) -> dict[str, str]:
    """The environment of a child that reads and writes every compiled program in ``folder``."""
    return {
        _CACHE_DIR: folder,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }


def compile_only(workload: Workload) -> dict[str, float]:
    """Compiles the workload's step (and its twin, if it moves bytes) as :func:`measure` does.

    Under :func:`cache_env`, the programs land in the persistent cache, so
    that :func:`measure` in another process loads them rather than compile:
    on a GPU compiling autotunes kernels on the device, and its scratch
    buffers count in the process's peak (a U-Net b80 under ``Lean()`` peaked
    at 9.68 GiB compiling, where its step holds 8.36).
    """
    start = time.perf_counter()
    step, state, batch, _ = train_step(workload)
    _, report = _compile_and_analyze(step, state, batch)
    if report.moved:
        compile_twin(workload)
    return {"compile_s": time.perf_counter() - start}


def compile_in_subprocess(workload: Workload, env: dict[str, str]) -> dict[str, float]:
    """:func:`compile_only` in a fresh process, with ``env`` (a :func:`cache_env`)."""
    return _child(["compile", json.dumps(dataclasses.asdict(workload))], env)


def compile_twin(workload: Workload):
    """The workload's step compiled without host placement, and its ``loss_fn``, allocating nothing.

    The twin keeps the same residuals and compute as the step, on the
    device: its temp is what the host copies free, and its times are the
    compute of the step's transfer bound. The bench's internal API, for
    :func:`measure` and ``benchmarks/compile_probe.py``.
    """
    with without_host_placement():
        step, state, batch, loss_fn = train_step(workload, abstract=True)
        return step.trace(state, batch).lower().compile(), loss_fn


def _time_steps(compiled, state, batch, *, warmup: int, steps: int):
    """``(state, loss, times)`` after ``warmup`` untimed steps and ``steps`` timed ones, in seconds."""
    for _ in range(warmup):
        state, loss = compiled(state, batch)
    loss.block_until_ready()
    return _timed(compiled, state, batch, steps)


def _timed(compiled, state, batch, steps: int):
    """``(state, loss, times)``: ``steps`` steps, each timed to its end, in seconds."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, loss = compiled(state, batch)
        loss.block_until_ready()
        times.append(time.perf_counter() - start)
    return state, loss, times


def _forward_ms(loss_fn, state, batch, *, runs: int) -> float:
    """The median time of the forward pass alone (the loss), in milliseconds."""
    forward = jax.jit(lambda params, model_state, batch: loss_fn(params, model_state, batch)[0])
    return median_ms(forward, state[0], state[1], batch, runs=runs)


def _time_twin(twin, twin_loss, state, batch, *, steps: int):
    """``(state, loss, {"twin_forward_ms", "twin_step_ms"})``: the twin's forward pass and step.

    The twin's steps go on training ``state``; the first, a warm-up, is not counted.
    """
    with without_host_placement():
        forward_ms = _forward_ms(twin_loss, state, batch, runs=steps)
    state, loss, times = _timed(twin, state, batch, steps + 1)
    return (
        state,
        loss,
        {
            "twin_forward_ms": forward_ms,
            "twin_step_ms": statistics.median(times[1:]) * 1e3,
        },
    )


def _probe_link(devices) -> dict[str, float]:
    """The host link's bandwidths per device, all the step's devices copying at once
    (:func:`measure_link`), with an array that fits what each has free."""
    # On CPU the "link" is a memcpy: a smaller array tells as much, sooner.
    # Under a memory cap, the probe must fit in what the step left free.
    nbytes = 2**30 if devices[0].platform == "gpu" else 2**26
    for stats in (d.memory_stats() or {} for d in devices):
        if "bytes_limit" in stats:
            nbytes = min(nbytes, (stats["bytes_limit"] - stats["bytes_in_use"]) // 4)
    return measure_link(nbytes, devices=devices)


def _workload_fields(workload: Workload) -> dict[str, Any]:
    """What a record says of its workload, the plan included."""
    return {
        "model": workload.model,
        "batch": workload.batch,
        "image_size": workload.image_size,
        "dtype": workload.dtype,
        "strategy": workload.strategy,
        "window": workload.window,
        "plan": workload.plan,
        **_plan_fields(workload),
        "offloaded_blocks": workload.offloaded_blocks,
        "num_devices": workload.num_devices,
        **spatial_fields(workload),
        **_accumulation_fields(workload),
        "framework": "jax",
    }


def spatial_fields(workload: Workload) -> dict[str, Any]:
    """A spatially split workload's mesh; the image size recorded is the whole image's."""
    if workload.spatial == 1:
        return {}
    return {"spatial": workload.spatial, "mesh": {"data": workload.num_devices,
                                                 "space": workload.spatial}}  # fmt: skip


def _accumulation_fields(workload: Workload) -> dict[str, Any]:
    """An accumulating workload's micro-batch, and how many make its (global) batch."""
    if workload.micro_batch is None:
        return {}
    return {
        "micro_batch": workload.micro_batch,
        "accumulation_steps": workload.batch // workload.micro_batch,
    }


def device_fields(device) -> dict[str, Any]:
    """The device and the versions a record was measured with."""
    return {
        "device": device.device_kind,
        "platform": device.platform,
        "jax_version": jax.__version__,
        "flax_version": flax.__version__,
        "jaxoffload_version": jaxoffload.__version__,
    }


def _compiled_fields(report) -> dict[str, Any]:
    """What the compiled program holds and moves, from its :class:`jaxoffload.MemoryReport`."""
    return {
        "compiled_temp_bytes": report.temp_bytes,
        "compiled_host_temp_bytes": report.host_temp_bytes,
        "compiled_argument_bytes": report.argument_bytes,
        "twin_temp_bytes": report.twin_temp_bytes,
        "copies_free_little": report.frees_little,
        "requested_host_bytes": report.requested_bytes,
        "host_buffers": report.host_buffers,
        "device_to_host_copies": report.device_to_host,
        "device_to_host_bytes": report.device_to_host_bytes,
        "host_to_device_copies": report.host_to_device,
        "host_to_device_bytes": report.host_to_device_bytes,
    }


def _step_fields(workload: Workload, times: list[float], loss) -> dict[str, Any]:
    """The timed steps' median and each, the throughput and the last loss."""
    step_s = statistics.median(times)
    return {
        "step_time_ms": step_s * 1e3,
        "step_times_ms": [t * 1e3 for t in times],
        "images_per_s": workload.batch / step_s,
        "final_loss": float(loss),
    }


def _plan_fields(workload: Workload) -> dict[str, Any]:
    """A planned workload's budget and per-block choices, for its record."""
    if workload.strategy != "plan":
        return {}
    planned = Plan.from_dict(workload.planned)
    return {
        "budget": workload.budget,
        "budget_bytes": planned.budget_bytes,
        "plan_choices": [brief(s) for s in planned.strategies],
        "plan_outside": brief(planned.outside),
        "plan_compiled_bytes": planned.compiled_bytes,
        "plan_estimated_bytes": planned.estimated_bytes,
        "plan_estimated_step_ms": planned.estimated_step_ms,
        "plan_measured_step_ms": planned.measured_step_ms,
        "planned": workload.planned,  # the plan itself: it re-applies without planning
    }


def add_transfer_bounds(records: list[dict[str, Any]]) -> None:
    """Adds the per-phase lower bound on step time to each offloading record, in place.

    ``bound_ms = max(fwd_compute_ms, offloaded_bytes / d2h) + max(bwd_compute_ms,
    fetched bytes / h2d)``: the least a step takes if each phase must both
    compute and move its own bytes. It is a model, not a floor: copies that
    spill from the forward into the backward pass share the full-duplex link
    with fetches, and can beat it. The compute times are those of the
    record's :data:`COMPUTE_TWIN` in the same run (``forward_ms``, and the
    rest of its step, optimizer update included), the bandwidths those that
    the record's own process measured, and the bytes those of its compiled
    program's host copies (or of its own twin, ``twin_step_ms``, when its
    process timed one). Records that move nothing (every record on CPU),
    without a twin, or without link figures, are left as they are.
    """
    done = {r["strategy"]: r for r in records if "step_time_ms" in r}
    for r in records:
        if "d2h_gbps" not in r or not r.get("device_to_host_bytes"):
            continue
        if "twin_step_ms" in r:  # its own twin, timed in its process
            fwd, bwd = r["twin_forward_ms"], r["twin_step_ms"] - r["twin_forward_ms"]
            twin = {"strategy": r["strategy"] + " without host placement"}
        else:
            twin = done.get(COMPUTE_TWIN.get(r["strategy"], ""))
            if twin is None or "forward_ms" not in twin:
                continue
            fwd, bwd = _compute_ms(twin)
        out_ms = r["device_to_host_bytes"] / (r["d2h_gbps"] * 1e6)
        back_ms = r["host_to_device_bytes"] / (r["h2d_gbps"] * 1e6)
        bound = max(fwd, out_ms) + max(bwd, back_ms)
        r.update(
            offloaded_bytes=r["device_to_host_bytes"],
            compute_twin=twin["strategy"],
            fwd_compute_ms=fwd,
            bwd_compute_ms=bwd,
            bound_ms=bound,
            bound_ratio=r["step_time_ms"] / bound,
        )


def _compute_ms(twin: dict[str, Any]) -> tuple[float, float]:
    """A no-transfer run's forward time, and the rest of its step (backward and update)."""
    return twin["forward_ms"], twin["step_time_ms"] - twin["forward_ms"]


def _compare_gradients(
    loss_fn, initial, batch, reference: str, micro_batch: int | None = None
) -> float:
    """:func:`gradient_error` of the gradient at ``initial``, over micro-batches if given."""
    return gradient_error(gradient_at(loss_fn, *initial, batch, micro_batch), reference)


def gradient_at(
    loss_fn, params, model_state, batch, micro_batch: int | None = None
) -> list[np.ndarray]:
    """The gradient of ``loss_fn`` at ``params``, as float64 arrays in a fixed order."""
    # Arguments, not constants: NNX writes BatchNorm statistics in place into its variables,
    # and a batch split over devices stays split.
    _, grads = jax.jit(_value_and_grad(loss_fn, micro_batch))(params, model_state, batch)
    return [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]


def _accumulation_check(workload: Workload, loss_fn, initial) -> dict[str, Any]:
    """An accumulating record's gradient error against the whole batch's, and why it is not 0.

    The step it accumulates (``"none"``'s, or ``"lean"``'s) may not fit the
    global batch at all (which is why one accumulates), so the check is at a
    batch that it runs whole: at most one micro-batch's images (but two per
    device at least). The gradient of two micro-batches of half as many is
    compared with the whole batch's
    as :func:`gradient_error` compares any run with its reference. It is the
    same but for rounding where the loss is a mean over images and nothing
    else couples them; BatchNorm's statistics and dropout's masks do.
    """
    n = workload.num_devices
    half = n * max(1, workload.micro_batch // (2 * n))  # still split over the devices
    check = dataclasses.replace(workload, batch=2 * half, micro_batch=half)
    _, batch = _placed(lambda: ((), _batch(check)), check, abstract=False)
    with tempfile.TemporaryDirectory() as folder:
        whole = os.path.join(folder, "whole_batch_gradient.npz")
        _compare_gradients(loss_fn, initial, batch, whole)  # stores it, as "none" does
        error = _compare_gradients(loss_fn, initial, batch, whole, micro_batch=half)
    params, model_state = initial
    per_micro_batch = f"per micro-batch of {workload.micro_batch}"
    statistics = _has_batch_statistics(model_state)
    masks = _draws_random_numbers(loss_fn, params, model_state, batch)
    differs = [what for what, yes in [("BatchNorm's batch statistics", statistics),
                                      ("dropout's masks", masks)] if yes]  # fmt: skip
    against = (
        f"against {ACCUMULATED_STRATEGIES[workload.strategy]}'s step on a whole batch of "
        f"{2 * half}, accumulated over two micro-batches of {half}"
    )
    return {
        "batch_norm_statistics": per_micro_batch if statistics else None,
        "dropout_masks": per_micro_batch if masks else None,
        "grad_rel_err": error,
        "grad_check_batch": 2 * half,
        "grad_rel_err_note": (
            f"{against}: not the same, since {' and '.join(differs)} are per micro-batch"
            if differs
            else f"{against}: the same but for rounding (a mean loss; no BatchNorm, no dropout)"
        ),
    }


def _has_batch_statistics(model_state) -> bool:
    """Whether a model keeps BatchNorm's statistics: linen's ``batch_stats``, NNX's ``BatchStat``."""
    variables = jax.tree.leaves(model_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return "batch_stats" in model_state or any(isinstance(v, nnx.BatchStat) for v in variables)


def _draws_random_numbers(loss_fn, params, model_state, batch) -> bool:
    """Whether the loss draws random numbers (dropout's masks), which a micro-batch draws anew."""
    jaxpr = jax.make_jaxpr(loss_fn)(params, model_state, batch)
    return any(eqn.primitive.name == "random_bits" for eqn in equations(jaxpr))


def gradient_error(grads: list[np.ndarray], reference: str) -> float:
    """Relative L2 error of ``grads`` against the gradient stored at ``reference``.

    The first run (the reference strategy) finds no file: it stores ``grads``
    there and gets 0. Any framework's gradients can be compared this way, as
    long as every run lists its arrays in the same order.

    Args:
      grads: the gradient's arrays, in a fixed order.
      reference: a ``.npz`` path.

    Raises:
      ValueError: if the stored arrays have other shapes (another model).
    """
    if not os.path.exists(reference):
        np.savez(reference, *grads)
        return 0.0
    with np.load(reference) as stored:
        ref = [stored[f"arr_{n}"] for n in range(len(stored.files))]
    if [r.shape for r in ref] != [g.shape for g in grads]:
        raise ValueError(f"{reference} holds the gradient of another model.")
    return relative_error(grads, ref)


def relative_error(grads: Sequence[np.ndarray], reference: Sequence[np.ndarray]) -> float:
    """The relative L2 error of ``grads`` against ``reference``, over all their arrays."""
    diff = sum(np.sum((g - r) ** 2) for g, r in zip(grads, reference))
    return float(np.sqrt(diff / sum(np.sum(r**2) for r in reference)))


class OutOfMemory(RuntimeError):
    """The workload did not fit in device memory."""


def measure_in_subprocess(
    workload: Workload,
    *,
    steps: int = 10,
    reference: str | None = None,
    env: dict[str, str] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """:func:`measure` in a fresh Python process.

    ``options`` are :func:`measure`'s other keyword arguments.

    Raises:
      OutOfMemory: if the child ran out of device memory.
      RuntimeError: if it failed otherwise; the message holds its last output.
    """
    options = {"steps": steps, "reference": reference, **options}
    return _child(["measure", json.dumps(dataclasses.asdict(workload)), json.dumps(options)], env)


def measure_all(
    workloads: list[Workload],
    *,
    steps: int = 10,
    env: dict[str, str] | None = None,
    on_start: Any = None,
    on_record: Any = None,
    measured: Sequence[dict[str, Any]] = (),
    reference: str | None = None,
    compile_first: bool = False,
) -> list[dict[str, Any]]:
    """Measures each workload in its own process, with gradients compared to the first.

    The first workload must use the ``"none"`` strategy: it is the reference
    for every ``grad_rel_err`` (but an accumulating strategy's, which its process
    checks at a smaller batch). A workload that runs out of memory gives a
    record with ``"out_of_memory": True``; one whose process fails otherwise
    gives a record with its ``"error"``. Records of strategies that move
    residuals to the host get the transfer bound (:func:`add_transfer_bounds`)
    when their :data:`COMPUTE_TWIN` is among the workloads. A planned strategy
    is planned in a process of its own (:func:`plan_in_subprocess`), from its
    twin's record, which must come before it.

    Args:
      workloads: what to measure, the reference first (none where every workload
        accumulates gradients: each checks its own against its step on a whole batch).
      steps: timed steps per workload.
      env: extra environment variables for the child processes.
      on_start: called with each workload before it starts (for progress).
      on_record: called with the records so far after each one, so that an
        interrupted run loses nothing already measured.
      measured: records of an earlier run of these workloads, kept in place of
        measuring again the workloads they match (by strategy and budget).
      reference: the ``.npz`` file of the first workload's gradient, which the
        others are compared with; a temporary one by default. A run that keeps
        the first workload's record in ``measured`` must give the file that
        its run wrote.
      compile_first: compile each step in a process of its own first, into a
        persistent compilation cache that the measuring process loads it
        from (:func:`compile_only`): on a GPU, so that the runtime peak is the
        step's, not its compile's. Planning compiles into a cache of its own
        (empty when it starts), from which the plans' steps are then loaded.
    """
    self_checked = all(w.strategy in ACCUMULATED_STRATEGIES for w in workloads)
    if not workloads or (workloads[0].strategy != "none" and not self_checked):
        raise ValueError(
            "the first workload must use the 'none' strategy: it is the reference (unless "
            "every workload accumulates, and checks itself against its own whole step)."
        )
    kept = {(r["strategy"], r.get("budget")): r for r in measured}
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as folder:
        cache = planned = None
        if compile_first:
            cache = cache_env(os.path.join(folder, "compiled"))
            # Planning compiles into a cache of its own, cold as a user's, from which the
            # plans it returns are loaded rather than compiled again.
            planned = cache_env(os.path.join(folder, "planned"))
        budget_plans = _BudgetPlans(workloads, kept, {**(env or {}), **planned} if planned else env)
        reference = reference or os.path.join(folder, "reference_gradient.npz")
        for w in workloads:
            record = kept.get((w.strategy, w.budget))
            if record is None:
                if on_start is not None:
                    on_start(w)
                record = _plan_and_measure(
                    w,
                    records,
                    budget_plans,
                    steps=steps,
                    reference=reference,
                    env=env,
                    cache=planned if w.strategy == "plan" else cache,
                )
            records.append(record)
            if w is workloads[0] and "step_time_ms" not in record:
                reference = None  # no reference gradient: no errors to report
            if (w.strategy, w.budget) not in kept and on_record is not None:
                on_record(records)
    add_transfer_bounds(records)
    return records


def _plan_and_measure(
    workload: Workload,
    records: list[dict[str, Any]],
    budget_plans: _BudgetPlans,
    *,
    steps: int,
    reference: str | None,
    env: dict[str, str] | None,
    cache: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The record of one workload, planned first if its strategy is: measured, or its failure.

    With ``cache`` (a :func:`cache_env`), its step is compiled in a process of its own first.
    """
    w = workload
    try:
        if w.strategy == "plan" and w.planned is None:
            w = budget_plans.apply(w, records)
        if w.strategy == "offload-hidden":
            w = plan_in_subprocess(w, env=env, **_hidden_budget(w, records))
        if cache is not None:
            env = {**(env or {}), **cache}
            compile_in_subprocess(w, env)
        record = measure_in_subprocess(
            w, steps=steps, reference=reference, env=env, **_measure_options(w.strategy)
        )
    except OutOfMemory:
        return _failure_record(w, {"out_of_memory": True})
    except NoPlan as e:
        # An answer, not a failure: the least that any plan reached, and why.
        no_plan = {"no_plan": e.message, "least_share": e.least_share, "platform": e.platform}
        return {**_failure_record(w, no_plan), **budget_plans.planning(w)}
    except RuntimeError as e:
        # One broken strategy must not cost the others' measurements.
        return _failure_record(w, {"error": str(e)})
    if w.strategy == "plan":
        record.update(budget_plans.planning(w))
    return record


def _measure_options(strategy: str) -> dict[str, bool]:
    """What :func:`measure` times beyond the step for a strategy, after its peak is read."""
    return {
        "time_forward": strategy in COMPUTE_TWIN.values(),
        # Twins measure the link too: a planner takes it from them.
        "probe_link": strategy in {*COMPUTE_TWIN, *COMPUTE_TWIN.values(), "plan"},
        "time_twin": strategy == "plan",
    }


def _failure_record(workload: Workload, failure: dict[str, Any]) -> dict[str, Any]:
    """The record of a workload that could not be measured: the workload, and what went wrong."""
    return {
        **dataclasses.asdict(workload),
        "offloaded_blocks": workload.offloaded_blocks,
        "framework": "jax",
        **failure,
    }


class NoPlan(RuntimeError):
    """No plan fits a ``"plan"`` workload's budget: the planner's message and the least share."""

    def __init__(self, message: str, least_share: float | None, platform: str | None):
        super().__init__(message)
        self.message, self.least_share, self.platform = message, least_share, platform


class _BudgetPlans:
    """The plans of a run's ``"plan"`` budgets, all made in one process when the first is needed.

    Planning measures every block's costs, once for all the budgets; in a
    process of its own (:func:`plan_budgets_in_subprocess`), they count in no
    measured peak.
    """

    def __init__(
        self,
        workloads: Sequence[Workload],
        kept: dict[tuple[str, float | None], dict[str, Any]],
        env: dict[str, str] | None,
    ):
        self.budgets = [
            w.budget for w in workloads if w.strategy == "plan" and ("plan", w.budget) not in kept
        ]
        self.env = env
        self.results: dict[float, dict[str, Any]] = {}

    def apply(self, workload: Workload, records: list[dict[str, Any]]) -> Workload:
        """``workload`` with its budget's plan; raises ``RuntimeError`` if none fits."""
        if not self.results:
            budgets_bytes = _budget_bytes(self.budgets, records)
            results = plan_budgets_in_subprocess(workload, budgets_bytes, env=self.env)
            self.results.update(zip(self.budgets, results))
        result = self.results[workload.budget]
        if "no_plan" in result:
            raise NoPlan(result["no_plan"], result.get("least_share"), result.get("platform"))
        return dataclasses.replace(workload, planned=result["planned"])

    def planning(self, workload: Workload) -> dict[str, Any]:
        """How long planning took (``planning_s``), and for how many budgets together; the
        first budget's also with the plans that planning compiled (``planner_points``)."""
        result = self.results[workload.budget]
        keys = ("planning_s", "planned_budgets", "planner_points")
        return {k: result[k] for k in keys if k in result}


def plan_in_subprocess(
    workload: Workload, *, env: dict[str, str] | None = None, **budget: float
) -> Workload:
    """:func:`hidden_offload_workload` in a fresh Python process.

    Planning times each block on the device; in a process of its own, that
    does not count in the runtime peak of the process that then measures the
    planned step.

    Args:
      workload: a workload of a ``PLANNED_STRATEGIES`` strategy.
      env: extra environment variables for the child process.
      **budget: ``fwd_ms``, ``bwd_ms``, ``d2h_gbps`` and ``h2d_gbps``, as
        :func:`hidden_offload_workload` takes them.

    Returns:
      The workload with its ``plan`` and ``window``.

    Raises:
      OutOfMemory: if the child ran out of device memory.
      RuntimeError: if it failed otherwise.
    """
    planned = _child(["plan", json.dumps(dataclasses.asdict(workload)), json.dumps(budget)], env)
    return dataclasses.replace(workload, plan=tuple(planned["plan"]), window=planned["window"])


def plan_budgets_in_subprocess(
    workload: Workload, budgets_bytes: Sequence[int], *, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """:func:`plan_budgets` in a fresh Python process, so its timing runs count in no measured peak."""
    return _child(
        ["plan-budgets", json.dumps(dataclasses.asdict(workload)), json.dumps(list(budgets_bytes))],
        env,
    )


def _budget_bytes(budgets: Sequence[float], records: list[dict[str, Any]]) -> list[int]:
    """Each budget share in the planner's bytes (compiled arguments and temporaries).

    A share is of the ``"none"`` run's runtime peak, less what that run's
    allocator held beyond its compiled bytes, so that the plan's runtime
    peak, not only its compiled bytes, fits.
    """
    none = next((r for r in records if r["strategy"] == "none" and "step_time_ms" in r), None)
    if none is None:
        raise RuntimeError("'plan' budgets are shares of the 'none' run's peak: it failed.")
    compiled = none["compiled_temp_bytes"] + none["compiled_argument_bytes"]
    peak = none["peak_bytes_in_use"] or compiled  # no runtime peak on some backends
    return [int(b * peak - max(0, peak - compiled)) for b in budgets]


def _hidden_budget(workload: Workload, records: list[dict[str, Any]]) -> dict[str, float]:
    twin = COMPUTE_TWIN[workload.strategy]
    done = [r for r in records if r["strategy"] == twin and "d2h_gbps" in r]
    if not done:
        raise RuntimeError(
            f"{workload.strategy!r} is planned from the {twin!r} run's times and link: "
            f"list {twin!r} before it."
        )
    r = done[-1]
    fwd, bwd = _compute_ms(r)
    return {"fwd_ms": fwd, "bwd_ms": bwd, "d2h_gbps": r["d2h_gbps"], "h2d_gbps": r["h2d_gbps"]}


def largest_in_subprocess(
    workload: Workload,
    axis: str,
    *,
    plan: bool = False,
    env: dict[str, str] | None = None,
    time_limit_s: float = 300.0,
    min_speed: float | None = None,
) -> dict[str, Any]:
    """:func:`jaxoffload.bench.fit.largest` of a workload, in a fresh Python process.

    Its confirming step reads the process's runtime peak, so each search has a
    process of its own. The process runs ``python -m jaxoffload.bench.fit``:
    that module imports this one, which therefore names it rather than
    importing it.

    Returns:
      The record fields that it names for ``axis``: ``max_batch``,
      ``max_batch_images_per_s``, ... (or ``max_image_size``, ...).

    Raises:
      OutOfMemory: if the child ran out of device memory other than in the
        confirming step, which steps down instead (in planning's timing runs, say).
      RuntimeError: if it failed otherwise.
    """
    options = {"axis": axis, "plan": plan, "time_limit_s": time_limit_s, "min_speed": min_speed}
    argv = [json.dumps(dataclasses.asdict(workload)), json.dumps(options)]
    return _child(argv, env, module="jaxoffload.bench.fit")


def _child(
    argv: list[str], env: dict[str, str] | None, module: str = "jaxoffload.bench.benchmark"
) -> Any:
    """Runs ``python -m module argv`` and returns the JSON of its last stdout line.

    The child's ``[plan]`` and ``[fit ...]`` progress lines are passed on to
    this process's stderr as they come; the rest of its stderr is kept for the
    error.
    """
    child = subprocess.Popen(
        [sys.executable, "-m", module, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.extend(child.stdout))
    reader.start()
    stderr = []
    for line in child.stderr:
        stderr.append(line)
        if line.startswith(("[plan]", "[fit ")):
            print(line, end="", file=sys.stderr, flush=True)
    reader.join()
    returncode = child.wait()
    err = "".join(stderr)
    if returncode == 0:
        return json.loads("".join(stdout).strip().splitlines()[-1])
    if "RESOURCE_EXHAUSTED" in err or "Out of memory" in err:
        raise OutOfMemory(err.strip().splitlines()[-1])
    tail = "\n".join(err.strip().splitlines()[-15:])
    raise RuntimeError(f"the measuring process failed (exit code {returncode}):\n{tail}")


def probe_device(env: dict[str, str] | None = None) -> dict[str, Any]:
    """The default device's platform, kind, memory limit and device count, read in a fresh process.

    The parent of the measuring processes must not start a GPU client itself:
    the client would take its share of device memory away from every child.
    """
    return _child(["probe"], env)


def _probe() -> dict[str, Any]:
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {
        "platform": device.platform,
        "device": device.device_kind,
        "bytes_limit": stats.get("bytes_limit"),
        "device_count": jax.device_count(),
    }


def _main(argv: list[str]) -> None:
    if argv[0] == "probe":
        print(json.dumps(_probe()), flush=True)
    elif argv[0] == "plan":
        planned = hidden_offload_workload(Workload(**json.loads(argv[1])), **json.loads(argv[2]))
        print(json.dumps({"plan": planned.plan, "window": planned.window}), flush=True)
    elif argv[0] == "plan-budgets":
        results = plan_budgets(Workload(**json.loads(argv[1])), json.loads(argv[2]))
        print(json.dumps(results), flush=True)
    elif argv[0] == "compile":
        print(json.dumps(compile_only(Workload(**json.loads(argv[1])))), flush=True)
    elif argv[0] == "measure":
        record = measure(Workload(**json.loads(argv[1])), **json.loads(argv[2]))
        print(json.dumps(record), flush=True)
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    _main(sys.argv[1:])
