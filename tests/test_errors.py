"""A newcomer's mistakes: each is named, with what to write instead, or works as in jax."""

import contextlib
import functools
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import normal, rel_err
from jax.ad_checkpoint import checkpoint_name

import jaxoffload
from jaxoffload import Lean, Offload, Remat, Store, offload, wrap
from jaxoffload._src import context
from jaxoffload.bench.layers import BatchNorm
from tests.test_plan import ARGS, PLANNABLE, VARIABLES, Net, step
from tests.test_plan import X as IMAGES

W, X = normal(0, (3, 3)), normal(1, (2, 3))


def _layer(w, x):
    return jnp.tanh(x @ w)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, y, z):
        return nn.Dense(3)(x) * y + z


def _init_with(block, call):
    """Initialises a model that builds ``block()`` and calls it as ``call(block_instance, x)``."""

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return call(block(), x)

    return Model().init(jax.random.key(0), X)


# ---- device_argnums and static_argnums ----------------------------------------------------


def test_device_argnums_of_an_argument_passed_by_keyword_names_it():
    with pytest.raises(ValueError, match=r"and the keywords \['w', 'x'\].*pass 'w' positionally"):
        offload(_layer, device_argnums=0)(w=W, x=X)
    one = r"passes 1 positional argument and .*pass 'x' positionally"
    with pytest.raises(ValueError, match=one):
        offload(_layer, device_argnums=1)(W, x=X)


def test_device_argnums_out_of_range_gives_the_positions_the_call_has():
    three = lambda x, y, z: x * y * z  # noqa: E731
    message = r"device_argnums=\(3,\) .* passes 3 positional arguments\. .*here 0 to 2\."
    with pytest.raises(ValueError, match=message):
        offload(three, device_argnums=3)(X, X, X)
    # In linen, in the user's numbering (self is 0), not the lifted function's.
    block = jaxoffload.linen.offload(_Block, device_argnums=4)
    message = r"device_argnums=\(4,\) .* passes 3 positional arguments after self\. .*here 1 to 3\."
    with pytest.raises(ValueError, match=message):
        _init_with(block, lambda b, x: b(x, x, x))


def test_linen_keyword_arguments_reach_the_module():
    # flax's lift.pack dropped them, with only a RuntimeWarning, unless asked not to.
    plain = _init_with(_Block, lambda b, x: b(x, y=2 * x, z=x))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        lean = jaxoffload.linen.wrap(_Block, Lean())
        variables = _init_with(lean, lambda b, x: b(x, y=2 * x, z=x))

    class Model(nn.Module):
        block: type

        @nn.compact
        def __call__(self, x):
            return self.block()(x, y=2 * x, z=x)

    assert rel_err(Model(lean).apply(variables, X), Model(_Block).apply(plain, X)) == 0.0


@pytest.mark.parametrize(
    ("argnums", "write"),
    [(1.0, "write device_argnums=1"), ([0, 1.0], r"write device_argnums=\(0, 1\)"),
     ("0", r"an int such as device_argnums=1, or a tuple")],
)  # fmt: skip
def test_device_argnums_of_the_wrong_type_say_what_to_write(argnums, write):
    with pytest.raises(TypeError, match=write):
        offload(_layer, device_argnums=argnums)


def test_an_argument_both_static_and_on_the_device_is_refused_where_it_is_written():
    both = "arguments \\[1\\] are in both static_argnums and device_argnums.*leave it out of"
    with pytest.raises(ValueError, match=both):
        offload(_layer, static_argnums=1, device_argnums=1)  # at once, not at the call
    with pytest.raises(ValueError, match=both):
        offload(lambda w, n: w * n, static_argnums=-1, device_argnums=1)(W, 2)
    with pytest.raises(ValueError, match=both.replace("1", "2")):
        jaxoffload.linen.offload(_Block, static_argnums=2, device_argnums=2)
    with pytest.raises(ValueError, match="take no negative positions"):
        jaxoffload.linen.offload(_Block, device_argnums=-1)


