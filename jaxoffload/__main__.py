"""``python -m jaxoffload``: train a small VGG with offloaded blocks and show what moved.

It runs anywhere, CPU included. On a GPU the memory report shows the host
copies and the device memory saved; on CPU it says that host placement has no
effect there.
"""

from __future__ import annotations

import argparse
import time
import warnings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m jaxoffload", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.image_size < 32:
        parser.error("--batch and --steps must be at least 1, and --image-size at least 32")

    import jax
    import jax.numpy as jnp
    import optax

    import jaxoffload
    from jaxoffload import models
    from jaxoffload.report import analyze

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({jax.default_backend()})")
    x = jax.random.normal(jax.random.key(0), (args.batch, args.image_size, args.image_size, 3))
    labels = jax.random.randint(jax.random.key(1), (args.batch,), 0, 10)
    tx = optax.sgd(0.01, momentum=0.9)
    grads = {}
    for strategy in ("none", "offload"):
        model = models.VGG(
            models.VGG11, num_classes=10, classifier_width=64,
            block_strategies=models.first_k(strategy, 8, 8),
        )  # fmt: skip
        params = model.init(jax.random.key(2), x[:1])["params"]

        def loss_fn(params, x, labels, model=model):
            logits = model.apply({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        def train_step(params, opt_state, x, labels, loss_fn=loss_fn):
            loss, g = jax.value_and_grad(loss_fn)(params, x, labels)
            updates, opt_state = tx.update(g, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        step = jax.jit(train_step, donate_argnums=(0, 1))
        grads[strategy] = jax.jit(jax.grad(loss_fn))(params, x, labels)
        opt_state = tx.init(params)
        traced = step.trace(params, opt_state, x, labels)
        compiled = traced.lower().compile()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", jaxoffload.OffloadWarning)
            report = analyze(traced, compiled)
        start = time.perf_counter()
        for _ in range(args.steps):
            params, opt_state, loss = compiled(params, opt_state, x, labels)
        loss.block_until_ready()
        ms = (time.perf_counter() - start) / args.steps * 1e3
        print(
            f"\n== VGG11, blocks: {strategy}; loss after {args.steps} steps {float(loss):.4f}, {ms:.1f} ms/step"
        )
        print(report.summary())
        for w in caught:
            print(f"warning: {w.message}")

    block = jaxoffload.linen.offload(models.ConvBlock)(64, pool=True)
    variables = block.init(jax.random.key(0), x)
    residuals = jaxoffload.saved_residuals(
        jaxoffload.offload(lambda v, x: block.apply(v, x), device_argnums=0), variables, x
    )
    print("\n== residuals of the first block (conv 3x3, ReLU, max-pool):")
    for r in residuals:
        print(f"  {r}")
    leaves = zip(jax.tree.leaves(grads["offload"]), jax.tree.leaves(grads["none"]))
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in leaves)
    print(f"\nlargest gradient difference, offload vs none: {diff:.1e}")


if __name__ == "__main__":
    main()
