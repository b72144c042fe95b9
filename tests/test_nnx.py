"""jaxoffload.nnx: every strategy on an NNX CNN trains as plain NNX and nnx.remat do."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxoffload
from jaxoffload import Lean, Offload, Remat, Store
from tests.helpers import host_device_puts, normal, rel_err


class Block(nnx.Module):
    def __init__(self, features, rngs):
        self.conv1 = nnx.Conv(features, features, (3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(features, rngs=rngs)
        self.conv2 = nnx.Conv(features, features, (3, 3), rngs=rngs)
        self.bn2 = nnx.BatchNorm(features, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)

    def __call__(self, x):
        y = self.drop(nnx.relu(self.bn1(self.conv1(x))))
        return nnx.relu(x + self.bn2(self.conv2(y)))


class Net(nnx.Module):
    def __init__(self, wrap_block, rngs):
        self.stem = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.blocks = nnx.List([Block(8, rngs) for _ in range(2)])
        self.head = nnx.Linear(8, 4, rngs=rngs)
        self.wrap_block = wrap_block

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.stem(x)), (2, 2), (2, 2))
        for block in self.blocks:
            x = self.wrap_block(lambda b, x: b(x))(block, x)
        return self.head(x.mean((1, 2)))


X = normal(0, (4, 16, 16, 3))
LABELS = jnp.array([0, 1, 2, 3])
# Store() is the function itself: nothing to compare.
STRATEGIES = {
    "Lean": Lean(),
    "Remat": Remat(),
    "Offload": Offload(),
    "Offload(window=2)": Offload(window=2),
}
WRAPS = {
    "plain": lambda f: f,
    "nnx.remat": nnx.remat,
    **{name: functools.partial(jaxoffload.nnx.wrap, strategy=s) for name, s in STRATEGIES.items()},
}


def _train(wrap, steps=2):
    model = Net(wrap, nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, labels):
        def loss_fn(model):
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss, grads

    losses, grads = [], []
    for _ in range(steps):
        loss, g = step(model, optimizer, X, LABELS)
        losses.append(loss)
        grads.append(g)
    return model, losses, grads


@pytest.fixture(scope="module")
def plain():
    return _train(WRAPS["plain"])


@pytest.mark.parametrize("name", [n for n in WRAPS if n != "plain"])
def test_every_strategy_trains_as_plain_and_nnx_remat(plain, name):
    model, losses, grads = _train(WRAPS[name])
    plain_model, plain_losses, plain_grads = plain
    for g, p in zip(grads, plain_grads):
        assert rel_err(nnx.to_pure_dict(g), nnx.to_pure_dict(p)) <= 1e-6, name
    assert rel_err(losses, plain_losses) <= 1e-6
    stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    plain_stats = nnx.to_pure_dict(nnx.state(plain_model, nnx.BatchStat))
    assert rel_err(stats, plain_stats) <= 1e-6
    # The statistics did move, and the dropout stream advanced as in plain NNX.
    assert float(jnp.abs(model.blocks[0].bn1.mean[...]).sum()) > 0
    counts = nnx.to_pure_dict(nnx.state(model, nnx.RngCount))
    assert counts == nnx.to_pure_dict(nnx.state(plain_model, nnx.RngCount))


def test_offload_places_residuals_on_the_host():
    model = Net(lambda f: jaxoffload.nnx.wrap(f, Offload()), nnx.Rngs(0, dropout=1))

    def loss(model, x):
        return model(x).sum()

    graphdef, state = nnx.split(model)

    def gradient(state, x):
        return nnx.grad(loss)(nnx.merge(graphdef, state), x)

    assert host_device_puts(jax.make_jaxpr(gradient)(state, X)) > 0


def test_a_bound_method_is_wrapped_with_its_module():
    block = Block(8, nnx.Rngs(0, dropout=1))
    x = normal(1, (2, 8, 8, 8))
    lean = jaxoffload.nnx.wrap(block.__call__, Lean())
    y = lean(x)
    assert float(jnp.abs(block.bn1.mean[...]).sum()) > 0 and y.shape == x.shape


def test_the_function_transform_refuses_nnx_modules():
    block = Block(8, nnx.Rngs(0, dropout=1))
    x = normal(1, (2, 8, 8, 8))
    with pytest.raises(TypeError, match="jaxoffload.nnx.wrap"):
        jaxoffload.offload(lambda m, x: m(x))(block, x)
    with pytest.raises(TypeError, match="NNX Module Block"):
        jaxoffload.offload(block.__call__)
    with pytest.raises(TypeError, match="jaxoffload.nnx"):
        jaxoffload.wrap(lambda ms, x: ms[0](x), Lean())([block], x)


def test_a_module_instance_is_wrapped_in_place_with_its_paths_kept():
    plain = Net(WRAPS["plain"], nnx.Rngs(0, dropout=1))
    model = Net(WRAPS["plain"], nnx.Rngs(0, dropout=1))
    for block in model.blocks:
        assert jaxoffload.nnx.wrap(block, Offload()) is block
    assert type(model.blocks[0]).__name__ == "Block"
    assert jax.tree.structure(nnx.to_pure_dict(nnx.state(model))) == jax.tree.structure(
        nnx.to_pure_dict(nnx.state(plain))
    )
    graphdef, state = nnx.split(model)

    def gradient(state, x):
        return nnx.grad(lambda m, x: m(x).sum())(nnx.merge(graphdef, state), x)

    assert host_device_puts(jax.make_jaxpr(gradient)(state, X)) > 0
    # Wrapping again replaces the strategy; it does not nest. Store() is the plain class.
    jaxoffload.nnx.wrap(model.blocks[0], Lean())
    assert type(model.blocks[0]).__mro__[1] is Block
    jaxoffload.nnx.wrap(model.blocks[0], Store())
    assert type(model.blocks[0]) is Block


def test_the_plain_nnx_resnet_trains_as_plain_with_its_stem_wrapped_too():
    from jaxoffload.bench import models
    from jaxoffload.bench.models import flax_nnx_resnet

    def gradient(strategy):
        model = flax_nnx_resnet.ResNet(
            (1, 1), flax_nnx_resnet.BottleneckResNetBlock, num_classes=4, num_filters=4,
            rngs=nnx.Rngs(0),
        )  # fmt: skip
        models.wrap_nnx_blocks(model, strategy)
        return nnx.jit(nnx.grad(lambda m: m(X).sum()))(model), model

    plain, plain_model = gradient(Store())
    plain_stats = nnx.to_pure_dict(nnx.state(plain_model, nnx.BatchStat))
    for strategy in (Lean(), Offload()):
        grads, model = gradient(strategy)
        assert type(model).__mro__[1] is flax_nnx_resnet.ResNet  # the stem's strategy
        assert rel_err(nnx.to_pure_dict(grads), nnx.to_pure_dict(plain)) <= 1e-6
        stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
        assert rel_err(stats, plain_stats) <= 1e-6


def test_static_argnums_are_checked_and_honoured():
    dense = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    def layer(dense, x, relu):
        return nnx.relu(dense(x)) if relu else dense(x)

    x = normal(2, (4, 3))
    wrapped = jaxoffload.nnx.wrap(layer, Lean(), static_argnums=2)
    for relu in (True, False):
        assert rel_err(wrapped(dense, x, relu), layer(dense, x, relu)) <= 1e-6
    with pytest.raises(ValueError, match="static_argnums=\\(5,\\)"):
        jaxoffload.nnx.wrap(layer, Lean(), static_argnums=5)(dense, x, True)


# ---- plans -------------------------------------------------------------------------------

PATHS = ("blocks/0", "blocks/1")


def _train_planned(plan, steps=2):
    model = Net(WRAPS["plain"], nnx.Rngs(0, dropout=1))
    assert plan.apply(model) is model  # in place
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    losses, grads = [], []
    for _ in range(steps):
        loss, g = nnx.jit(_step)(model, optimizer, X, LABELS)
        losses.append(loss)
        grads.append(g)
    return model, losses, grads


def _step(model, optimizer, x, labels):
    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss, grads


@pytest.mark.parametrize(
    "plan",
    [
        jaxoffload.Plan(tuple(zip(PATHS, (Lean(), Remat())))),
        jaxoffload.Plan(tuple(zip(PATHS, (Offload(), Offload(window=2)))), Lean()),
        jaxoffload.Plan(tuple(zip(PATHS, (Remat(), Remat()))), Remat()),  # plain's arithmetic
        jaxoffload.Plan(tuple(zip(PATHS, (Store(), Lean()))), Lean()),  # a StoredCall inside
    ],
    ids=["mixed", "offload", "remat-control", "stored-inside-lean"],
)
def test_an_applied_plan_trains_as_plain(plain, plan):
    model, losses, grads = _train_planned(plan)
    plain_model, plain_losses, plain_grads = plain
    for g, p in zip(grads, plain_grads):
        assert rel_err(nnx.to_pure_dict(g), nnx.to_pure_dict(p)) <= 1e-6
    assert rel_err(losses, plain_losses) <= 1e-6
    stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    assert rel_err(stats, nnx.to_pure_dict(nnx.state(plain_model, nnx.BatchStat))) <= 1e-6
    assert type(model.blocks[1]).__name__ == "Block"
    # Store() everywhere puts the model back as it was.
    jaxoffload.Plan(tuple((p, Store()) for p in PATHS)).apply(model)
    assert type(model) is Net and type(model.blocks[1]) is Block


def test_plan_finds_the_blocks_in_call_order_and_leaves_the_model_as_it_was():
    model = Net(WRAPS["plain"], nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    before = nnx.to_pure_dict(nnx.state(model, (nnx.Param, nnx.BatchStat)))
    plan = jaxoffload.plan(
        model, _step, optimizer, X, LABELS, budget=1.0, blocks=Block,
        options=(Store(),), runs=1, progress=False,
    )  # fmt: skip
    assert [p for p, _ in plan.blocks] == list(PATHS)
    assert plan.compiled_bytes <= plan.budget_bytes
    assert type(model) is Net and all(type(b) is Block for b in model.blocks)
    # Nothing ran on the model's own variables: the timing runs use zeros.
    assert rel_err(nnx.to_pure_dict(nnx.state(model, (nnx.Param, nnx.BatchStat))), before) == 0


def test_plan_says_how_to_select_an_nnx_models_blocks():
    model = Net(WRAPS["plain"], nnx.Rngs(0, dropout=1))
    with pytest.raises(ValueError, match=r"blocks=MyBlock.*Block \(2\)"):
        jaxoffload.plan(model, _step, X, LABELS, budget=1.0, progress=False)
    with pytest.raises(ValueError, match="is inside block 'blocks/0'"):
        jaxoffload.plan(
            model, _step, X, LABELS, budget=1.0, blocks=(Block, nnx.Conv), progress=False
        )
    with pytest.raises(ValueError, match="selects no submodule"):
        jaxoffload.plan(model, _step, X, LABELS, budget=1.0, blocks=nnx.Embed, progress=False)
    with pytest.raises(ValueError, match="does not have; its submodules are"):
        jaxoffload.Plan((("blocks/7", Lean()),)).apply(model)
    # A block where its class is meant, and a selection of one argument, were called as
    # blocks(path, module), and Python's arity error named the block's __call__ or the lambda.
    with pytest.raises(TypeError, match=r"blocks= takes the blocks' class, not a block: got a "
                       r"Block instance; write blocks=Block"):  # fmt: skip
        jaxoffload.plan(model, _step, X, LABELS, budget=1.0, blocks=model.blocks[0])
    with pytest.raises(TypeError, match=r"called as blocks\(path, module\).*<lambda>\(path\) "
                       r"cannot be called so"):  # fmt: skip
        jaxoffload.plan(model, _step, X, LABELS, budget=1.0, blocks=lambda path: "blocks" in path)


def test_blocks_are_found_in_call_order_not_graph_order():
    from jaxoffload._src.planner.program import discover as _discover

    class Pair(nnx.Module):
        def __init__(self, rngs):
            self.z_first, self.a_second = Block(8, rngs), Block(8, rngs)

        def __call__(self, x):
            return self.a_second(self.z_first(x))

    model = Pair(nnx.Rngs(0, dropout=1))
    x = normal(1, (2, 8, 8, 8))
    paths, calls = _discover(model, nnx.grad(lambda m, x: m(x).sum()), (x,), Block)
    assert paths == ["z_first", "a_second"] and len(calls) == 2


def test_donating_an_nnx_modules_state_is_refused_by_name():
    from jaxoffload._src.nnx import functional

    model = Net(WRAPS["plain"], nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"names the NNX Modules at \[0\]"):
        functional(_step, model, (optimizer, X, LABELS), donate_argnums=0)
    with pytest.raises(ValueError, match=r"positions \[3\], but the step takes 3 arguments"):
        functional(_step, model, (optimizer, X, LABELS), donate_argnums=3)
    _, arrays, donate = functional(_step, model, (optimizer, X, LABELS), donate_argnums=(1, 2))
    assert donate == (1, 2) and arrays[1] is X


class ListNet(nnx.Module, pytree=False):  # flax's opt-out of pytree mode: blocks in a list
    def __init__(self, rngs):
        self.blocks = [Block(8, rngs) for _ in range(2)]
        self.head = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((1, 2)))


@pytest.mark.parametrize("wrapped", ["model", "blocks"])
def test_a_module_out_of_pytree_mode_keeps_its_state_and_gradients_when_wrapped(wrapped):
    x = normal(1, (2, 8, 8, 8))

    def gradients(model):
        return nnx.to_pure_dict(nnx.grad(lambda m: m(x).sum())(model))

    plain = gradients(ListNet(nnx.Rngs(0, dropout=1)))
    model = ListNet(nnx.Rngs(0, dropout=1))
    for module in [model] if wrapped == "model" else model.blocks:
        jaxoffload.nnx.wrap(module, Lean())
    assert nnx.to_pure_dict(nnx.state(model)).keys() == {"blocks", "head"}
    got = gradients(model)
    assert jax.tree.structure(got) == jax.tree.structure(plain)
    assert rel_err(got, plain) <= 1e-6


def test_the_gradient_of_the_input_with_the_module_closed_over_runs_as_plain():
    # What a wrapped call writes back is what it changed: a write of an unchanged Param
    # would be refused here, the Module living outside jax.grad's trace.
    x = normal(1, (2, 8, 8, 8))
    conv = nnx.Conv(8, 8, (3, 3), rngs=nnx.Rngs(0))
    plain = jax.grad(lambda x: conv(x).sum())(x)
    jaxoffload.nnx.wrap(conv, Lean())
    assert rel_err(jax.grad(lambda x: conv(x).sum())(x), plain) <= 1e-6


def test_a_module_with_no_call_of_its_own_is_refused_where_it_would_wrap_nothing():
    # An nnx.List is iterated, never called: its wrap changed nothing, silently.
    model = Net(WRAPS["plain"], nnx.Rngs(0, dropout=1))
    with pytest.raises(TypeError, match=r"List has no __call__.*for block in model.blocks"):
        jaxoffload.nnx.wrap(model.blocks, Remat())
    assert jaxoffload.nnx.wrap(model.blocks, Store()) is model.blocks  # Store() wraps nothing


def test_a_module_wrapped_in_place_pickles_and_loads_wrapped():
    import pickle

    conv = jaxoffload.nnx.wrap(nnx.Conv(8, 8, (3, 3), rngs=nnx.Rngs(0)), Offload(window=2))
    loaded = pickle.loads(pickle.dumps(conv))
    assert type(loaded).__name__ == "Conv" and type(loaded).__mro__[1] is nnx.Conv
    x = normal(1, (2, 8, 8, 8))
    graphdef, state = nnx.split(loaded)

    def gradient(state, x):
        return nnx.grad(lambda m, x: m(x).sum())(nnx.merge(graphdef, state), x)

    assert host_device_puts(jax.make_jaxpr(gradient)(state, x)) > 0  # Offload() still applies
    assert rel_err(nnx.to_pure_dict(nnx.state(loaded)), nnx.to_pure_dict(nnx.state(conv))) == 0