def test_a_traced_array_named_static_is_refused_by_name_before_tracing_the_block():
    # jax said only that a tracer leaked, after tracing the block, or the forward pass ran.
    said = "static_argnums names the argument 'x', which holds a traced array"
    with pytest.raises(TypeError, match=said):
        jax.grad(lambda x: offload(lambda x, n: jnp.tanh(x) * n, static_argnums=0)(x, 2).sum())(X)

    class Flagged(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return nn.Dense(3)(x)

    block = jaxoffload.linen.wrap(Flagged, Lean(), static_argnums=1)  # 1 is x: self is 0
    variables = Flagged().init(jax.random.key(0), X, True)
    with pytest.raises(TypeError, match=said):
        jax.jit(lambda x: block().apply(variables, x, True))(X)
    dense = nnx.Linear(X.shape[-1], 3, rngs=nnx.Rngs(0))
    jaxoffload.nnx.wrap(dense, Lean(), static_argnums=0)  # 0 is x: an instance's own numbering
    with pytest.raises(TypeError, match=said.replace("'x'", "'inputs'")):
        nnx.grad(lambda m, x: m(x).sum(), argnums=1)(dense, X)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("strategy", [Lean(), Offload(), Remat()], ids=repr)
def test_a_python_flag_passed_positionally_is_static_as_a_keyword_one_is(strategy, train):
    # Traced, `if train` raised TracerBoolConversionError with no word of static_argnums.
    f = lambda x, train, scale: jnp.tanh(x) * scale if train else x  # noqa: E731
    ours = wrap(f, strategy)
    assert rel_err(ours(X, train, 2.0), f(X, train, 2.0)) == 0.0
    grad = lambda g: jax.grad(lambda x: g(x, train, 2.0).sum())(X)  # noqa: E731
    assert rel_err(grad(ours), grad(f)) <= 1e-6


class _Flagged(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        y = nn.Dense(3)(x)
        return jnp.tanh(y) if train else y


@pytest.mark.parametrize("train", [True, False])
def test_a_linen_flag_passed_positionally_is_static(train):
    plain = _init_with(_Flagged, lambda b, x: b(x, train))
    lean = jaxoffload.linen.wrap(_Flagged, Lean())
    variables = _init_with(lean, lambda b, x: b(x, train))
    assert jax.tree.map(jnp.shape, variables) == jax.tree.map(jnp.shape, plain)

    class Model(nn.Module):
        block: type

        @nn.compact
        def __call__(self, x):
            return self.block()(x, train)

    assert rel_err(Model(lean).apply(variables, X), Model(_Flagged).apply(plain, X)) == 0.0


class _ConvFlagged(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        y = jnp.where(~train, -1.0, 1.0) * nn.Conv(2, (3, 3))(x)  # NumPy's ~ is not, not -2
        return nn.relu(y) if train else y


class _NnxConvFlagged(nnx.Module):
    def __init__(self):
        self.conv = nnx.Conv(2, 2, (3, 3), rngs=nnx.Rngs(0))

    def __call__(self, x, train):
        y = jnp.where(~train, -1.0, 1.0) * self.conv(x)
        return nnx.relu(y) if train else y


@pytest.mark.parametrize(
    "flag", [np.bool_(True), np.bool_(False), np.array(True), np.array(False)], ids=repr
)
@pytest.mark.parametrize("face", ["linen", "nnx"])
def test_a_numpy_bool_flag_is_static_as_a_python_one_is(face, flag):
    # Traced, `if train` raised TracerBoolConversionError where the plain block runs.
    x = normal(5, (1, 4, 4, 2))
    if face == "linen":
        variables = _ConvFlagged().init(jax.random.key(0), x, True)
        block = jaxoffload.linen.wrap(_ConvFlagged, Lean())
        plain = functools.partial(_ConvFlagged().apply, variables)
        ours = functools.partial(block().apply, variables)
    else:
        plain = _NnxConvFlagged()
        ours = jaxoffload.nnx.wrap(_NnxConvFlagged(), Lean())
    for call in (lambda f, x: f(x, flag), lambda f, x: f(x, train=flag)):
        assert rel_err(call(ours, x), call(plain, x)) == 0.0
        grad = lambda f: jax.grad(lambda x: call(f, x).sum())(x)  # noqa: B023, E731
        assert rel_err(grad(ours), grad(plain)) <= 1e-6


# ---- what is wrapped ----------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [Lean(), Offload(), Remat()], ids=repr)
def test_python_scalar_outputs_work_as_under_jax_checkpoint(strategy):
    def f(w, x):
        return (x @ w).sum(), 2.0, 3

    ours, ref = wrap(f, strategy)(W, X), jax.checkpoint(f)(W, X)
    assert [(type(a), a.dtype) for a in ours] == [(type(a), a.dtype) for a in ref]
    assert rel_err(ours, ref) == 0.0
    grad = lambda g: jax.jit(jax.grad(lambda w: g(w, X)[0] * g(w, X)[1]))(W)  # noqa: E731
    assert rel_err(grad(wrap(f, strategy)), grad(jax.checkpoint(f))) <= 1e-6
    assert float(jax.grad(lambda w: wrap(lambda w, x: 1.0, strategy)(w, X))(W).sum()) == 0.0


def test_linen_transform_of_a_plain_function_says_to_use_the_function_transform():
    f = jaxoffload.linen.offload(_layer)
    message = r"self, its first argument, is of type .*Array.*write jaxoffload\.offload\(_layer\)"
    with pytest.raises(TypeError, match=message):
        f(W, X)


def test_function_transform_of_a_linen_module_says_to_use_the_linen_one():
    class_message = r"linen Module class Dense.*jaxoffload\.linen\.offload\(Dense\)"
    with pytest.raises(TypeError, match=class_message):
        offload(nn.Dense)
    with pytest.raises(TypeError, match=r"linen Module class Dense"):
        wrap(functools.partial(nn.Dense, 3), Lean())
    instance_message = r"linen Module Dense\(\.\.\.\).*linen\.offload\(Dense\)\(\.\.\.\)"
    with pytest.raises(TypeError, match=instance_message):
        offload(nn.Dense(3))
    # Its apply is a function of arrays, and welcome.
    variables = nn.Dense(3).init(jax.random.key(0), X)
    assert rel_err(offload(nn.Dense(3).apply)(variables, X), nn.Dense(3).apply(variables, X)) == 0.0


def test_function_transform_of_an_nnx_module_says_to_use_the_nnx_one():
    norm = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    message = (
        r"NNX Module BatchNorm\(\.\.\.\) as the function.*jaxoffload\.nnx\.wrap\(module, Lean\(\)\)"
    )
    with pytest.raises(TypeError, match=message):
        wrap(norm, Lean())
    with pytest.raises(TypeError, match=r"NNX Module class Linear.*jaxoffload\.nnx\.wrap\(module"):
        offload(nnx.Linear)


def test_nnx_transform_of_a_linen_module_says_to_use_the_linen_one():
    with pytest.raises(
        TypeError,
        match=r"linen Module class Dense\. Write jaxoffload\.linen\.wrap\(Dense, Lean\(\)\)",
    ):
        jaxoffload.nnx.wrap(nn.Dense, Lean())
    with pytest.raises(TypeError, match=r"linen Module class Dense"):
        jaxoffload.nnx.offload(functools.partial(nn.Dense, 3))
    message = r"linen Module Dense\(\.\.\.\).*jaxoffload\.linen\.wrap\(Dense, Lean\(\)\)\(\.\.\.\) where you wrote"
    with pytest.raises(TypeError, match=message):
        jaxoffload.nnx.wrap(nn.Dense(3), Lean())


def test_linen_transform_of_an_nnx_module_says_to_use_the_nnx_one():
    with pytest.raises(TypeError, match=r"NNX Module class Linear\. Write jaxoffload\.nnx\.wrap"):
        jaxoffload.linen.wrap(nnx.Linear, Lean())
    with pytest.raises(
        TypeError, match=r"NNX Module Linear\(\.\.\.\)\. Write jaxoffload\.nnx\.wrap"
    ):
        jaxoffload.linen.offload(nnx.Linear(3, 3, rngs=nnx.Rngs(0)))


# ---- names, schedule, residuals_per_call ---------------------------------------------------


def _marked(w, x):
    return jnp.tanh(checkpoint_name(jnp.sin(x @ w), "a") @ w)


def test_a_name_that_the_function_never_marks_is_refused_with_the_names_it_marks():
    step = lambda f: jax.grad(lambda w, x: f(w, x).sum())(W, X)  # noqa: E731
    message = r"marks no value named 'nonexistent'.*the names it marks are \['a'\]"
    with pytest.raises(ValueError, match=message):
        step(offload(_marked, names=["nonexistent"]))
    with pytest.raises(ValueError, match="marks no value named 'a'.*it marks no value"):
        step(offload(_layer, names=["a"]))
    step(offload(_marked, names=["a"]))


def test_names_are_looked_for_in_the_whole_function_not_region_by_region():
    inner = offload(_layer, device_argnums=0)

    def model(w, x):
        return _marked(w, inner(w, _marked(w, x)) @ w)  # 'a' outside the inner call

    ref = jax.grad(lambda w, x: model(w, x).sum())(W, X)
    outer = wrap(model, Offload(names=["a"]), device_argnums=0)
    assert rel_err(jax.grad(lambda w, x: outer(w, x).sum())(W, X), ref) <= 1e-6


def test_schedule_is_gone_and_says_what_replaced_it():
    message = r"jaxoffload\.offload\(f, window=2\).*Offload\(window=2\)"
    with pytest.raises(AttributeError, match=message):
        jaxoffload.schedule  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'scheduled'"):
        jaxoffload.scheduled  # noqa: B018


def test_residuals_per_call_without_a_gradient_warns():
    forward_only = jax.jit(lambda w, x: offload(_layer)(w, x).sum())
    with pytest.warns(jaxoffload.OffloadWarning, match="differentiates no call.*takes a gradient"):
        assert jaxoffload.residuals_per_call(forward_only, W, X) == []


def test_offload_traced_for_cpu_says_once_per_process_that_nothing_moves(monkeypatch):
    assert jax.default_backend() == "cpu"
    monkeypatch.setattr(context, "SAID", set())  # as in a fresh process
    step = lambda f: jax.grad(lambda w, x: f(w, x).sum())  # noqa: E731
    message = "no effect.*nothing moves.*once per process"
    with pytest.warns(jaxoffload.OffloadWarning, match=message):
        jax.make_jaxpr(step(offload(_layer)))(W, X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.make_jaxpr(step(offload(lambda w, x: jnp.sin(x @ w))))(W, X)  # another: no word
        jax.make_jaxpr(step(wrap(_layer, Lean())))(W, X)  # Lean moves nothing, and says nothing


# ---- the lean BatchNorm takes flax's arguments ---------------------------------------------


def test_lean_batch_norm_takes_flaxs_arguments_in_flaxs_order():
    fields = lambda cls: [f for f in cls.__dataclass_fields__ if f not in ("parent", "name")]  # noqa: E731
    assert fields(BatchNorm) == [*fields(nn.BatchNorm), "relu"]


@pytest.mark.parametrize(
    "options",
    [{"use_bias": False}, {"use_scale": False, "use_bias": False}, {"axis": 3},
     {"axis": (-1,), "scale_init": nn.initializers.constant(2.0),
      "bias_init": nn.initializers.constant(0.5)}],
)  # fmt: skip
def test_lean_batch_norm_matches_flax_with_its_options(options):
    x = 3 * normal(2, (2, 2, 3, 4)) + 1
    ct = normal(3, x.shape)
    flax_norm, lean_norm = (
        cls(use_running_average=False, momentum=0.9, **options) for cls in (nn.BatchNorm, BatchNorm)
    )
    variables = {"params": {}, **flax_norm.init(jax.random.key(0), x)}  # no params without both
    lean_variables = {"params": {}, **lean_norm.init(jax.random.key(0), x)}
    assert jax.tree.map(jnp.shape, lean_variables) == jax.tree.map(jnp.shape, variables)
    assert rel_err(lean_variables, variables) == 0.0

    def run(module):
        def loss(params, x):
            state = {"batch_stats": variables["batch_stats"]}
            y, new = module.apply({"params": params, **state}, x, mutable=["batch_stats"])
            return jnp.sum(y * ct), (y, new)

        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(variables["params"], x)

    (ref_grads, (ref_y, ref_stats)), (grads, (y, stats)) = run(flax_norm), run(lean_norm)
    assert rel_err(y, ref_y) <= 1e-6
    assert rel_err(stats, ref_stats) == 0.0
    assert rel_err(grads, ref_grads) <= 1e-6


@pytest.mark.parametrize(
    ("options", "match"),
    [({"axis_name": "batch"}, "no cross-device statistics .*takes no axis_name='batch'"),
     ({"axis_index_groups": [[0, 1]]}, "takes no axis_index_groups"),
     ({"use_fast_variance": False}, "takes no use_fast_variance=False: leave use_fast_variance out"),
     ({"force_float32_reductions": False}, "takes no force_float32_reductions=False")],
)  # fmt: skip
def test_lean_batch_norm_refuses_what_it_does_not_compute_by_name(options, match):
    with pytest.raises(ValueError, match=match + ".*flax.linen.BatchNorm"):
        BatchNorm(use_running_average=False, **options)


def test_lean_batch_norm_refuses_other_axes_and_a_mask_at_the_call():
    x = jnp.ones((2, 3, 4))
    with pytest.raises(ValueError, match=r"axis=1\) takes the features .* axes \[1\].*axis=-1"):
        BatchNorm(use_running_average=False, axis=1).init(jax.random.key(0), x)
    norm = BatchNorm(use_running_average=False)
    with pytest.raises(ValueError, match="takes no mask"):
        norm.init(jax.random.key(0), x, mask=x > 0)
    with pytest.raises(TypeError, match=r"\['padding'\].*need conv_kernel"):
        norm.init(jax.random.key(0), x, padding="SAME")


# ---- strategies and plans ------------------------------------------------------------------


@pytest.mark.parametrize("make", [Lean, Offload, lambda **kw: offload(_layer, **kw)])
@pytest.mark.parametrize(
    ("value", "write"),
    [(2, r"got 2; write max_recompute=1\.0"), (-0.1, r"got -0\.1; write max_recompute=0\.0"),
     ("0.5", r"got '0\.5'; write max_recompute=0\.5, without quotes"),
     ("half", r"got 'half'; write a number such as max_recompute=0\.25"),
     (float("nan"), r"got nan; write a number such as max_recompute=0\.25")],
)  # fmt: skip
def test_max_recompute_is_a_share_from_0_to_1(make, value, write):
    with pytest.raises(ValueError, match=r"max_recompute is a share .* at most 1, " + write):
        make(max_recompute=value)
    assert make(max_recompute=1) is not None


_PlannedDense = jaxoffload.linen.plannable(nn.Dense)


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _PlannedDense(3)(jnp.tanh(_PlannedDense(3)(x)))


def _plan(model, budget):
    variables = _Net().init(jax.random.key(0), X)

    def step(model, variables, x):
        return jax.grad(lambda v: model.apply(v, x).sum())(variables)

    return jaxoffload.plan(model, step, variables, X, budget=budget, runs=1, progress=False)


@pytest.mark.parametrize(
    ("budget", "write"),
    [("0.5", r"got the string '0\.5'; write budget=0\.5, a share"),
     ("50%", r"got the string '50%'; write budget=0\.5, a share"),
     ("8 GiB", r"got the string '8 GiB'; write budget=8 \* 2\*\*30, in bytes"),
     (["0.5"], r"got the string '0\.5'; write budget=0\.5")],
)  # fmt: skip
def test_a_budget_written_as_a_string_is_quoted_whole_with_what_to_write(budget, write):
    with pytest.raises(TypeError, match=r"budget must be bytes \(an int\) or a share .*" + write):
        _plan(_Net(), budget)


def test_plan_of_a_bound_model_says_to_pass_the_unbound_one():
    bound = _Net().bind(_Net().init(jax.random.key(0), X))
    message = (
        r"jaxoffload\.plan takes an unbound linen Module, but this _Net is bound .*"
        r"_Net\(\.\.\.\) itself, or model\.unbind\(\)\[0\].*the step as its arguments"
    )
    with pytest.raises(TypeError, match=message):
        _plan(bound, 1.0)
    with pytest.raises(
        TypeError, match=r"jaxoffload\.plan takes a Module instance, got the class _Net"
    ):
        _plan(_Net, 1.0)
    with pytest.raises(TypeError, match=r"Plan\.apply takes an unbound linen Module.*to apply\."):
        jaxoffload.Plan((("Dense_0", Lean()),)).apply(bound)


# ---- saved_residuals says why, in the user's words -----------------------------------------


def _input_reasons(calls):
    return sorted({r.reason for c in calls for r in c.residuals if r.where == "input"})


def test_module_variables_are_kept_on_the_device_as_variables_not_as_device_argnums():
    # linen and NNX pass a Module's variables as device arguments of their own.
    linen_block = jaxoffload.linen.wrap(_Block, Lean(), device_argnums=2)
    variables = _init_with(linen_block, lambda b, x: b(x, x, x))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return linen_block()(x, 2 * x, x)

    step = jax.grad(lambda v, x: Model().apply(v, x).sum())
    reasons = _input_reasons(jaxoffload.offloaded_calls(step, variables, X))
    # x, kept by the layers around a lean block; the Dense kernel; y, which the user named.
    assert reasons == ["Lean", "a Module's variable", "argument in device_argnums"], reasons

    linear = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(linear)
    lean = jaxoffload.nnx.wrap(lambda m, x: jnp.tanh(m(x)), Lean())
    step = jax.grad(lambda state, x: lean(nnx.merge(graphdef, state), x).sum())
    reasons = _input_reasons(jaxoffload.offloaded_calls(step, state, X))
    assert reasons == ["Lean", "a Module's variable"], reasons


# ---- every mistake answered, before anything compiles ----------------------------------------

# The event jax records around every backend compile, persistent-cache hits included.
_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def _compiles():
    """The names of the programs compiled inside it."""
    names = []

    def listen(event, duration, **kwargs):
        if event == _COMPILE:
            names.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _refused_before_compiling(error, match, call):
    """Asserts that ``call()`` raises ``error`` matching ``match``, having compiled nothing."""
    with _compiles() as compiled, pytest.raises(error, match=match):
        call()
    assert compiled == [], compiled


def test_the_compile_counter_counts():
    with _compiles() as compiled:
        jax.jit(lambda x: x * 3 + 1)(X)
    assert len(compiled) == 1


def _plan_call(**kwargs):
    the_step = kwargs.pop("step", step)
    options = {"budget": 1.0, "runs": 1, "progress": False, **kwargs}
    return lambda: jaxoffload.plan(PLANNABLE, the_step, *ARGS, **options)


def _fit_call(**kwargs):
    the_step = kwargs.pop("step", step)
    options = {"budget": 10**9, "progress": False, "args_at": _args_at, **kwargs}
    return lambda: jaxoffload.largest_size(Net(), the_step, **options)


def _args_at(batch):
    x = jnp.zeros((batch, 16, 16, 3))
    return VARIABLES["params"], VARIABLES["batch_stats"], x, jnp.zeros((batch,), jnp.int32)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"budget": 50}, ValueError,
      r"budget=50 bytes is less than the step's arguments alone, .* so nothing can fit it; a "
      r"share of the plain step's memory is a float: did you mean budget=0\.5\?"),
     ({"budget": 1}, ValueError, r"budget=1 bytes is less .* did you mean budget=1\.0\?"),
     ({"budget": np.int64(1)}, ValueError, r"did you mean budget=1\.0\?"),
     ({"budget": []}, ValueError, r"budget=\[\] holds no budget: give one, budget=0\.5"),
     ({"budget": float("nan")}, ValueError, r"budget must be positive.*got nan"),
     ({"budget": 2.5}, ValueError, r"a share of the plain step's memory, in \(0, 1\].*got 2\.5"),
     ({"budget": np.bool_(True)}, TypeError, r"got np\.True_ \(a bool\)"),
     ({"budget": 2**20, "held_bytes": 2**30}, ValueError,
      r"budget=1048576 bytes is less than the step's arguments and the 1\.00 GiB held on the "
      r"device besides them \(held_bytes\), 1\.00 GiB \(.* bytes\), so nothing can fit it\. Give"),
     ({"held_bytes": -1}, ValueError,
      r"held_bytes must be a non-negative int \(bytes\), or None, got -1; write held_bytes=0"),
     ({"held_bytes": "3"}, TypeError, r"held_bytes must be .*got '3'; write held_bytes=3, without"),
     ({"runs": 0}, ValueError, r"runs must be an int of at least 1, got 0; write runs=1 or more"),
     ({"runs": 2.0}, TypeError, r"runs must be an int of at least 1, got 2\.0; write runs=2\."),
     ({"max_rounds": 0}, ValueError, r"max_rounds must be an int of at least 1, got 0"),
     ({"per_round": "4"}, TypeError, r"per_round must be .*got '4'; write per_round=4, without"),
     ({"options": []}, ValueError, r"options is empty"),
     ({"options": Lean()}, TypeError, r"options is a sequence of strategies, got Lean"),
     ({"blocks": nn.Dense}, TypeError, r"blocks= selects the blocks of an NNX model"),
     ({"donate_argnums": 9}, ValueError, r"donate_argnums=\(9,\) names positions \[9\], but the "
      r"step takes 4 arguments"),
     ({"block_costs": "flops"}, ValueError, r"block_costs is one of \('timed', 'traced'\)"),
     ({"progress": "yes"}, TypeError, r"progress must be True .* got 'yes'"),
     ({"step": jax.jit(step)}, TypeError,
      r"jaxoffload\.plan takes the training step unjitted, but got a jitted one "
      r"\(jax\.jit\(step\) or nnx\.jit\(step\)\).*Pass step itself, and jit it"),
     ({"step": "step"}, TypeError, r"takes the training step as a function step\(model, \*args\)"),
     # Python's arity error came from inside the first trace, naming only the user's step.
     pytest.param({"step": lambda model, params, x: x}, TypeError,
      r"jaxoffload\.plan calls step\(model, \*args\), here with the model and the 4 arguments "
      r"given after the step, but <lambda>\(model, params, x\) cannot be called so \(too many "
      r"positional arguments\): give the step's other arguments after the step",
      id="step of the wrong arity")],
    ids=lambda v: repr(v)[:40],
)  # fmt: skip
def test_plan_refuses_what_it_is_given_wrong_before_it_compiles(kwargs, error, match):
    _refused_before_compiling(error, match, _plan_call(**kwargs))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"runs": 0}, ValueError, r"runs must be an int of at least 1, got 0"),
     ({"exponent": 0}, ValueError,
      r"exponent must be a finite number above 0 \(1 for a batch, 2 for an image's side\), "
      r"got 0; write a number such as exponent=1\.0\."),
     ({"exponent": -1}, ValueError, r"exponent must be a finite number above 0 .*got -1;"),
     ({"exponent": float("nan")}, ValueError, r"exponent must be .*got nan;"),
     ({"exponent": float("inf")}, ValueError, r"exponent must be .*got inf;"),
     ({"time_limit_s": -5}, ValueError,
      r"time_limit_s must be a number of at least 0 \(seconds\), got -5; write a number such as "
      r"time_limit_s=600\.0\."),
     ({"time_limit_s": float("nan")}, ValueError, r"time_limit_s must be .*got nan"),
     ({"multiple_of": 32, "limit": 16}, ValueError,
      r"no size in \[smallest=1, limit=16\] is a multiple of multiple_of=32, so there is "
      r"nothing to search: write limit=32 or more"),
     ({"start": 10, "limit": 5}, ValueError, r"start must be in \[smallest=1, limit=5\], got 10"),
     ({"tolerance": 1}, ValueError, r"tolerance must be a finite number above 0 below 1"),
     ({"limit": 2**40 + 0.5}, TypeError, r"limit must be an int of at least 1, got"),
     ({"min_speed": 0.7}, ValueError, r"min_speed .*without plan=True: write plan=True"),
     ({"options": (Lean(),)}, ValueError, r"options choose what a plan may do, but plan=False"),
     ({"plan": 1}, TypeError, r"plan must be a bool, got 1; write plan=True"),
     ({"budget": 0.5}, ValueError,
      r"budget=0\.5 is a share of the device's memory, but this cpu device reports no memory "
      r"limit: give bytes"),
     ({"budget": 100}, ValueError, r"budget=100 bytes is less than the step's arguments alone.*"
      r"a share of the device's memory is a float: did you mean budget=1\.0\?"),
     ({"budget": "80%"}, TypeError, r"got the string '80%'; write budget=0\.8, a share"),
     ({"donate_argnums": 4}, ValueError, r"donate_argnums=\(4,\) names positions \[4\]"),
     pytest.param({"args_at": lambda size, dtype: _args_at(size)}, TypeError,
      r"largest_size calls args_at\(size\), here args_at\(1\), but <lambda>\(size, dtype\) "
      r"cannot be called so \(missing a required argument: 'dtype'\): args_at takes the size",
      id="args_at of two parameters"),
     pytest.param({"step": lambda model, params, x: x}, TypeError,
      r"largest_size calls step\(model, \*args_at\(size\)\), here with the model and the 4 "
      r"arguments that args_at\(1\) returns, but <lambda>\(model, params, x\) cannot be called",
      id="step of the wrong arity")],
    ids=lambda v: repr(v)[:40],
)  # fmt: skip
def test_largest_size_refuses_what_it_is_given_wrong_before_it_compiles(kwargs, error, match):
    _refused_before_compiling(error, match, _fit_call(**kwargs))


