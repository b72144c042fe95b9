"""Offload over a batch-sharded Mesh: same gradients, and host placement keeps the sharding.

The tests run on 4 forced CPU devices (``tests/conftest.py`` sets XLA_FLAGS).
"""

import contextlib
import functools
import re
import runpy
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from helpers import every_strategy_value, host_puts, normal, rel_err
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxoffload
from jaxoffload._src import planner
from jaxoffload.bench.models import plain_model
from jaxoffload.bench.models.flax_resnet import ResNet, ResNetBlock

pytestmark = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4",
)


def _mesh(axis_type):
    return jax.make_mesh((4,), ("batch",), axis_types=(axis_type,))


def _context(mesh):
    # Explicit axes are part of the types, and need the mesh in context.
    explicit = mesh.axis_types[0] == AxisType.Explicit
    return jax.set_mesh(mesh) if explicit else contextlib.nullcontext()


def _layer(w, x):
    return jnp.tanh(x @ w)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_sharded_gradients_match_unsharded(axis_type):
    mesh = _mesh(axis_type)
    w, x = normal(0, (16, 16)), normal(1, (8, 16))
    f = jaxoffload.offload(_layer, device_argnums=0)
    grad = jax.jit(jax.grad(lambda w, x: jnp.sum(f(w, x) ** 2), argnums=(0, 1)))
    reference = jax.jit(jax.grad(lambda w, x: jnp.sum(_layer(w, x) ** 2), argnums=(0, 1)))(w, x)
    with _context(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("batch")))
        got = grad(w, xs)
    assert rel_err(got, reference) <= 1e-6
    assert got[1].sharding.spec[0] == "batch"  # the input gradient stays batch-sharded


def test_host_placement_keeps_the_sharding():
    mesh = _mesh(AxisType.Explicit)
    f = jaxoffload.offload(_layer, device_argnums=0)
    with _context(mesh):
        w = normal(0, (16, 16))
        xs = jax.device_put(normal(1, (8, 16)), NamedSharding(mesh, P("batch")))
        jaxpr = jax.make_jaxpr(jax.grad(lambda w, x: f(w, x).sum(), argnums=(0, 1)))(w, xs)
    to_host = [
        eqn
        for eqn in jaxpr.jaxpr.eqns
        if eqn.primitive.name == "device_put" and jax.memory.Space.Host in eqn.params["devices"]
    ]
    assert to_host
    for eqn in to_host:
        aval = eqn.outvars[0].aval
        assert aval.sharding.spec == P("batch", None), aval  # batch-sharded on the host too
        assert aval.memory_space == jax.memory.Space.Host


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = jaxoffload.linen.offload(nn.Conv)
        x = nn.relu(block(8, (3, 3))(x))
        x = nn.relu(block(8, (3, 3))(x))
        return nn.Dense(4)(x.mean((1, 2)))


def test_sharded_flax_training_step():
    mesh = _mesh(AxisType.Auto)
    x = normal(0, (8, 6, 6, 3))
    params = Net().init(jax.random.key(0), x)["params"]
    loss = lambda p, x: jnp.sum(Net().apply({"params": p}, x) ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss))
    got = grad(params, jax.device_put(x, NamedSharding(mesh, P("batch"))))
    assert rel_err(got, grad(params, x)) <= 1e-6


# ---- a plain-Flax ResNet, data parallel over a 4-device mesh ----------------------------

STRATEGIES = every_strategy_value()
RESNET = dict(stage_sizes=(1, 1), num_filters=8, num_classes=10)


def _resnet(strategy):
    return plain_model(ResNet, ResNetBlock, strategy, **RESNET)


# The two-process example's step, so that one and two processes train the same.
EXAMPLE = Path(__file__).parents[1] / "jaxoffload/bench/distributed_example.py"
_step = runpy.run_path(str(EXAMPLE))["step"]


@pytest.fixture(scope="module")
def problem():
    """The batch, the variables, and the single-device gradients and statistics."""
    x, labels = normal(0, (8, 16, 16, 3)), jnp.arange(8) % 10
    variables = _resnet(jaxoffload.Store()).init(jax.random.key(1), x, True)
    args = (variables["params"], variables["batch_stats"], x, labels)
    reference = jax.jit(functools.partial(_step, _resnet(jaxoffload.Store())))(*args)
    return args, reference


@pytest.fixture(scope="module")
def mesh():
    # jax.make_mesh's axes are Explicit by default: the batch's sharding is in its type.
    return jax.make_mesh((4,), ("data",))


def _data_parallel(args, mesh):
    """Parameters and statistics replicated, the batch sharded over ``data``."""
    params, stats, x, labels = args
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    return (*jax.device_put((params, stats), replicated), *jax.device_put((x, labels), batch))


def _check_matches(got, reference):
    assert rel_err(got[0], reference[0]) <= 1e-6  # gradients
    assert rel_err(got[1], reference[1]) <= 1e-6  # BatchNorm's updated statistics


@pytest.mark.parametrize("strategy", STRATEGIES, ids=str)
def test_data_parallel_gradients_match_one_device(problem, mesh, strategy):
    args, reference = problem
    got = jax.jit(functools.partial(_step, _resnet(strategy)))(*_data_parallel(args, mesh))
    _check_matches(got, reference)
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(got))


