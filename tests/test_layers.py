"""jaxoffload.layers: the values and gradients of jax and flax, from fewer residuals."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import jax_residuals, rel_err
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from jaxoffload._src import pool_kernel
from jaxoffload._src.layers import Pool, first_max, max_pool, relu, relu_max_pool
from jaxoffload.bench.layers import (
    BatchNorm,
    batch_norm,
    batch_norm_relu_conv,
    conv_after,
    residual_tail,
    tail_conv,
)


@st.composite
def pool_cases(draw):
    """A random NHWC input, odd sizes included, a pool that fits it, and a seed.

    Strides up to the window's (overlapping windows when smaller) and every
    kind of padding: "VALID", "SAME" and explicit pairs.
    """
    shape = (draw(st.integers(1, 3)), draw(st.integers(2, 11)), draw(st.integers(2, 11)),
             draw(st.integers(1, 4)))  # fmt: skip
    window = draw(st.sampled_from([(2, 2), (3, 3), (2, 1), (1, 3), (3, 2)]))
    window = tuple(min(w, s) for w, s in zip(window, shape[1:3]))
    strides = tuple(draw(st.integers(1, w)) for w in window)
    padding = draw(
        st.one_of(
            st.sampled_from(["VALID", "SAME"]),
            st.tuples(*[st.tuples(st.integers(0, w - 1), st.integers(0, w - 1)) for w in window]),
        )
    )
    seed = draw(st.integers(0, 2**16))
    return jax.random.normal(jax.random.key(seed), shape), (window, strides, padding), seed


def _check_pool_against_flax(ours, flax, x, seed):
    assert rel_err(ours(x), flax(x)) == 0.0
    ct = jax.random.normal(jax.random.key(seed + 1), flax(x).shape)
    grad = lambda f: jax.jit(jax.grad(lambda x: jnp.sum(f(x) * ct)))(x)  # noqa: E731
    assert rel_err(grad(ours), grad(flax)) <= 1e-6


@settings(deadline=None, max_examples=5)
@given(pool_cases())
def test_matches_flax_max_pool(case):
    x, (window, strides, padding), seed = case
    ours = lambda x: max_pool(x, window, strides, padding)  # noqa: E731
    flax = lambda x: nn.max_pool(x, window, strides=strides, padding=padding)  # noqa: E731
    _check_pool_against_flax(ours, flax, x, seed)


def test_ties_go_to_the_first_element_of_the_window():
    x = jnp.array([[1.0, 1.0], [1.0, 0.0]]).reshape(1, 2, 2, 1)
    g = jax.grad(lambda x: max_pool(x, (2, 2), (2, 2)).sum())(x)
    np.testing.assert_array_equal(g[0, :, :, 0], [[1.0, 0.0], [0.0, 0.0]])


def test_overlapping_windows_add_their_gradients():
    # 3 wide, stride 2: the middle element is the maximum of both windows.
    x = jnp.array([0.0, 1.0, 5.0, 2.0, 3.0]).reshape(1, 5, 1, 1)
    g = jax.grad(lambda x: max_pool(x, (3, 1), (2, 1)).sum())(x)
    np.testing.assert_array_equal(g[0, :, 0, 0], [0.0, 0.0, 2.0, 0.0, 0.0])


@pytest.mark.parametrize("window, strides", [((2, 2), (2, 2)), ((3, 3), (2, 2))])
def test_backward_keeps_no_input_sized_index_tensor(window, strides):
    x = jnp.ones((2, 8, 8, 4), jnp.bfloat16)
    pool = lambda x: max_pool(x, window, strides, "SAME")  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: pool(x).astype(jnp.float32).sum()))(x)
    integer_shapes = {
        v.aval.shape
        for eqn in jaxpr.jaxpr.eqns
        for v in eqn.outvars
        if jnp.issubdtype(v.aval.dtype, jnp.integer)
    }
    assert integer_shapes <= {(2, 4, 4, 4)}  # one small index per pooled element at most
    assert "select_and_scatter" not in str(jaxpr) and "select_and_gather" not in str(jaxpr)


@settings(deadline=None, max_examples=4)  # each example compiles the interpreter anew
@given(
    st.tuples(st.integers(1, 2), st.integers(1, 5), st.integers(1, 5), st.integers(1, 9)),
    st.sampled_from([jnp.bfloat16, jnp.float32]),
    st.integers(0, 2**16),
)
def test_pool_kernel_gives_the_xla_routes_values(half_shape, dtype, seed):
    """The Pallas kernel (run by its interpreter here) against the phases, bit for bit.

    Small integer inputs tie often; the cotangents span 13 binades, so sums round.
    """
    batch, rows, cols, channels = half_shape
    shape = (batch, 2 * rows, 2 * cols, channels)
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.randint(keys[0], shape, -2, 3).astype(dtype)
    pool = Pool.of(x, (3, 3), (2, 2), ((1, 1), (1, 1)))
    first = first_max(pool.slices(x))
    scale = 2.0 ** jax.random.randint(keys[1], first.shape, -6, 7)
    g = (jax.random.normal(keys[2], first.shape) * scale).astype(dtype)
    got = pool_kernel.route(g, first, shape, interpret=True)
    want = pool.route_by_phases(g, first, shape)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize(
    "shape, padding, kernel",
    [
        ((2, 8, 8, 4), ((1, 1), (1, 1)), True),  # ResNet's stem pool
        ((2, 7, 8, 4), ((1, 1), (1, 1)), False),  # odd height
        ((2, 8, 8, 4), "SAME", False),  # padding (0, 1)
    ],
)
def test_the_stem_pool_routes_by_the_kernel_on_cuda(shape, padding, kernel):
    x = jnp.ones(shape, jnp.bfloat16)
    pool = lambda x: relu_max_pool(x, (3, 3), (2, 2), padding)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: pool(x).astype(jnp.float32).sum()))(x))
    assert ("pallas_call" in jaxpr) == kernel
    assert ("platform_index" in jaxpr) == kernel  # the XLA route elsewhere


@pytest.mark.parametrize(
    "x, kwargs",
    [
        (jnp.arange(36.0).reshape(6, 6, 1), {}),  # no batch dimension
        (jnp.arange(36).reshape(1, 6, 6, 1), {}),  # integers: no -inf to pad with
        (jnp.arange(36.0).reshape(1, 6, 6, 1), {"padding": ((3, 0), (0, 0))}),  # a padded window
    ],
)
def test_what_the_lean_rules_do_not_take_falls_back_to_flax(x, kwargs):
    np.testing.assert_array_equal(
        max_pool(x, (3, 3), (1, 1), **kwargs), nn.max_pool(x, (3, 3), (1, 1), **kwargs)
    )
    assert "reduce_window" in str(
        jax.make_jaxpr(lambda x: max_pool(x, (3, 3), (1, 1), **kwargs))(x)
    )


@settings(deadline=None, max_examples=6)
@given(
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=4),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_relu_matches_jax(shape, dtype, seed):
    x = jax.random.normal(jax.random.key(seed), shape, dtype)
    x = x.at[(0,) * len(shape)].set(0)  # the kink: both give gradient 0 there
    ct = jax.random.normal(jax.random.key(seed + 1), shape, dtype)
    assert rel_err(relu(x), jax.nn.relu(x)) == 0.0
    ours = jax.grad(lambda x: jnp.sum(relu(x) * ct).astype(jnp.float32))(x)
    ref = jax.grad(lambda x: jnp.sum(jax.nn.relu(x) * ct).astype(jnp.float32))(x)
    assert rel_err(ours, ref) == 0.0


def test_relu_keeps_no_mask_of_its_own():
    # conv -> relu -> pool: jax.nn.relu adds a bool mask beside the pool's input;
    # the lean relu's residual *is* the pool's input, so nothing is added.
    w = jax.random.normal(jax.random.key(0), (3, 3, 2, 4))

    def block(act):
        def f(w, x):
            y = jax.lax.conv_general_dilated(
                x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
            )
            return max_pool(act(y), (2, 2), (2, 2)).sum()

        return f

    x = jax.random.normal(jax.random.key(1), (2, 6, 6, 2))
    dtypes = lambda act: sorted(dtype for dtype, _, _ in jax_residuals(block(act), w, x))  # noqa: E731
    # jax.nn.relu: the convolution's output, the pool's input and a mask; the
    # lean relu: only the pool's input, which is also its mask.
    assert dtypes(jax.nn.relu) == ["bool", "float32", "float32"]
    assert dtypes(relu) == ["float32"]


@settings(deadline=None, max_examples=5)
@given(pool_cases())
def test_relu_max_pool_matches_flax(case):
    x, (window, strides, padding), seed = case
    ours = lambda x: relu_max_pool(x, window, strides, padding)  # noqa: E731
    flax = lambda x: nn.max_pool(jax.nn.relu(x), window, strides=strides, padding=padding)  # noqa: E731
    _check_pool_against_flax(ours, flax, x, seed)


def test_relu_max_pool_keeps_only_a_byte_index_beside_its_output():

    x = jax.random.normal(jax.random.key(0), (2, 8, 8, 4), jnp.bfloat16)
    for pool in ((2, 2), (2, 2), "VALID"), ((3, 3), (2, 2), "SAME"):  # ResNet's stem pool last
        f = lambda x: relu_max_pool(x, *pool).astype(jnp.float32).sum()  # noqa: B023, E731
        residuals = sorted((dtype, shape) for dtype, shape, _ in jax_residuals(f, x))
        assert residuals == [("bfloat16", (2, 4, 4, 4)), ("int8", (2, 4, 4, 4))]
    # A window with no positive value passes no gradient, as through jax.nn.relu.
    negative = -jnp.ones((1, 2, 2, 1))
    assert (
        float(jnp.abs(jax.grad(lambda x: relu_max_pool(x, (2, 2), (2, 2)).sum())(negative)).sum())
        == 0
    )


@st.composite
def norm_cases(draw):
    """NHWC shapes, odd sizes included, with at least 3 values per channel.

    With 2 values per channel the input gradient is zero in exact arithmetic,
    so both implementations return rounding noise and no relative error means anything.
    """
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 9)), draw(st.integers(1, 9)),
             draw(st.integers(1, 8)))  # fmt: skip
    assume(shape[0] * shape[1] * shape[2] >= 3)
    return shape, draw(st.booleans()), draw(st.integers(0, 2**16))


@settings(deadline=None, max_examples=5)
@given(norm_cases())
def test_batch_norm_matches_flax(case):
    shape, fused_relu, seed = case
    keys = jax.random.split(jax.random.key(seed), 4)
    x = 3 * jax.random.normal(keys[0], shape) + 1
    params = {
        "scale": jax.random.normal(keys[1], shape[-1:]),
        "bias": jnp.linspace(-1, 1, shape[-1]),
    }
    ct = jax.random.normal(keys[2], shape)
    flax_norm = nn.BatchNorm(use_running_average=False, momentum=0.9)
    lean_norm = BatchNorm(use_running_average=False, momentum=0.9, relu=fused_relu)
    stats = flax_norm.init(keys[3], x)["batch_stats"]
    assert jax.tree.structure(lean_norm.init(keys[3], x)) == jax.tree.structure(
        {"batch_stats": stats, "params": params}
    )

    def run(module, activation):
        def loss(params, x):
            y, new = module.apply(
                {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
            )
            y = activation(y)
            return jnp.sum(y * ct), (y, new)

        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    (ref_grads, (ref_y, ref_stats)) = run(flax_norm, jax.nn.relu if fused_relu else (lambda y: y))
    (grads, (y, new_stats)) = run(lean_norm, lambda y: y)
    assert rel_err(y, ref_y) == 0.0
    assert rel_err(new_stats, ref_stats) == 0.0
    assert rel_err(grads, ref_grads) <= 1e-6


def test_batch_norm_in_eval_mode_matches_flax():
    x = jax.random.normal(jax.random.key(0), (2, 3, 3, 4))
    variables = nn.BatchNorm(use_running_average=True).init(jax.random.key(1), x)
    variables = jax.tree.map(lambda v: v + 0.5, variables)
    ref = jax.nn.relu(nn.BatchNorm(use_running_average=True).apply(variables, x))
    assert rel_err(BatchNorm(use_running_average=True, relu=True).apply(variables, x), ref) <= 1e-7


def test_batch_norm_statistics_have_gradients():
    # mean and var are outputs too; a user may differentiate them.
    x = jax.random.normal(jax.random.key(0), (5, 3))

    def stats(f):
        def g(x):
            mean, var = f(x)
            return jnp.sum(jnp.sin(mean)) + jnp.sum(jnp.cos(var))

        return jax.grad(g)(x)

    ours = stats(lambda x: batch_norm(x, jnp.ones(3), jnp.zeros(3))[1:])
    ref = stats(lambda x: (x.mean(0), (x * x).mean(0) - x.mean(0) ** 2))
    assert rel_err(ours, ref) <= 1e-6


def test_batch_norm_keeps_its_input_in_its_own_dtype_and_nothing_else_large():
    x = jnp.ones((4, 8, 8, 16), jnp.bfloat16)
    f = lambda x, s, b: batch_norm(x, s, b, relu=True)[0].astype(jnp.float32).sum()  # noqa: E731
    residuals = jax_residuals(f, x, jnp.ones(16), jnp.zeros(16), keep_arguments="x")
    large = [(dtype, shape) for dtype, shape, _ in residuals if np.prod(shape) > 16]
    assert large == [("bfloat16", x.shape)]
    # flax's BatchNorm followed by a ReLU keeps float32 copies and a mask.
    module = nn.BatchNorm(use_running_average=False, dtype=jnp.bfloat16)
    variables = module.init(jax.random.key(0), x)

    def plain(v, x):
        y = jax.nn.relu(module.apply(v, x, mutable=["batch_stats"])[0])
        return y.astype(jnp.float32).sum()

    plain_bytes = sum(np.prod(shape) * np.dtype(dtype).itemsize
                      for dtype, shape, _ in jax_residuals(plain, variables, x))  # fmt: skip
    assert plain_bytes >= 3 * x.nbytes


@settings(deadline=None, max_examples=7)
@given(
    size=st.integers(3, 9),
    stride=st.sampled_from([1, 2]),
    padding=st.sampled_from(["SAME", "VALID", 1]),
    seed=st.integers(0, 2**16),
)
def test_convolution_already_keeps_only_its_input_and_kernel(size, stride, padding, seed):
    # No custom rule is needed for a convolution: jax's own keeps exactly these.
    conv = nn.Conv(4, (3, 3), strides=stride, padding=padding, use_bias=False)
    x = jax.random.normal(jax.random.key(seed), (2, size, size + 1, 3))
    variables = conv.init(jax.random.key(1), x)
    from jax._src.ad_checkpoint import saved_residuals

    residuals = saved_residuals(lambda v, x: conv.apply(v, x).sum(), variables, x)
    assert sorted(aval.shape for aval, _ in residuals) == [(2, size, size + 1, 3), (3, 3, 3, 4)]


def test_average_pooling_keeps_nothing_but_a_scalar():
    # Its gradient is linear in the cotangent: no custom rule is needed either.
    x = jax.random.normal(jax.random.key(0), (2, 7, 7, 3))
    f = lambda x: jnp.sin(nn.avg_pool(x, (2, 2), strides=(2, 2), padding="SAME")).sum()  # noqa: E731
    # A scalar (the window's size) and the sine's cosine: the pool keeps no tensor.
    assert [shape for _, shape, _ in jax_residuals(f, x)] == [(), (2, 4, 4, 3)]


@st.composite
def norm_conv_cases(draw):
    """A BatchNorm, ReLU and convolution: odd sizes, stride 2 and padding included."""
    shape, _, seed = draw(norm_cases())
    kernel = draw(st.sampled_from([1, 3]))
    assume(shape[1] >= kernel and shape[2] >= kernel)
    conv = {
        "strides": draw(st.sampled_from([1, 2])),
        "padding": draw(st.sampled_from(["SAME", "VALID", 1])),
    }
    return shape, (kernel, kernel), conv, seed


class _NormReluConv(nn.Module):
    """Conv(relu(BatchNorm(x))) with flax's layers, or through ``conv_after``."""

    lean: bool
    kernel_size: tuple[int, int]
    conv: dict

    @nn.compact
    def __call__(self, x):
        options = {"use_running_average": False, "momentum": 0.9}
        conv = functools.partial(nn.Conv, 3, self.kernel_size, use_bias=False, **self.conv)
        if self.lean:
            return conv(conv_general_dilated=conv_after(BatchNorm(relu=True, **options)))(x)
        return conv()(jax.nn.relu(nn.BatchNorm(**options)(x)))


