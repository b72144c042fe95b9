"""Time ways to compute a max-pool's input gradient from its one-byte window index, on a GPU.

    python benchmarks/pool_probe.py OUT.json [--shape 256,112,112,64]

The pool is ResNet's stem pool (3x3 window, stride 2, padding 1; bf16). Each way runs
jitted, alone; the figure is the median of 30 runs after one to compile. Every way must
give the same gradient (`max_abs_diff` against the first, exactly 0). The ways:

- `phases`, `padding`: `jaxoffload.layers._Pool`'s two XLA routes (the library uses
  phases where windows overlap, padding where they do not);
- `kernel` (GPUs only): the Pallas kernel that the library uses for this pool on CUDA
  (`jaxoffload._pool_kernel`);
- `phases_per_dim`: phases interleaved one dimension at a time, without a transpose;
- `wide_bitcast`: every window position's share broadcast into a (batch, q, r, q, r,
  channels) array that reshapes to the input's shape without moving data;
- `flax`: the backward pass of `flax.linen.max_pool(relu(x))`, XLA's select-and-scatter.
"""

import argparse
import itertools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxoffload import _pool_kernel, layers
from jaxoffload.benchmark import _median_ms


def route_phases_per_dim(pool, g, first, shape):
    phases, _ = pool._phases(g, first, shape)

    def interleave(prefix):
        dim = len(prefix)
        if dim == len(pool.strides):
            return phases[prefix]
        x = jnp.stack([interleave((*prefix, r)) for r in range(pool.strides[dim])], 2 + dim)
        shape_ = list(x.shape)
        return x.reshape(
            shape_[: 1 + dim] + [shape_[1 + dim] * shape_[2 + dim]] + shape_[3 + dim :]
        )

    return pool._unpad(interleave(()), shape)


def route_wide_bitcast(pool, g, first, shape):
    padded = pool._padded(shape)
    qs = [-(-size // s) for size, s in zip(padded, pool.strides)]
    zero = jnp.zeros((), g.dtype)
    wide = [g.shape[0], *(x for q, s in zip(qs, pool.strides) for x in (q, s)), g.shape[-1]]
    gx = jnp.zeros(wide, g.dtype)
    for n, offset in enumerate(itertools.product(*map(range, pool.window))):
        shifts = [o // s for o, s in zip(offset, pool.strides)]
        config = [(0, 0, 0)] + [(t, q - j - t, 0) for t, q, j in zip(shifts, qs, g.shape[1:-1])]
        share = jax.lax.pad(jnp.where(first == n, g, zero), zero, config + [(0, 0, 0)])
        share = share.reshape([g.shape[0], *(x for q in qs for x in (q, 1)), g.shape[-1]])
        mask = True
        for i, (o, s) in enumerate(zip(offset, pool.strides)):
            axis_shape = [1] * len(wide)
            axis_shape[2 + 2 * i] = s
            mask = mask & (jnp.arange(s).reshape(axis_shape) == o % s)
        gx = gx + jnp.where(mask, share, zero)
    gx = gx.reshape(g.shape[0], *(q * s for q, s in zip(qs, pool.strides)), g.shape[-1])
    return pool._unpad(gx, shape)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--shape", default="256,112,112,64")
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.shape.split(","))
    x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    window, strides, padding = (3, 3), (2, 2), ((1, 1), (1, 1))
    pool = layers._Pool.of(x, window, strides, padding)
    _, (pooled, first) = layers._relu_max_pool_fwd(x, pool, shape)
    g = jax.random.normal(jax.random.key(1), pooled.shape, jnp.bfloat16)
    ways = {
        "phases": lambda g, f: pool._route_by_phases(g, f, shape),
        "phases_per_dim": lambda g, f: route_phases_per_dim(pool, g, f, shape),
        "wide_bitcast": lambda g, f: route_wide_bitcast(pool, g, f, shape),
        "padding": lambda g, f: pool._route_by_padding(g, f, shape),
    }
    if jax.default_backend() == "gpu":
        ways["kernel"] = lambda g, f: _pool_kernel.route(g, f, shape)
    results, reference = {}, None
    for name, way in ways.items():
        f = jax.jit(way)
        out = f(g, first).astype(jnp.float32)
        reference = out if reference is None else reference
        diff = float(jnp.abs(out - reference).max())
        results[name] = {"ms": _median_ms(f, g, first, runs=30), "max_abs_diff": diff}
        print(name, results[name], flush=True)
    relu_pool = lambda x: nn.max_pool(nn.relu(x), window, strides=strides, padding=padding)  # noqa: E731
    results["flax"] = {"ms": _median_ms(jax.jit(jax.vjp(relu_pool, x)[1]), g, runs=30)}
    print("flax", results["flax"], flush=True)
    results["device"] = str(jax.devices()[0].device_kind)
    results["jax"] = jax.__version__
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
