"""Timing on the device: programs in turns, a function's median, the host link; and zeros.

Every figure the planner measures comes through here, so that each is taken the
same way: after a run to warm up, with ``jax.block_until_ready``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "compile_all",
    "compile_timed",
    "forward_and_backward",
    "fresh_zeros",
    "link_probe_bytes",
    "measure_link",
    "median_ms",
    "padded",
    "slower_link_gbps",
    "step_ms",
    "steps_together",
    "timed_together",
    "vjp_programs",
    "zeros",
]


# Each program of a block is timed until its runs add up to this, at the least: a
# program of a millisecond or less needs many runs before its fastest ones agree.
MIN_TIMED_S = 0.05


def timed_together(
    programs: Sequence[tuple[Any, Sequence[Any]]], runs: int
) -> list[tuple[float, float]]:
    """``(ms, spread)`` of each ``executable(*args)``, timed in turns.

    The programs run one after another, round after round, so that a change
    in the machine's load falls on all of them alike, not on whichever was
    timed then. A program's time is the lower quartile of its runs, what it
    takes when nothing else gets in the way; its spread is the gap between the
    quartiles over that.
    """
    once = []
    for executable, args in programs:
        jax.block_until_ready(executable(*args))  # warm up
        start = time.perf_counter()
        jax.block_until_ready(executable(*args))
        once.append(time.perf_counter() - start)
    rounds = max(runs, 4, min(100, math.ceil(MIN_TIMED_S / max(min(once), 1e-6))))

    def run(k: int) -> float:
        executable, args = programs[k]
        start = time.perf_counter()
        jax.block_until_ready(executable(*args))
        return time.perf_counter() - start

    return _in_turns(run, len(programs), rounds)


def median_ms(fn, *args, runs: int) -> float:
    """The median time of ``fn(*args)`` in milliseconds, over ``runs`` runs after one to warm up."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def step_ms(executable, structs, runs: int) -> float:
    """The median ms of a compiled step on zeros of ``structs``, after one run to warm up.

    The arguments are made afresh for every run, since a step that donates
    them uses them up. ``inf`` if the device runs out of memory.
    """
    times = []
    try:
        for _ in range(runs + 1):
            times.append(_one_step(executable, structs))
    except jax.errors.JaxRuntimeError:  # out of memory: no time to give
        return math.inf
    return statistics.median(times[1:]) * 1e3


def steps_together(executables: Sequence[Any], structs, runs: int) -> list[tuple[float, float]]:
    """``(ms, spread)`` of each compiled step, timed in turns as :func:`timed_together` does.

    Each run gets fresh zeros of ``structs`` (a step may donate them); each
    step was run once already (:func:`step_ms`), so none is warmed up here.
    """
    return _in_turns(lambda k: _one_step(executables[k], structs), len(executables), max(runs, 4))


def _in_turns(run: Callable[[int], float], count: int, rounds: int) -> list[tuple[float, float]]:
    """``(ms, spread)`` of ``run(k)``'s seconds for each of ``count`` programs, run in turns.

    Round after round, each program once, no program always first; a program's
    time is the lower quartile of its runs, its spread the gap between the
    quartiles over that.
    """
    times: list[list[float]] = [[] for _ in range(count)]
    for r in range(rounds):
        for k in np.roll(np.arange(count), r):
            times[k].append(run(int(k)))
    return [_quartile_and_spread(t) for t in times]


def _one_step(executable, structs) -> float:
    args = jax.block_until_ready(fresh_zeros(structs))
    start = time.perf_counter()
    jax.block_until_ready(executable(*args))
    return time.perf_counter() - start


def _quartile_and_spread(runs: Sequence[float]) -> tuple[float, float]:
    """A program's time, the lower quartile of its runs in ms, and the gap between the quartiles over it."""
    low, high = np.percentile(runs, [25, 75])
    return float(low) * 1e3, float((high - low) / low)


def fresh_zeros(structs):
    """Zeros of every leaf of ``structs``, made by one compiled program where it can be: a
    ResNet-50 training state has 430 leaves, and an op per leaf dispatches as many before
    every timed run.
    Leaves with a sharding and leaves without, together, are made one op a leaf."""
    leaves, tree = jax.tree.flatten(structs)
    shardings = tuple(getattr(x, "sharding", None) for x in leaves)
    placed = {isinstance(s, jax.sharding.Sharding) for s in shardings}
    if len(placed) > 1:
        return jax.tree.map(zeros, structs)
    key = (tree, tuple((x.shape, x.dtype) for x in leaves), shardings if True in placed else None)
    try:
        hash(key)
    except TypeError:  # a leaf that cannot key a cache
        return jax.tree.map(zeros, structs)
    return _zeros_program(*key)()


@functools.lru_cache(maxsize=16)
def _zeros_program(tree, shapes, shardings):
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    out = None if shardings is None else jax.tree.unflatten(tree, shardings)
    return jax.jit(lambda: jax.tree.unflatten(tree, [zeros(s) for s in structs]), out_shardings=out)


