"""jaxoffload.offload as a function transform: values, gradients and placement."""

import warnings

import flax.linen as nn
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import host_copies, host_device_puts, jax_residuals, normal, rel_err
from hypothesis import given, settings
from jax.ad_checkpoint import checkpoint_name

import jaxoffload
from jaxoffload import Lean, Offload, Remat, Store, offload, saved_residuals, wrap

# ---- the layers: each is f(params, x) -> y --------------------------------------------


class ResidualBlock(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the shortcut, then ReLU."""

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(x.shape[-1], (3, 3), use_bias=False)(x)
        y = nn.relu(nn.BatchNorm(use_running_average=False)(y))
        y = nn.Conv(x.shape[-1], (3, 3), use_bias=False)(y)
        y = nn.BatchNorm(use_running_average=False)(y)
        return nn.relu(x + y)


class ConvBNReLU(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.Conv(8, (3, 3), strides=(2, 2), use_bias=False)(x)
        return nn.relu(nn.BatchNorm(use_running_average=False)(y))


LAYERS = {
    "dense": (nn.Dense(16), (8, 24)),
    "conv": (nn.Conv(8, (3, 3), padding="SAME"), (2, 9, 9, 3)),
    "conv_bn_relu": (ConvBNReLU(), (2, 9, 9, 3)),
    "residual_block": (ResidualBlock(), (2, 8, 8, 6)),
}


def _layer(name):
    module, shape = LAYERS[name]
    x = normal(0, shape)
    variables = module.init(jax.random.key(1), x)
    params = variables["params"]
    state = {k: v for k, v in variables.items() if k != "params"}

    def f(params, x):
        # Batch statistics are computed from the batch; the updated state is an
        # output, as in a training step.
        return module.apply({"params": params, **state}, x, mutable=list(state))

    return f, params, x


TRANSFORMS = {
    "identity": lambda f: f,
    "checkpoint": jax.checkpoint,
    "store": lambda f: wrap(f, Store()),
    "remat": lambda f: wrap(f, Remat(jax.checkpoint_policies.dots_saveable)),
    "lean": lambda f: wrap(f, Lean(), device_argnums=0),
    "lean_no_recompute": lambda f: wrap(f, Lean(max_recompute=0)),
    "offload": offload,
    "offload_device_params": offload(device_argnums=0),
    "offload_min_bytes": offload(min_bytes=1024),
    "offload_recompute": offload(recompute=True),
}


def _loss(f):
    def loss(params, x):
        y, _ = f(params, x)
        return jnp.sum(jnp.sin(y))

    return loss


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_gradients_match_plain(layer, transform):
    f, params, x = _layer(layer)
    g = TRANSFORMS[transform](f)
    grad = lambda fn: jax.jit(jax.value_and_grad(_loss(fn), argnums=(0, 1)))  # noqa: E731
    (value, grads), (ref_value, ref_grads) = grad(g)(params, x), grad(f)(params, x)
    assert rel_err(value, ref_value) <= 1e-6
    assert rel_err(grads, ref_grads) <= 1e-6
    # Non-differentiated outputs (BatchNorm's new statistics) match too.
    assert rel_err(jax.jit(g)(params, x), jax.jit(f)(params, x)) <= 1e-6


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_forward_places_residuals_in_host_memory(layer):
    f, params, x = _layer(layer)
    g = offload(f, device_argnums=0)
    moved = [r for r in saved_residuals(g, params, x) if r.placement == "pinned_host"]
    assert moved, "every layer here has activations to move"
    jaxpr = jax.make_jaxpr(jax.grad(_loss(g), argnums=(0, 1)))(params, x)
    assert host_device_puts(jaxpr) == host_copies(moved)
    # The values stored for the backward pass are typed as host memory.
    assert str(jaxpr).count("<host>") >= host_copies(moved)
    # and the plain function places nothing, nor does a lean one.
    assert host_device_puts(jax.make_jaxpr(jax.grad(_loss(f), argnums=(0, 1)))(params, x)) == 0
    lean = wrap(f, Lean(), device_argnums=0)
    assert host_device_puts(jax.make_jaxpr(jax.grad(_loss(lean), argnums=(0, 1)))(params, x)) == 0


@pytest.mark.parametrize("layer", ["conv_bn_relu", "residual_block"])
def test_lean_keeps_fewer_bytes_than_jax_and_offload_moves_no_more(layer):
    from helpers import jax_residuals

    f, params, x = _layer(layer)
    plain = sum(
        np.prod(shape) * np.dtype(dtype).itemsize
        for dtype, shape, _ in jax_residuals(_loss(f), params, x, keep_arguments="x")
    )
    lean = saved_residuals(wrap(f, Lean(), device_argnums=0), params, x)
    lean_bytes = sum(r.nbytes for r in lean if r.reason != "argument in device_argnums")
    assert lean_bytes < plain
    moved = saved_residuals(offload(f, device_argnums=0), params, x)
    assert sum(r.nbytes for r in moved if r.placement == "pinned_host") <= lean_bytes
    # BatchNorm's float32 copies are recomputed: what stays is the input, the
    # convolutions' outputs and per-channel vectors.
    assert all(r.dtype == x.dtype for r in lean)


def test_which_residuals_move_follows_the_rules():
    w, x = normal(0, (32, 32)), normal(1, (4, 32))
    f = lambda w, x: jnp.tanh(x @ w)  # noqa: E731
    everything = saved_residuals(offload(f), w, x)
    assert {r.placement for r in everything} == {"pinned_host"}
    kept = saved_residuals(offload(f, device_argnums=0), w, x)
    assert [(r.shape, r.placement, r.reason) for r in kept if r.placement == "device"] == [
        ((32, 32), "device", "argument in device_argnums")
    ]
    small = saved_residuals(offload(f, min_bytes=4 * 32 * 32), w, x)
    assert all(r.placement == "device" for r in small if r.nbytes < 4 * 32 * 32)
    assert [r.shape for r in small if r.placement == "pinned_host"] == [(32, 32)]


def test_cheap_values_are_recomputed_not_kept():
    # exp(sin(x)) * 3: every value is elementwise in x, which is kept anyway.
    f = lambda x: jnp.exp(jnp.sin(x)) * 3.0  # noqa: E731
    x = normal(0, (64,))
    for strategy in (Lean(), Offload()):
        residuals = saved_residuals(wrap(f, strategy), x)
        assert [r.where for r in residuals] == ["input"], strategy
    # A matrix product within the budget is recomputed; out of it, kept.
    w = normal(1, (64, 64))
    # (The logistic: a polynomial transcendental such as tanh that makes a product's input is
    # kept whatever the budget, tests/test_cut.py.)
    g = lambda w, x: jax.nn.sigmoid(jax.nn.sigmoid(x @ w) @ w)  # noqa: E731
    where = lambda s: sorted(r.where for r in saved_residuals(wrap(g, s, device_argnums=0), w, x))  # noqa: E731
    # Kept: the inner logistic (it needs x @ w again) and the output (free: the next layer keeps it).
    assert where(Lean(max_recompute=0.0)) == ["input", "input", "logistic", "logistic"]
    assert where(Lean(max_recompute=0.5)) == ["input", "input", "logistic"]


def test_offload_that_moves_nothing_says_so():
    w, x = normal(0, (8, 8)), normal(1, (4, 8))
    everything_small = offload(lambda w, x: jnp.tanh(x @ w), min_bytes=1 << 20)
    with pytest.warns(jaxoffload.OffloadWarning, match=r"none of its \d+ residuals moves"):
        jax.grad(lambda w, x: everything_small(w, x).sum())(w, x)
    # Nothing to move is not worth a warning: a function without residuals.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.grad(lambda x: offload(lambda x: 2.0 * x)(x).sum())(x)


def test_names_select_residuals_and_recompute_the_rest():
    def f(x):
        a = checkpoint_name(jnp.sin(x), "a")
        b = jnp.cos(a) * 3.0
        return jnp.tanh(b) * x

    x = normal(0, (64,))
    g = offload(f, names=["a"])
    residuals = saved_residuals(g, x)
    # Only the input and the named value are stored; everything else is recomputed.
    assert len(residuals) == 2 and all(r.placement == "pinned_host" for r in residuals)
    ref = jax.grad(lambda x: f(x).sum())(x)
    assert rel_err(jax.jit(jax.grad(lambda x: g(x).sum()))(x), ref) <= 1e-6
    # recompute=True moves the input alone.
    assert [r.where for r in saved_residuals(offload(f, recompute=True), x)] == ["input"]


def test_calls_count_their_recomputation_and_mark_residuals_that_are_outputs():
    w, x = normal(0, (8, 8)), normal(1, (4, 8))
    matmul = 2 * 4 * 8 * 8

    def f(w, x):
        return jnp.tanh(x @ w) @ w

    def calls(g):
        return jaxoffload.offloaded_calls(jax.grad(lambda w, x: g(w, x).sum()), w, x)

    (kept,) = calls(offload(f, max_recompute=0))
    (recomputed,) = calls(offload(f, recompute=True))
    assert kept.flops == recomputed.flops == 2 * matmul
    # Each product's backward pass is two products; recompute=True recomputes x @ w too.
    assert kept.grad_flops == 6 * matmul
    assert recomputed.grad_flops == 7 * matmul
    # relu keeps its output, which is the call's output; the matmul keeps its inputs.
    (lean,) = calls(wrap(lambda w, x: jax.nn.relu(x @ w), Lean()))
    assert sorted((r.shape, r.output) for r in lean.residuals) == [
        ((4, 8), False),
        ((4, 8), True),
        ((8, 8), False),
    ]
    assert lean.device_bytes == 4 * (4 * 8 * 2 + 8 * 8) and lean.host_bytes == 0
    assert [n.rule for n in lean.rewrites] == ["relu"]


def test_bare_and_configured_decorators():
    @offload
    def bare(x):
        return jnp.sin(x) ** 2

    @offload(min_bytes=0)
    def configured(x):
        return jnp.sin(x) ** 2

    x = normal(0, (16,))
    ref = jax.grad(lambda x: jnp.sum(jnp.sin(x) ** 2))(x)
    for f in (bare, configured):
        assert f.__name__ in ("bare", "configured")
        assert rel_err(jax.grad(lambda x, f=f: f(x).sum())(x), ref) <= 1e-6


def test_pytrees_integers_static_and_keyword_arguments():
    @offload(static_argnums=2)
    def f(tree, n, activation, *, scale):
        y = activation(tree["a"] @ tree["b"]) * n
        return {"y": y * scale, "count": n + 1}, (y.sum(), n)

    tree = {"a": normal(0, (4, 8)), "b": normal(1, (8, 3))}
    n, scale = jnp.int32(3), normal(2, ())

    def loss(f):
        def loss(tree, n, scale):
            out, (s, m) = f(tree, n, jnp.tanh, scale=scale)
            return jnp.sum(out["y"]) + s * m

        return loss

    plain = f.__jaxoffload__[0]
    grads = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2), allow_int=True))(tree, n, scale)
    ref = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2), allow_int=True))(tree, n, scale)
    assert rel_err((grads[0], grads[2]), (ref[0], ref[2])) <= 1e-6
    assert grads[1].dtype == jax.dtypes.float0  # integers get float0 cotangents
    out, _ = f(tree, n, jnp.tanh, scale=scale)
    assert int(out["count"]) == 4


def test_vjp_and_value_and_grad_agree():
    f = lambda w, x: jnp.tanh(x @ w)  # noqa: E731
    g = offload(f, device_argnums=0)
    w, x = normal(0, (8, 8)), normal(1, (3, 8))
    ct = normal(2, (3, 8))
    y, vjp = jax.vjp(g, w, x)
    y_ref, vjp_ref = jax.vjp(f, w, x)
    assert rel_err(y, y_ref) <= 1e-6 and rel_err(vjp(ct), vjp_ref(ct)) <= 1e-6


def test_unused_residuals_are_not_kept():
    # jax.vjp keeps values its backward pass never reads (here: relu's input
    # next to its mask). Keeping those would cost memory for nothing. No reader
    # keeps the relu's output, so jax's rule (a one-byte mask) stays.
    f = lambda x: jax.nn.relu(x) * 2.0  # noqa: E731
    x = normal(0, (128,))
    assert [(r.dtype, r.where) for r in saved_residuals(offload(f), x)] == [(np.bool_, "gt")]
    # A lean call's input costs nothing (the layer before keeps it), and gives the mask.
    assert [r.where for r in saved_residuals(wrap(f, Lean()), x)] == ["input"]


def test_offload_composes_with_checkpoint_and_vmap():
    f = offload(lambda x: jnp.sin(x) * x)
    x = normal(0, (4, 8))
    ref = jax.grad(lambda x: jnp.sum(jnp.sin(x) * x))(x)
    assert rel_err(jax.grad(lambda x: jax.checkpoint(f)(x).sum())(x), ref) <= 1e-6
    assert rel_err(jax.vmap(jax.grad(lambda r: f(r).sum()))(x), ref) <= 1e-6


def test_nested_calls_keep_their_strategies():
    # The outer strategy applies to the code between the inner calls.
    inner = offload(lambda w, x: jnp.tanh(x @ w), device_argnums=0)

    def model(w, x):
        x = jnp.sin(x @ w)  # outside the inner calls
        return inner(w, inner(w, x))

    w, x = normal(0, (8, 8)) / 3, normal(1, (4, 8))
    ref = jax.grad(lambda w, x: model(w, x).sum(), argnums=(0, 1))(w, x)
    for outer in (Lean(), Remat(), Offload()):
        g = wrap(model, outer, device_argnums=0)
        got = jax.jit(jax.grad(lambda w, x, g=g: g(w, x).sum(), argnums=(0, 1)))(w, x)
        assert rel_err(got, ref) <= 1e-6, outer
        calls = jaxoffload.offloaded_calls(jax.grad(lambda w, x, g=g: g(w, x).sum()), w, x)
        hosts = [c.host_bytes > 0 for c in calls]
        # The two inner calls move their residuals; the region moves them only under Offload.
        assert hosts.count(True) == 2 + isinstance(outer, Offload), (outer, hosts)


def test_forward_mode_is_refused_clearly():
    f = offload(jnp.sin)
    message = (
        r"jax\.jvp, jax\.jacfwd and jax\.hessian differentiate in forward mode, which sin, "
        r"wrapped with Offload\(\), does not support: .* reverse mode only\. For forward mode, "
        r"wrap it with Remat\(\) or Store\(\); for second order, go reverse over reverse: "
        r"jax\.jacrev\(jax\.jacrev\(f\)\), or jax\.grad of jax\.grad\."
    )
    with pytest.raises(TypeError, match=message):
        jax.jvp(f, (jnp.ones(3),), (jnp.ones(3),))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"names": "a"}, TypeError, "sequence of strings"),
        ({"names": [1]}, TypeError, "must be strings"),
        ({"names": ["a"], "recompute": True}, ValueError, "takes no names"),
        ({"min_bytes": -1}, ValueError, "non-negative"),
        (
            {"min_bytes": 1.5},
            TypeError,
            r"min_bytes must be a non-negative int \(bytes\), got 1\.5",
        ),
        ({"max_recompute": -0.1}, ValueError, "non-negative"),
        ({"window": 0}, ValueError, "window must be an int of at least 1"),
        ({"window": True}, TypeError, r"window must be an int of at least 1, got True \(a bool\)"),
        ({"recompute": 1}, TypeError, "recompute must be a bool"),
        ({"device_argnums": "0"}, TypeError, "int or a sequence of ints"),
        ({"device_argnums": 1.0}, TypeError, "int or a sequence of ints"),
        ({"static_argnums": [None]}, TypeError, "must be ints"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        offload(lambda x: x, **kwargs)


def test_bad_calls_are_explained():
    with pytest.raises(TypeError, match="expects a callable"):
        offload(3)
    with pytest.raises(ValueError, match=r"static_argnums=\(3,\) names positions \[3\]"):
        offload(lambda x: x, static_argnums=3)(jnp.ones(2))
    with pytest.raises(ValueError, match=r"passes 2 positional arguments.*positionally"):
        offload(lambda x, y: x * y, device_argnums=2)(jnp.ones(2), jnp.ones(2))
    with pytest.raises(ValueError, match="keywords \\['y'\\]"):
        offload(lambda x, y: x * y, device_argnums=1)(jnp.ones(2), y=jnp.ones(2))
    with pytest.raises(ValueError, match="both static_argnums and device_argnums"):
        offload(lambda x, y: x, static_argnums=1, device_argnums=1)(jnp.ones(2), 3)
    with pytest.raises(TypeError, match="made by jaxoffload.wrap or jaxoffload.offload"):
        saved_residuals(lambda x: x, jnp.ones(2))
    with pytest.raises(TypeError, match="write Lean\\(\\), not Lean"):
        wrap(jnp.sin, Lean)
    with pytest.raises(TypeError, match="for the command line"):
        wrap(jnp.sin, "lean")


def test_residuals_per_call_warns_without_a_gradient():
    f = offload(jnp.sin)
    with pytest.warns(jaxoffload.OffloadWarning, match="takes a gradient"):
        assert jaxoffload.residuals_per_call(f, jnp.ones(3)) == []


def test_public_surface():
    for name in jaxoffload.__all__:
        assert hasattr(jaxoffload, name), name


def _weight_gradients_before_first_fetch(window: int, fetch_window=None) -> set[tuple[int, ...]]:
    """Shapes of the weight-gradient matmuls that the fetch of layer 0's residuals waits for."""
    strategy = Offload(window=window, fetch_window=fetch_window)
    layer = wrap(lambda w, x: jnp.tanh(x @ w), strategy, device_argnums=0)
    ws = [jnp.ones((4 + i, 5 + i)) for i in range(3)]  # one shape per layer

    def loss(ws, x):
        for w in ws:
            x = layer(w, x)
        return x.sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss))(ws, jnp.ones((2, 4))).jaxpr
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    fetches = [
        eqn
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "device_put"
        and eqn.outvars[0].aval.memory_space == jax.memory.Space.Device
    ]
    # Layer 0's residuals, packed into one buffer, are the fewest bytes: its shapes are the least.
    fetch = min(
        fetches, key=lambda eqn: eqn.invars[0].aval.size * eqn.invars[0].aval.dtype.itemsize
    )
    seen, todo, shapes = set(), list(fetch.invars), set()
    while todo:
        v = todo.pop()
        if v in seen or v not in producer:
            continue
        seen.add(v)
        eqn = producer[v]
        shape = eqn.outvars[0].aval.shape
        if eqn.primitive.name == "dot_general" and shape[::-1] in {w.shape for w in ws}:
            shapes.add(shape[::-1])  # jax computes the weight gradient transposed
        todo.extend(x for x in eqn.invars if isinstance(x, jax.extend.core.Var))
    return shapes


