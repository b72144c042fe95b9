"""MobileNetV2, ConvNeXt and U-Net in plain Flax: published shapes, the plain gradient, the bench's tasks."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import normal, rel_err

import jaxoffload
from jaxoffload import Lean, Offload, Plan, Remat, Store
from jaxoffload.bench import models
from jaxoffload.bench.models import flax_convnext, flax_efficientnet, flax_mobilenet, flax_unet
from jaxoffload.bench.step import cross_entropy, train_step
from jaxoffload.bench.workload import Workload


@pytest.mark.parametrize(
    ("name", "count", "blocks"),
    [
        # torchvision's mobilenet_v2 and convnext_tiny; the U-Net as the common
        # BatchNorm reimplementations count it, with two classes.
        ("flax-mobilenetv2", 3_504_872, 17),
        ("flax-convnext-t", 28_589_128, 18),
        # torchvision's efficientnet_b0: 16 MBConv blocks with squeeze-and-excitation.
        ("flax-efficientnet-b0", 5_288_548, 16),
        ("flax-unet", 31_037_698, 9),
    ],
)
def test_published_shapes(name, count, blocks):
    # Shapes only: nothing is compiled or allocated at 224x224.
    model = models.create(name)
    shapes = jax.eval_shape(
        lambda x: model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, True),
        jnp.ones((1, 224, 224, 3)),
    )
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(shapes["params"])) == count
    assert models.num_blocks(name) == blocks
    out = jax.eval_shape(lambda v, x: model.apply(v, x, False), shapes, jnp.ones((1, 224, 224, 3)))
    per_pixel = models.task(name) == "segment"
    assert out.shape == ((1, 224, 224, 2) if per_pixel else (1, 1000))
    # ConvNeXt has no BatchNorm: its variables are its parameters alone.
    assert ("batch_stats" in shapes) == (name != "flax-convnext-t")


# Tiny versions that keep every kind of block: MobileNetV2's expansion-1 block, which at a
# quarter of the width is a residual one too, and a strided expanding one, with its dropout
# on; ConvNeXt's downsampling; a U-Net one level deep (a double conv down, at the bottom and
# up). Their blocks are few: XLA:CPU's compiles are this file's time.
TINY = {
    "mobilenetv2": (
        flax_mobilenet.MobileNetV2, flax_mobilenet.InvertedResidual,
        dict(width_multiplier=0.25, stages=((1, 16, 1, 1), (6, 24, 1, 2)), head_features=32,
             num_classes=10),
    ),
    "convnext": (
        flax_convnext.ConvNeXt, flax_convnext.ConvNeXtBlock,
        dict(stage_sizes=(1, 1), num_filters=8, num_classes=10),
    ),
    "unet": (flax_unet.UNet, flax_unet.DoubleConv, dict(num_filters=4, depth=1, num_classes=3)),
    # EfficientNet's expansion-1 block, and a strided expanding one with a 5x5 depthwise conv,
    # each with its squeeze-and-excitation.
    "efficientnet": (
        flax_efficientnet.EfficientNet, flax_efficientnet.MBConv,
        dict(stages=((1, 3, 1, 8, 1), (6, 5, 2, 16, 1)), stem_features=8, head_features=16,
             num_classes=10),
    ),
}  # fmt: skip
# An RngBitGenerator key for dropout: XLA:CPU compiles threefry slowly (a tiny U-Net's init
# took 20 s).
RNGS = {"params": jax.random.key(1), "dropout": jax.random.key(7, impl="rbg")}


def _variables(model, x):
    """Random variables in the model's shapes, drawn by numpy, so that no init is compiled.

    Scales, variances and ConvNeXt's layer scales are about 1 (the last so that its blocks'
    gradients count), the rest small.
    """
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path[-1:])
        mean, spread = (1.0, 0.1) if any(k in name for k in ("scale", "var")) else (0.0, 0.3)
        return jnp.asarray(rng.normal(mean, spread, leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, _shapes(model, x))


def _shapes(model, x):
    """The model's variables as ``jax.ShapeDtypeStruct``s: nothing is compiled."""
    return jax.eval_shape(lambda x: model.init(RNGS, x, True), x)


def _gradients(model, x, variables):
    def loss(params):
        y, state = model.apply(
            {**variables, "params": params}, x, True, mutable=["batch_stats"], rngs=RNGS
        )
        return jnp.sum(jnp.sin(y)), state

    return jax.jit(jax.grad(loss, has_aux=True))(variables["params"])