@settings(deadline=None, max_examples=4)
@given(norm_conv_cases())
def test_batch_norm_relu_conv_matches_flax(case):
    shape, kernel_size, conv, seed = case
    keys = jax.random.split(jax.random.key(seed), 3)
    x = 3 * jax.random.normal(keys[0], shape) + 1
    plain = _NormReluConv(False, kernel_size, conv)
    lean = _NormReluConv(True, kernel_size, conv)
    variables = plain.init(keys[1], x)
    assert jax.tree.structure(lean.init(keys[1], x)) == jax.tree.structure(variables)
    variables = jax.tree.map(lambda v: v + 0.1 * jax.random.normal(keys[2], v.shape), variables)

    def run(module):
        def loss(params, x):
            state = {"batch_stats": variables["batch_stats"]}
            y, new = module.apply({"params": params, **state}, x, mutable=["batch_stats"])
            return jnp.sum(jnp.sin(y)), (y, new)

        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(variables["params"], x)

    (ref_grads, (ref_y, ref_stats)), (grads, (y, stats)) = run(plain), run(lean)
    assert rel_err(y, ref_y) <= 1e-6
    assert rel_err(stats, ref_stats) == 0.0
    assert rel_err(grads, ref_grads) <= 1e-6


def test_batch_norm_relu_conv_keeps_its_input_but_not_the_convolutions():
    x = jnp.ones((4, 8, 8, 16), jnp.bfloat16)
    kernel = jnp.ones((3, 3, 16, 32), jnp.bfloat16)
    conv = {"window_strides": (1, 1), "padding": "SAME",
            "dimension_numbers": ("NHWC", "HWIO", "NHWC")}  # fmt: skip

    def fused(x, s, b, k):
        return batch_norm_relu_conv(x, s, b, k, **conv)[0].astype(jnp.float32).sum()

    def unfused(x, s, b, k):
        y = jax.lax.conv_general_dilated(batch_norm(x, s, b, relu=True)[0], k, **conv)
        return y.astype(jnp.float32).sum()

    def large(f):
        residuals = jax_residuals(f, x, jnp.ones(16), jnp.zeros(16), kernel, keep_arguments="x")
        return [shape for _, shape, _ in residuals if np.prod(shape) > 16]

    assert large(fused) == [x.shape]
    assert large(unfused) == [x.shape, x.shape]  # the BatchNorm's input and the conv's