def test_window_moves_each_fetch_earlier():
    # Window 1: layer 0's residuals come back once layer 1's weight gradient exists.
    assert _weight_gradients_before_first_fetch(1) == {(5, 6), (6, 7)}
    # Window 2: as soon as layer 1's backward pass starts (after layer 2's).
    assert _weight_gradients_before_first_fetch(2) == {(6, 7)}


def test_fetch_window_sets_the_fetch_apart_from_the_copies_window():
    # Copies in flight over two calls, each fetch when its own backward pass starts: as window 1.
    assert _weight_gradients_before_first_fetch(2, fetch_window=1) == {(5, 6), (6, 7)}
    # Copies waited for in the call, fetches a call ahead: as window 2.
    assert _weight_gradients_before_first_fetch(1, fetch_window=2) == {(6, 7)}


def test_small_residuals_travel_packed_and_large_ones_alone():
    from jaxoffload._src.transfers import PACK_BELOW

    side = int((PACK_BELOW // 4) ** 0.5) + 1  # a float32 matrix just over the packing size

    def f(w, x):
        big = jnp.tanh(x @ w)
        # Reductions keep their small outputs, which the products' gradients need.
        return (
            jnp.sin(big).mean(axis=0)
            * jnp.exp(jnp.cos(big).mean(axis=1))
            * jnp.exp(big.max(axis=0))
        )

    g = offload(f, device_argnums=0)
    w, x = normal(0, (side, side)) / side, normal(1, (side, side))
    moved = [r for r in saved_residuals(g, w, x) if r.placement == "pinned_host"]
    large = [r for r in moved if r.nbytes >= PACK_BELOW]
    assert large and len(moved) - len(large) >= 2, moved
    loss = lambda f: lambda w, x: f(w, x).sum()  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss(g), argnums=(0, 1)))(w, x)
    assert host_device_puts(jaxpr) == len(large) + 1 == host_copies(moved)
    got = jax.jit(jax.grad(loss(g), argnums=(0, 1)))(w, x)
    assert rel_err(got, jax.jit(jax.grad(loss(f), argnums=(0, 1)))(w, x)) <= 1e-6