def _block_paths(variables, block):
    """The block instances' names in call order, as a linen plan names them."""
    prefix = block.__name__ + "_"
    paths = [k for k in variables["params"] if k.startswith(prefix)]
    return sorted(paths, key=lambda k: int(k.removeprefix(prefix)))


@pytest.mark.parametrize("family", list(TINY))
def test_tiny_families_give_the_plain_gradient_under_lean_offload_and_a_plan(family):
    model, block, kwargs = TINY[family]
    x = normal(0, (2, 16, 16, 3))
    plain = models.plain_model(model, block, Store(), **kwargs)
    variables = _variables(plain, x)
    grads, state = _gradients(plain, x, variables)
    # A plan mixes the strategies over the blocks (Remat's among them), the code outside lean.
    paths = _block_paths(variables, block)
    assert len(paths) == {"mobilenetv2": 2, "convnext": 2, "unet": 3, "efficientnet": 2}[family]
    cycle = (Offload(), Remat(), Offload(recompute=True))
    plan = Plan(tuple((p, cycle[n % len(cycle)]) for n, p in enumerate(paths)), Lean())
    variants = {
        "lean": models.plain_model(model, block, Lean(), **kwargs),
        "offload": models.plain_model(model, block, Offload(), **kwargs),
        "plan": plan.apply(model(block_cls=jaxoffload.linen.plannable(block), **kwargs)),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxoffload.OffloadWarning)  # nothing moves on CPU
        for label, wrapped in variants.items():
            # The plain model's variable tree, names and shapes (test_models.py checks the
            # initial values too, on the other plain models).
            shapes = jax.tree.map(jnp.shape, _shapes(wrapped, x))
            assert shapes == jax.tree.map(jnp.shape, variables), label
            got_grads, got_state = _gradients(wrapped, x, variables)
            assert rel_err(got_grads, grads) <= 1e-5, label
            assert rel_err(got_state, state) <= 1e-5, label
    if "batch_stats" in variables:  # they did move, so the state check means something
        assert rel_err(state, {"batch_stats": variables["batch_stats"]}) > 0


def test_the_bench_trains_a_segmentation_model_on_label_maps():
    # Traced, not compiled: the labels, the loss and the offloaded blocks of the registered U-Net.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxoffload.OffloadWarning)
        workload = Workload("flax-unet", 2, 32, "float32", "offload")
        step, state, batch, _ = train_step(workload, abstract=True)
        assert workload.num_classes == 2 and workload.offloaded_blocks == 9
        assert batch[1].shape == (2, 32, 32) and batch[1].dtype == jnp.int32
        calls = jaxoffload.offloaded_calls(step, state, batch)
        assert sum(c.host_bytes > 0 for c in calls) == 9
        assert jax.eval_shape(step, state, batch)[1].shape == ()
    # Classifiers keep one label per image, and their 1000 classes.
    classify = Workload("flax-mobilenetv2", 2, 32, "float32", "none")
    assert classify.num_classes == 1000
    assert train_step(classify, abstract=True)[2][1].shape == (2,)
    with pytest.raises(ValueError, match="divisible by 16, got 40x40"):
        train_step(Workload("flax-unet", 1, 40, "float32", "none"), abstract=True)


def test_per_pixel_loss_is_the_mean_over_pixels():
    rng = np.random.default_rng(1)
    logits, labels = rng.normal(size=(2, 4, 4, 3)), rng.integers(0, 3, (2, 4, 4))
    # Each pixel's -log softmax at its label, in numpy.
    log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    per_pixel = -np.take_along_axis(log_p, labels[..., None], -1)
    loss = cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(labels))
    assert float(loss) == pytest.approx(per_pixel.mean(), rel=1e-6)
    with pytest.raises(ValueError, match=r"logits \(2, 3\) do not match the labels \(2, 4, 4\)"):
        cross_entropy(jnp.asarray(logits[:, 0, 0]), jnp.asarray(labels))


def test_the_bench_trains_a_model_without_batch_stats():
    # ConvNeXt's state holds no collection but its parameters: the step's model state is empty.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxoffload.OffloadWarning)
        workload = Workload("flax-convnext-t", 2, 32, "float32", "offload")
        step, state, batch, _ = train_step(workload, abstract=True)
        (params, model_state, _), loss = jax.eval_shape(step, state, batch)
    assert state[1] == {} and model_state == {} and loss.shape == ()
    assert jax.tree.structure(params) == jax.tree.structure(state[0])
