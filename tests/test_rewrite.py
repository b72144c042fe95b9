"""jaxoffload.rewrite: lean rules found in unmodified Flax code, exact where Flax's edge cases are."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from helpers import normal, rel_err

import jaxoffload
from jaxoffload import Lean, Offload
from jaxoffload._src import rewrite
from jaxoffload.bench.models import flax_resnet


def _rules(f, *args):
    notes = []
    jax.make_jaxpr(rewrite.with_lean_rules(f, notes))(*args)
    return [(n.rule, n.applied) for n in notes]


def test_relus_and_pools_are_found_where_a_reader_keeps_their_output():
    x, w = normal(0, (2, 8, 8, 3)), normal(1, (3, 3, 3, 4))
    conv = functools.partial(jax.lax.conv_general_dilated, window_strides=(1, 1), padding="SAME",
                             dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip
    # A ReLU read by a convolution, and one read only by a pool: fused with it.
    assert _rules(lambda x: nn.max_pool(nn.relu(conv(nn.relu(x), w)), (2, 2), (2, 2)), x) == [
        ("relu", True), ("relu", True), ("relu_max_pool", True),
    ]  # fmt: skip
    # A ReLU read by something that keeps nothing of it keeps jax's one-byte mask.
    assert _rules(lambda x: nn.relu(x) * 2, x) == [("relu", False)]
    # jnp.maximum is not jax.nn.relu: its gradient at 0 is 1/2, so it is left alone.
    assert _rules(lambda x: conv(jnp.maximum(x, 0.0), w), x) == []

    # A ReLU read by the pool and by another layer: not fused, each lean.
    def shared(x):
        y = nn.relu(conv(x, w))
        return nn.max_pool(y, (2, 2), (2, 2)) + y[:, ::2, ::2]

    assert _rules(shared, x) == [("relu", True), ("max_pool", True)]


def test_pools_the_rules_do_not_take_keep_jax_s_and_say_why():
    x = normal(0, (2, 8, 8, 3))
    dilated = lambda x: jax.lax.reduce_window(  # noqa: E731
        x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "VALID", window_dilation=(1, 2, 2, 1)
    )

    def across(x):
        return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 1, 3), (1,) * 4, "VALID")

    notes = []
    for f in (dilated, across):
        jax.make_jaxpr(rewrite.with_lean_rules(f, notes))(x)
    assert [(n.applied, n.why) for n in notes] == [
        (False, "dilated"), (False, "the window spans the batch or feature dimension"),
    ]  # fmt: skip
    assert str(notes[0]).endswith("max_pool, jax's rule (dilated)")


def test_a_lean_call_lists_the_rules_it_used():
    x = normal(0, (2, 8, 8, 3))
    f = jaxoffload.wrap(lambda x: nn.max_pool(nn.relu(x), (2, 2), (2, 2)), Offload())
    (call,) = jaxoffload.offloaded_calls(jax.grad(lambda x: f(x).sum()), x)
    assert [n.rule for n in call.rewrites if n.applied] == ["relu", "relu_max_pool"]
    # The pool keeps its output and a one-byte index, not its input (four times larger).
    assert sorted((str(r.dtype), r.shape) for r in call.residuals) == [
        ("float32", (2, 4, 4, 3)), ("int8", (2, 4, 4, 3)),
    ]  # fmt: skip


class ImageNetBlock(nn.Module):
    """Flax's ImageNet bottleneck, with its edge cases set by the test."""

    train: bool = True
    dtype: object = jnp.float32
    param_dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        norm = functools.partial(
            nn.BatchNorm, use_running_average=not self.train, momentum=0.9, epsilon=1e-5,
            dtype=self.dtype, param_dtype=self.param_dtype,
        )  # fmt: skip
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype,
                                 param_dtype=self.param_dtype)  # fmt: skip
        block = flax_resnet.BottleneckResNetBlock(
            4, conv=conv, norm=norm, act=nn.relu, strides=(2, 2)
        )
        return block(x)


# The rules are Lean's; Offload places the same residuals elsewhere, so it runs one case.
@pytest.mark.parametrize(
    ("strategy", "train", "dtype", "param_dtype"),
    [
        (Lean(), True, jnp.float32, jnp.float32),
        (Lean(), False, jnp.float32, jnp.float32),  # use_running_average: eval mode
        (Lean(), True, jnp.bfloat16, jnp.float32),  # bf16 compute, f32 parameters
        (Lean(), True, jnp.float32, jnp.bfloat16),  # the other mix
        (Offload(), True, jnp.float32, jnp.float32),
    ],
    ids=["lean", "lean-eval", "lean-bf16", "lean-bf16-params", "offload"],
)
def test_lean_rules_are_exact_at_flax_s_edge_cases(strategy, train, dtype, param_dtype):
    x = normal(0, (2, 8, 8, 8), dtype)
    plain = ImageNetBlock(train, dtype, param_dtype)
    variables = plain.init(jax.random.key(0), x)
    # Flax's ImageNet example starts the last BatchNorm's scale at zero.
    initial = variables["params"]
    assert not jnp.any(initial["BottleneckResNetBlock_0"]["BatchNorm_2"]["scale"])
    wrapped = jaxoffload.linen.wrap(ImageNetBlock, strategy)(train, dtype, param_dtype)

    def grads(model, params):
        def loss(params):
            y, state = model.apply({**variables, "params": params}, x, mutable=["batch_stats"])
            return jnp.sum(jnp.sin(y.astype(jnp.float32))), state

        return jax.jit(jax.grad(loss, has_aux=True))(params)

    # At the zero scale itself, and away from it.
    for params in (initial, jax.tree.map(lambda p: p + 0.1, initial)):
        (got, got_state), (ref, ref_state) = grads(wrapped, params), grads(plain, params)
        bound = 1e-6 if dtype == param_dtype == jnp.float32 else 1e-2
        assert rel_err(got, ref) <= bound
        assert rel_err(got_state, ref_state) <= bound
