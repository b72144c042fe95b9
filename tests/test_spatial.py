"""Spatial sharding: one image's activations split along its height over a mesh axis.

A plain-Flax U-Net at batch 1, its image sharded ``P(None, "space")`` over 2 or 4
of the forced CPU devices (``tests/conftest.py``): the partitioner splits every
convolution and exchanges the halos, under every strategy value and a plan.
``jaxoffload.spatial_gathers`` names what it cannot split: the U-Net's 2x2
up-convolutions, whose backward pass gathers the whole activation.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import every_strategy_value, host_puts, normal, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoffload
from jaxoffload._src import planner, report, timing
from jaxoffload._src.planner.budget import devices_of
from jaxoffload.bench.models import plain_model
from jaxoffload.bench.models.flax_unet import DoubleConv, UNet

pytestmark = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4",
)

STRATEGIES = every_strategy_value()
UNET = dict(num_filters=4, depth=2, num_classes=3)
SIDE = 32


def _unet(strategy):
    return plain_model(UNet, DoubleConv, strategy, **UNET)


def _step(model, params, batch_stats, x, labels):
    """The gradients of a per-pixel cross-entropy, and BatchNorm's updated statistics."""

    def loss_fn(params):
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats}, x, True, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updates["batch_stats"]

    grads, batch_stats = jax.grad(loss_fn, has_aux=True)(params)
    return grads, batch_stats


@pytest.fixture(scope="module")
def problem():
    """One image and its labels, the variables, and one device's gradients and statistics."""
    x = normal(0, (1, SIDE, SIDE, 3))
    labels = jax.random.randint(jax.random.key(1), (1, SIDE, SIDE), 0, UNET["num_classes"])
    variables = _unet(jaxoffload.Store()).init(jax.random.key(2), x, True)
    args = (variables["params"], variables["batch_stats"], x, labels)
    return args, jax.jit(functools.partial(_step, _unet(jaxoffload.Store())))(*args)


def _mesh(n, axis_type=AxisType.Explicit):
    return jax.make_mesh((n,), ("space",), axis_types=(axis_type,))


def _spatial(args, mesh):
    """The variables replicated; the image and its labels split along their height."""
    params, stats, x, labels = args
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "space"))
    return (*jax.device_put((params, stats), replicated), *jax.device_put((x, labels), rows))


def _check_matches(got, reference):
    assert rel_err(got[0], reference[0]) <= 1e-5  # gradients
    assert rel_err(got[1], reference[1]) <= 1e-5  # BatchNorm's statistics, over all the rows


@pytest.mark.parametrize("strategy", STRATEGIES, ids=str)
def test_spatially_sharded_gradients_match_one_device(problem, strategy):
    args, reference = problem
    mesh = _mesh(4)
    with jax.set_mesh(mesh):
        got = jax.jit(functools.partial(_step, _unet(strategy)))(*_spatial(args, mesh))
    _check_matches(got, reference)


def test_auto_axes_give_the_same_gradients(problem):
    args, reference = problem
    mesh = _mesh(2, AxisType.Auto)
    step = jax.jit(functools.partial(_step, _unet(jaxoffload.Offload())))
    _check_matches(step(*_spatial(args, mesh)), reference)


PLANNABLE = UNet(**UNET, block_cls=jaxoffload.linen.plannable(DoubleConv))


def test_a_plan_under_a_spatial_mesh_gives_one_device_s_gradients(problem):
    args, reference = problem
    plan = jaxoffload.Plan(
        (
            ("DoubleConv_0", jaxoffload.Offload(window=2)),
            ("DoubleConv_1", jaxoffload.Remat()),
            ("DoubleConv_2", jaxoffload.Lean()),
            ("DoubleConv_3", jaxoffload.Offload(recompute=True)),
            ("DoubleConv_4", jaxoffload.Store()),
        ),
        jaxoffload.Lean(),
    )
    mesh = _mesh(4)
    with jax.set_mesh(mesh):
        got = jax.jit(functools.partial(_step, plan.apply(PLANNABLE)))(*_spatial(args, mesh))
    _check_matches(got, reference)


def test_the_planner_s_budget_is_per_device_under_a_spatial_mesh(problem):
    args, reference = problem
    mesh = _mesh(4)
    with jax.set_mesh(mesh):
        sharded = _spatial(args, mesh)
        plan = jaxoffload.plan(
            PLANNABLE, _step, *sharded, budget=1.0, options=(jaxoffload.Lean(),), runs=1,
            max_rounds=1, progress=False,
        )  # fmt: skip
        got = jax.jit(functools.partial(_step, plan.apply(PLANNABLE)))(*sharded)
    # memory_analysis of a sharded program is one device's: a quarter of the rows.
    assert plan.compiled_bytes < planner.compiled_bytes(PLANNABLE, _step, *args, plan=plan)
    assert plan.compiled_bytes <= plan.budget_bytes
    _check_matches(got, reference)