def test_conv_after_needs_a_relu_and_matches_flax_in_eval_mode():
    x = jax.random.normal(jax.random.key(0), (2, 5, 5, 4))

    class Block(nn.Module):
        lean: bool
        relu: bool = True

        @nn.compact
        def __call__(self, x):
            conv = functools.partial(nn.Conv, 3, (3, 3), use_bias=False)
            if self.lean:
                norm = BatchNorm(use_running_average=True, relu=self.relu)
                return conv(conv_general_dilated=conv_after(norm))(x)
            return conv()(jax.nn.relu(nn.BatchNorm(use_running_average=True)(x)))

    variables = Block(False).init(jax.random.key(1), x)
    variables = jax.tree.map(lambda v: v + 0.5, variables)
    assert rel_err(Block(True).apply(variables, x), Block(False).apply(variables, x)) <= 1e-6
    with pytest.raises(ValueError, match="only with relu=True"):
        Block(True, relu=False).apply(variables, x)


class _Tail(nn.Module):
    """``relu(BatchNorm(Conv(relu(BatchNorm(x)))) + s)``, ``s`` the shortcut or its own BatchNorm."""

    lean: bool
    kernel_size: tuple[int, int]
    conv: dict
    norm_shortcut: bool
    train: bool = True

    @nn.compact
    def __call__(self, x, shortcut):
        options = {"use_running_average": not self.train, "momentum": 0.9}
        conv = functools.partial(nn.Conv, 3, self.kernel_size, use_bias=False, **self.conv)
        if self.lean:
            before, after = BatchNorm(relu=True, **options), BatchNorm(**options)
            shortcut_norm = BatchNorm(**options) if self.norm_shortcut else None
            return conv(conv_general_dilated=tail_conv(before, after, shortcut, shortcut_norm))(x)
        before, after = nn.BatchNorm(**options), nn.BatchNorm(**options)
        y = after(conv()(jax.nn.relu(before(x))))
        return jax.nn.relu(
            y + (nn.BatchNorm(**options)(shortcut) if self.norm_shortcut else shortcut)
        )


