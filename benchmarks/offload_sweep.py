"""Offload the first k conv blocks of a VGG and measure device memory and step time.

Each variant runs in its own process, so that ``peak_bytes_in_use`` is that
variant's alone. A last process compares every variant's gradients with the
plain model's on the same batch.

    python benchmarks/offload_sweep.py --out benchmarks/results/vgg19_offload_sweep_h200.json
    python benchmarks/offload_sweep.py --model vgg11 --batch 4 --image-size 32   # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

MODELS = {"vgg11": "VGG11", "vgg13": "VGG13", "vgg16": "VGG16", "vgg19": "VGG19"}
DTYPES = ("bfloat16", "float32")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vgg19", choices=sorted(MODELS))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--ks", default="0,4,8,12,16", help="numbers of leading blocks to offload")
    p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure nn.remat on every block")  # fmt: skip
    p.add_argument("--flax-pool", action="store_true",
                   help="use flax.linen.max_pool instead of jaxoffload.layers.max_pool")  # fmt: skip
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--out", default=None, help="JSON file for the records")
    p.add_argument("--hlo-dir", default=None, help="write each variant's compiled HLO here")
    p.add_argument("--one", nargs=2, metavar=("STRATEGY", "K"), help=argparse.SUPPRESS)
    p.add_argument("--grads", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build(args, strategy: str, k: int):
    """The model, its initial state, a batch and the jitted training step."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxoffload import models
    from jaxoffload.models.vgg import num_conv_blocks

    config = getattr(models, MODELS[args.model])
    n = num_conv_blocks(config)
    if strategy == "remat":
        strategies = models.first_k("remat", n, n)
    else:
        strategies = models.first_k(strategy, k, n)
    dtype = jnp.dtype(args.dtype)
    model = models.VGG(
        config, dtype=dtype, block_strategies=strategies, lean_pool=not args.flax_pool
    )
    key = jax.random.key(0)
    x = jax.random.normal(key, (args.batch, args.image_size, args.image_size, 3), dtype)
    labels = jax.random.randint(key, (args.batch,), 0, 1000)
    params = model.init(jax.random.key(1), x[:1])["params"]
    tx = optax.sgd(1e-3, momentum=0.9)

    def loss_fn(params, x, labels):
        logits = model.apply({"params": params}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def train_step(params, opt_state, x, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, labels)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(train_step, donate_argnums=(0, 1))
    return model, params, tx.init(params), x, labels, step, loss_fn


def run_one(args, strategy: str, k: int) -> dict:
    """Compiles, runs and measures one variant in this process."""
    import jax

    import jaxoffload
    from jaxoffload import report as report_lib

    _, params, opt_state, x, labels, step, _ = build(args, strategy, k)
    traced = step.trace(params, opt_state, x, labels)
    compiled = traced.lower().compile()
    report = report_lib.analyze(traced, compiled, on_dropped="warn")
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        pool = "flaxpool" if args.flax_pool else "leanpool"
        path = os.path.join(args.hlo_dir, f"{args.model}_{pool}_{strategy}_k{k}.hlo.txt")
        with open(path, "w") as f:
            f.write(compiled.as_text())
    for _ in range(2):  # warm-up
        params, opt_state, loss = compiled(params, opt_state, x, labels)
    loss.block_until_ready()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, x, labels)
        loss.block_until_ready()
        times.append(time.perf_counter() - start)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    import flax

    return {
        "model": args.model,
        "batch": args.batch,
        "image_size": args.image_size,
        "dtype": args.dtype,
        "strategy": strategy,
        "offloaded_blocks": k,
        "max_pool": "flax" if args.flax_pool else "lean",
        "framework": "jax",
        "device": device.device_kind,
        "platform": device.platform,
        "jax_version": jax.__version__,
        "flax_version": flax.__version__,
        "jaxoffload_version": jaxoffload.__version__,
        "compiled_temp_bytes": report.temp_bytes,
        "compiled_host_temp_bytes": report.host_temp_bytes,
        "compiled_argument_bytes": report.argument_bytes,
        "requested_host_bytes": report.requested_bytes,
        "host_buffers": report.host_buffers,
        "device_to_host_copies": report.device_to_host,
        "device_to_host_bytes": report.device_to_host_bytes,
        "host_to_device_copies": report.host_to_device,
        "host_to_device_bytes": report.host_to_device_bytes,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "step_time_ms": statistics.median(times) * 1e3,
        "step_times_ms": [t * 1e3 for t in times],
        "final_loss": float(loss),
        "grad_rel_err": None,
        "date": datetime.date.today().isoformat(),
    }


