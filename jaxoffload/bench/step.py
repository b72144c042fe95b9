"""A workload's training step: its model, state, batch and loss, and one SGD update."""

from __future__ import annotations

from collections.abc import Sequence

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxoffload import Plan, Strategy
from jaxoffload.bench import models
from jaxoffload.bench.catalog import PLANS
from jaxoffload.bench.workload import Workload

__all__ = [
    "cross_entropy",
    "images_and_labels",
    "linen_model",
    "nnx_training",
    "placed",
    "run_once",
    "sgd_step",
    "train_step",
    "training",
    "uniform_strategy",
    "value_and_grad",
]


def train_step(workload: Workload, *, abstract: bool = False):
    """The jitted, state-donating training step of a workload, its state and batch.

    Args:
      workload: what to build.
      abstract: return the state and batch as ``jax.ShapeDtypeStruct``s,
        allocating nothing (for tracing at any size).

    Returns:
      ``(step, state, batch, loss_fn)``: ``step(state, batch) -> (state, loss)``
      with ``state = (params, model_state, opt_state)``, and
      ``loss_fn(params, model_state, batch) -> (loss, model_state)``, of one
      micro-batch under an accumulating strategy. With ``num_devices`` > 1 the state
      and batch are placed for data parallelism (:func:`placed`).
    """
    if models.is_nnx(workload.model):
        step, state, batch, loss_fn = nnx_training(workload, abstract=abstract)
        return jax.jit(step, donate_argnums=0), state, batch, loss_fn
    step, state, batch, loss_fn = training(workload, linen_model(workload), abstract=abstract)
    return jax.jit(step, donate_argnums=0), state, batch, loss_fn


def linen_model(workload: Workload, *, plannable: bool = False) -> flax.linen.Module:
    """The workload's linen model: under its strategy or its plan, or plannable (plain-Flax)."""
    dtype = jnp.dtype(workload.dtype)
    if not (plannable or workload.runs_plan):
        return models.create(
            workload.model,
            strategy=workload.block_strategies,
            dtype=dtype,
            num_classes=workload.num_classes,
        )
    model = models.plannable_model(workload.model, dtype=dtype, num_classes=workload.num_classes)
    if plannable:
        return model
    return workload.block_plan.apply(model)


def training(workload: Workload, model, *, abstract: bool | None):
    """``(step, state, batch, loss_fn)`` of :func:`train_step` for ``model``, ``step`` not jitted.

    With ``abstract=None``, nothing is initialised: ``state`` and ``batch`` are ``None``.
    """
    tx = _OPTIMIZER

    def rngs():
        # Models with dropout draw from this stream; the same key every step keeps the
        # gradients of different strategies comparable. Made where it is traced, so that
        # building a step dispatches nothing (a deviceless compile has no device to run on).
        return {"dropout": jax.random.key(2)}

    def init():
        x, labels = images_and_labels(workload)
        variables = model.init({"params": jax.random.key(1), **rngs()}, x[:1], True)
        params = variables.pop("params")
        return (params, dict(variables), tx.init(params)), (x, labels)

    def loss_fn(params, model_state, batch):
        x, labels = batch
        logits, new_state = model.apply(
            {"params": params, **model_state}, x, True, mutable=list(model_state), rngs=rngs()
        )
        return cross_entropy(logits, labels), new_state

    step = sgd_step(loss_fn, tx, workload.micro_batch)
    if abstract is None:
        return step, None, None, loss_fn
    state, batch = placed(init, workload, abstract=abstract)
    return step, state, batch, loss_fn


def nnx_training(workload: Workload, *, abstract: bool | None, model=None):
    """:func:`training` for a plain Flax NNX model: the state is its split, as pytrees.

    ``model`` gives the step its Modules' classes (under a plan, say): its
    variables are not used, the state's are.
    """
    tx = _OPTIMIZER

    def build():
        model = models.create_nnx(
            workload.model,
            strategy=None
            if workload.strategy in PLANS
            else uniform_strategy(workload.block_strategies),
            dtype=jnp.dtype(workload.dtype),
            num_classes=workload.num_classes,
            rngs=nnx.Rngs(1),
        )
        if workload.strategy in PLANS and workload.planned is not None:
            Plan.from_dict(workload.planned).apply(model)
        return model

    graphdef = nnx.split(nnx.eval_shape(build) if model is None else model, nnx.Param, ...)[0]

    def init():
        _, params, rest = nnx.split(build(), nnx.Param, ...)
        return (params, rest, tx.init(params)), images_and_labels(workload)

    def loss_fn(params, model_state, batch):
        x, labels = batch
        # Fresh Variables of this trace: NNX refuses to mutate those of an outer one.
        model = nnx.merge(graphdef, params, model_state, copy=True)
        return cross_entropy(model(x), labels), nnx.split(model, nnx.Param, ...)[2]

    step = sgd_step(loss_fn, tx, workload.micro_batch)
    if abstract is None:
        return step, None, None, loss_fn
    state, batch = placed(init, workload, abstract=abstract)
    return step, state, batch, loss_fn


