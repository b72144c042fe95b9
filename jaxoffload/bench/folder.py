"""The output folder: its records, rewritten whole after each, and the reference gradient.

``--resume`` keeps the records of an earlier run with the same :data:`RUN_FLAGS`, whose plans
were costed as this run's will be (``--block-costs``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

from jaxoffload.bench.catalog import (
    ACCUMULATED_STRATEGIES,
    CHOSEN_STRATEGIES,
    default_block_costs,
)
from jaxoffload.bench.options import BenchError, dest
from jaxoffload.bench.record import Record, records_from_json

__all__ = [
    "RECORDS",
    "REFERENCE",
    "RUN_FLAGS",
    "earlier_records",
    "run_fields",
    "writable_folder",
    "write_records",
]

RECORDS = "records.json"
# The 'none' run's gradient, kept in --out until the run is complete, for --resume.
REFERENCE = "reference_gradient.npz"

# The flags whose values every record of a run shares, and the records' keys for them.
RUN_FLAGS = {
    "--model": "model",
    "--batch": "batch",
    "--image-size": "image_size",
    "--dtype": "dtype",
    "--steps": "steps",
    "--window": "window",
    "--micro-batch": "micro_batch",
    "--devices": "num_devices",
    "--spatial": "spatial",
    "--memory-cap": "memory_cap_gib",
}
# What a record without one of those fields was measured with: they came later.
_RUN_DEFAULTS = {"spatial": 1}


def writable_folder(text: str) -> pathlib.Path:
    """``--out`` as a folder this process can write into, checked before anything is measured."""
    out = pathlib.Path(text)
    if out.exists() and not out.is_dir():
        raise BenchError(
            f"--out {text} is a file, not a folder: give a folder (made if need be) for "
            f"{RECORDS} and pareto.png"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=out).close()
    except OSError as e:
        raise BenchError(
            f"--out {text}: cannot write records there ({e.strerror}): give a folder you can "
            "write to"
        ) from None
    return out


def earlier_records(path: pathlib.Path, args: argparse.Namespace) -> dict[str, Record]:
    """The records of ``path`` that ``--resume`` keeps, by name: all but the failed ones.

    Raises:
      BenchError: if a record was measured with other values of :data:`RUN_FLAGS`.
    """
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise BenchError(
            f"--resume: {path} is not a records file ({e}): leave out --resume to measure afresh"
        ) from None
    try:
        records = records_from_json(data)
    except ValueError as e:
        raise BenchError(
            f"--resume: {path} {e}: give the --out folder of an earlier bench run, or leave out "
            "--resume to measure afresh"
        ) from None
    for r in records:
        for flag, key in RUN_FLAGS.items():
            if key == "window" and r.strategy in CHOSEN_STRATEGIES:
                continue  # the planner chose it
            if key == "micro_batch" and r.strategy not in ACCUMULATED_STRATEGIES:
                continue  # only accumulating strategies take it
            theirs = getattr(r, key)
            if theirs is None and key not in r.nulls:  # not in the file: from before the flag
                theirs = _RUN_DEFAULTS.get(key)
            ours = getattr(args, dest(flag))
            if theirs != ours:
                raise BenchError(
                    f"--resume: {path} holds {r.name!r} measured with {flag} {theirs}, and this "
                    f"command has {flag} {ours}: give that run's arguments, or leave out --resume "
                    "to measure afresh"
                )
        _check_block_costs(path, r, args)
    return {r.name: r for r in records if r.error is None}


def _check_block_costs(path: pathlib.Path, record: Record, args: argparse.Namespace) -> None:
    """Raises if ``record`` was planned with other block costs than this command plans with:
    a run's plans are costed alike."""
    planned = record.strategy == "offload-hidden" or record.budget is not None
    if record.strategy not in CHOSEN_STRATEGIES or not planned:  # a size search plans by default
        return
    theirs = record.block_costs or "timed"  # before records kept it, blocks were timed
    ours = args.block_costs or default_block_costs(args.model, record.strategy)
    if theirs != ours:
        raise BenchError(
            f"--resume: {path} holds {record.name!r} planned with --block-costs {theirs}, and "
            f"this command plans with --block-costs {ours}: give --block-costs {theirs}, or "
            "leave out --resume to measure afresh"
        )


def write_records(path: pathlib.Path, records: Sequence[Record]) -> None:
    """Writes the records' JSON to ``path`` whole or not at all: a kill mid-write leaves the
    file as it was."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps([r.to_json() for r in records], indent=1) + "\n")
    os.replace(partial, path)


def run_fields(args: argparse.Namespace, command: str | None) -> dict[str, Any]:
    """What every record of the run says of it, beyond its workload."""
    return {
        "steps": args.steps,
        "memory_cap_gib": args.memory_cap,
        "command": command,
        "commit": _commit(),
    }


def _commit() -> str | None:
    """The code's commit: ``$JAXOFFLOAD_COMMIT`` (for a copy without its git history), or
    the checkout's, or ``None``."""
    if os.environ.get("JAXOFFLOAD_COMMIT"):
        return os.environ["JAXOFFLOAD_COMMIT"]
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None