@pytest.mark.parametrize(
    ("returns", "got"),
    [(None, "None"), (VARIABLES["params"], "a dict"), (X, r"a float32 array of shape \(2, 3\)")],
    ids=["None", "a dict", "an array"],
)
def test_largest_size_says_what_args_at_must_return(returns, got):
    args_at = lambda n: returns  # noqa: E731
    match = rf"args_at\(1\) must return the step's arguments after the model, as a tuple such as \(state, batch\), got .*{got}"
    _refused_before_compiling(
        TypeError,
        match,
        lambda: jaxoffload.largest_size(Net(), step, args_at, budget=10**9, progress=False),
    )
    with pytest.raises(TypeError, match="args_at must be a function of the size"):
        jaxoffload.largest_size(Net(), step, (X,), budget=10**9, progress=False)


def test_largest_size_refuses_an_args_at_whose_arguments_do_not_grow_with_the_size():
    # Arguments built once and closed over compiled alike at every size: the search
    # answered its limit, as if every size fitted.
    match = (
        r"args_at gives arguments of the same shapes at sizes 1 and 8, so the step would "
        r"compile alike at every size.*args_at\(size\) must build the batch at that size"
    )
    fixed = lambda n: _args_at(4)  # noqa: E731
    _refused_before_compiling(ValueError, match, _fit_call(args_at=fixed))


