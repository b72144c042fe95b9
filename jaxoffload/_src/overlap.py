"""What a device trace says about a step: when the device computes, when it copies to and from
the host, and how much of the copying ran while it computed.

Offload pays only where its host copies run under compute. A bound (bytes over the link's
speed, beside the compute's time) says what could hide; a trace says what did. This module
reads the trace that :func:`jax.profiler.trace` writes, from the device's own activity records
(kernels and copies as the GPU ran them, not as the host launched them).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import statistics
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax

__all__ = [
    "Activity",
    "Overlap",
    "busy_ns",
    "measure_overlap",
    "overlap_in_trace",
    "overlap_of",
    "read_trace",
    "shared_ns",
]

COMPUTE, TO_HOST, TO_DEVICE = "compute", "d2h", "h2d"
# The names the GPU tracer gives copies whose CUDA kind it knows, by direction.
_COPY_NAMES = {"MemcpyD2H": TO_HOST, "MemcpyH2D": TO_DEVICE}
_SIZE = re.compile(r"\bsize:(\d+)")
_KINDS = re.compile(r"kind_src:(\w+) kind_dst:(\w+)")
_STEP = "jaxoffload/step"


@dataclasses.dataclass(frozen=True)
class Activity:
    """One interval of device activity: a kernel (``"compute"``) or a host copy (``"d2h"``, ``"h2d"``).

    Copies between two places on the device count as compute: they use the device's
    memory, not the host link.
    """

    kind: str
    start_ns: float
    end_ns: float
    name: str
    nbytes: int = 0


@dataclasses.dataclass(frozen=True)
class Overlap:
    """How a step's host copies ran against its compute, per step, over the traced steps.

    Attributes:
      steps: the steps traced.
      step_ms: the median span of one step's device activity, first event to last.
      compute_busy_ms: the time at least one kernel runs, per step.
      d2h_busy_ms, h2d_busy_ms: the time a copy to the host (from the host) runs, per step.
      d2h_overlap_ms, h2d_overlap_ms: the part of that time during which a kernel runs too.
      d2h_bytes, h2d_bytes: the bytes each direction copies, per step.
      device: the trace's name for the device read (``/device:GPU:0``, or ``/host:CPU``
        where the computation ran on the host, with no device plane).
      timeline: the activity of the median step, in ns from its start, for a picture.
    """

    steps: int
    step_ms: float
    compute_busy_ms: float
    d2h_busy_ms: float
    h2d_busy_ms: float
    d2h_overlap_ms: float
    h2d_overlap_ms: float
    d2h_bytes: int
    h2d_bytes: int
    device: str
    timeline: tuple[Activity, ...] = dataclasses.field(default=(), repr=False)

    @property
    def d2h_overlap_fraction(self) -> float | None:
        """The share of the copies to the host that ran under compute; ``None`` with no copy."""
        return _share(self.d2h_overlap_ms, self.d2h_busy_ms)

    @property
    def h2d_overlap_fraction(self) -> float | None:
        """The share of the copies from the host that ran under compute; ``None`` with no copy."""
        return _share(self.h2d_overlap_ms, self.h2d_busy_ms)

    def fields(self) -> dict[str, Any]:
        """The figures as a bench record writes them (``benchmarks/`` and ``MEASURING`` terms)."""
        names = ("compute_busy_ms", "d2h_busy_ms", "h2d_busy_ms", "d2h_overlap_ms",
                 "h2d_overlap_ms")  # fmt: skip
        out: dict[str, Any] = {n: round(getattr(self, n), 4) for n in names}
        out["traced_step_ms"] = round(self.step_ms, 4)
        out["traced_steps"] = self.steps
        out["traced_d2h_bytes"], out["traced_h2d_bytes"] = self.d2h_bytes, self.h2d_bytes
        for direction in (TO_HOST, TO_DEVICE):
            share = getattr(self, f"{direction}_overlap_fraction")
            out[f"{direction}_overlap_fraction"] = None if share is None else round(share, 4)
        return out

    def rows(self, merge_ns: float = 2000.0) -> dict[str, list[list[float]]]:
        """The timeline as one row per kind: the intervals in ms from the step's start, those
        less than ``merge_ns`` apart merged (a picture needs no more, and a record stays small).

        Example:
          >>> o = overlap_of([Activity("compute", 0, 1e6, "k"), Activity("compute", 1.001e6, 2e6, "k"),
          ...                 Activity("d2h", 5e5, 3e6, "MemcpyD2H", 8)])
          >>> o.rows()
          {'compute': [[0.0, 2.0]], 'd2h': [[0.5, 3.0]], 'h2d': []}
        """
        rows = {}
        for kind in (COMPUTE, TO_HOST, TO_DEVICE):
            merged: list[list[float]] = []
            for start, end in _union(
                (a.start_ns, a.end_ns) for a in self.timeline if a.kind == kind
            ):
                if merged and start - merged[-1][1] * 1e6 < merge_ns:
                    merged[-1][1] = end / 1e6
                else:
                    merged.append([start / 1e6, end / 1e6])
            rows[kind] = [[round(s, 4), round(e, 4)] for s, e in merged]
        return rows

    def summary(self) -> str:
        """A few lines a person reads: the busy times, and what share of each copy was hidden."""
        lines = [
            f"{self.steps} steps traced on {self.device}: {self.step_ms:.2f} ms a step, "
            f"compute busy {self.compute_busy_ms:.2f} ms"
        ]
        for direction, label in ((TO_HOST, "to the host"), (TO_DEVICE, "from the host")):
            busy = getattr(self, f"{direction}_busy_ms")
            if not busy:
                lines.append(f"  copies {label}: none")
                continue
            share = getattr(self, f"{direction}_overlap_fraction")
            nbytes = getattr(self, f"{direction}_bytes")
            lines.append(
                f"  copies {label}: {nbytes / 1e9:.3f} GB in {busy:.2f} ms busy, "
                f"{share:.0%} of it under compute ({busy * (1 - share):.2f} ms exposed)"
            )
        return "\n".join(lines)


def _share(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None


def read_trace(path: str | os.PathLike) -> tuple[list[Activity], list[tuple[float, float]], str]:
    """The device activity in a trace, the windows of the steps marked in it, and the device's name.

    Args:
      path: an ``.xplane.pb`` file, or a folder that :func:`jax.profiler.trace` wrote into
        (its newest ``.xplane.pb`` is read).

    Returns:
      ``(activities, steps, device)``: the first GPU's kernels and host copies (or, with no GPU,
      the host's XLA operations as compute); the ``(start_ns, end_ns)`` of each step marked
      with :func:`measure_overlap`'s annotation or :class:`jax.profiler.StepTraceAnnotation`;
      and the name of the plane read.
    """
    data = jax.profiler.ProfileData.from_file(_xplane_file(path))
    planes = list(data.planes)
    devices = sorted((p for p in planes if p.name.startswith("/device:GPU:")), key=lambda p: p.name)
    if devices:
        plane = devices[0]
        activities = [
            a
            for line in plane.lines
            if line.name.startswith("Stream #")
            for a in map(_gpu_activity, line.events)
        ]
    else:  # a computation on the host: its XLA operations, no copy
        plane = next(p for p in planes if p.name == "/host:CPU")
        activities = [
            Activity(COMPUTE, e.start_ns, e.start_ns + e.duration_ns, e.name)
            for line in plane.lines
            for e in line.events
            if any(k == "hlo_op" for k, _ in e.stats)
        ]
    steps = sorted(
        (e.start_ns, e.start_ns + e.duration_ns)
        for p in planes
        if p.name.startswith("/host:")
        for line in p.lines
        for e in line.events
        if e.name == _STEP or any(k == "step_num" for k, _ in e.stats)
    )
    return activities, steps, plane.name


def overlap_in_trace(path: str | os.PathLike) -> Overlap:
    """How the host copies in a trace ran against compute, per step marked in it.

    For a trace taken around a user's own loop, with each step inside a
    :class:`jax.profiler.StepTraceAnnotation` and waited for: all the traced activity is one
    step where none is marked.

    Args:
      path: the folder that :func:`jax.profiler.trace` wrote into, or an ``.xplane.pb`` file.
    """
    activities, steps, device = read_trace(path)
    if not activities:
        raise ValueError(f"the trace at {os.fspath(path)!r} holds no device activity.")
    return overlap_of(activities, steps, device)


def _xplane_file(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if os.path.isfile(path):
        return path
    found = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
    if not found:
        raise FileNotFoundError(
            f"no .xplane.pb under {path!r}: give the folder that jax.profiler.trace(log_dir) "
            "wrote into, or the .xplane.pb file itself."
        )
    return max(found, key=os.path.getmtime)


def _gpu_activity(event) -> Activity:
    stats = dict(event.stats)
    details = str(stats.get("memcpy_details", ""))
    kind = _COPY_NAMES.get(event.name, COMPUTE)
    kinds = _KINDS.search(details)
    if kinds:  # the tracer knows each side's memory: pinned or pageable host, or the device
        src, dst = (k.lower() for k in kinds.groups())
        on_device = ("device", "array")
        if src in on_device and dst not in on_device:
            kind = TO_HOST
        elif dst in on_device and src not in on_device:
            kind = TO_DEVICE
    size = _SIZE.search(details)
    nbytes = int(size.group(1)) if size and kind != COMPUTE else 0
    return Activity(kind, event.start_ns, event.start_ns + event.duration_ns, event.name, nbytes)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def busy_ns(intervals: Iterable[tuple[float, float]]) -> float:
    """The time covered by at least one of ``intervals``.

    Example:
      >>> busy_ns([(0, 4), (2, 6), (8, 9)])
      7
    """
    return sum(e - s for s, e in _union(intervals))


def shared_ns(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """The time covered both by one of ``a`` and by one of ``b``.

    Example:
      >>> shared_ns([(0, 4), (6, 10)], [(3, 7)])
      2
    """
    a, b = _union(a), _union(b)
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_of(
    activities: Sequence[Activity], steps: Sequence[tuple[float, float]] = (), device: str = ""
) -> Overlap:
    """The busy times and overlaps of ``activities``, per step.

    Args:
      activities: device activity, as :func:`read_trace` gives it.
      steps: each step's window; an activity belongs to the step whose window holds its
        start. With none, all the activity is one step.
      device: the device's name, for the summary.
    """
    windows = list(steps) or [(min(a.start_ns for a in activities), float("inf"))]
    per_step: list[list[Activity]] = [[] for _ in windows]
    for a in activities:
        for n, (start, end) in enumerate(windows):
            if start <= a.start_ns < end:
                per_step[n].append(a)
                break
    per_step = [step for step in per_step if step]
    if not per_step:
        raise ValueError(
            "the trace holds no device activity inside its steps: was the step run (and "
            "waited for, with block_until_ready) inside the trace?"
        )
    figures = [_step_figures(step) for step in per_step]
    n = len(figures)
    mean = {k: sum(f[k] for f in figures) / n for k in figures[0]}
    spans = [f["span"] for f in figures]
    median = min(range(n), key=lambda i: abs(spans[i] - statistics.median(spans)))
    first = min(a.start_ns for a in per_step[median])
    timeline = tuple(
        dataclasses.replace(a, start_ns=a.start_ns - first, end_ns=a.end_ns - first)
        for a in sorted(per_step[median], key=lambda a: a.start_ns)
    )
    ms = 1e-6
    return Overlap(
        steps=n,
        step_ms=statistics.median(spans) * ms,
        compute_busy_ms=mean["compute"] * ms,
        d2h_busy_ms=mean[TO_HOST] * ms,
        h2d_busy_ms=mean[TO_DEVICE] * ms,
        d2h_overlap_ms=mean[f"{TO_HOST}_shared"] * ms,
        h2d_overlap_ms=mean[f"{TO_DEVICE}_shared"] * ms,
        d2h_bytes=round(mean[f"{TO_HOST}_bytes"]),
        h2d_bytes=round(mean[f"{TO_DEVICE}_bytes"]),
        device=device,
        timeline=timeline,
    )


def _step_figures(step: list[Activity]) -> dict[str, float]:
    by_kind = {k: [(a.start_ns, a.end_ns) for a in step if a.kind == k]
               for k in (COMPUTE, TO_HOST, TO_DEVICE)}  # fmt: skip
    figures = {k: busy_ns(v) for k, v in by_kind.items()}
    for k in (TO_HOST, TO_DEVICE):
        figures[f"{k}_shared"] = shared_ns(by_kind[k], by_kind[COMPUTE])
        figures[f"{k}_bytes"] = sum(a.nbytes for a in step if a.kind == k)
    figures["span"] = max(a.end_ns for a in step) - min(a.start_ns for a in step)
    return figures


def measure_overlap(
    run_step: Callable[[], Any], *, steps: int = 5, warmup: int = 3, log_dir: str | None = None
) -> Overlap:
    """Traces ``steps`` calls of ``run_step`` and says how its host copies ran against compute.

    Each call is waited for (``jax.block_until_ready`` on what it returns) inside its own
    step annotation, so the device's work of one step never spills into the next.

    Args:
      run_step: runs one training step; it threads its own state (a closure), since a step
        that donates its state cannot be called twice on the same arguments.
      steps: the steps traced, after ``warmup`` untraced ones (which compile the step).
      warmup: untraced calls first.
      log_dir: where the trace is written (for TensorBoard or Perfetto); a temporary
        folder, removed afterwards, if ``None``.

    Returns:
      An :class:`Overlap`; ``print(overlap.summary())`` reads it.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = jax.jit(lambda x: jnp.tanh(x @ x))
      >>> x = jnp.ones((64, 64))
      >>> o = measure_overlap(lambda: f(x), steps=2, warmup=1)
      >>> o.steps, o.d2h_busy_ms, o.d2h_overlap_fraction
      (2, 0.0, None)
    """
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int of at least {least}, got {value!r}.")
    if not callable(run_step):
        raise TypeError(
            f"run_step must be a function that runs one step, got {run_step!r}; write "
            "lambda: step(state, batch), or a function that threads the state."
        )
    for _ in range(warmup):
        jax.block_until_ready(run_step())
    with tempfile.TemporaryDirectory() as scratch:
        folder = log_dir or scratch
        with jax.profiler.trace(folder):
            for n in range(steps):
                with jax.profiler.StepTraceAnnotation(_STEP, step_num=n):
                    jax.block_until_ready(run_step())
        return overlap_in_trace(folder)
