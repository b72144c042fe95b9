"""The benchmark models: parameter counts, and the plain gradient under every strategy value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import normal, rel_err

import jaxoffload
from jaxoffload import Lean, Offload, Remat, Store
from jaxoffload.bench import models
from jaxoffload.bench.measure import requested_host_bytes
from jaxoffload.bench.models import resnet
from jaxoffload.bench.step import placed, train_step
from jaxoffload.bench.workload import Workload


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("vgg11", 132_863_336),
        ("vgg19", 143_667_240),
        ("vgg19_bn", 143_678_248),
        ("resnet18", 11_689_512),
        ("resnet50", 25_557_032),
        ("resnet152", 60_192_808),
        ("flax-resnet18", 11_689_512),
        ("flax-resnet34", 21_797_672),
        ("flax-resnet50", 25_557_032),
        ("flax-resnet101", 44_549_160),
        ("flax-vgg11", 132_863_336),
        ("flax-vgg16", 138_357_544),
        ("flax-vgg19", 143_667_240),
    ],
)
def test_imagenet_parameter_counts(name, count):
    # The torchvision references; BatchNorm statistics are not parameters.
    model = models.create(name)
    shapes = jax.eval_shape(
        lambda x: model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, True),
        jnp.ones((1, 224, 224, 3)),
    )
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(shapes["params"])) == count


def test_plain_models_import_nothing_from_jaxoffload():
    import ast
    import pathlib

    plain = (models.flax_resnet, models.flax_vgg, models.flax_nnx_resnet, models.flax_mobilenet)
    for module in (*plain, models.flax_convnext, models.flax_unet):
        tree = ast.parse(pathlib.Path(module.__file__).read_text())
        imported = [
            alias.name if isinstance(node, ast.Import) else node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in (node.names if isinstance(node, ast.Import) else [None])
        ]
        assert not [m for m in imported if m and m.startswith("jaxoffload")], module.__name__


# Each strategy value; the options that change no rule run once, in float32 (a window is
# tested in test_linen.py, test_sharding.py and on the reference ResNet below).
STRATEGIES = {
    "remat": Remat(),
    "lean": Lean(),
    "offload": Offload(),
}
OPTIONS = {
    "offload, recompute": Offload(recompute=True),
    "remat-dots": Remat(jax.checkpoint_policies.dots_saveable),
    "offload, min_bytes": Offload(min_bytes=1 << 12),
    "offload, max_bytes": Offload(window=2, max_bytes=1 << 10),
}


def _plain(model, block, strategy, **kwargs):
    """A plain-Flax model with one block per stage (they differ only in depth), wrapped as ``create`` does."""
    return models.plain_model(model, block, strategy, **kwargs)


# One or two blocks per stage keep the test fast. The VGG has its dropout on.
PLAIN = {
    "flax resnet, basic": lambda s, dtype: _plain(
        models.flax_resnet.ResNet, models.flax_resnet.ResNetBlock, s,
        stage_sizes=(1, 1), num_classes=10, num_filters=8, dtype=dtype,
    ),
    "flax resnet, bottleneck": lambda s, dtype: _plain(
        models.flax_resnet.ResNet, models.flax_resnet.BottleneckResNetBlock, s,
        stage_sizes=(2, 1), num_classes=10, num_filters=8, dtype=dtype,
    ),
    "flax vgg": lambda s, dtype: _plain(
        models.flax_vgg.VGG, models.flax_vgg.VGGStage, s,
        stage_sizes=(2, 1), num_classes=10, dtype=dtype, dropout_rate=0.25, num_filters=8,
        classifier_width=32,
    ),
}  # fmt: skip


def _gradients(model, x, rngs):
    variables = model.init({"params": jax.random.key(1), **rngs}, x, True)

    def loss(params):
        y, state = model.apply(
            {**variables, "params": params}, x, True, mutable=["batch_stats"], rngs=rngs
        )
        return jnp.sum(jnp.sin(y)), state

    grads, state = jax.jit(jax.grad(loss, has_aux=True))(variables["params"])
    return variables, grads, state


# float64 is the sharper check of exactness: the basic ResNet runs in it alone, the others
# in float32 (the bottleneck one with every option, a case each: the suite's workers share them).
@pytest.mark.parametrize(
    "name, dtype, labels",
    [("flax resnet, basic", jnp.float64, tuple(STRATEGIES))]
    + [(name, jnp.float32, tuple(STRATEGIES)) for name in PLAIN if name != "flax resnet, basic"]
    + [("flax resnet, bottleneck", jnp.float32, (label,)) for label in OPTIONS],
)
def test_plain_models_give_the_plain_gradient_under_every_strategy(name, dtype, labels):
    bound = 1e-9 if dtype == jnp.float64 else 1e-6
    with jax.enable_x64(dtype == jnp.float64):
        x = normal(0, (2, 16, 16, 3), dtype)
        rngs = {"dropout": jax.random.key(7)}
        variables, grads, state = _gradients(PLAIN[name](Store(), dtype), x, rngs)
        if "batch_stats" in variables:  # they did move
            assert rel_err(state, {"batch_stats": variables["batch_stats"]}) > 0
        for label in labels:
            strategy = {**STRATEGIES, **OPTIONS}[label]
            got_vars, got_grads, got_state = _gradients(PLAIN[name](strategy, dtype), x, rngs)
            # The same variable tree, names and initial values as the plain model's.
            assert jax.tree.structure(got_vars) == jax.tree.structure(variables), label
            assert rel_err(got_vars, variables) == 0.0, label
            assert rel_err(got_grads, grads) <= bound, label
            assert rel_err(got_state, state) <= bound, label


def test_a_workload_s_initial_state_has_the_bits_that_jit_gives():
    """placed() compiles a state's init as a program that runs once (on CPU at a lower LLVM
    level): every strategy starts from the state that XLA's default level (3, asked for here,
    as tests/conftest.py lowers the suite's) gives, bit for bit, for a small ResNet with its
    BatchNorm statistics, an optimizer state and a batch."""
    import optax

    model = PLAIN["flax resnet, basic"](Store(), jnp.float32)
    workload = Workload("flax-resnet18", 2, 32, "float32", "none")

    def init():
        x = jax.random.normal(jax.random.key(0), (2, 16, 16, 3))
        variables = model.init({"params": jax.random.key(1)}, x[:1], True)
        return variables, optax.sgd(1e-3, momentum=0.9).init(variables["params"]), x

    got = placed(init, workload, abstract=False)
    want = jax.jit(init).lower().compile({"xla_backend_optimization_level": 3})()
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_lean_keeps_fewer_residual_bytes_than_the_plain_model():
    from helpers import jax_residuals

    x = normal(0, (2, 16, 16, 3))
    rngs = {"dropout": jax.random.key(7)}

    def residual_bytes(strategy):
        model = PLAIN["flax resnet, bottleneck"](strategy, jnp.float32)
        variables = model.init({"params": jax.random.key(1), **rngs}, x, True)

        def loss(params):
            y, _ = model.apply({**variables, "params": params}, x, True, mutable=["batch_stats"])
            return jnp.sum(y)

        residuals = jax_residuals(loss, variables["params"])
        return sum(np.prod(shape) * np.dtype(dtype).itemsize for dtype, shape, _ in residuals)

    assert residual_bytes(Lean()) < 0.6 * residual_bytes(Store())


def test_reference_models_give_the_plain_gradient_under_every_strategy():
    # float64: at initialisation a deep BatchNorm network amplifies float32
    # rounding differences between equivalent formulas to about 1e-5.
    with jax.enable_x64(True):
        x = normal(0, (2, 16, 16, 3), jnp.float64)
        # The VGG's blocks are the ResNet's in kind (hand-made lean layers, the
        # same wrapping); the plain-Flax models cover every strategy value.
        for name, n in (("resnet", 2),):
            make = lambda s: models.ResNet((1, 1), "bottleneck", 10, jnp.float64, s)  # noqa: E731
            reference = None
            variants = {"store": (Store(),) * n, "lean": (Lean(),) * n}
            # A mix, which also stands for all-offload (the plain-Flax models run that): the
            # window spans a lean block, and the lean block's input is offloaded.
            variants["offload, then lean"] = (Offload(window=2), Lean())
            for label, strategies in variants.items():
                variables, grads, _ = _gradients(make(strategies), x, {})
                if reference is None:
                    reference = variables, grads
                assert jax.tree.structure(variables) == jax.tree.structure(reference[0]), label
                assert rel_err(grads, reference[1]) <= 1e-9, (name, label)


def test_lean_and_flax_pools_agree():
    x = normal(0, (2, 32, 32, 3))
    lean = models.VGG(models.VGG11, num_classes=10, classifier_width=32, lean_pool=True)
    flax_pool = models.VGG(models.VGG11, num_classes=10, classifier_width=32)
    variables = lean.init(jax.random.key(1), x)
    grad = lambda m: jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(m.apply(p, x)))))(variables)  # noqa: E731
    assert rel_err(grad(lean), grad(flax_pool)) <= 1e-6


def test_bad_strategies_and_models_are_named():
    x = jnp.ones((1, 32, 32, 3))
    with pytest.raises(ValueError, match="has 2 entries, but the model has 8 blocks"):
        models.VGG(models.VGG11, block_strategies=(Store(), Store())).init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="for the command line"):
        models.VGG(models.VGG11, block_strategies=("none",) * 8).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="Unknown model 'vgg20'"):
        models.create("vgg20")
    with pytest.raises(ValueError, match="wraps one block class"):
        models.create("flax-resnet18", strategy=(Lean(), Store()) * 4)
    with pytest.raises(ValueError, match="the stem takes"):
        resnet.stem_strategy(Offload(), (Store(),))


def test_lean_offload_asks_to_move_fewer_bytes_than_lean_keeps():
    # At ImageNet size, from the jaxpr alone (the same on every backend; the GPU
    # run checks that the compiled program moves what is asked).
    calls = {
        strategy: jaxoffload.offloaded_calls(
            *_abstract_step(Workload("flax-resnet50", 256, 224, "bfloat16", strategy))
        )
        for strategy in ("lean", "offload")
    }
    for lean, offload in zip(calls["lean"], calls["offload"]):
        lean_bytes = sum(
            r.nbytes
            for r in lean.residuals
            if r.reason not in ("argument in device_argnums", "a Module's variable")
        )
        assert offload.host_bytes <= lean_bytes
    # Every block moves; the stem and the classifier, outside the blocks, are lean.
    moves = [c.host_bytes > 0 for c in calls["offload"]]
    assert moves == [False] + [True] * 16 + [False], moves
    moved = requested_host_bytes(Workload("flax-resnet50", 256, 224, "bfloat16", "offload"))
    assert moved == sum(c.host_bytes for c in calls["offload"])


def _abstract_step(workload):
    step, state, batch, _ = train_step(workload, abstract=True)
    return step, state, batch


@pytest.mark.parametrize(("after", "defers"), [(Lean(), False), (Offload(), True)])
def test_an_offloading_block_defers_its_relu_only_to_an_offloading_block(after, defers):
    # Deferred to a lean block, the ReLU is one that XLA recomputes from the
    # sum in the backward pass, keeping the sum alive (XLA's live-range dump on
    # an H200); an offloading block moves the sum instead of its ReLU.
    strategies = (Offload(), after) + (Lean(),) * 6
    model = models.create("resnet18", strategy=strategies, num_classes=10)
    x = normal(0, (2, 32, 32, 3))
    variables = model.init(jax.random.key(0), x, True)
    _, state = model.apply(
        variables, x, True, mutable=["batch_stats", "intermediates"], capture_intermediates=True
    )
    (block0,) = state["intermediates"]["block0"]["__call__"]
    assert bool((block0 < 0).any()) == defers


def test_resnet_stem_follows_the_blocks_unless_told():
    for strategies, expected in [
        ((Store(), Store()), Store()),
        ((Lean(), Offload()), Lean()),
        ((Offload(), Lean()), Lean()),
        ((Offload(), Offload()), Remat()),
    ]:
        assert resnet.stem_strategy(None, strategies) == expected, strategies
    assert resnet.stem_strategy(Store(), (Offload(), Offload())) == Store()
