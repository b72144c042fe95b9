"""Proof that an offload happened: what the compiled program keeps where."""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any

import jax
import numpy as np

from jaxoffload._src import checks
from jaxoffload._src.errors import OffloadDroppedError, OffloadWarning
from jaxoffload._src.jaxprs import equations, format_bytes, nbytes
from jaxoffload._src.transfers import without_host_placement

__all__ = [
    "MemoryReport",
    "SpatialGather",
    "analyze",
    "complain_if_dropped",
    "device_bytes_of",
    "memory_report",
    "read_host_transfers",
    "read_spatial_gathers",
    "requested_host_transfers",
    "spatial_gathers",
    "with_twin",
]

# XLA writes the host memory space as S(5) in a layout: bf16[8,128]{1,0:S(5)}.
# A typed array; scalars print no layout unless they carry a memory space.
_ARRAY = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\](?:\{[^}]*\})?")
_HOST_SPACE = "S(5)"
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\(%?([\w.\-]*)")
_HOST_KINDS = ("pinned_host", "unpinned_host")
# Instructions whose result is another instruction's buffer, or an argument.
_ALIASES = ("get-tuple-element", "tuple", "bitcast", "opt-barrier", "copy-done", "parameter")
_BYTES = {"pred": 1, "s4": 1, "u4": 1}  # sub-byte types are stored a byte each
_GATHERS = ("all-gather", "all-gather-start")
_GATHERED = re.compile(r"dimensions=\{(\d+)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """What one compiled program keeps in device and host memory.

    Attributes:
      platform: the backend, e.g. ``"gpu"`` or ``"cpu"``.
      temp_bytes: device temporaries, from ``memory_analysis()``.
      host_temp_bytes: host temporaries, from ``memory_analysis()``.
      argument_bytes: device arguments, from ``memory_analysis()``.
      output_bytes: device outputs, from ``memory_analysis()``.
      requested_transfers: ``device_put``s to host memory in the traced program.
      requested_bytes: the bytes those ``device_put``s move.
      host_buffers: buffers the compiled program creates in host memory
        (``S(5)``): the destinations of device-to-host copies and any other
        instruction writing there (aliases and arguments are not counted).
      host_buffer_bytes: their total size.
      device_to_host: compiled copies from device to host memory.
      device_to_host_bytes: the bytes they move.
      host_to_device: compiled copies from host to device memory.
      host_to_device_bytes: the bytes they move.
      twin_temp_bytes: the device temp of the same program with host
        placement off (:func:`jaxoffload._src.transfers.without_host_placement`),
        or ``None`` where it was not compiled.
    """

    platform: str
    temp_bytes: int
    host_temp_bytes: int
    argument_bytes: int
    output_bytes: int
    requested_transfers: int
    requested_bytes: int
    host_buffers: int
    host_buffer_bytes: int
    device_to_host: int
    device_to_host_bytes: int
    host_to_device: int
    host_to_device_bytes: int
    twin_temp_bytes: int | None = None

    @property
    def freed_bytes(self) -> int | None:
        """The device temp that the host copies free: the twin's temp less this program's."""
        return None if self.twin_temp_bytes is None else self.twin_temp_bytes - self.temp_bytes

    @property
    def frees_little(self) -> bool:
        """Whether the bytes moved free less than a tenth of themselves in device temp."""
        freed = self.freed_bytes
        return self.moved and freed is not None and freed < self.device_to_host_bytes / 10

    @property
    def requested(self) -> bool:
        """Whether the traced program asked for host placement."""
        return self.requested_transfers > 0

    @property
    def moved(self) -> bool:
        """Whether the compiled program really moves data to the host."""
        return self.device_to_host > 0

    @property
    def dropped(self) -> bool:
        """Host placement was requested and the compiler kept no transfer of it."""
        return self.requested and not self.moved and self.platform != "cpu"

    def summary(self) -> str:
        """One paragraph a person can read."""
        lines = [
            f"platform {self.platform}: device temp {format_bytes(self.temp_bytes)}, "
            f"host temp {format_bytes(self.host_temp_bytes)}",
            f"requested: {self.requested_transfers} transfers to host, {format_bytes(self.requested_bytes)}",
            f"compiled: {self.device_to_host} device->host copies ({format_bytes(self.device_to_host_bytes)}), "
            f"{self.host_to_device} host->device copies ({format_bytes(self.host_to_device_bytes)}), "
            f"{self.host_buffers} host buffers ({format_bytes(self.host_buffer_bytes)})",
        ]
        if self.platform == "cpu" and self.requested:
            lines.append(
                "note: host placement has no effect on CPU: XLA:CPU keeps every buffer in one memory."
            )
        elif self.dropped:
            lines.append("note: the compiler dropped every requested transfer; nothing moved.")
        if self.twin_temp_bytes is not None:
            lines.append(
                f"without host placement: device temp {format_bytes(self.twin_temp_bytes)}; the copies "
                f"free {format_bytes(self.freed_bytes)}"
            )
        return "\n".join(lines)


def memory_report(
    jitted: Any, *args: Any, on_dropped: str = "warn", twin: bool = True, **kwargs: Any
) -> MemoryReport:
    """Compiles ``jitted`` for ``args`` and reports where its memory goes.

    XLA:GPU silently deletes host round trips it judges useless, so a requested
    offload can compile to nothing. This reads the compiled program, not the
    request, and says so when the two disagree. Where the program does move
    residuals, it also compiles its twin with host placement off, and warns
    if the bytes moved free less than a tenth of themselves in device temp:
    moving them then costs transfers for little.

    Args:
      jitted: a function wrapped in :func:`jax.jit` or :func:`flax.nnx.jit`
        (or anything with ``.trace``, ``.lower`` and ``.compile``).
      *args: its arguments, as arrays or :class:`jax.ShapeDtypeStruct`.
      on_dropped: what to do when host placement was requested but nothing
        moves: ``"warn"`` (an :class:`OffloadWarning`), ``"raise"`` (an
        :class:`OffloadDroppedError`; on CPU, where no placement ever has an
        effect, a warning still) or ``"ignore"``; ``"ignore"`` also silences
        the warning that the copies free little.
      twin: compile the twin without host placement when something moves.
        Its trace clears ``jitted``'s cache, so the next call of ``jitted``
        compiles again.
      **kwargs: its keyword arguments.

    Returns:
      A :class:`MemoryReport`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxoffload import memory_report
      >>> r = memory_report(jax.jit(lambda x: x * 2), jnp.ones(4))
      >>> (r.requested, r.moved)
      (False, False)
    """
    if not hasattr(jitted, "trace"):
        raise TypeError(
            f"memory_report expects a jax.jit-wrapped function, got {jitted!r}; "
            "wrap it first: memory_report(jax.jit(f), *args)."
        )
    _check_on_dropped(on_dropped)  # before the compile, not after
    twin = checks.flag("twin", twin)
    traced = jitted.trace(*args, **kwargs)
    report = analyze(traced, traced.lower().compile(), on_dropped=on_dropped)
    if twin and report.moved:
        # jit caches traces by argument types alone: clear it on both sides
        # of the twin's trace, so that neither reuses the other's. nnx.jit's
        # wrapper has no cache of its own: its jax.jit (jitted_fn) holds it.
        cached = getattr(jitted, "jitted_fn", jitted)
        cached.clear_cache()
        with without_host_placement():
            twin_compiled = jitted.trace(*args, **kwargs).lower().compile()
        cached.clear_cache()
        report = with_twin(report, twin_compiled, on_dropped=on_dropped)
    return report


def with_twin(
    report: MemoryReport, twin_compiled: Any, *, on_dropped: str = "warn"
) -> MemoryReport:
    """``report`` with the device temp of its twin compiled without host placement.

    Warns (an :class:`OffloadWarning`) if the bytes moved free less than a
    tenth of themselves, unless ``on_dropped`` is ``"ignore"``.
    """
    twin_temp = int(twin_compiled.memory_analysis().temp_size_in_bytes)
    report = dataclasses.replace(report, twin_temp_bytes=twin_temp)
    if report.frees_little and on_dropped != "ignore":
        warnings.warn(
            f"the compiled program moves {format_bytes(report.device_to_host_bytes)} to host memory, but "
            f"its device temp is {format_bytes(report.temp_bytes)} against {format_bytes(twin_temp)} without "
            f"host placement: the copies free {format_bytes(report.freed_bytes)}, less than a tenth of "
            "what they move. The device peak is elsewhere (a working set, not residuals); "
            "Lean() keeps the same memory without the transfers.",
            OffloadWarning,
            stacklevel=3,
        )
    return report


def analyze(traced: Any, compiled: Any, *, on_dropped: str = "warn") -> MemoryReport:
    """:func:`memory_report` for a program already traced and compiled, without a twin.

    Args:
      traced: the result of ``jitted.trace(*args)``.
      compiled: the result of ``traced.lower().compile()``; it can then be
        called without compiling again.
      on_dropped: as in :func:`memory_report`.

    Returns:
      A :class:`MemoryReport`.
    """
    _check_on_dropped(on_dropped)
    analysis = compiled.memory_analysis()
    # nnx.jit's trace wraps jax's, which holds the jaxpr.
    requested = requested_host_transfers(getattr(traced, "traced", traced).jaxpr)
    report = MemoryReport(
        platform=jax.default_backend(),
        temp_bytes=int(analysis.temp_size_in_bytes),
        host_temp_bytes=int(analysis.host_temp_size_in_bytes),
        argument_bytes=int(analysis.argument_size_in_bytes),
        output_bytes=int(analysis.output_size_in_bytes),
        requested_transfers=len(requested),
        requested_bytes=sum(requested),
        **read_host_transfers(compiled.as_text()),
    )
    complain_if_dropped(report, on_dropped)
    return report


@dataclasses.dataclass(frozen=True)
class SpatialGather:
    """An all-gather in a compiled program that joins an array along a spatial dimension.

    Attributes:
      op_name: the jax operation it comes from, as the HLO's metadata names it,
        e.g. ``"jit(step)/transpose(jvp(UNet))/ConvTranspose_0/conv_general_dilated"``.
      shape: the gathered array, as HLO writes it, e.g. ``"f32[1,32,32,4]"``.
      dimension: the dimension gathered along.
      nbytes: the gathered array's bytes, on every device of the gather.
    """

    op_name: str
    shape: str
    dimension: int
    nbytes: int


def spatial_gathers(jitted: Any, *args: Any, **kwargs: Any) -> list[SpatialGather]:
    """Compiles ``jitted`` for ``args`` and lists the all-gathers that undo a spatial sharding.

    Sharding images along their height (``P("data", "space")`` for NHWC) splits
    every activation across the devices, and the partitioner exchanges only
    the halos a convolution needs. Where it cannot partition an operation that
    way, it gathers the whole activation on every device, silently: such a
    step runs, with the gradients it should have, but holds what one device
    would. This finds them: all-gathers along a spatial dimension of an array of
    rank 4 or more, channels last (dimensions 1 to ``ndim - 2``), with the
    operation each comes from. A parameter gathered along such a dimension
    (a convolution kernel's input features under FSDP) is listed too; its
    ``op_name`` tells it apart.

    Args:
      jitted: a function wrapped in :func:`jax.jit`.
      *args: its arguments, as arrays or :class:`jax.ShapeDtypeStruct`, with
        their shardings.
      **kwargs: its keyword arguments.

    Returns:
      The gathers, in program order; empty where every activation stays split.
    """
    if not hasattr(jitted, "lower"):
        raise TypeError(
            f"spatial_gathers expects a jax.jit-wrapped function, got {jitted!r}; "
            "wrap it first: spatial_gathers(jax.jit(f), *args)."
        )
    return read_spatial_gathers(jitted.lower(*args, **kwargs).compile().as_text())


def read_spatial_gathers(text: str) -> list[SpatialGather]:
    """:func:`spatial_gathers` of a compiled program's optimized HLO text."""
    found = []
    for line in text.splitlines():
        match = _INSTRUCTION.match(line)
        dimension = _GATHERED.search(line)
        if not (match and match.group(3) in _GATHERS and dimension):
            continue
        # all-gather-start's result is (operand, result): the gathered array is the last.
        gathered = list(_ARRAY.finditer(match.group(2)))[-1]
        rank, d = len(gathered.group(2).split(",")), int(dimension.group(1))
        if rank >= 4 and 1 <= d <= rank - 2:
            op_name = _OP_NAME.search(line)
            shape = f"{gathered.group(1)}[{gathered.group(2)}]"
            found.append(
                SpatialGather(op_name.group(1) if op_name else "", shape, d, _array_bytes(gathered))
            )
    return found


def requested_host_transfers(jaxpr: Any) -> list[int]:
    """The bytes of each ``device_put`` to host memory in a (closed) jaxpr, nested ones included.

    What a program *asks* to move, the same on every backend; what the compiled
    program moves is in :func:`memory_report`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxoffload
      >>> f = jaxoffload.offload(lambda x: jnp.sin(x))
      >>> requested_host_transfers(jax.make_jaxpr(jax.grad(lambda x: f(x).sum()))(jnp.ones(8)))
      [32]
    """
    return [
        nbytes(eqn.outvars[0].aval)
        for eqn in equations(jaxpr)
        if eqn.primitive.name == "device_put" and any(map(_is_host, eqn.params["devices"]))
    ]


def _check_on_dropped(on_dropped: Any) -> None:
    if on_dropped not in ("warn", "raise", "ignore"):
        raise ValueError(f"on_dropped must be 'warn', 'raise' or 'ignore', got {on_dropped!r}.")


def complain_if_dropped(report: MemoryReport, on_dropped: str) -> None:
    """Warns or raises, as ``on_dropped`` says, where ``report`` asked for copies and moved none."""
    if on_dropped == "ignore" or not report.requested or report.moved:
        return
    if report.platform == "cpu":
        warnings.warn(
            f"{report.requested_transfers} host transfers were requested, but host placement "
            "has no effect on CPU: XLA:CPU keeps every buffer in one memory. "
            "Measure memory savings on a GPU.",
            OffloadWarning,
            stacklevel=3,
        )
        return
    message = (
        f"{report.requested_transfers} host transfers ({format_bytes(report.requested_bytes)}) were "
        f"requested, but the compiled program for {report.platform} moves nothing to host "
        "memory: XLA dropped them. Residuals stay on the device."
    )
    if on_dropped == "raise":
        raise OffloadDroppedError(message)
    warnings.warn(message, OffloadWarning, stacklevel=3)


def _is_host(destination: Any) -> bool:
    if destination == jax.memory.Space.Host:
        return True
    return getattr(destination, "memory_kind", None) in _HOST_KINDS


def read_host_transfers(text: str) -> dict[str, int]:
    """Counts host buffers and host transfers in optimized HLO text."""
    counts = dict.fromkeys(
        (
            "host_buffers",
            "host_buffer_bytes",
            "device_to_host",
            "device_to_host_bytes",
            "host_to_device",
            "host_to_device_bytes",
        ),
        0,
    )
    # Recent XLA prints operands by name only, so a copy's source type is
    # looked up from the instruction that defines it.
    instructions = [m.groups() for m in map(_INSTRUCTION.match, text.splitlines()) if m]
    types = {name: result for name, result, _, _ in instructions}
    for _, result, opcode, operand in instructions:
        if opcode in ("copy-start", "copy"):
            # copy-start's result is (destination, source, context).
            arrays = list(_ARRAY.finditer(result + " " + types.get(operand, "")))
            if len(arrays) < 2 or (opcode == "copy" and len(arrays) != 2):
                continue  # a tuple copy, or an operand not found: no single transfer
            dst, src = arrays[:2]
            if _in_host(dst) and not _in_host(src):
                counts["device_to_host"] += 1
                counts["device_to_host_bytes"] += _array_bytes(dst)
                counts["host_buffers"] += 1
                counts["host_buffer_bytes"] += _array_bytes(dst)
            elif _in_host(src) and not _in_host(dst):
                counts["host_to_device"] += 1
                counts["host_to_device_bytes"] += _array_bytes(dst)
        elif opcode not in _ALIASES and _HOST_SPACE in result:
            host = [a for a in _ARRAY.finditer(result) if _in_host(a)]
            counts["host_buffers"] += len(host)
            counts["host_buffer_bytes"] += sum(map(_array_bytes, host))
    return counts


def device_bytes_of(shape: str) -> int:
    """The device bytes of an HLO shape, an array or a tuple of them, host arrays (``S(5)``)
    left out: ``bf16[8,128]{1,0}`` is 2,048."""
    return sum(_array_bytes(a) for a in _ARRAY.finditer(shape) if not _in_host(a))


def _in_host(array: re.Match) -> bool:
    return _HOST_SPACE in array.group(0)


def _array_bytes(array: re.Match) -> int:
    dtype, dims = array.group(1), array.group(2)
    size = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
    return size * _BYTES.get(dtype, _itemsize(dtype))


def _itemsize(hlo_dtype: str) -> int:
    bits = re.search(r"(\d+)", hlo_dtype)
    return max(1, int(bits.group(1)) // 8) if bits else 1