def test_a_size_search_that_fits_nothing_says_so_and_takes_numbers_of_any_kind():
    least = sum(x.nbytes for x in jax.tree.leaves(_args_at(1)))
    found = jaxoffload.largest_size(
        Net(), step, _args_at, budget=np.int64(least + 1), start=np.int32(2), limit=4,
        progress=False,
    )  # fmt: skip
    assert found.size == 0 and found.budget_bytes == least + 1 and not found.confirmed
    smallest, nbytes = min(found.probes)
    assert smallest == 1 and nbytes > least + 1
    assert found.stopped.startswith("nothing fits: the smallest size compiled, 1, takes ")


def test_strategies_take_numpy_numbers_and_keep_python_ones():
    assert Offload(window=np.int64(2), max_bytes=np.uint32(7)) == Offload(window=2, max_bytes=7)
    assert "window=2, max_bytes=7" in repr(Offload(window=np.int64(2), max_bytes=np.uint32(7)))
    lean = Lean(max_recompute=np.float32(0.5), max_slowdown=jnp.array(0.03, jnp.float32))
    assert repr(lean) == "Lean(max_recompute=0.5, max_slowdown=0.03)"
    assert hash(lean) == hash(Lean(0.5, 0.03)) and Remat(prevent_cse=np.bool_(False)) == Remat(
        prevent_cse=False
    )
    json = jaxoffload.Plan((("Block_0", Offload(window=np.int64(2))),)).to_json()
    assert '"window": 2' in json


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [({"window": True}, TypeError, r"window must be an int of at least 1, got True \(a bool\)"),
     ({"window": 2.0}, TypeError, r"window must be an int of at least 1, got 2\.0; write window=2\."),
     ({"window": "2"}, TypeError, r"got '2'; write window=2, without quotes"),
     ({"max_bytes": 1e9}, TypeError, r"max_bytes must be a non-negative int .*write max_bytes=1000000000\."),
     ({"min_bytes": -1}, ValueError, r"min_bytes must be a non-negative int \(bytes\), got -1"),
     ({"max_recompute": np.float32(1.5)}, ValueError, r"at most 1, got 1\.5; write max_recompute=1\.0"),
     ({"names": 3}, TypeError, r"names must be a sequence of strings, got 3"),
     ({"recompute": 0}, TypeError, r"recompute must be a bool, got 0; write recompute=False")],
    ids=lambda v: repr(v)[:30],
)  # fmt: skip
def test_offload_fields_say_what_to_write(kwargs, error, match):
    with pytest.raises(error, match=match):
        Offload(**kwargs)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [(float("nan"), ValueError, r"got nan; write a number such as max_slowdown=0\.03"),
     (float("inf"), ValueError, r"got inf; write None"),
     (np.float64(-0.5), ValueError, r"got -0\.5")],
)  # fmt: skip
def test_lean_refuses_a_max_slowdown_that_is_no_share_of_a_time(value, error, match):
    # NaN was accepted, and its first trace ended in a bare StopIteration.
    with pytest.raises(
        error, match=r"max_slowdown must be a finite number of at least 0 .*" + match
    ):
        Lean(max_slowdown=value)