def grad_errors(args, variants: list[tuple[str, int]]) -> dict[str, float]:
    """Relative L2 error of each variant's gradient against the plain model's."""
    import jax
    import jax.numpy as jnp

    def grads(strategy, k):
        _, params, _, x, labels, _, loss_fn = build(args, strategy, k)
        return jax.jit(jax.grad(loss_fn))(params, x, labels)

    reference = jax.tree.leaves(grads("none", 0))
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(r.astype(jnp.float32))) for r in reference))
    errors = {}
    for strategy, k in variants:
        leaves = jax.tree.leaves(grads(strategy, k))
        diff = jnp.sqrt(
            sum(
                jnp.sum(jnp.square(a.astype(jnp.float32) - r.astype(jnp.float32)))
                for a, r in zip(leaves, reference)
            )  # fmt: skip
        )
        errors[f"{strategy}:{k}"] = float(diff / norm)
    return errors


def child(args, extra: list[str]) -> str:
    """Runs this script with ``extra`` in a fresh process; returns its last line."""
    argv = [
        os.path.abspath(__file__),
        f"--model={args.model}",
        f"--batch={args.batch}",
        f"--image-size={args.image_size}",
        f"--dtype={args.dtype}",
        f"--ks={args.ks}",
        f"--steps={args.steps}",
        "--remat" if args.remat else "--no-remat",
        *(["--flax-pool"] if args.flax_pool else []),
        *([f"--hlo-dir={args.hlo_dir}"] if args.hlo_dir else []),
        *extra,
    ]
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(extra)} failed with exit code {done.returncode}")
    return done.stdout.strip().splitlines()[-1]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args, args.one[0], int(args.one[1]))), flush=True)
        return
    ks = [int(k) for k in args.ks.split(",")]
    variants = [("none" if k == 0 else "offload", k) for k in ks]
    if args.remat:
        variants.append(("remat", 0))
    if args.grads:
        print(json.dumps(grad_errors(args, variants)), flush=True)
        return
    records = []
    for strategy, k in variants:
        print(f"[{time.strftime('%H:%M:%S')}] {strategy} k={k} ...", file=sys.stderr, flush=True)
        records.append(json.loads(child(args, ["--one", strategy, str(k)])))
        write(args.out, records)  # keep what is done if a later variant fails
    print(f"[{time.strftime('%H:%M:%S')}] gradients ...", file=sys.stderr, flush=True)
    errors = json.loads(child(args, ["--grads"]))
    command = "python benchmarks/offload_sweep.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    for r in records:
        r["grad_rel_err"] = errors[f"{r['strategy']}:{r['offloaded_blocks']}"]
        r["command"] = command
        r["host"] = platform.node()
    print_table(records)
    write(args.out, records)


def write(path: str | None, records: list[dict]) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(records, f, indent=1)
            f.write("\n")


def print_table(records: list[dict]) -> None:
    gib = lambda b: f"{b / 2**30:.2f}" if b is not None else "-"  # noqa: E731
    header = f"{'strategy':9} {'k':>3} {'temp GiB':>9} {'host GiB':>9} {'peak GiB':>9} {'d2h':>5} {'h2d':>5} {'step ms':>8} {'grad err':>9}"
    print(header)
    for r in records:
        print(
            f"{r['strategy']:9} {r['offloaded_blocks']:>3} {gib(r['compiled_temp_bytes']):>9} "
            f"{gib(r['compiled_host_temp_bytes']):>9} {gib(r['peak_bytes_in_use']):>9} "
            f"{r['device_to_host_copies']:>5} {r['host_to_device_copies']:>5} "
            f"{r['step_time_ms']:>8.1f} {r['grad_rel_err']:>9.2e}"
        )


if __name__ == "__main__":
    main()
