"""Reference VGGs: parameter counts, and one variable tree for every block strategy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import normal, rel_err

import jaxoffload
from jaxoffload import models
from jaxoffload.benchmark import Workload, requested_host_bytes
from jaxoffload.models import resnet
from jaxoffload.models.vgg import num_conv_blocks


@pytest.mark.parametrize(
    ("name", "count"),
    [
        ("vgg11", 132_863_336),
        ("vgg13", 133_047_848),
        ("vgg16", 138_357_544),
        ("vgg19", 143_667_240),
        ("vgg19_bn", 143_678_248),
        ("resnet18", 11_689_512),
        ("resnet34", 21_797_672),
        ("resnet50", 25_557_032),
        ("resnet101", 44_549_160),
        ("resnet152", 60_192_808),
    ],
)
def test_imagenet_parameter_counts(name, count):
    # The torchvision references; BatchNorm statistics are not parameters.
    model = models.create(name)
    shapes = jax.eval_shape(
        lambda x: model.init(jax.random.key(0), x, True), jnp.ones((1, 224, 224, 3))
    )
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(shapes["params"])) == count


# One block per stage keeps the test fast; the models differ only in depth.
# Each factory takes the strategy of every block.
SMALL_MODELS = {
    "basic resnet": lambda s: models.ResNet((1, 1, 1, 1), "basic", 10, jnp.float64, (s,) * 4),
    "bottleneck resnet": lambda s: models.ResNet(
        (1, 1, 1, 1), "bottleneck", 10, jnp.float64, (s,) * 4
    ),
    "vgg11": lambda s: models.VGG(models.VGG11, 10, jnp.float64, (s,) * 8, classifier_width=32),
    "vgg11_bn": lambda s: models.VGG(
        models.VGG11, 10, jnp.float64, (s,) * 8, classifier_width=32, norm=True
    ),
}


@pytest.mark.parametrize("name", SMALL_MODELS)
def test_every_strategy_gives_the_plain_gradient(name):
    # float64: at initialisation a deep BatchNorm network amplifies float32
    # rounding differences between equivalent formulas to about 1e-5.
    with jax.enable_x64(True):
        x = normal(0, (2, 32, 32, 3), jnp.float64)
        reference = None
        variants = [(s, SMALL_MODELS[name](s)) for s in models.BLOCK_STRATEGIES]
        # Offloading blocks chained by a schedule, alone and between lean ones.
        offload = SMALL_MODELS[name]("offload")
        n = len(offload.block_strategies)
        hidden = ("offload", "lean") * (n // 2)
        if name in ("vgg11", "bottleneck resnet"):  # one of each kind keeps the suite short
            variants += [
                ("offload, window 2", offload.clone(offload_window=2)),
                ("offload, window 3", offload.clone(offload_window=3)),
                ("offload-hidden-like", offload.clone(block_strategies=hidden, offload_window=2)),
            ]
        if name == "bottleneck resnet":
            variants += [
                ("offload, a window per stage", offload.clone(offload_window=(1, 2, 2, 1)))
            ]
        for strategy, model in variants:
            variables = model.init(jax.random.key(1), x, True)

            def loss(params, model=model, variables=variables):
                y, _ = model.apply(
                    {**variables, "params": params}, x, True, mutable=["batch_stats"]
                )
                return jnp.sum(jnp.sin(y))

            grads = jax.jit(jax.grad(loss))(variables["params"])
            if reference is None:
                reference = variables, grads
            assert jax.tree.structure(variables) == jax.tree.structure(reference[0]), strategy
            assert rel_err(grads, reference[1]) <= 1e-9, strategy


def test_strategies_share_variables_and_gradients():
    config, x = models.VGG11, normal(0, (2, 32, 32, 3))
    n = num_conv_blocks(config)
    variants = {
        "none": (),
        "remat": models.first_k("remat", n, n),
        "offload-plain": models.first_k("offload-plain", n, n),
        "mixed": ("offload-plain", "remat") * (n // 2),
    }
    results = {}
    for name, strategies in variants.items():
        model = models.VGG(config, num_classes=10, classifier_width=32, block_strategies=strategies)
        variables = model.init(jax.random.key(1), x)
        loss = lambda p: jnp.sum(jnp.sin(model.apply(p, x)))  # noqa: E731, B023
        results[name] = variables, jax.jit(jax.grad(loss))(variables)
    ref_vars, ref_grads = results["none"]
    for name, (variables, grads) in results.items():
        assert jax.tree.structure(variables) == jax.tree.structure(ref_vars), name
        assert rel_err(variables, ref_vars) == 0.0, name
        assert rel_err(grads, ref_grads) <= 1e-6, name


def test_lean_and_flax_pools_agree():
    x = normal(0, (2, 32, 32, 3))
    lean = models.VGG(models.VGG11, num_classes=10, classifier_width=32, lean_pool=True)
    flax_pool = models.VGG(models.VGG11, num_classes=10, classifier_width=32)
    variables = lean.init(jax.random.key(1), x)
    grad = lambda m: jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(m.apply(p, x)))))(variables)  # noqa: E731
    assert rel_err(grad(lean), grad(flax_pool)) <= 1e-6


def test_bad_strategies_are_named():
    x = jnp.ones((1, 32, 32, 3))
    with pytest.raises(ValueError, match="has 2 entries, but the model has 8 blocks"):
        models.VGG(models.VGG11, block_strategies=("none", "none")).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="Unknown block strategy 'swap'"):
        models.VGG(models.VGG11, block_strategies=("swap",) * 8).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="between 0 and 8"):
        models.first_k("offload", 9, 8)
    with pytest.raises(ValueError, match="Unknown block strategy"):
        models.wrap_block(models.ConvBlock, "swap")
    with pytest.raises(ValueError, match="Unknown model 'vgg20'"):
        models.create("vgg20")


@pytest.mark.parametrize("name", ["vgg11", "resnet18"])
def test_lean_blocks_mix_with_the_others(name):
    # A lean block leaves its ReLU to its reader: a lean or plain block, or the head.
    n = models.num_blocks(name)
    mixed = ("lean", "none", "offload", "lean-unordered", "remat", "lean", "none", "lean")[:n]
    with jax.enable_x64(True):
        x = normal(0, (2, 32, 32, 3), jnp.float64)
        grads = {}
        for strategies in (("none",) * n, mixed):
            model = models.create(name, strategy=strategies, num_classes=10, dtype=jnp.float64)
            variables = model.init(jax.random.key(1), x, True)

            def loss(params, model=model, variables=variables):
                y, _ = model.apply(
                    {**variables, "params": params}, x, True, mutable=["batch_stats"]
                )
                return jnp.sum(jnp.sin(y))

            grads[strategies] = jax.jit(jax.grad(loss))(variables["params"])
        plain, lean = grads.values()
        assert rel_err(lean, plain) <= 1e-9


@pytest.mark.parametrize(
    ("name", "batch", "at_most"), [("vgg19", 128, 0.5), ("resnet50", 256, 0.15)]
)
def test_lean_offload_asks_to_move_fewer_bytes(name, batch, at_most):
    # At ImageNet size, from the jaxpr alone (the same on every backend; the GPU
    # run checks that the compiled program moves what is asked).
    requested = {
        strategy: requested_host_bytes(Workload(name, batch, 224, "bfloat16", strategy))
        for strategy in ("offload-plain", "offload")
    }
    assert 0 < requested["offload"] <= at_most * requested["offload-plain"], requested


def test_an_offloading_block_leaves_on_the_device_an_input_kept_there_anyway():
    # After a lean block, whose fused tail keeps its output (this block's
    # input), or after the lean stem, which keeps its pooled output.
    def host_bytes(plan):
        workload = Workload("resnet50", 2, 64, "bfloat16", "offload-hidden", plan=plan)
        step, state, batch, _ = jaxoffload.benchmark.train_step(workload, abstract=True)
        calls = jaxoffload.offloaded_calls(step, state, batch)
        return [c.host_bytes for c in calls]

    every = host_bytes(("offload",) * 16)
    between_lean = host_bytes(("offload", "lean", "offload") + ("lean",) * 13)
    # Block 1 moves its input (the sum of block 0, which keeps nothing on the
    # device) and its 3x3 convolution's output, 256 and 64 channels at 16x16.
    assert every[1] == 2 * 16 * 16 * (256 + 64) * 2
    # Blocks 0 and 2, between lean layers, move only the 3x3 convolution's output.
    assert between_lean[0] == between_lean[2] == 2 * 16 * 16 * 64 * 2
    assert between_lean[1] == 0


@pytest.mark.parametrize(("after", "defers"), [("lean", False), ("offload", True), ("none", False)])
def test_an_offloading_block_defers_its_relu_only_to_an_offloading_block(after, defers):
    # Deferred to a lean block, the ReLU is one that XLA recomputes from the
    # sum in the backward pass, keeping the sum alive (XLA's live-range dump on
    # an H200); an offloading block moves the sum instead of its ReLU.
    strategies = ("offload", after) + ("lean",) * 6
    model = models.create("resnet18", strategy=strategies, num_classes=10)
    x = normal(0, (2, 32, 32, 3))
    variables = model.init(jax.random.key(0), x, True)
    _, state = model.apply(
        variables, x, True, mutable=["batch_stats", "intermediates"], capture_intermediates=True
    )
    (block0,) = state["intermediates"]["block0"]["__call__"]
    assert bool((block0 < 0).any()) == defers


def test_resnet_stem_follows_the_blocks_unless_told():
    x = jnp.ones((2, 32, 32, 3))
    for strategies, expected in [
        (("none", "none"), "none"),
        (("lean", "offload"), "lean"),
        (("offload", "lean"), "lean"),
        (("offload", "offload"), "remat"),
    ]:
        assert resnet._stem_strategy("auto", strategies) == expected, strategies
    assert resnet._stem_strategy("none", ("offload", "offload")) == "none"

    def stem_sized_residuals(stem):
        # Residuals of the stem convolution's output size (2, 16, 16, 64).
        model = models.ResNet((1, 1), "basic", 10, block_strategies=("none",) * 2, stem=stem)
        variables = model.init(jax.random.key(0), x, True)

        def forward(params):
            y, _ = model.apply({**variables, "params": params}, x, True, mutable=["batch_stats"])
            return y

        saved = jaxoffload.saved_residuals(jaxoffload.offload(forward), variables["params"])
        return sorted(str(r.dtype) for r in saved if r.shape == (2, 16, 16, 64))

    assert stem_sized_residuals("lean") == ["float32"]  # the convolution's output
    assert stem_sized_residuals("remat") == []
    assert len(stem_sized_residuals("none")) > 1
    with pytest.raises(ValueError, match="Unknown stem 'big'"):
        stem_sized_residuals("big")


def test_resnet_takes_one_window_per_stage():
    x = jnp.ones((1, 32, 32, 3))
    model = models.ResNet((1, 1), "basic", 10, block_strategies=("offload",) * 2)
    variables = model.clone(offload_window=(1, 2)).init(jax.random.key(0), x)
    assert "block1" in variables["params"]
    with pytest.raises(
        ValueError, match="offload_window has 3 entries, but the model has 2 stages"
    ):
        model.clone(offload_window=(1, 2, 2)).init(jax.random.key(0), x)


def test_stages_with_equal_windows_share_one_chain():
    # Gates link consecutive calls of one chain; each adds barriers to the step.
    x = jnp.ones((1, 32, 32, 3))

    def barriers(window):
        model = models.ResNet((1, 1, 1, 1), "basic", 10, block_strategies=("offload",) * 4)
        model = model.clone(offload_window=window)
        variables = model.init(jax.random.key(0), x)

        def loss(params):
            y, _ = model.apply({**variables, "params": params}, x, True, mutable=["batch_stats"])
            return jnp.sum(y)

        return str(jax.make_jaxpr(jax.grad(loss))(variables["params"])).count(
            "optimization_barrier"
        )

    # Window 1 has no gates; one chain of four calls at window 2 has three; with 2,2,1,1
    # the first two stages share a chain (one gate) and the last two start another.
    ungated, three, one = barriers((1, 1, 1, 1)), barriers((2, 2, 2, 2)), barriers((2, 2, 1, 1))
    assert ungated < one < three
    assert three - ungated == 3 * (one - ungated)
    assert barriers(1) == ungated and barriers(2) == three