def test_the_strategy_base_class_is_no_strategy():
    message = r"Strategy is the base class of the strategies.*write Store\(\), Lean\(\), Remat\(\)"
    with pytest.raises(TypeError, match=message):
        jaxoffload.Strategy()
    with pytest.raises(TypeError, match=r"write Lean\(\), not Lean"):
        jaxoffload.linen.wrap(_Block, Lean)


def test_nnx_wrap_of_a_module_class_says_to_wrap_an_instance():
    message = (
        r"NNX Module class Linear: it would wrap the constructor, and the Modules it builds "
        r"would run plain\. Build the Module, then write jaxoffload\.nnx\.wrap\(module, Lean\(\)\)"
    )
    with pytest.raises(TypeError, match=message):
        jaxoffload.nnx.wrap(nnx.Linear, Lean())
    with pytest.raises(TypeError, match=r"NNX Module class Linear: it would wrap the constructor"):
        jaxoffload.nnx.offload(nnx.Linear)


def test_a_linen_plan_of_a_block_the_model_lacks_is_refused():
    blocks = (("Block_0", Lean()), ("Block_1", Remat()), ("Block_2", Store()), ("Block_7", Lean()))
    planned = jaxoffload.Plan(blocks).apply(PLANNABLE)
    message = (
        r"the plan names \['Block_7'\], which Net did not call; the plannable blocks it called "
        r"are Block_0, Block_1, Block_2\. The plan was made for another model"
    )
    with pytest.raises(ValueError, match=message):
        planned.init(jax.random.key(0), IMAGES)
    with pytest.raises(ValueError, match=message):
        planned.apply(VARIABLES, IMAGES, mutable=["batch_stats"])


