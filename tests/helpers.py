"""Shared helpers for the CPU tests."""

import jax
import jax.numpy as jnp
import numpy as np


def rel_err(a, b) -> float:
    """Relative L2 error of two pytrees of arrays, in float64."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and all(np.shape(x) == np.shape(y) for x, y in zip(la, lb))
    num = sum(
        np.sum((np.asarray(x, np.float64) - np.asarray(y, np.float64)) ** 2) for x, y in zip(la, lb)
    )
    den = sum(np.sum(np.asarray(y, np.float64) ** 2) for y in lb)
    return float(np.sqrt(num / max(den, 1e-300)))


def host_device_puts(jaxpr) -> int:
    """How many device_put equations in ``jaxpr`` (and its sub-jaxprs) target host memory."""
    from jax.extend import core

    def walk(j):
        for eqn in j.eqns:
            if (
                eqn.primitive.name == "device_put"
                and jax.memory.Space.Host in eqn.params["devices"]
            ):
                yield eqn
            for sub in core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return sum(1 for _ in walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr))


def host_copies(moved) -> int:
    """How many copies the moved residuals of one call travel in: each large one alone, the
    small ones one buffer a dtype (``jaxoffload._src.transfers.packed``)."""
    from jaxoffload._src.transfers import PACK_BELOW

    small = [r.dtype for r in moved if r.nbytes < PACK_BELOW]
    return len(moved) - len(small) + len(set(small))


def normal(key: int, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(key), shape, dtype)


def jax_residuals(fun, *args, keep_arguments=()):
    """What jax's own ``saved_residuals`` says ``fun``'s backward pass reads: ``(dtype, shape, what)``.

    Arguments are left out (they are kept anyway), but for those named in
    ``keep_arguments``.
    """
    from jax._src.ad_checkpoint import saved_residuals

    def kept(what):
        return not what.startswith("from the argument ") or what.split()[-1] in keep_arguments

    return [
        (str(aval.dtype), tuple(aval.shape), what)
        for aval, what in saved_residuals(fun, *args)
        if kept(what)
    ]


def bench_record(workload, **extra):
    """The part of a bench record that the command reads, as the measuring process gives it.

    Keys that a record does not name (``run``, say) are kept in its ``extra``.
    """
    from jaxoffload.bench.record import Record

    fields = ("model", "batch", "image_size", "dtype", "window", "micro_batch", "num_devices")
    return Record.from_json({
        **{k: getattr(workload, k) for k in fields},
        "strategy": workload.strategy, "grad_rel_err": 0.0, "step_time_ms": 1.0,
        "compiled_temp_bytes": 1, "compiled_host_temp_bytes": 0, "peak_bytes_in_use": None,
        "images_per_s": 2.0, "device": "cpu", **extra,
    })  # fmt: skip


def stand_in_children(**methods):
    """The bench's child processes, with ``methods`` standing in for some of theirs.

    Each keyword names a method of :class:`jaxoffload.bench.child.Children` (``probe``,
    ``compile``, ``measure``, ``hidden_offload``, ``plan_budgets``, ``largest``) and gives a
    function with its arguments that answers in its place, so that a test measures nothing
    on a GPU or in a child; the methods not named start real child processes.
    """
    from jaxoffload.bench.child import Children

    unknown = set(methods) - set(vars(Children))
    assert not unknown, f"Children has no method {unknown}"
    children = Children()
    vars(children).update(methods)
    return children


def host_puts(jaxpr) -> list:
    """The ``device_put``s to host memory in a jaxpr, nested jaxprs' included."""
    from jax.extend import core

    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put" and jax.memory.Space.Host in eqn.params["devices"]:
            found.append(eqn)
        for sub in core.jaxprs_in_params(eqn.params):
            found += host_puts(sub)
    return found


def every_strategy_value() -> list:
    """One value of each strategy, and Offload's window and recompute options."""
    import jaxoffload

    return [
        jaxoffload.Store(),
        jaxoffload.Lean(),
        jaxoffload.Remat(),
        jaxoffload.Offload(),
        jaxoffload.Offload(window=2),
        jaxoffload.Offload(recompute=True),
    ]
