"""Gradients compared: with a stored reference, and an accumulated one with the whole batch's."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxoffload.bench.catalog import ACCUMULATED_STRATEGIES
from jaxoffload.bench.step import images_and_labels, placed, value_and_grad
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import equations

__all__ = [
    "accumulation_check",
    "compare_gradients",
    "draws_random_numbers",
    "gradient_at",
    "gradient_error",
    "has_batch_statistics",
    "relative_error",
]


def compare_gradients(
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
    _, grads = jax.jit(value_and_grad(loss_fn, micro_batch))(params, model_state, batch)
    return [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]


def accumulation_check(workload: Workload, loss_fn, initial) -> dict[str, Any]:
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
    _, batch = placed(lambda: ((), images_and_labels(check)), check, abstract=False)
    with tempfile.TemporaryDirectory() as folder:
        whole = os.path.join(folder, "whole_batch_gradient.npz")
        compare_gradients(loss_fn, initial, batch, whole)  # stores it, as "none" does
        error = compare_gradients(loss_fn, initial, batch, whole, micro_batch=half)
    params, model_state = initial
    per_micro_batch = f"per micro-batch of {workload.micro_batch}"
    statistics = has_batch_statistics(model_state)
    masks = draws_random_numbers(loss_fn, params, model_state, batch)
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


def has_batch_statistics(model_state) -> bool:
    """Whether a model keeps BatchNorm's statistics: linen's ``batch_stats``, NNX's ``BatchStat``."""
    variables = jax.tree.leaves(model_state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return "batch_stats" in model_state or any(isinstance(v, nnx.BatchStat) for v in variables)


def draws_random_numbers(loss_fn, params, model_state, batch) -> bool:
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