def zeros(struct) -> jax.Array:
    """Zeros of ``struct``'s shape, dtype and sharding (distinct keys for a PRNG key array)."""
    if jax.dtypes.issubdtype(struct.dtype, jax.dtypes.prng_key):
        keys = jax.random.split(jax.random.key(0), math.prod(struct.shape))
        return keys.reshape(struct.shape)
    sharding = getattr(struct, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
        return jnp.zeros(struct.shape, struct.dtype, device=sharding)
    return jnp.zeros(struct.shape, struct.dtype)


def compile_all(lowered: Iterable[Any], *, parallel: bool = True) -> list[Any]:
    """Compiles lowered programs, several at once if ``parallel``: XLA compiles outside Python's lock.

    ``lowered`` may be a generator that lowers each program when asked: each
    starts compiling as soon as it is lowered, while the next is traced (a
    step takes seconds to trace). On a GPU, compiles that autotune kernels at
    once contend for the device: the programs of one ResNet-50 block compiled
    far slower together than one after another on an H200 (docs/design.md,
    "Time comes from the device"). Compile at once only programs whose kernels
    were autotuned already, such as steps of one model after its first.
    """
    return [executable for executable, _ in compile_timed(lowered, parallel=parallel)]


def compile_timed(
    lowered: Iterable[Any], *, parallel: bool = True, options: dict[str, Any] | None = None
) -> list[tuple[Any, float]]:
    """:func:`compile_all`, each executable with the seconds that its own compile took;
    ``options``, XLA's compiler options for each."""

    def timed(x):
        start = time.perf_counter()
        return x.compile(options), time.perf_counter() - start

    if not parallel:
        return [timed(x) for x in lowered]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        futures = [pool.submit(timed, x) for x in lowered]
        return [f.result() for f in futures]


def link_probe_bytes(device) -> int:
    """What :func:`measure_link` moves each way by default: ``2**30`` bytes, or a sixteenth of
    that on a CPU, whose two memories are both the host's. There a move is a memory copy, not
    a transfer over a link, and the smaller array times it in a sixteenth of the time, which
    every planner that offloads pays."""
    return 2**26 if device.platform == "cpu" else 2**30


def measure_link(
    nbytes: int | None = None, runs: int = 3, devices: Sequence[Any] | None = None
) -> dict[str, float]:
    """The host link's bandwidth: ``jax.device_put`` between device and pinned host memory.

    With several ``devices`` they all copy at once, each its own ``nbytes``, as
    the devices of one sharded step do: devices that share a PCIe switch, or a
    host's memory bandwidth, each get less than one alone.

    Args:
      nbytes: size of the array moved each way, per device; by default
        :func:`link_probe_bytes`.
      runs: timed moves each way; the median counts.
      devices: the devices that copy at once; the first device by default.

    Returns:
      ``{"d2h_gbps": ..., "h2d_gbps": ..., "link_devices": n}``: each device's
      bandwidth, in 10⁹ bytes per second, with ``n`` devices copying.
    """
    devices = list(devices or jax.devices()[:1])
    nbytes = link_probe_bytes(devices[0]) if nbytes is None else nbytes
    on_host, on_device = (_placed_on(devices, kind) for kind in ("pinned_host", "device"))
    # Made where it lives: no device ever holds another's part.
    shape = (len(devices), nbytes // 4)
    x = jax.jit(lambda: jnp.ones(shape, jnp.float32), out_shardings=on_device)()
    host = jax.device_put(x, on_host).block_until_ready()
    d2h = median_ms(lambda: jax.device_put(x, on_host), runs=runs)
    h2d = median_ms(lambda: jax.device_put(host, on_device), runs=runs)
    each = x.nbytes / len(devices)
    return {
        "d2h_gbps": each / d2h / 1e6,
        "h2d_gbps": each / h2d / 1e6,
        "link_devices": len(devices),
    }


def slower_link_gbps() -> float:
    """The first device's host link, the slower way, in 10⁹ bytes per second: what prices a
    program's host copies. It moves a quarter of :func:`link_probe_bytes`, as a price needs
    the link's speed, not the probe's precision."""
    device = jax.devices()[0]
    link = measure_link(link_probe_bytes(device) // 4, devices=[device])
    return min(link["d2h_gbps"], link["h2d_gbps"])


def _placed_on(devices: Sequence[Any], memory_kind: str) -> jax.sharding.Sharding:
    """A row per device in ``memory_kind``; one device's as a single-device sharding."""
    if len(devices) == 1:
        return jax.sharding.SingleDeviceSharding(devices[0], memory_kind=memory_kind)
    mesh = jax.sharding.Mesh(np.array(devices), ("link",))
    return jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("link"), memory_kind=memory_kind
    )


def vjp_programs(fun, structs):
    """``(forward, forward_and_backward, their arguments)`` of ``fun`` alone, as jitted functions.

    The arguments are zeros of ``structs``, and the cotangents zeros of the outputs.
    """
    both, cotangent_structs = forward_and_backward(fun, structs)
    args = [zeros(s) for s in structs]
    cotangents = [zeros(c) for c in cotangent_structs]
    return jax.jit(fun), jax.jit(both), tuple(args), (args, cotangents)


def forward_and_backward(fun, structs):
    """``(both, cotangent_structs)``: ``both(args, cotangents)`` runs ``fun``'s forward pass
    and its backward pass on cotangents of its float outputs, of ``cotangent_structs``."""
    out_structs = jax.eval_shape(fun, *structs)
    floats = [jax.dtypes.issubdtype(o.dtype, np.inexact) for o in out_structs]

    def both(args, cotangents):
        out, vjp_fun = jax.vjp(fun, *args)
        return vjp_fun(padded(cotangents, floats, out))

    return both, [o for f, o in zip(floats, out_structs) if f]


def padded(cotangents, floats, outs) -> list[Any]:
    """The float outputs' ``cotangents``, with float0 zeros for the others, as a vjp takes them."""
    it = iter(cotangents)
    return [next(it) if f else np.zeros(o.shape, jax.dtypes.float0) for f, o in zip(floats, outs)]