def test_fetched_values_cross_the_recompute_barrier_packed():
    # A barrier's operand is a buffer of its own: a value unpacked before the barrier would
    # be a slice kernel on a GPU, where after it the slice fuses into its reader.
    f, params, x = _layer("residual_block")
    g = offload(f, device_argnums=0)
    jaxpr = jax.make_jaxpr(jax.grad(_loss(g), argnums=(0, 1)))(params, x).jaxpr
    operands = _barrier_operands(jaxpr)
    # The values fetched cross the barrier as they came: here, one buffer of small values.
    assert operands.count("fetched") == host_device_puts(jaxpr) == 1, operands
    assert "slice" not in operands, operands


def _barrier_operands(jaxpr) -> list[str]:
    """For each operand of each ``optimization_barrier`` in ``jaxpr``: its producer's name."""
    from jax.extend import core

    found = []
    producers = {v: _producer(eqn) for eqn in jaxpr.eqns for v in eqn.outvars}
    for eqn in jaxpr.eqns:
        if _is_barrier(eqn):
            found += [producers.get(v, "input") for v in eqn.invars if hasattr(v, "aval")]
        for sub in core.jaxprs_in_params(eqn.params):
            found += _barrier_operands(sub)
    return found


def _is_barrier(eqn) -> bool:
    """A barrier, or a ``custom_jvp`` around one alone (how jaxoffload gives it tangents)."""
    if eqn.primitive.name == "custom_jvp_call":
        return [e.primitive.name for e in eqn.params["call_jaxpr"].eqns] == ["optimization_barrier"]
    return eqn.primitive.name == "optimization_barrier"