def test_a_plan_on_a_model_without_plannable_blocks_is_refused():
    planned = jaxoffload.Plan((("Block_0", Lean()), ("Block_1", Lean()))).apply(Net())
    message = (
        r"the plan names the blocks \['Block_0', 'Block_1'\], but Net called no plannable block, "
        r"so none would take its strategy: .*jaxoffload\.linen\.plannable\(Block\)"
    )
    with pytest.raises(ValueError, match=message):
        planned.apply(VARIABLES, IMAGES, mutable=["batch_stats"])


def _damaged(tmp_path, text):
    path = tmp_path / "plan.json"
    path.write_text(text)
    return path


_SAVED = jaxoffload.Plan((("Block_0", Lean()), ("Block_1", Offload(window=2))), budget_bytes=5)


@pytest.mark.parametrize(
    ("text", "match"),
    [('{"outside": {"kind": "Store"}}',
      r"plan\.json holds no plan: what Plan\.save writes: an object whose \"blocks\" are \[path, "
      r"strategy\] pairs, but it has no \"blocks\" \(its keys: 'outside'\)\."),
     ("[1, 2]", r"plan\.json holds no plan: .* but it holds a list\."),
     (_SAVED.to_json()[:40],
      r"plan\.json holds no plan: its JSON is damaged or cut off at line \d+, column \d+ \(.*\)\. "
      r"Save the plan again"),
     (_SAVED.to_json().replace('"window"', '"windw"'),
      r"plan\.json, block 1 \('Block_1'\): Offload has no field 'windw' \(did you mean "
      r"'window'\?\); its fields are fetch_window, max_bytes, max_recompute, min_bytes, names, "
      r"recompute, window\."),
     (_SAVED.to_json().replace('"window": 2', '"window": 0'),
      r"plan\.json, block 1 \('Block_1'\): window must be an int of at least 1, got 0"),
     (_SAVED.to_json().replace('"Lean"', '"Laen"'),
      r"plan\.json, block 0 \('Block_0'\): unknown strategy kind 'Laen'"),
     ('{"blocks": [["Block_0"]]}', r"plan\.json, block 0: a block is a \[path, strategy\] pair"),
     ('{"blocks": [], "budget": 3}',
      r"plan\.json: a plan has no field 'budget' \(did you mean 'budget_bytes'\?\)"),
     (_SAVED.to_json().replace('"budget_bytes": 5', '"budget_bytes": -5'),
      r"plan\.json: budget_bytes must be a non-negative int, or None, got -5")],
    ids=["no blocks", "a list", "cut off", "misspelled", "bad window", "bad kind", "not a pair",
         "unknown field", "bad figure"],
)  # fmt: skip
def test_a_damaged_plan_file_says_which_file_what_and_where(tmp_path, text, match):
    path = _damaged(tmp_path, text)
    with pytest.raises(ValueError, match=match) as raised:
        jaxoffload.Plan.load(path)
    assert type(raised.value) is ValueError and str(path) in str(raised.value)
    assert jaxoffload.Plan.load(_damaged(tmp_path, _SAVED.to_json())) == _SAVED


