"""Data-parallel training with jaxoffload across two processes (jax.distributed), on CPU.

Each process owns 2 CPU devices; the 4 devices form one global mesh, the
batch is sharded over ``data`` and the parameters are replicated. Process 0
prints the gradients' relative error against a one-process reference that
each process computes on its own first device.

Run both processes (the script launches them when given no --process-id)::

    python -m jaxoffload.bench.distributed_example --strategy lean,offload
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import subprocess
import sys

STRATEGIES = ("store", "lean", "remat", "offload")


def _strategy(name: str):
    import jaxoffload

    return {
        "store": jaxoffload.Store(),
        "lean": jaxoffload.Lean(),
        "remat": jaxoffload.Remat(),
        "offload": jaxoffload.Offload(),
    }[name]


def step(model, params, batch_stats, x, labels):
    """The training step's gradients and new BatchNorm statistics (tests/test_sharding.py too)."""
    import jax
    import optax

    def loss_fn(params):
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats}, x, True, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updates["batch_stats"]

    return jax.grad(loss_fn, has_aux=True)(params)


def run_process(process_id: int, port: int, strategies: list[str]) -> None:
    """One of the two processes: the sharded step per strategy, and (on process 0) its error."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax

    jax.config.update("jax_platforms", "cpu")
    # CPU devices of different processes talk through gloo.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id
    )
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxoffload
    from jaxoffload.bench.step import run_once

    # Every process builds the same global batch and variables, on its first local device.
    local = jax.local_devices()[0]
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 16, 16, 3)), local)
    labels = jax.device_put(jnp.arange(8) % 10, local)
    variables = run_once(lambda: _model(jaxoffload.Store()).init(jax.random.key(1), x, True))
    reference = jax.jit(functools.partial(step, _model(jaxoffload.Store())))(
        variables["params"], variables["batch_stats"], x, labels
    )

    mesh = jax.make_mesh((4,), ("data",))
    batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    params, stats = jax.tree.map(
        lambda v: _global_array(v, replicated), (variables["params"], variables["batch_stats"])
    )
    xs, ys = _global_array(x, batch), _global_array(labels, batch)

    if process_id == 0:
        print(f"devices={jax.device_count()} processes={jax.process_count()}")
    for strategy in strategies:
        grads, new_stats = jax.jit(functools.partial(step, _model(_strategy(strategy))))(
            params, stats, xs, ys
        )
        # Replicated outputs: each process reads its own copy.
        errors = _rel_err(grads, reference[0]), _rel_err(new_stats, reference[1])
        if process_id == 0:
            print(f"strategy={strategy} grad_rel_err={errors[0]:.3e} "
                  f"batch_stats_rel_err={errors[1]:.3e}", flush=True)  # fmt: skip
    jax.distributed.shutdown()


def _model(strategy):
    """A small plain-Flax ResNet whose blocks are wrapped with ``strategy``."""
    from jaxoffload.bench.models import plain_model
    from jaxoffload.bench.models.flax_resnet import ResNet, ResNetBlock

    return plain_model(
        ResNet, ResNetBlock, strategy, stage_sizes=(1, 1), num_filters=8, num_classes=10
    )


def _global_array(value, sharding):
    """``value`` as a global array: each process gives the shards of its own devices."""
    import jax
    import numpy as np

    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _rel_err(got, want) -> float:
    """The relative L2 error of this process's copy of replicated ``got`` against ``want``."""
    import jax
    import numpy as np

    pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    num = sum(np.sum((np.asarray(a.addressable_data(0), np.float64) - np.asarray(b)) ** 2)
              for a, b in pairs)  # fmt: skip
    den = sum(np.sum(np.asarray(b, np.float64) ** 2) for _, b in pairs)
    return float(np.sqrt(num / den))


def free_port() -> int:
    """A TCP port that was free a moment ago, for the coordinator."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(strategies: list[str], timeout: float = 120) -> str:
    """Runs the two processes, and returns process 0's output; raises with both outputs on failure."""
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--process-id",
                str(i),
                "--port",
                str(port),
                "--strategy",
                ",".join(strategies),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outputs = [p.communicate()[0] for p in procs]
        raise RuntimeError(_both(f"timed out after {timeout} s", outputs)) from None
    if any(p.returncode for p in procs):
        codes = [p.returncode for p in procs]
        raise RuntimeError(_both(f"exit codes {codes}", outputs))
    return outputs[0]


def _both(what: str, outputs) -> str:
    return f"two-process run: {what}\n" + "\n".join(
        f"--- process {i} ---\n{out[-4000:]}" for i, out in enumerate(outputs)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--strategy", default="lean,offload", help=f"comma-separated, of {', '.join(STRATEGIES)}"
    )
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args()
    strategies = args.strategy.split(",")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        parser.error(f"--strategy {','.join(unknown)}: choose from {', '.join(STRATEGIES)}")
    if args.process_id is None:
        print(launch(strategies), end="")
    else:
        run_process(args.process_id, args.port, strategies)


if __name__ == "__main__":
    main()