def _producer(eqn) -> str:
    if eqn.primitive.name == "device_put" and jax.memory.Space.Device in eqn.params["devices"]:
        return "fetched"
    return eqn.primitive.name


@pytest.mark.parametrize("strategy", [Remat(), Remat(jax.checkpoint_policies.dots_saveable)])
def test_a_remat_block_recomputes_once_its_cotangent_arrives(strategy):
    """A recomputation needs only the block's saved input, so XLA's latency-hiding scheduler
    may start it early, to run under a host copy, and hold every block's recomputed values at
    once (design §13). Remat() ties its saved values to the cotangent, as an offload that
    recomputes does; under forward mode it is jax.checkpoint itself (test_composition)."""
    g = wrap(lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w), strategy, device_argnums=0)
    w, x = normal(0, (8, 8)) / 3, normal(1, (4, 8))
    loss = lambda f: lambda w, x: jnp.sum(f(w, x) ** 2)  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss(g), argnums=(0, 1)))(w, x).jaxpr
    operands = _barrier_operands(jaxpr)
    # The saved values (jaxpr inputs here) cross a barrier beside values that the step
    # computes, the cotangent among them; under jax.checkpoint alone no barrier is traced.
    assert "input" in operands and set(operands) - {"input"}, operands
    got = jax.jit(jax.grad(loss(g), argnums=(0, 1)))(w, x)
    plain = jax.jit(jax.grad(loss(lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w)), argnums=(0, 1)))
    assert rel_err(got, plain(w, x)) <= 1e-6