@pytest.mark.parametrize("strategy", [jaxoffload.Offload(), jaxoffload.Offload(window=2)], ids=str)
def test_host_copies_keep_the_spatial_sharding(problem, strategy):
    mesh = _mesh(2)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(functools.partial(_step, _unet(strategy)))(
            *_spatial(problem[0], mesh)
        )
    activations = [
        v.aval for eqn in host_puts(jaxpr.jaxpr) for v in eqn.outvars if v.aval.ndim == 4
    ]
    assert activations
    for aval in activations:  # each device copies its own rows, and only those
        assert aval.memory_space == jax.memory.Space.Host
        assert aval.sharding.spec[1] == "space", aval


def test_the_link_is_measured_per_device_with_every_device_copying_at_once(problem):
    mesh = _mesh(4)
    sharded = _spatial(problem[0], mesh)
    # The planner's link is that of the devices its step's arguments are placed on.
    assert devices_of(sharded) == list(mesh.devices.flat)
    link = timing.measure_link(2**20, runs=1, devices=devices_of(sharded))
    assert link["link_devices"] == 4 and link["d2h_gbps"] > 0 and link["h2d_gbps"] > 0


def _temp_bytes(args, n):
    mesh = _mesh(n)
    with jax.set_mesh(mesh):
        step = jax.jit(functools.partial(_step, _unet(jaxoffload.Lean())))
        compiled = step.lower(*_spatial(args, mesh)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_per_device_bytes_fall_with_the_device_count(problem):
    # One process, three meshes with one axis name: what a block's rules traced under one
    # mesh is not reused under another.
    one, two, four = (_temp_bytes(problem[0], n) for n in (1, 2, 4))
    assert four < two < one
    assert four < 0.6 * one  # most of the step is activations, split four ways


class PixelShuffleUp(nn.Module):
    """A 2x2 stride-2 up-convolution as a 1x1 convolution and a depth-to-space."""

    features: int

    @nn.compact
    def __call__(self, x):
        n, h, w, _ = x.shape
        y = nn.Conv(4 * self.features, (1, 1))(x).reshape(n, h, w, 2, 2, self.features)
        return y.transpose(0, 1, 3, 2, 4, 5).reshape(n, 2 * h, 2 * w, self.features)


def test_spatial_gathers_name_the_up_convolutions_and_nothing_else(problem):
    mesh = _mesh(2)
    with jax.set_mesh(mesh):
        step = jax.jit(functools.partial(_step, _unet(jaxoffload.Lean())))
        gathers = jaxoffload.spatial_gathers(step, *_spatial(problem[0], mesh))
    assert gathers
    assert all("ConvTranspose" in g.op_name and g.dimension == 1 for g in gathers), gathers
    # The whole activation, on every device: the level's rows, not half of them.
    assert {g.shape for g in gathers} >= {f"f32[1,{SIDE},{SIDE},{UNET['num_filters']}]"}

    # Written as a 1x1 convolution and a depth-to-space, the same up-sampling stays split.
    # (Under Explicit axes jax asks for a transposed convolution's out_sharding: Auto here.)
    auto = _mesh(2, AxisType.Auto)
    x = jax.device_put(normal(3, (1, 16, 16, 8)), NamedSharding(auto, P(None, "space")))
    for up, gathered in [(nn.ConvTranspose(4, (2, 2), strides=(2, 2)), True),
                         (PixelShuffleUp(4), False)]:  # fmt: skip
        variables = up.init(jax.random.key(0), x)
        grad = jax.jit(jax.grad(lambda v, x, up=up: jnp.sum(up.apply(v, x) ** 2), argnums=(0, 1)))
        assert bool(jaxoffload.spatial_gathers(grad, variables, x)) == gathered, up


def test_the_gathers_are_read_from_the_compiled_text_in_either_form():
    """XLA:CPU writes all-gather, XLA:GPU all-gather-start with (operand, result)."""
    meta = 'metadata={op_name="jit(step)/ConvTranspose_0/conv_general_dilated"}'
    text = "\n".join([
        f"  %all-gather.3 = f32[1,32,32,4]{{3,2,0,1}} all-gather(%f), dimensions={{1}}, {meta}",
        f"  %ags = (bf16[1,16,32,4]{{3,2,1,0}}, bf16[1,32,32,4]{{3,2,1,0}}) "
        f"all-gather-start(%g), channel_id=5, dimensions={{2}}, {meta}",
        "  %all-gather.4 = f32[8,16]{1,0} all-gather(%h), dimensions={0}",  # a batch, not rows
        "  %all-gather.5 = f32[8,4,4,16]{3,2,1,0} all-gather(%k), dimensions={0}",
    ])  # fmt: skip
    gathers = report.read_spatial_gathers(text)
    assert [(g.shape, g.dimension, g.nbytes) for g in gathers] == [
        ("f32[1,32,32,4]", 1, 16384), ("bf16[1,32,32,4]", 2, 8192)
    ]  # fmt: skip
    assert gathers[0].op_name == "jit(step)/ConvTranspose_0/conv_general_dilated"
