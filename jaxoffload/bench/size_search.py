"""The bench's size search: :func:`jaxoffload.largest_size` on a workload's training step.

Run it in a fresh process (:meth:`jaxoffload.bench.child.Children.largest`): its
confirming step reads the process's runtime peak.
"""

from __future__ import annotations

import dataclasses
import time

import jax

import jaxoffload
from jaxoffload.bench import models
from jaxoffload.bench.measure import device_fields
from jaxoffload.bench.record import Record, SizeSearch
from jaxoffload.bench.step import linen_model, training
from jaxoffload.bench.workload import Workload

__all__ = ["AXES", "largest"]

# The sizes a search can grow, each with the multiple its sizes keep and the power of the
# size that a step's bytes grow with: the batch, or the images' side. Sides are multiples
# of 16, so that a U-Net's four halvings and doublings meet its skips.
AXES = {"batch": (1, 1.0), "image_size": (16, 2.0)}
# The smallest size of each axis that a workload takes (Workload checks it), and
# the largest searched: a segmentation net's one image may reach thousands of pixels a side.
SMALLEST = {"batch": 1, "image_size": 32}
LARGEST = {"batch": 4096, "image_size": 8192}

# What the allocator holds beyond a step's compiled bytes: a few percent.
ALLOCATOR_SLACK = 0.03


def largest(
    workload: Workload,
    axis: str,
    *,
    plan: bool = False,
    budget_bytes: int | None = None,
    time_limit_s: float = 300.0,
    limit: int | None = None,
    min_speed: float | None = None,
) -> Record:
    """The largest ``axis`` (``"batch"`` or ``"image_size"``) at which the workload's step fits.

    Args:
      workload: the model, dtype and strategy; its ``axis`` is where the search starts.
      plan: plan the plain-Flax model at each size instead of taking the
        workload's strategy (:func:`jaxoffload.largest_size` with ``plan=True``).
      budget_bytes: device bytes; by default, this process's device memory
        limit less :data:`ALLOCATOR_SLACK`.
      time_limit_s, limit, min_speed: as in :func:`jaxoffload.largest_size`; the
        limit is :data:`LARGEST`'s by default.

    Returns:
      A record of the search alone: the workload's strategy (``"plan"`` with ``plan``),
      the device and versions, and what the search found (``searches[axis]``, written as
      ``max_batch``, ``max_batch_images_per_s``, ``max_batch_step_ms``, its bracket
      ``max_batch_fits_at`` and ``max_batch_over_at``, ... or ``max_image_size``, with
      ``max_image_size_ms_per_megapixel``).
    """
    if axis not in AXES:
        raise ValueError(f"axis must be one of {sorted(AXES)}, got {axis!r}.")
    if budget_bytes is None:
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            raise RuntimeError(
                "a size search needs a device that reports its memory limit (a GPU), or a "
                "budget in bytes."
            )
        budget_bytes = int(stats["bytes_limit"] * (1 - ALLOCATOR_SLACK))
    model, step = _model_and_step(workload, plan)
    # Sizes that split over the mesh: a batch over "data", each image's rows over "space".
    multiple = AXES[axis][0] * (workload.num_devices if axis == "batch" else workload.spatial)
    smallest = -(-SMALLEST[axis] // multiple) * multiple

    def args_at(size):
        _, state, batch, _ = training(
            dataclasses.replace(workload, **{axis: size}), model, abstract=True
        )
        return state, batch

    began = time.perf_counter()
    found = jaxoffload.largest_size(
        model, step, args_at, budget=budget_bytes, plan=plan, start=getattr(workload, axis),
        limit=LARGEST[axis] if limit is None else limit, multiple_of=multiple,
        smallest=smallest, exponent=AXES[axis][1], time_limit_s=time_limit_s,
        donate_argnums=(0,), min_speed=min_speed,
    )  # fmt: skip
    # The versions too: the planned model's search record has no measured step to carry them.
    found = _found(workload, axis, found, time.perf_counter() - began)
    if plan:
        found = found.with_fields(min_speed=min_speed)
    return Record.of(
        strategy="plan" if plan else workload.strategy,
        **device_fields(jax.devices()[0]),
        searches={axis: found},
    )


def _model_and_step(workload: Workload, plan: bool):
    """The model as the library takes it, and ``step(model, state, batch)``."""
    if models.is_nnx(workload.model):
        raise NotImplementedError("the size search takes the linen models of the bench.")

    def step(model, state, batch):
        return training(workload, model, abstract=None)[0](state, batch)

    return linen_model(workload, plannable=plan), step


def _found(workload, axis, found: jaxoffload.Fit, search_s: float) -> SizeSearch:
    """What the search found, and at what speed."""
    batch = found.size if axis == "batch" else workload.batch
    side = found.size if axis == "image_size" else workload.image_size
    fields = {}
    if axis == "image_size" and found.step_ms:
        fields["ms_per_megapixel"] = found.step_ms / (batch * side * side / 1e6)
    if found.plan is not None:
        fields["plan"] = found.plan.to_dict()
    return SizeSearch.of(
        size=found.size,
        step_ms=found.step_ms,
        images_per_s=batch / found.step_ms * 1e3 if found.step_ms else None,
        peak_bytes=found.peak_bytes,
        compiled_bytes=found.compiled_bytes,
        confirmed=found.confirmed,
        budget_bytes=found.budget_bytes,
        probes=[list(p) for p in found.probes],
        search_s=search_s,
        stopped=found.stopped,
        fits_at=found.fits_at,
        over_at=found.over_at,
        **fields,
    )