def test_windows_give_plain_gradients_mixed_with_lean_calls():
    kept = wrap(lambda w, x: jnp.tanh(x @ w), Lean(), device_argnums=0)
    ws = [normal(i, (8, 8)) / 3 for i in range(6)]
    x = normal(9, (4, 8))

    def loss(ws, x, layers):
        for w, f in zip(ws, layers):
            x = f(w, x)
        return jnp.sum(x**2)

    plain = jax.grad(loss)(ws, x, [lambda w, x: jnp.tanh(x @ w)] * 6)
    for window, fetch_window in ((1, None), (2, None), (3, None), (7, None), (2, 1), (1, 3)):
        strategy = Offload(window=window, fetch_window=fetch_window)
        layer = wrap(lambda w, x: jnp.tanh(x @ w), strategy, device_argnums=0)
        for layers in ([layer] * 6, [layer, kept, layer, kept, kept, layer]):
            got = jax.jit(jax.grad(loss), static_argnums=2)(ws, x, tuple(layers))
            assert rel_err(got, plain) <= 1e-6, window


def _optimized_hlo(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def test_xla_drops_barrier_operands_whose_outputs_are_unread():
    # Why the window's gates are read on both sides: were this to change, the
    # gates could go back to plain barriers.
    def f(x, y):
        x, _ = jax.lax.optimization_barrier((jnp.sin(x), jnp.cos(y)))
        return x

    assert "cosine" not in _optimized_hlo(f, jnp.ones(8), jnp.ones(8))


def test_schedule_gates_survive_xla():
    # A gate: the outputs leave through a barrier with the gate, and the
    # gate's side is read by the anchor gradient (`_after_tokens`).
    from jaxoffload._src.transfers import after_tokens, scalar_of

    def f(x, y, w):
        out, gate = jax.lax.optimization_barrier((jnp.exp(x), scalar_of(jnp.cos(y))))
        return out, after_tokens((x, w), [gate])[1]

    x, y, w = jnp.ones(8), jnp.full(8, 2.0), jnp.ones(2)
    assert "cosine" in _optimized_hlo(f, x, y, w)  # the gate is still computed
    out, anchored = f(x, y, w)
    assert jnp.array_equal(out, jnp.exp(x)) and jnp.array_equal(anchored, w)  # adds nothing


def test_schedule_gates_ride_on_a_gradient_that_a_step_reads():
    # A Flax block's smallest gradients are often those of BatchNorm's running
    # statistics, which no training step reads: a gate anchored there is dropped
    # with them. The anchor is the smallest leaf of rank 2 or more (a kernel's).
    from jaxoffload._src.transfers import after_tokens, scalar_of

    def f(x, y, stats, kernel):
        out, gate = jax.lax.optimization_barrier((jnp.exp(x), scalar_of(jnp.cos(y))))
        _, kernel = after_tokens((stats, kernel), [gate])  # the stats' result is unread
        return out, kernel

    args = jnp.ones(8), jnp.full(8, 2.0), jnp.ones(2), jnp.ones((3, 3))
    assert "cosine" in _optimized_hlo(f, *args)


def test_keywords_without_arrays_are_static():
    def layer(x, *, relu=True, scale=None):
        y = jnp.sin(x) * (1.0 if scale is None else scale)
        return jax.nn.relu(y) if relu else y

    def gradient(f, x, kwargs):
        return jax.grad(lambda x: f(x, **kwargs).sum())(x)

    x = jnp.linspace(-2.0, 2.0, 8)
    for strategy in (jaxoffload.Lean(), jaxoffload.Offload(), jaxoffload.Remat()):
        wrapped = jaxoffload.wrap(layer, strategy)
        for kwargs in ({"relu": True}, {"relu": False}, {"relu": False, "scale": jnp.float32(2)}):
            got, want = gradient(wrapped, x, kwargs), gradient(layer, x, kwargs)
            assert jnp.allclose(got, want), (strategy, kwargs)


@pytest.mark.parametrize(
    "strategy",
    [
        Store(),
        Lean(),
        Remat(),
        Remat(jax.checkpoint_policies.dots_saveable),
        Offload(),
        Offload(window=2),
        Offload(recompute=True),
        Offload(names=("hidden",)),
    ],
    ids=repr,
)
def test_saved_residuals_answers_for_every_strategy(strategy):
    def f(w, x):
        h = checkpoint_name(jnp.tanh(x @ w), "hidden")
        return jnp.sin(h @ w).sum()

    w, x = normal(0, (8, 8)), normal(1, (4, 8))
    residuals = saved_residuals(wrap(f, strategy), w, x)
    assert residuals and all(r.nbytes > 0 for r in residuals)
    host = [r for r in residuals if r.placement == "pinned_host"]
    assert bool(host) == strategy.to_host
    if strategy == Store():
        # Store leaves the function as it is: jax's own residuals, in jax's order.
        kept = [(str(r.dtype), r.shape) for r in residuals]
        ours = [(d, s) for d, s, _ in jax_residuals(f, w, x, keep_arguments=("w", "x"))]
        assert sorted(kept) == sorted(ours)
    if strategy == Remat():
        assert sorted(r.where for r in residuals) == ["input", "input"]  # nothing but its inputs
    if strategy == Remat(jax.checkpoint_policies.dots_saveable):
        assert len(residuals) == 4  # the inputs, and the two products' outputs


def test_a_cap_that_moves_nothing_says_so_and_why():
    f = offload(lambda w, x: jnp.sin(jnp.tanh(x @ w) @ w), device_argnums=0, max_bytes=64)
    with pytest.warns(
        jaxoffload.OffloadWarning, match=r"none of its 4 residuals.*over max_bytes=64"
    ):
        jax.make_jaxpr(jax.grad(lambda w, x: f(w, x).sum()))(jnp.ones((8, 8)), jnp.ones((4, 8)))
    moved = saved_residuals(
        offload(lambda w, x: jnp.sin(x @ w), max_bytes=200), jnp.ones((8, 8)), jnp.ones((4, 8))
    )
    # The largest residual that fits goes first: the 256-byte w does not, the 128-byte ones do.
    assert [r.nbytes for r in moved if r.placement == "pinned_host"] == [128]


def _cached(kind: str) -> int:
    from jaxoffload._src import residuals

    return sum(key[0] == kind for key in residuals.SELECTIONS)


def test_a_call_is_selected_once_per_program_and_strategy_and_constants_count():
    from jaxoffload._src import residuals

    residuals.SELECTIONS.clear()
    f, params, x = _layer("residual_block")
    lean = wrap(f, Lean())

    def two_calls(params, x):  # one program, called twice
        y, _ = lean(params, x)
        return lean(params, y)[0].sum()

    jax.grad(two_calls)(params, x)
    assert _cached("selection") == 1
    jax.grad(lambda p, x: wrap(f, Lean(max_recompute=0.0))(p, x)[0].sum())(params, x)
    assert _cached("selection") == 2  # another strategy: another selection
    assert _cached("kept") == 2  # and another cut,
    assert _cached("differentiated") == 1  # of one trace: both cut with lean rules

    # Programs that differ only in a constant's value are not one program.
    def scaled(c):
        return wrap(lambda x: jnp.sin(x) * c, Lean())

    x = normal(2, (4, 5))
    for c in (np.full(5, 2.0, np.float32), np.full(5, 3.0, np.float32)):
        got = jax.grad(lambda x, c=c: scaled(c)(x).sum())(x)
        np.testing.assert_allclose(got, np.cos(x) * c, rtol=1e-6)


def test_calls_of_one_program_in_other_structures_share_a_selection_with_their_own_gradients():
    from jaxoffload._src import residuals

    residuals.SELECTIONS.clear()
    # One flat program; the inputs' structure differs, as a linen block's RNG path does.
    lean = wrap(lambda d, b: jnp.sin(jnp.tanh(next(iter(d.values()))) * b), Lean())
    plain = lambda d, b: jnp.sin(jnp.tanh(next(iter(d.values()))) * b)  # noqa: E731

    def loss(f, x, y):
        return (f({"u": x}, y) + f({"w": y}, x) ** 2).sum()

    x, y = normal(0, (4, 5)), normal(1, (4, 5))
    got = jax.grad(lambda x, y: loss(lean, x, y), argnums=(0, 1))(x, y)
    want = jax.grad(lambda x, y: loss(plain, x, y), argnums=(0, 1))(x, y)
    assert _cached("selection") == 1
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def test_an_offload_s_windows_share_its_trace_and_cut_and_its_caps_its_trace():
    from jaxoffload._src import residuals

    residuals.SELECTIONS.clear()
    f, params, x = _layer("residual_block")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxoffload.OffloadWarning)  # a CPU moves nothing
        for strategy in (Lean(), Offload(), Offload(window=2), Offload(max_bytes=10**9)):
            jax.grad(lambda p, x, s=strategy: wrap(f, s)(p, x)[0].sum())(params, x)
    assert _cached("selection") == 4
    # Lean's cut; Offload()'s, which its window shares; the cap's, which may differ.
    assert _cached("kept") == 3
    assert _cached("differentiated") == 1