def placed(init, workload: Workload, *, abstract: bool):
    """``init()``'s ``(state, batch)``, made on the devices that the step reads them on.

    With ``num_devices`` > 1 (data parallel), they are made over a mesh of the
    first devices, ``jax.make_mesh``'s, as in ``tests/test_sharding.py`` and
    :mod:`jaxoffload.bench.distributed_example`: the batch split along its
    axis ``data``, the state replicated. With ``spatial`` > 1 the mesh has an
    axis ``space`` too, of Auto type, as ``tests/test_spatial.py`` has it: the
    images and per-pixel labels are split along their rows over it, and the
    partitioner carries the split through the step. Each device makes its own
    part, so no device ever holds the whole batch. With ``abstract``, they are
    ``jax.ShapeDtypeStruct``s with those shardings, allocating nothing.
    """
    if workload.devices == 1:
        # Eager init dispatches hundreds of small ops: jit makes it one program.
        return jax.eval_shape(init) if abstract else run_once(init)
    mesh = workload.mesh()
    replicated = NamedSharding(mesh, P())

    def split(leaf):  # the batch's axis over "data", an image's rows over "space"
        spec = ("data", "space")[: min(leaf.ndim, 2 if workload.spatial > 1 else 1)]
        return NamedSharding(mesh, P(*spec))

    state, batch = jax.eval_shape(init)
    shardings = jax.tree.map(lambda _: replicated, state), jax.tree.map(split, batch)
    if not abstract:
        return run_once(init, out_shardings=shardings)
    return jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
        (state, batch), shardings,
    )  # fmt: skip


def run_once(init, **jit_options):
    """``jax.jit(init, **jit_options)()``, compiled as a program that runs once.

    An init draws every parameter from jax's PRNG, and on CPU most of its compile is LLVM
    optimising those draws at XLA's default level, 3, for a program that runs once. On CPU
    it is compiled at level 2, which gives the same bits (``tests/test_models.py`` checks
    it) in a fraction of the compile; elsewhere as jit compiles it.
    """
    lowered = jax.jit(init, **jit_options).lower()
    on_cpu = jax.default_backend() == "cpu"
    return lowered.compile({"xla_backend_optimization_level": 2} if on_cpu else None)()


def uniform_strategy(strategies: Sequence[Strategy]) -> Strategy:
    """The one strategy of every block: a plain-Flax model wraps one block class."""
    (strategy,) = set(strategies)
    return strategy


# Every workload's optimizer: SGD with momentum, as in the records.
_OPTIMIZER = optax.sgd(1e-3, momentum=0.9)


def images_and_labels(workload: Workload):
    """The workload's images and labels, the same for every strategy and API.

    The labels follow the model's task (:func:`jaxoffload.bench.models.task`):
    one per image for ``"classify"``, a ``(batch, height, width)`` map for
    ``"segment"``.
    """
    key = jax.random.key(0)
    shape = (workload.batch, workload.image_size, workload.image_size, 3)
    x = jax.random.normal(key, shape, jnp.dtype(workload.dtype))
    labels = shape[:1] if models.task(workload.model) == "classify" else shape[:3]
    return x, jax.random.randint(key, labels, 0, workload.num_classes)


def cross_entropy(logits, labels):
    """The mean softmax cross entropy: over images, or over every pixel of a segmentation.

    The logits have one axis more than the labels, their last: ``(batch,
    classes)`` against ``(batch,)``, or ``(batch, height, width, classes)``
    against ``(batch, height, width)``.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"the logits {logits.shape} do not match the labels {labels.shape}: a model's task "
            "(jaxoffload.bench.models.task) sets the labels' shape, one per image or per pixel."
        )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return loss.mean()


def sgd_step(loss_fn, tx, micro_batch: int | None = None):
    """``step(state, batch)`` for ``state = (params, model_state, opt_state)``: one update.

    With ``micro_batch``, of the gradient accumulated over micro-batches
    (:func:`value_and_grad`).
    """
    loss_and_grads = value_and_grad(loss_fn, micro_batch)

    def step(state, batch):
        params, model_state, opt_state = state
        (loss, model_state), grads = loss_and_grads(params, model_state, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), model_state, opt_state), loss

    return step


def value_and_grad(loss_fn, micro_batch: int | None = None):
    """``jax.value_and_grad(loss_fn, has_aux=True)``, or its mean over micro-batches.

    Accumulated, the micro-batches run in one ``lax.scan``, so that the
    compiled loop holds one micro-batch's activations, and their mean-loss
    gradients are summed and divided by their count: the whole batch's
    gradient, where the loss is a mean over images and nothing else couples
    them. BatchNorm's batch statistics do: each micro-batch is normalised by
    its own, and updates the running averages in turn (``model_state`` is the
    loop's carry). Dropout draws each micro-batch's masks for its own shape.
    The loss returned is the micro-batches' mean.
    """
    plain = jax.value_and_grad(loss_fn, has_aux=True)
    if micro_batch is None:
        return plain

    def accumulated(params, model_state, batch):
        count = jax.tree.leaves(batch)[0].shape[0] // micro_batch
        # Micro-batch i is images i, i + count, i + 2 count...: a batch split over devices
        # splits so on each device, and each micro-batch stays split over all of them.
        micro_batches = jax.tree.map(
            lambda a: a.reshape(micro_batch, count, *a.shape[1:]).swapaxes(0, 1), batch
        )

        def add(carry, micro):
            loss_sum, grads_sum, model_state = carry
            (loss, model_state), grads = plain(params, model_state, micro)
            return (loss_sum + loss, jax.tree.map(jnp.add, grads_sum, grads), model_state), None

        zeros = jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params)
        (loss, grads, model_state), _ = jax.lax.scan(add, (*zeros, model_state), micro_batches)
        return (loss / count, model_state), jax.tree.map(lambda g: g / count, grads)

    return accumulated