def test_plan_from_json_given_a_path_says_to_load_it(tmp_path):
    # A path was parsed as JSON text, and the error said the JSON was damaged at line 1.
    path = _damaged(tmp_path, _SAVED.to_json())
    for named in (str(path), "plan.json"):
        with pytest.raises(ValueError, match=r"names a file: write Plan\.load\("):
            jaxoffload.Plan.from_json(named)
    assert jaxoffload.Plan.from_json(_SAVED.to_json()) == _SAVED


def test_forward_mode_through_lean_or_offload_names_the_block_and_what_works():
    lean = wrap(_layer, Lean(), device_argnums=0)
    message = (
        r"jax\.jvp, jax\.jacfwd and jax\.hessian differentiate in forward mode, which _layer, "
        r"wrapped with Lean\(\), does not support: .* For forward mode, wrap it with Remat\(\) or "
        r"Store\(\); for second order, go reverse over reverse"
    )
    with pytest.raises(TypeError, match=message):
        jax.jvp(lambda x: lean(W, x), (X,), (X,))
    with pytest.raises(TypeError, match=message.replace("Lean", "Offload")):
        jax.jacfwd(lambda x: offload(_layer, device_argnums=0)(W, x))(X)
    # In linen, the Module's method is named.
    block = jaxoffload.linen.wrap(_Block, Lean())
    variables = _init_with(block, lambda b, x: b(x, x, x))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return block()(x, x, x)

    with pytest.raises(TypeError, match=r"which _Block\.__call__, wrapped with Lean\(\), does not"):
        jax.jvp(lambda x: Model().apply(variables, x), (X,), (X,))