def test_a_cap_that_leaves_what_offload_keeps_on_the_device_keeps_lean_s_cut():
    """The offloading cut recomputes more (here the block's output) to move less: that pays
    only where what it keeps moves. A cap that leaves it on the device keeps Lean's cut."""
    f, params, x = _layer("residual_block")

    def kept(strategy):
        return [(r.where, r.shape) for r in saved_residuals(wrap(f, strategy), params, x)]

    lean, moving = kept(Lean()), kept(Offload())
    assert lean != moving
    assert kept(Offload(window=2, max_bytes=64)) == lean  # only per-channel vectors fit
    assert kept(Offload(max_bytes=10**9)) == moving  # all of it fits
    assert kept(Offload(min_bytes=1 << 10)) == moving  # no cap: small values stay by choice
    _assert_gradients_match_store(f, params, x, Offload(window=2, max_bytes=64))


def _assert_gradients_match_store(f, params, x, strategy):
    """``strategy``'s gradients of ``f`` are Store()'s, beside Lean()'s: the same arithmetic."""
    loss = lambda s: lambda p, x: jnp.sum(jnp.sin(wrap(f, s)(p, x)[0]))  # noqa: E731
    want = jax.grad(loss(Store()), argnums=(0, 1))(params, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxoffload.OffloadWarning)  # a CPU moves nothing
        for s in (Lean(), strategy):
            assert rel_err(jax.grad(loss(s), argnums=(0, 1))(params, x), want) <= 1e-6, s


