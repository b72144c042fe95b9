"""A bench record: what one workload's run measured, as a typed value, written to JSON at the edge.

A record's JSON keys are its fields' names, and stay so: the committed results and the
scripts that read them (``benchmarks/``) know them by these names. A size search's
fields are written flat, ``max_batch``, ``max_batch_step_ms``..., as they always were.

Which keys a record has depends on what happened to it (a measured step, a failure, a
size search alone), so a field is written only where the record carries it: where it is
not ``None``, or where it is named in ``nulls``, the fields it carries as JSON null. A
record made with :meth:`Record.of` carries every field given it; one read back with
:meth:`Record.from_json` carries the keys its file had, and keeps those it does not know
in ``extra``, so that an older or newer record is written back as it was read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from jaxoffload.bench.catalog import PLANS

__all__ = ["SEARCH_AXES", "Record", "SizeSearch", "label", "records_from_json"]

# The axes of the size searches, as jaxoffload.bench.size_search names them.
SEARCH_AXES = ("batch", "image_size")


class _Carrying:
    """Fields that are written where they are not ``None``, or named in ``nulls``."""

    nulls: frozenset[str]

    @classmethod
    def of(cls, **fields: Any) -> Any:
        """A value that carries every field given, ``None`` ones as null.

        Example:
          >>> Record.of(strategy="none", grad_rel_err=None).to_json()
          {'strategy': 'none', 'grad_rel_err': None}
          >>> Record(strategy="none", grad_rel_err=None).to_json()
          {'strategy': 'none'}
        """
        return cls(**fields, nulls=frozenset(k for k, v in fields.items() if v is None))

    def with_fields(self, **fields: Any) -> Any:
        """This value with ``fields`` set and carried, ``None`` ones as null."""
        nulls = {k for k, v in fields.items() if v is None}
        return dataclasses.replace(self, **fields, nulls=(self.nulls - set(fields)) | nulls)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SizeSearch(_Carrying):
    """What one size search found (:func:`jaxoffload.bench.size_search.largest`), for one axis.

    Written as ``max_<axis>`` (the size) and ``max_<axis>_<field>`` for the others.
    """

    size: int | None = None
    step_ms: float | None = None
    images_per_s: float | None = None
    peak_bytes: int | None = None
    compiled_bytes: int | None = None
    confirmed: bool | None = None
    budget_bytes: int | None = None
    probes: list[list[int]] | None = None
    search_s: float | None = None
    stopped: str | None = None
    ms_per_megapixel: float | None = None
    plan: dict[str, Any] | None = None
    min_speed: float | None = None
    # The search's bracket (jaxoffload.Fit's): the largest size compiled within the budget,
    # and the smallest above it compiled over.
    fits_at: int | None = None
    over_at: int | None = None
    nulls: frozenset[str] = frozenset()

    def to_json(self, axis: str) -> dict[str, Any]:
        """The search's keys of a record's JSON, named for ``axis``."""
        return {_search_key(axis, name): value for name, value in _carried(self)}

    @classmethod
    def from_json(cls, axis: str, data: dict[str, Any]) -> SizeSearch | None:
        """The search for ``axis`` that a record's JSON holds, its keys popped from ``data``;
        ``None`` where it holds none."""
        names = [f.name for f in _fields(cls)]
        found = {name: data.pop(key) for name in names if (key := _search_key(axis, name)) in data}
        return cls.of(**found) if found else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record(_Carrying):
    """One record of ``jaxoffload bench``: a workload, and what measuring it gave.

    Every field but ``strategy`` may be missing (``None``): a failed workload has no
    step, and the planned model's size-search record has no measured step at all.
    ``searches`` holds the size searches by axis (``"batch"``, ``"image_size"``), and
    ``search_errors`` the message of each that failed.
    """

    # The workload, as the record says it (a failed one's as its Workload has it).
    model: str | None = None
    batch: int | None = None
    image_size: int | None = None
    dtype: str | None = None
    strategy: str
    blocks: int | None = None
    num_classes: int | None = None
    window: int | tuple[int, ...] | None = None
    plan: tuple[str, ...] | None = None
    budget: float | None = None
    block_costs: str | None = None
    budget_bytes: int | None = None
    plan_choices: list[str] | None = None
    plan_outside: str | None = None
    plan_compiled_bytes: int | None = None
    plan_estimated_bytes: int | None = None
    plan_estimated_step_ms: float | None = None
    plan_measured_step_ms: float | None = None
    # offload-hidden's schedule: the bytes its blocks move each way (their max_bytes).
    plan_moved_bytes: int | None = None
    planned: dict[str, Any] | None = None
    offloaded_blocks: int | None = None
    num_devices: int | None = None
    spatial: int | None = None
    mesh: dict[str, int] | None = None
    micro_batch: int | None = None
    accumulation_steps: int | None = None
    framework: str | None = None
    # The device and the versions.
    device: str | None = None
    platform: str | None = None
    jax_version: str | None = None
    flax_version: str | None = None
    jaxoffload_version: str | None = None
    # The compiled program: what it holds and moves.
    compiled_temp_bytes: int | None = None
    compiled_host_temp_bytes: int | None = None
    compiled_argument_bytes: int | None = None
    twin_temp_bytes: int | None = None
    copies_free_little: bool | None = None
    requested_host_bytes: int | None = None
    host_buffers: int | None = None
    device_to_host_copies: int | None = None
    device_to_host_bytes: int | None = None
    host_to_device_copies: int | None = None
    host_to_device_bytes: int | None = None
    # The runtime: the peaks, the steps, the gradient.
    peak_bytes_in_use: int | None = None
    compile_peak_bytes: int | None = None
    compiled_from_cache: bool | None = None
    # Seconds to trace the step; Lean(max_slowdown=...)'s blocks are timed then, and listed.
    trace_s: float | None = None
    fallbacks: list[dict[str, Any]] | None = None
    step_time_ms: float | None = None
    step_times_ms: list[float] | None = None
    # With bench --repeat: each process's step_time_ms, the first's first; step_time_ms is
    # their median (None for a process that failed).
    step_time_ms_runs: list[float | None] | None = None
    images_per_s: float | None = None
    final_loss: float | None = None
    batch_norm_statistics: str | None = None
    dropout_masks: str | None = None
    grad_rel_err: float | None = None
    grad_check_batch: int | None = None
    grad_rel_err_note: str | None = None
    date: str | None = None
    spatial_gathers: list[dict[str, Any]] | None = None
    forward_ms: float | None = None
    twin_forward_ms: float | None = None
    twin_step_ms: float | None = None
    d2h_gbps: float | None = None
    h2d_gbps: float | None = None
    link_devices: int | None = None
    # A device trace of the step (bench --trace; jaxoffload.Overlap.fields).
    compute_busy_ms: float | None = None
    d2h_busy_ms: float | None = None
    h2d_busy_ms: float | None = None
    d2h_overlap_ms: float | None = None
    h2d_overlap_ms: float | None = None
    d2h_overlap_fraction: float | None = None
    h2d_overlap_fraction: float | None = None
    traced_step_ms: float | None = None
    traced_steps: int | None = None
    traced_d2h_bytes: int | None = None
    traced_h2d_bytes: int | None = None
    timeline: dict[str, list[list[float]]] | None = None
    # Planning, the run's own fields, and the transfer bound.
    planning_s: float | None = None
    planned_budgets: int | None = None
    planner_points: Any = None
    steps: int | None = None
    memory_cap_gib: float | None = None
    command: str | None = None
    commit: str | None = None
    offloaded_bytes: int | None = None
    compute_twin: str | None = None
    fwd_compute_ms: float | None = None
    bwd_compute_ms: float | None = None
    bound_ms: float | None = None
    bound_ratio: float | None = None
    # What went wrong, or why no plan fits.
    out_of_memory: bool | None = None
    error: str | None = None
    no_plan: str | None = None
    least_share: float | None = None
    # The size searches, by axis, and those that failed.
    searches: Mapping[str, SizeSearch] = dataclasses.field(default_factory=dict)
    search_errors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Keys that this code does not name, as read, and the fields carried as null.
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    nulls: frozenset[str] = frozenset()

    @property
    def name(self) -> str:
        """The strategy, with the budget for plans: ``plan@0.5``.

        The planned model's size searches have no budget: their record is ``plan``.

        Example:
          >>> Record(strategy="plan", budget=0.5).name, Record(strategy="lean").name
          ('plan@0.5', 'lean')
        """
        return label(self.strategy, self.budget)

    def with_search(self, axis: str, found: Record) -> Record:
        """This record with the search of ``axis`` in ``found``, a search's own record
        (:func:`jaxoffload.bench.size_search.largest`), and the other fields that it carries (the
        device and versions it ran with); an earlier error of that search is dropped."""
        carried = {name: value for name, value in _carried(found) if name != "strategy"}
        return dataclasses.replace(
            self.with_fields(**carried),
            searches={**self.searches, axis: found.searches[axis]},
            search_errors={k: v for k, v in self.search_errors.items() if k != axis},
        )

    def to_json(self) -> dict[str, Any]:
        """The record as JSON: a key per field it carries, the searches' flat, then ``extra``.

        Example:
          >>> import json
          >>> record = Record.of(
          ...     strategy="none", window=(1, 2), step_time_ms=1.5, peak_bytes_in_use=None
          ... )
          >>> record.to_json()
          {'strategy': 'none', 'window': (1, 2), 'peak_bytes_in_use': None, 'step_time_ms': 1.5}
          >>> Record.from_json(json.loads(json.dumps(record.to_json()))) == record
          True
        """
        data = dict(_carried(self))
        for axis, found in self.searches.items():
            data.update(found.to_json(axis))
        for axis, error in self.search_errors.items():
            data[f"max_{axis}_error"] = error
        return {**data, **self.extra}

    @classmethod
    def from_json(cls, data: Any) -> Record:
        """The record of a JSON object that ``to_json`` (or an earlier bench) wrote.

        Raises:
          ValueError: if ``data`` is not a JSON object with a ``"strategy"`` string.
        """
        if not isinstance(data, dict) or not isinstance(data.get("strategy"), str):
            raise ValueError(
                f"a bench record is a JSON object with a 'strategy' string, not {_brief(data)}"
            )
        data = dict(data)
        searches = {axis: s for axis in SEARCH_AXES if (s := SizeSearch.from_json(axis, data))}
        errors = {
            axis: data.pop(f"max_{axis}_error")
            for axis in SEARCH_AXES
            if f"max_{axis}_error" in data
        }
        known = {f.name: data.pop(f.name) for f in _fields(cls) if f.name in data}
        for name in ("window", "plan"):  # tuples in Python, lists in JSON
            if isinstance(known.get(name), list):
                known[name] = tuple(known[name])
        return dataclasses.replace(
            cls.of(**known), searches=searches, search_errors=errors, extra=data
        )


def records_from_json(data: Any) -> list[Record]:
    """The records of a bench's ``records.json``, as ``json.load`` reads it.

    Raises:
      ValueError: if ``data`` is not a list of records; the message says what it holds
        instead, as the end of a sentence that begins with the file's name.

    Example:
      >>> records_from_json([{"strategy": "none", "step_time_ms": 1.5}])[0].step_time_ms
      1.5
      >>> records_from_json({"strategy": "none"})
      Traceback (most recent call last):
      ...
      ValueError: holds an object with the keys ['strategy'], not a list of bench records
    """
    if not isinstance(data, list):
        raise ValueError(f"holds {_brief(data)}, not a list of bench records")
    records = []
    for n, item in enumerate(data):
        try:
            records.append(Record.from_json(item))
        except ValueError:
            raise ValueError(
                f"holds {_brief(item)} at index {n} of its list, where a bench record (an "
                "object with a 'strategy' string) belongs"
            ) from None
    return records


def label(strategy: str, budget: float | None) -> str:
    """A strategy's name in the table and in messages, with its budget for plans: ``plan@0.5``."""
    return f"{strategy}@{budget:g}" if strategy in PLANS and budget is not None else strategy


_BOOKKEEPING = frozenset({"searches", "search_errors", "extra", "nulls"})


def _fields(cls: type) -> list[dataclasses.Field]:
    """The fields that are JSON keys: all but the bookkeeping."""
    return [f for f in dataclasses.fields(cls) if f.name not in _BOOKKEEPING]


def _carried(value: Record | SizeSearch) -> list[tuple[str, Any]]:
    """``(name, value)`` of each field that ``value`` carries, in their declared order."""
    return [
        (f.name, v)
        for f in _fields(type(value))
        if (v := getattr(value, f.name)) is not None or f.name in value.nulls
    ]


def _search_key(axis: str, name: str) -> str:
    return f"max_{axis}" if name == "size" else f"max_{axis}_{name}"


def _brief(data: Any) -> str:
    """What was found instead of a record, in a few words, in JSON's terms."""
    if isinstance(data, dict):
        return f"an object with the keys {sorted(data)[:5]}"
    kinds = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return f"{kinds.get(type(data), 'a number')} ({json.dumps(data)[:40]})"