@pytest.mark.parametrize("strategy", [jaxoffload.Offload(), jaxoffload.Offload(window=2)], ids=str)
def test_resnet_host_copies_keep_the_batch_sharding(problem, mesh, strategy):
    args = _data_parallel(problem[0], mesh)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(functools.partial(_step, _resnet(strategy)))(*args)
    to_host = host_puts(jaxpr.jaxpr)
    assert to_host
    for eqn in to_host:
        for aval in (v.aval for v in eqn.outvars):
            assert aval.memory_space == jax.memory.Space.Host
            if aval.ndim == 4:  # activations: the batch stays split over the devices
                assert aval.sharding.spec[0] == "data", aval


def _fsdp(mesh, x):
    """Shards ``x`` over ``data`` along its largest dimension that 4 divides; else replicated."""
    dims = sorted((d for d in range(x.ndim) if x.shape[d] % 4 == 0), key=lambda d: -x.shape[d])
    spec = [None] * x.ndim
    if dims:
        spec[dims[0]] = "data"
    return NamedSharding(mesh, P(*spec))


@pytest.mark.parametrize("strategy", [jaxoffload.Lean(), jaxoffload.Offload()], ids=str)
def test_fsdp_parameter_sharding_gives_the_same_gradients(problem, mesh, strategy):
    args, reference = problem
    params, stats = (jax.tree.map(functools.partial(_fsdp, mesh), t) for t in args[:2])
    batch = NamedSharding(mesh, P("data"))
    step = jax.jit(
        functools.partial(_step, _resnet(strategy)),
        in_shardings=(params, stats, batch, batch),
        out_shardings=(params, stats),
    )
    got = step(*args)
    _check_matches(got, reference)
    specs = [leaf.sharding.spec for leaf in jax.tree.leaves(got[0])]
    assert any("data" in spec for spec in specs)  # some parameters really are split


PLANNABLE = ResNet(**RESNET, block_cls=jaxoffload.linen.plannable(ResNetBlock))


def test_plan_under_the_mesh_gives_the_same_gradients(problem, mesh):
    args, reference = problem
    plan = jaxoffload.Plan(
        (("ResNetBlock_0", jaxoffload.Lean()), ("ResNetBlock_1", jaxoffload.Offload())),
        jaxoffload.Lean(),
    )
    got = jax.jit(functools.partial(_step, plan.apply(PLANNABLE)))(*_data_parallel(args, mesh))
    _check_matches(got, reference)


def test_planner_budget_is_per_device(problem, mesh):
    args, reference = problem
    sharded = _data_parallel(args, mesh)
    plan = jaxoffload.plan(
        PLANNABLE, _step, *sharded, budget=1.0, options=(jaxoffload.Lean(),), runs=1,
        max_rounds=1, progress=False,
    )  # fmt: skip
    # memory_analysis of a sharded program is one device's: a quarter of the batch.
    unsharded = planner.compiled_bytes(PLANNABLE, _step, *args, plan=plan)
    assert plan.compiled_bytes < unsharded
    assert plan.compiled_bytes <= plan.budget_bytes
    got = jax.jit(functools.partial(_step, plan.apply(PLANNABLE)))(*sharded)
    _check_matches(got, reference)


def test_two_processes_give_the_one_process_gradients(monkeypatch):
    # Two jax.distributed processes of 2 CPU devices each, one global mesh (gloo collectives).
    # They share the suite's compilation cache (tests/conftest.py): most of their time is
    # XLA's compiles.
    example = runpy.run_path(str(EXAMPLE))
    # One strategy: the processes' start and compiles dominate, and the one-process tests
    # above cover every strategy value under the same mesh.
    out = example["launch"](["lean"], timeout=120)
    errors = dict(re.findall(r"strategy=(\w+) grad_rel_err=(\S+)", out))
    assert set(errors) == {"lean"}, out
    assert all(float(e) <= 1e-6 for e in errors.values()), out
    stats = [float(e) for e in re.findall(r"batch_stats_rel_err=(\S+)", out)]
    assert len(stats) == 1 and max(stats) <= 1e-6, out


def test_the_zeros_of_each_timed_run_are_made_as_their_structs_say():
    """Each timed run's arguments are made by one compiled program: the same zeros, with the
    same shardings (and distinct PRNG keys), as one op per leaf would make."""
    from jaxoffload._src import timing

    mesh = _mesh(AxisType.Explicit)
    batch = NamedSharding(mesh, P("batch"))
    structs = {
        "x": jax.ShapeDtypeStruct((8, 3), jnp.bfloat16, sharding=batch),
        "w": jax.ShapeDtypeStruct((3,), jnp.float32, sharding=NamedSharding(mesh, P())),
    }
    plain = {
        "k": jax.ShapeDtypeStruct((4,), jax.random.key(0).dtype),
        "n": jax.ShapeDtypeStruct((), jnp.int32),
    }
    for tree in (structs, plain):
        made = timing.fresh_zeros(tree)
        each = jax.tree.map(timing.zeros, tree)
        for name in tree:
            assert made[name].shape == each[name].shape and made[name].dtype == each[name].dtype
            if name in structs:
                assert made[name].sharding == tree[name].sharding
                assert not jnp.any(made[name])
    keys = jax.random.key_data(made["k"])
    assert len({tuple(k.tolist()) for k in keys}) == 4  # distinct keys
    assert timing.fresh_zeros(structs)["x"].sharding == batch  # made again from the cache
