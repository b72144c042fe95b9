"""XLA options that let a step's host copies run under its compute.

XLA:GPU runs host copies on streams of their own, but its latency-hiding scheduler lets two
asynchronous operations be in flight at a time by default, and prices every copy at one
constant whatever its size. The first makes copies wait for one another, and calls wait for
them; the second starts a long copy too late to hide it. ``docs/design.md`` ("Copies that
hide") has what each option did on the measured steps.

The profile prices a copy to the host at its own bytes over the link, and each fetch at
every fetch's: the fetches share the one link, and the scheduler, which sees each alone,
would start each as late as its own bytes allow, so that a fetch needed next queued behind
one needed later. Priced at the queue, each fetch starts as soon as its ``Offload`` window
lets it. Copies to the host keep their own price: priced at the queue, they started
together and slowed one another.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from jaxoffload._src.report import device_bytes_of

__all__ = [
    "ASYNC_IN_FLIGHT",
    "compiler_options",
    "copy_cost_profile",
    "host_copies",
    "with_copy_costs",
]

# Asynchronous operations the scheduler may keep in flight: host copies among them.
ASYNC_IN_FLIGHT = 64
# XLA's schedule-early rule, which copy-starts fall under: each starts right after the value it
# copies is made, rather than where the scheduler's estimate says it still hides.
START_EARLY = {
    "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
    "xla_gpu_experimental_collective_start_as_early_as_possible": True,
}
# A copy's fixed cost on top of its bytes: stream synchronisation, a few microseconds.
_COPY_OVERHEAD_US = 5.0
_COPY_START = re.compile(r"%(copy-start[\w.\-]*) = \((\w+)\[([\d,]*)\]\{[^}]*S\(5\)")
_COPY_BACK = re.compile(
    r"%(copy-start[\w.\-]*) = \((\w+)\[([\d,]*)\]\{[^}]*\}, \w+\[[\d,]*\]\{[^}]*S\(5\)"
)


def compiler_options(lowered=None, *, link_gbps: float | None = None) -> dict[str, Any]:
    """Options for ``jax.jit(..., compiler_options=...)`` or ``.compile(...)`` of an offloading step.

    Without arguments, the options let copies run in parallel with one another and with compute,
    each started as soon as the value it copies is made.
    Given the lowered step, they also tell the scheduler how long each of its host copies takes:
    its bytes over the host link. That costs one compile here, whose copy names the profile uses.

    Args:
      lowered: ``jax.jit(step).lower(*args)``, or ``None``.
      link_gbps: the host link's speed in 10⁹ bytes per second, to price the copies; measured
        on the first device (:func:`jaxoffload._src.timing.slower_link_gbps`) if ``None`` and
        the step has host copies.

    Returns:
      A dict of XLA options; options of other backends are ignored on a CPU.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> step = jax.jit(lambda x: x * 2, compiler_options=compiler_options())
      >>> step(jnp.ones(2)).tolist()
      [2.0, 2.0]
    """
    options: dict[str, Any] = {
        "xla_gpu_experimental_parallel_async_compute_limit": ASYNC_IN_FLIGHT,
        **START_EARLY,
    }
    if lowered is None:
        return options
    if not hasattr(lowered, "compile"):
        raise TypeError(
            f"compiler_options takes a lowered step, jax.jit(step).lower(*args), got {lowered!r}."
        )
    return with_copy_costs(options, lowered.compile(options).as_text(), link_gbps)


def with_copy_costs(
    options: dict[str, Any],
    hlo_text: str,
    link_gbps: float | Callable[[], float] | None = None,
) -> dict[str, Any]:
    """``options``, and a profile pricing each host copy of the program ``hlo_text``.

    The program compiled with ``options``; compiled again with the result, its copies are
    scheduled by their cost. A program without host copies gets ``options`` back, and its
    link is not measured: ``link_gbps`` may be a function that measures it, called only
    where there are copies to price (``None`` measures it on the first device).
    """
    if not (link_gbps is None or callable(link_gbps)):
        _check_link(link_gbps)  # refused where given, copies or not
    copies = host_copies(hlo_text)
    if not copies:
        return options
    if link_gbps is None:
        from jaxoffload._src.timing import slower_link_gbps as link_gbps
    profile = _profile(copies, link_gbps() if callable(link_gbps) else link_gbps)
    # The profile prices the copies alone: the other instructions keep the default costs.
    return {
        **options,
        "fdo_profile": profile.encode(),
        "xla_gpu_pgle_accuracy_checker": "PGLE_STRICTNESS_LEVEL_OFF",
    }


def copy_cost_profile(hlo_text: str, link_gbps: float) -> str:
    """A latency profile (``ProfiledInstructionsProto``, text) pricing each host copy of a program.

    Each ``copy-start`` to host memory (``S(5)``) in ``hlo_text`` costs its bytes over
    ``link_gbps``, plus a fixed few microseconds; each one from host memory costs the
    bytes of every fetch, the queue on the link (see the module's docstring).

    Example:
      >>> hlo = "%copy-start.3 = (bf16[1000,1000]{1,0:S(5)}, bf16[1000,1000]{1,0}, u32[]) ..."
      >>> copy_cost_profile(hlo, link_gbps=50.0)
      'costs { name: "copy-start.3" cost_us: 45.000 }'
    """
    return _profile(host_copies(hlo_text), link_gbps)


def host_copies(hlo_text: str) -> list[tuple[str, str, str, bool]]:
    """``(name, element type, dims, is_fetch)`` of each ``copy-start`` to or from host memory."""
    return [
        (*m.groups(), is_fetch)
        for pattern, is_fetch in ((_COPY_START, False), (_COPY_BACK, True))
        for m in pattern.finditer(hlo_text)
    ]


def _check_link(link_gbps: float) -> None:
    if not link_gbps > 0:
        raise ValueError(f"link_gbps must be a positive speed, got {link_gbps!r}.")


def _profile(copies: list[tuple[str, str, str, bool]], link_gbps: float) -> str:
    _check_link(link_gbps)
    alone = {}  # name -> (µs on the link, is_fetch)
    for name, dtype, dims, is_fetch in copies:
        size = device_bytes_of(f"{dtype}[{dims}]")
        alone[name] = size / (link_gbps * 1e3) + _COPY_OVERHEAD_US, is_fetch
    queue = sum(us for us, is_fetch in alone.values() if is_fetch)
    return "\n".join(
        f'costs {{ name: "{name}" cost_us: {queue if is_fetch else us:.3f} }}'
        for name, (us, is_fetch) in sorted(alone.items())
    )