def test_under_lean_s_cut_a_cap_moves_no_input_or_output_and_goes_to_the_rest():
    """The layers around a call keep its inputs and outputs on the device: moving them would
    free nothing, so under Lean's cut they stay, and the cap moves the largest of the rest."""
    f, params, x = _layer("residual_block")
    strategy = Offload(max_bytes=x.nbytes + 500)  # room for one activation, and vectors

    def kept(strategy):
        return saved_residuals(wrap(f, strategy), params, x)

    capped, lean = kept(strategy), kept(Lean())
    assert [(r.where, r.shape) for r in capped] == [(r.where, r.shape) for r in lean]
    around = [r for r in capped if r.where == "input" or r.output]
    assert around and all(r.placement == "device" for r in around)
    assert all("moving it frees nothing" in r.reason for r in around)
    moved = [r for r in capped if r.placement == "pinned_host"]
    assert max(r.nbytes for r in moved) == x.nbytes  # an activation inside the block
    assert "conv_general_dilated" in max(moved, key=lambda r: r.nbytes).where
    assert sum(r.nbytes for r in moved) <= strategy.max_bytes
    _assert_gradients_match_store(f, params, x, strategy)


_DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8, jnp.int32, jnp.bool_, jnp.uint8, jnp.float16]


@settings(max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 4), max_size=3)), max_size=5
    )
)
def test_packing_gives_back_every_value_bit_for_bit(specs):
    from jaxoffload._src.transfers import packed, unpacked

    values = [
        (jax.random.normal(jax.random.key(n), shape) * 100).astype(dtype)
        for n, (dtype, shape) in enumerate(specs)
    ]
    moving, packing = packed(values)
    assert len(moving) == len({v.dtype for v in values})  # one buffer a dtype, or the one value
    back = unpacked(moving, packing)
    for a, b in zip(values, back):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(np.asarray(a), np.asarray(b))