@pytest.mark.parametrize(
    "face",
    ["function", "linen", "nnx"],
)
def test_a_traced_flag_is_named_as_the_user_names_it(face):
    # It was `dynamic[3]` of jaxoffload's inner `call`, or `rest[0][2]` of its `pure`.
    flag = jnp.array(True)
    if face == "function":
        f = wrap(lambda x, train: jnp.tanh(x) if train else x, Lean())
        run = lambda: jax.jit(f)(X, flag)  # noqa: E731
        where = "<lambda>"
    elif face == "linen":
        block = jaxoffload.linen.wrap(_Flagged, Lean())
        variables = _init_with(block, lambda b, x: b(x, True))

        class Model(nn.Module):
            @nn.compact
            def __call__(self, x, train):
                return block()(x, train)

        run = lambda: jax.jit(Model().apply)(variables, X, flag)  # noqa: E731
        where = "__call__"
    else:

        class Flagged(nnx.Module):
            def __init__(self):
                self.dense = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

            def __call__(self, x, train):
                return jnp.tanh(self.dense(x)) if train else x

        module = jaxoffload.nnx.wrap(Flagged(), Lean())
        run = lambda: nnx.jit(lambda m, x, t: m(x, t))(module, X, flag)  # noqa: E731
        where = "__call__"
    message = rf"tracing the function {re.escape(where)} at .*depends on the value of the argument train\."
    with pytest.raises(jax.errors.TracerBoolConversionError, match=message) as raised:
        run()
    assert "static_argnums" in "".join(getattr(raised.value, "__notes__", []))
    assert "dynamic" not in str(raised.value) and "rest[" not in str(raised.value)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [(lambda: jaxoffload.offloaded_calls(3, X), TypeError,
      r"offloaded_calls takes a function .* got 3: write offloaded_calls\(step, \*args\)"),
     (lambda: jaxoffload.Plan(None), TypeError, r"blocks must be \(path, strategy\) pairs"),
     (lambda: jaxoffload.Plan((("Block_0",),)), TypeError, r"blocks must be \(path, strategy\)"),
     (lambda: jaxoffload.Plan.from_json(3), TypeError, r"for a file, write Plan\.load\(path\)"),
     (lambda: jaxoffload.linen.wrap(3, Lean()), TypeError,
      r"take a linen Module class or a method, got 3"),
     (lambda: jaxoffload.linen.wrap(nn.Dense, Lean(), methods="__call__"), TypeError,
      r"methods is a sequence of method names, got '__call__'; write methods=\('__call__',\)"),
     (lambda: jaxoffload.linen.wrap(nn.Dense, Lean(), methods=["call"]), ValueError,
      r"methods=\('call',\) names \['call'\], which Dense does not have"),
     (lambda: Remat("dots_saveable"), TypeError,
      r"got 'dots_saveable'; write policy=jax\.checkpoint_policies\.dots_saveable"),
     (lambda: jaxoffload.memory_report(jax.jit(jnp.sin), X, twin="yes"), TypeError,
      r"twin must be a bool, got 'yes'")],
    ids=["offloaded_calls", "Plan(None)", "a single", "from_json", "linen.wrap(3)",
         "methods string", "methods missing", "policy by name", "twin"],
)  # fmt: skip
def test_other_mistakes_are_named_too(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_positions_and_budgets_take_numpy_numbers():
    lean = wrap(_layer, Lean(), device_argnums=np.int64(0))
    assert rel_err(lean(W, X), _layer(W, X)) == 0.0
    _refused_before_compiling(  # a list of budgets as an array: bytes that no plan can fit
        ValueError, r"budget=2 bytes is less than", _plan_call(budget=np.array([0.5, 2]))
    )


@pytest.mark.parametrize("strategy", [Lean(), Remat(), Offload()], ids=repr)
def test_a_strategy_whose_block_runs_all_its_work_in_its_own_checkpoint_says_so(strategy):
    # The inner jax.checkpoint keeps its policy: the strategy had nothing to apply to, and
    # said nothing.
    inner = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))
    all_inside = wrap(lambda w, x: x + inner(w, x), strategy)
    with pytest.warns(jaxoffload.OffloadWarning, match="applies to nothing in this call"):
        got = jax.grad(lambda w: all_inside(w, X).sum())(W)
    assert rel_err(got, jax.grad(lambda w: (X + inner(w, X)).sum())(W)) <= 1e-6
    some_outside = wrap(lambda w, x: inner(w, x) @ w, strategy)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "applies to nothing", jaxoffload.OffloadWarning)
        warnings.filterwarnings("ignore", "offloaded calls are traced for CPU")
        jax.grad(lambda w: some_outside(w, X).sum())(W)


@pytest.mark.parametrize(
    "make, meant",
    [
        (lambda: Lean(max_recompte=0.1), "Lean has no field 'max_recompte' .*'max_recompute'"),
        (lambda: Offload(windw=2), "Offload has no field 'windw' .*'window'"),
        (lambda: Remat(polcy=None), "Remat has no field 'polcy' .*'policy'"),
    ],
)
def test_a_misspelled_strategy_field_is_refused_with_the_field_meant(make, meant):
    # Python said only "unexpected keyword argument", where a file's strategy suggested one.
    with pytest.raises(TypeError, match=meant):
        make()
