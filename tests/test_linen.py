"""jaxoffload.linen.wrap and offload: nn.remat's shape, Flax's variables, and plain gradients."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from helpers import host_device_puts, normal, rel_err

import jaxoffload


class Block(nn.Module):
    """Conv, BatchNorm, ReLU and dropout: parameters, state and an RNG stream."""

    features: int = 8
    rate: float = 0.25

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.features, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.relu(x)
        return nn.Dropout(self.rate, deterministic=not train)(x)


class Net(nn.Module):
    """Two auto-named blocks through a transform given as a class decorator."""

    transform: object = None

    @nn.compact
    def __call__(self, x):
        block = self.transform(Block) if self.transform else Block
        for _ in range(2):
            x = block()(x)
        return nn.Dense(3)(x.mean((1, 2)))


class MethodNet(nn.Module):
    """The transform used on a method inside the class body."""

    def setup(self):
        self.block = Block(rate=0.0)
        self.head = nn.Dense(3)

    def _body(self, x):
        return self.block(x)

    body = jaxoffload.linen.wrap(_body, jaxoffload.Offload())

    def __call__(self, x):
        return self.head(self.body(x).mean((1, 2)))


TRANSFORMS = {
    "plain": None,
    "store": lambda b: jaxoffload.linen.wrap(b, jaxoffload.Store()),
    "remat": lambda b: jaxoffload.linen.wrap(b, jaxoffload.Remat()),
    "lean": lambda b: jaxoffload.linen.wrap(b, jaxoffload.Lean()),
    "offload": jaxoffload.linen.offload,
    "offload_window": functools.partial(jaxoffload.linen.offload, window=2, min_bytes=256),
    "offload_recompute": functools.partial(jaxoffload.linen.offload, recompute=True),
}


def _train_loss(model):
    def loss(params, state, x, rng):
        y, new_state = model.apply(
            {"params": params, **state}, x, rngs={"dropout": rng}, mutable=["batch_stats"]
        )
        return jnp.sum(jnp.sin(y)), new_state

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


@pytest.fixture(scope="module")
def setup():
    x = normal(0, (4, 10, 10, 3))
    variables = Net().init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, x)
    return x, variables


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_variable_tree_names_and_initial_values_are_the_plain_models(setup, name):
    x, variables = setup
    model = Net(TRANSFORMS[name])
    got = model.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, x)
    assert sorted(got["params"]) == ["Block_0", "Block_1", "Dense_0"]
    assert jax.tree.structure(got) == jax.tree.structure(variables)
    assert rel_err(got, variables) == 0.0  # the same initial values, too


def test_nn_remat_renames_what_wrap_keeps(setup):
    x, _ = setup
    rngs = {"params": jax.random.key(1), "dropout": jax.random.key(2)}
    assert sorted(Net(nn.remat).init(rngs, x)["params"])[0] == "CheckpointBlock_0"
    assert sorted(Net(TRANSFORMS["remat"]).init(rngs, x)["params"])[0] == "Block_0"


def test_a_checkpoint_of_the_plain_model_restores_into_every_strategy(setup, tmp_path):
    import orbax.checkpoint as ocp

    x, variables = setup
    # One plain training step, then a checkpoint.
    params, state = variables["params"], {"batch_stats": variables["batch_stats"]}
    (_, state), grads = _train_loss(Net())(params, state, x, jax.random.key(3))
    trained = {"params": jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), **state}
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "plain", trained)
    checkpointer.wait_until_finished()
    for name in sorted(TRANSFORMS):
        model = Net(TRANSFORMS[name])
        abstract = jax.eval_shape(
            lambda m=model: m.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, x)
        )
        restored = checkpointer.restore(tmp_path / "plain", abstract)
        assert rel_err(restored, trained) == 0.0, name
        y = model.apply(restored, x, rngs={"dropout": jax.random.key(4)}, mutable=["batch_stats"])
        ref = Net().apply(trained, x, rngs={"dropout": jax.random.key(4)}, mutable=["batch_stats"])
        assert rel_err(y, ref) <= 1e-6, name


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_gradients_batch_stats_and_dropout_match_plain(setup, name):
    x, variables = setup
    params = variables["params"]
    state = {"batch_stats": variables["batch_stats"]}
    rng = jax.random.key(3)
    (loss, new_state), grads = _train_loss(Net(TRANSFORMS[name]))(params, state, x, rng)
    (ref_loss, ref_state), ref_grads = _train_loss(Net())(params, state, x, rng)
    assert rel_err(loss, ref_loss) <= 1e-6
    assert rel_err(grads, ref_grads) <= 1e-6
    # BatchNorm's running statistics update exactly as the plain model's.
    assert rel_err(new_state, ref_state) <= 1e-6
    assert rel_err(new_state, state) > 0  # they did move


def test_offloaded_model_places_activations_on_host(setup):
    x, variables = setup
    params, state = variables["params"], {"batch_stats": variables["batch_stats"]}
    loss = _train_loss(Net(jaxoffload.linen.offload))
    jaxpr = jax.make_jaxpr(loss)(params, state, x, jax.random.key(3))
    assert host_device_puts(jaxpr) > 0
    assert (
        host_device_puts(jax.make_jaxpr(_train_loss(Net()))(params, state, x, jax.random.key(3)))
        == 0
    )


def test_parameters_stay_on_device():
    x = normal(0, (2, 6, 6, 3))
    block = jaxoffload.linen.offload(Block)(rate=0.0)
    variables = block.init(jax.random.key(0), x)

    def loss(params):
        y, _ = block.apply({**variables, "params": params}, x, mutable=["batch_stats"])
        return y.sum()

    jaxpr = jax.make_jaxpr(jax.grad(loss))(variables["params"])
    host_shapes = [
        eqn.outvars[0].aval.shape
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "device_put" and jax.memory.Space.Host in eqn.params["devices"]
    ]
    assert host_shapes and (3, 3, 3, 8) not in host_shapes  # the kernel is never copied


def test_method_form(setup):
    x, _ = setup
    model = MethodNet()
    variables = model.init(jax.random.key(0), x)

    class Plain(MethodNet):
        body = MethodNet._body

    def loss(module):
        def loss(params):
            y, _ = module.apply({**variables, "params": params}, x, mutable=["batch_stats"])
            return jnp.sum(y)

        return loss

    grads = jax.jit(jax.grad(loss(model)))(variables["params"])
    ref = jax.jit(jax.grad(loss(Plain())))(variables["params"])
    assert rel_err(grads, ref) <= 1e-6
    assert host_device_puts(jax.make_jaxpr(jax.grad(loss(model)))(variables["params"])) > 0


def test_partial_of_a_class(setup):
    x, variables = setup
    Offloaded = jaxoffload.linen.offload(functools.partial(Block, features=8))
    assert Offloaded.func.__name__ == "Block"
    block = Offloaded(name="block0")
    got = block.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    ref = Block(features=8).init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    assert rel_err(got, ref) == 0.0


def test_store_returns_the_class_and_bad_targets_are_named():
    assert jaxoffload.linen.wrap(Block, jaxoffload.Store()) is Block
    with pytest.raises(TypeError, match="not an instance"):
        jaxoffload.linen.wrap(Block(), jaxoffload.Lean())
    with pytest.raises(TypeError, match="write Lean\\(\\)"):
        jaxoffload.linen.wrap(Block, jaxoffload.Lean)


def test_a_wrapped_model_reaches_the_code_outside_its_wrapped_blocks(setup):
    # Net's classifier is outside its blocks: wrapping Net applies the strategy there.
    x, variables = setup
    params, state = variables["params"], {"batch_stats": variables["batch_stats"]}
    inner = lambda b: jaxoffload.linen.wrap(b, jaxoffload.Offload())  # noqa: E731
    for outer in (jaxoffload.Lean(), jaxoffload.Remat(), jaxoffload.Offload()):
        model = jaxoffload.linen.wrap(Net, outer)(inner)
        got = model.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, x)
        assert rel_err(got, variables) == 0.0
        (loss, new_state), grads = _train_loss(model)(params, state, x, jax.random.key(3))
        (ref_loss, ref_state), ref_grads = _train_loss(Net())(params, state, x, jax.random.key(3))
        assert rel_err(grads, ref_grads) <= 1e-6 and rel_err(new_state, ref_state) <= 1e-6


def test_static_argnums_count_self():
    # `train` (position 2, counting self) must be static: it is a Python bool.
    Offloaded = jaxoffload.linen.offload(Block, static_argnums=(2,))
    x = normal(0, (2, 6, 6, 3))
    variables = Offloaded().init(
        {"params": jax.random.key(0), "dropout": jax.random.key(1)}, x, True
    )
    y = Offloaded().apply(variables, x, False)
    assert y.shape == (2, 6, 6, 8)
    with pytest.raises(ValueError, match="count `self` as 0"):
        jaxoffload.linen.offload(Block, static_argnums=0)
    with pytest.raises(ValueError, match="count `self` as 0"):
        jaxoffload.linen.offload(Block, device_argnums=0)


def test_device_argnums_keep_an_input_on_the_device():
    x = normal(0, (2, 6, 6, 3))
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = Block(features=8).init(rngs, x)

    def placements(**kwargs):
        module = jaxoffload.linen.offload(Block, **kwargs)(features=8)

        def loss(v, x):
            rngs = {"dropout": jax.random.key(2)}
            return module.apply(v, x, rngs=rngs, mutable=["batch_stats"])[0].sum()

        (call,) = jaxoffload.offloaded_calls(jax.grad(loss, argnums=(0, 1)), variables, x)
        return [r.placement for r in call.residuals if r.shape == x.shape]

    assert placements() == ["pinned_host"]
    assert placements(device_argnums=1) == ["device"]