@settings(deadline=None, max_examples=2)
@given(norm_conv_cases(), st.booleans())
# Batch 1 at 2x2: in float32 flax itself is 2e-6 off the exact gradient here.
@example(((1, 2, 2, 1), (1, 1), {"strides": 1, "padding": "SAME"}, 5814), False)
def test_residual_tail_matches_flax(case, norm_shortcut):
    # In float64, so that the bounds test the rule's algebra, not rounding.
    # With a BatchNorm over a few values, the kernel's gradient is a sum that
    # cancels almost to zero (the loss hardly depends on the kernel's scale):
    # in float32 flax's own error against float64 reaches 2e-6 at batch 1,
    # 2x2, and the rule's is the same (over 300 draws); in float64 those
    # errors are near 1e-15, far below any bound that a wrong rule could meet.
    with jax.enable_x64(True):
        _check_residual_tail(case, norm_shortcut)


def _check_residual_tail(case, norm_shortcut):
    shape, kernel_size, conv, seed = case
    keys = jax.random.split(jax.random.key(seed), 6)
    x = 3 * jax.random.normal(keys[0], shape) + 1
    conv_out = nn.Conv(3, kernel_size, use_bias=False, **conv).init_with_output(keys[1], x)[0]
    # The BatchNorm after the convolution needs 3 values per channel too (see norm_cases).
    assume(conv_out.size // conv_out.shape[-1] >= 3)
    shortcut = jax.random.normal(keys[2], conv_out.shape)
    plain, lean = (_Tail(lean, kernel_size, conv, norm_shortcut) for lean in (False, True))
    variables = plain.init(keys[3], x, shortcut)
    assert jax.tree.structure(lean.init(keys[3], x, shortcut)) == jax.tree.structure(variables)
    # Float64 variables too: flax makes float32 parameters whatever the input.
    variables = jax.tree.map(
        lambda v: v.astype(x.dtype) + 0.1 * jax.random.normal(keys[4], v.shape), variables
    )
    ct = jax.random.normal(keys[5], conv_out.shape)

    def run(module):
        def loss(params, x, shortcut):
            state = {"batch_stats": variables["batch_stats"]}
            y, new = module.apply({"params": params, **state}, x, shortcut, mutable=["batch_stats"])
            return jnp.sum(y * ct), (y, new)

        grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
        return jax.jit(grad)(variables["params"], x, shortcut)

    (ref_grads, (ref_y, ref_stats)), (grads, (y, stats)) = run(plain), run(lean)
    assert rel_err(y, ref_y) <= 1e-12
    assert rel_err(stats, ref_stats) == 0.0
    assert rel_err(grads, ref_grads) <= 1e-12
    # Eval mode: the running statistics, no custom rule.
    evaluate = lambda lean: _Tail(lean, kernel_size, conv, norm_shortcut, train=False).apply(  # noqa: E731
        variables, x, shortcut
    )
    assert rel_err(evaluate(True), evaluate(False)) <= 1e-12


@pytest.mark.parametrize("norm_shortcut", [False, True])
def test_residual_tail_keeps_its_input_and_output_not_the_convolutions(norm_shortcut):
    x, kernel = jnp.ones((4, 8, 8, 16), jnp.bfloat16), jnp.ones((1, 1, 16, 64), jnp.bfloat16)
    shortcut = jnp.ones((4, 8, 8, 64), jnp.bfloat16)
    ones, zeros = jnp.ones(64), jnp.zeros(64)
    conv = {"window_strides": (1, 1), "padding": "SAME",
            "dimension_numbers": ("NHWC", "HWIO", "NHWC")}  # fmt: skip
    normalise = {"shortcut_scale": ones, "shortcut_bias": zeros} if norm_shortcut else {}

    def tail(x, shortcut, kernel):
        y = residual_tail(
            x, shortcut, ones[:16], zeros[:16], kernel, ones, zeros, **normalise, **conv
        )[0]
        return y.astype(jnp.float32).sum()

    residuals = jax_residuals(tail, x, shortcut, kernel, keep_arguments=("x", "shortcut"))
    large = [shape for _, shape, _ in residuals if np.prod(shape) > 64]
    # Its input and its output; a normalised shortcut's input too. Not the
    # convolution's input or output, nor the sum.
    assert sorted(large) == sorted([x.shape, shortcut.shape] + [shortcut.shape] * norm_shortcut)


def test_residual_tail_arguments_are_checked():
    x = jnp.ones((1, 4, 4, 2))
    kernel, one, zero = jnp.ones((1, 1, 2, 2)), jnp.ones(2), jnp.zeros(2)
    conv = {"window_strides": (1, 1), "padding": "SAME",
            "dimension_numbers": ("NHWC", "HWIO", "NHWC")}  # fmt: skip
    with pytest.raises(ValueError, match="both shortcut_scale and shortcut_bias"):
        residual_tail(x, x, one, zero, kernel, one, zero, shortcut_scale=one, **conv)
    with pytest.raises(ValueError, match="the convolution gives"):
        residual_tail(x, x[:, :2], one, zero, kernel, one, zero, **conv)
    norm = functools.partial(BatchNorm, use_running_average=False)
    with pytest.raises(ValueError, match="before.relu=True"):
        tail_conv(norm(), norm(), x)
    with pytest.raises(ValueError, match="same epsilon"):
        tail_conv(norm(relu=True), norm(epsilon=0.1), x)
    with pytest.raises(ValueError, match="use_running_average set"):
        tail_conv(BatchNorm(relu=True), BatchNorm(), x)
