"""Each strategy's and plan's gradient against a float32 highest-precision reference.

bf16 gradients differ from run to run by more than strategies differ (errors
against Store's moved by 20x between runs), so a strategy's arithmetic is
checked against what every strategy approximates: the plain model in float32
at the highest matmul precision, on the same images, at a small batch. A
strategy or plan holds where its error is within ``TOLERANCE`` of Store's,
the same-arithmetic control.

    python -m jaxoffload.bench.precision RESULTS.json [--batch 8] [--out FILE]

reads a bench's records and writes one JSON line per strategy or plan measured
there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxoffload.bench.catalog import CHOSEN_STRATEGIES
from jaxoffload.bench.gradients import gradient_at, relative_error
from jaxoffload.bench.measure import device_fields
from jaxoffload.bench.record import Record
from jaxoffload.bench.step import train_step
from jaxoffload.bench.workload import STRATEGIES, Workload

__all__ = ["TOLERANCE", "errors_against_float32", "gradient"]

# A strategy's error against the float32 reference may exceed Store's by this share.
TOLERANCE = 0.10


def gradient(workload: Workload, images: jax.Array | None = None) -> list[np.ndarray]:
    """The workload's gradient at its initial parameters (:func:`~jaxoffload.bench.gradients.gradient_at`).

    ``images`` replaces the workload's own (cast to its dtype), so that a
    reference in another dtype sees the same pixels.
    """
    _, state, batch, loss_fn = train_step(workload)
    if images is not None:
        batch = (images.astype(jnp.dtype(workload.dtype)), *batch[1:])
    return gradient_at(loss_fn, *state[:2], batch)


def _small(record: Record, batch: int) -> Workload | None:
    """The record's workload at ``batch`` images, or ``None`` if it has no gradient to check."""
    strategy = record.strategy
    if record.step_time_ms is None or record.micro_batch is not None:
        return None
    if strategy not in STRATEGIES and strategy not in CHOSEN_STRATEGIES:
        return None
    return Workload(
        model=record.model,
        batch=batch,
        image_size=record.image_size,
        dtype=record.dtype,
        strategy=strategy,
        window=1 if record.window is None else record.window,
        block_names=record.plan,
        budget=record.budget,
        block_costs=record.block_costs,
        planned=record.planned,
    )


def errors_against_float32(records: Sequence[Record], batch: int = 8) -> list[dict]:
    """Per record with a gradient, its error and Store's against the float32 reference.

    The records must be one model's, at one image size and dtype, with a
    ``"none"`` record among them (the control) and every ``"plan"`` record
    carrying its ``planned`` dict.
    """
    workloads = [w for r in records if (w := _small(r, batch)) is not None]
    store = next((w for w in workloads if w.strategy == "none"), None)
    if store is None:
        raise ValueError("the records hold no 'none' run: Store is the control.")
    reference_workload = dataclasses.replace(store, dtype="float32")
    images = train_step(store, abstract=False)[2][0].astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        reference = gradient(reference_workload, images)
    errors: dict[str, float] = {}  # each distinct workload compiled once

    def error_of(workload):
        key = json.dumps(dataclasses.asdict(workload), sort_keys=True)
        if key not in errors:
            errors[key] = relative_error(gradient(workload, images), reference)
        return errors[key]

    store_error = error_of(store)
    lines = []
    for workload in workloads:
        error = error_of(workload)
        lines.append(
            {
                "model": workload.model,
                "strategy": workload.strategy,
                "budget": workload.budget,
                "batch": batch,
                "dtype": workload.dtype,
                "grad_err_f32": error,
                "store_grad_err_f32": store_error,
                "ratio_to_store": error / store_error if store_error else None,
                "holds": error <= (1 + TOLERANCE) * store_error,
                **device_fields(jax.devices()[0]),
            }
        )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxoffload.bench.precision")
    parser.add_argument("results", help="a bench's JSON records")
    parser.add_argument("--batch", type=int, default=8, help="images of the small batch")
    parser.add_argument("--out", help="where to write the lines (JSON lines); stdout by default")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        records = [Record.from_json(r) for r in json.load(f)]
    lines = errors_against_float32(records, args.batch)
    # A line per strategy: not a list of objects with a strategy, as a bench's records are.
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text, end="")
    for line in lines:
        mark = "holds" if line["holds"] else "FAILS"
        print(
            f"{line['strategy']}{'' if line['budget'] is None else '@' + str(line['budget'])}: "
            f"{line['grad_err_f32']:.2e} against float32, {line['ratio_to_store']:.2f}x Store's "
            f"({mark})",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
