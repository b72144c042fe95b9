"""Lean(max_slowdown=...): a block whose lean cut is slower than jax's choice takes a fallback."""

import json

import jax
import jax.numpy as jnp
import pytest

from jaxoffload import Lean, Store, offloaded_calls, saved_residuals, wrap
from jaxoffload._src import fallbacks
from tests.helpers import normal, rel_err


def conv(x, w):
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def block(x, w, v):
    # The 1x1 convolution is cheap beside the 3x3 one, and its output wide: a lean cut
    # recomputes it rather than keep its tanh; one that recomputes no product keeps that.
    return jnp.tanh(conv(conv(x, w), v)).sum(-1, keepdims=True) * x


X, W, V = normal(0, (2, 8, 8, 4)), 0.3 * normal(1, (3, 3, 4, 4)), 0.3 * normal(2, (1, 1, 4, 8))


def gradients(f):
    return jax.jit(jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2)))(X, W, V)


def kept(strategy):
    """The bytes the wrapped block keeps: jax's residuals for Store, listed as its own call lists them."""
    wrapped = wrap(block, strategy, device_argnums=(1, 2))
    return sum(r.nbytes for r in saved_residuals(wrapped, X, W, V))


@pytest.fixture(autouse=True)
def nothing_timed_yet(monkeypatch):
    monkeypatch.setattr(fallbacks, "CHOSEN", {})


LEAN, NO_PRODUCT = Lean(), Lean(max_recompute=0.0)
NAMES = {
    LEAN: "Lean(max_recompute=0.25)",
    NO_PRODUCT: "Lean(max_recompute=0.0)",
    Store(): "Store()",
}


@pytest.mark.parametrize(
    "times, chosen, timed",
    [
        ({LEAN: 1.00, Store(): 1.00}, LEAN, [[LEAN, Store()]]),  # the cut costs nothing: it stays
        # Its products are what cost: the cut that recomputes none is timed next, and taken.
        ({LEAN: 1.30, NO_PRODUCT: 1.02, Store(): 1.00}, NO_PRODUCT,
         [[LEAN, Store()], [NO_PRODUCT, Store()]]),
        ({LEAN: 1.30, NO_PRODUCT: 1.20, Store(): 1.00}, Store(),  # every cut costs: jax's choice
         [[LEAN, Store()], [NO_PRODUCT, Store()]]),
    ],
)  # fmt: skip
def test_the_first_fallback_within_max_slowdown_is_taken(monkeypatch, times, chosen, timed):
    calls = []
    monkeypatch.setattr(
        fallbacks, "time_candidates", lambda c, _: calls.append(c) or [times[x] for x in c]
    )
    strategy = Lean(max_slowdown=0.03)
    assert strategy.fallbacks() == (LEAN, NO_PRODUCT, Store())
    assert kept(strategy) == kept(chosen)
    assert len({kept(LEAN), kept(NO_PRODUCT), kept(Store())}) == 3
    assert rel_err(gradients(wrap(block, strategy, device_argnums=(1, 2))), gradients(block)) < 1e-6
    kept(strategy)  # traced again: not timed again
    assert calls == timed  # leanest first, each beside Store, until one is within the limit
    step = jax.grad(lambda *a: wrap(block, strategy, device_argnums=(1, 2))(*a).sum())
    assert [c.strategy for c in offloaded_calls(step, X, W, V)] == [chosen]  # what users read
    # What a record lists: the block by its inputs beside the parameters, and why it took what it
    # did: each pair timed, by their reprs.
    assert fallbacks.taken() == [
        {
            "inputs": "float32[2, 8, 8, 4]",
            "times_ms": [{NAMES[x]: times[x] for x in pair} for pair in timed],
            "strategy": repr(chosen),
        }
    ]


def test_the_candidates_are_timed_on_the_device_while_the_step_is_traced():
    strategy = Lean(max_slowdown=10.0)  # any cut is within it: the lean one stays
    grads = gradients(wrap(block, strategy, device_argnums=(1, 2)))
    assert rel_err(grads, gradients(block)) < 1e-6
    assert [c.strategy for c in fallbacks.CHOSEN.values()] == [Lean()]


def test_only_a_differentiated_call_is_timed(monkeypatch):
    # An init or an evaluation runs the block alone, the same under every fallback.
    import flax.linen as nn

    import jaxoffload

    calls = []
    monkeypatch.setattr(fallbacks, "time_candidates", lambda c, _: calls.append(c) or [1.0] * 2)
    Block = jaxoffload.linen.wrap(nn.Dense, Lean(max_slowdown=0.03))
    variables = Block(4).init(jax.random.key(0), X[0, 0])
    jax.jit(Block(4).apply)(variables, X[0, 0])
    wrap(block, Lean(max_slowdown=0.03), device_argnums=(1, 2))(X, W, V)
    assert calls == []
    jax.grad(lambda v: Block(4).apply(v, X[0, 0]).sum())(variables)
    assert len(calls) == 1


def test_each_program_is_compiled_once_and_only_as_far_as_needed(monkeypatch):
    compiled = []
    compile_all = fallbacks.timing.compile_all
    monkeypatch.setattr(
        fallbacks.timing,
        "compile_all",
        lambda xs, **kw: compiled.extend(xs) or compile_all(xs, **kw),
    )

    def elementwise(x, w):  # no product: the lean cut and the one that recomputes none agree
        return jnp.sin(x * w) * x

    def chosen(f, *args):
        fallbacks.CHOSEN.clear()
        compiled.clear()
        n = len(args)
        jax.grad(lambda *a: wrap(f, strategy, device_argnums=tuple(range(1, n)))(*a).sum())(*args)
        (choice,) = fallbacks.CHOSEN.values()
        return choice.strategy, [list(pair) for pair in choice.times_ms], len(compiled)

    lean, store = "Lean(max_recompute=0.25)", "Store()"
    strategy = Lean(max_slowdown=10.0)  # the lean cut is within it: nothing else is compiled
    assert chosen(elementwise, X, X) == (Lean(), [[lean, store]], 2)
    assert chosen(block, X, W, V) == (Lean(), [[lean, store]], 2)
    # Every cut twice as slow as Store: the next cut is timed, unless its program was timed.
    monkeypatch.setattr(
        fallbacks.timing, "timed_together", lambda ps, runs: [(2.0, 0.0), (1.0, 0.0)][-len(ps) :]
    )
    strategy = Lean(max_slowdown=0.03)
    assert chosen(elementwise, X, X) == (Store(), [[lean, store]], 2)
    # The block's lean cut recomputes its 1x1 convolution: the cut that recomputes none differs.
    pairs = [[lean, store], ["Lean(max_recompute=0.0)", store]]
    assert chosen(block, X, W, V) == (Store(), pairs, 3)


def test_without_max_slowdown_nothing_is_timed(monkeypatch):
    monkeypatch.setattr(fallbacks, "time_candidates", lambda *_: pytest.fail("timed"))
    gradients(wrap(block, Lean(), device_argnums=(1, 2)))


@pytest.mark.parametrize(
    ("bad", "error", "got"),
    [(-0.1, ValueError, "got -0.1"), ("3%", TypeError, "got '3%'"),
     (True, TypeError, r"got True \(a bool\)"), (float("nan"), ValueError, "got nan")],
)  # fmt: skip
def test_a_bad_max_slowdown_is_refused(bad, error, got):
    with pytest.raises(error, match=rf"max_slowdown must be a finite number of at least 0 .*{got}"):
        Lean(max_slowdown=bad)


def test_a_block_sharded_over_an_explicit_mesh_is_timed_with_its_sharding():
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    def dense(x, w):  # the convolutions of the block above would need out_sharding here
        return jnp.tanh(x @ w) * x

    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        x, w = jax.device_put(normal(3, (8, 16)), P("data")), 0.3 * normal(4, (16, 16))
        wrapped = wrap(dense, Lean(max_slowdown=10.0), device_argnums=(1,))
        grads = jax.jit(jax.grad(lambda *a: wrapped(*a).sum(), argnums=(0, 1)))(x, w)
        plain = jax.jit(jax.grad(lambda *a: dense(*a).sum(), argnums=(0, 1)))(x, w)
    assert rel_err(grads, plain) < 1e-6
    assert [c.strategy for c in fallbacks.CHOSEN.values()] == [Lean()]


def test_a_bench_record_lists_each_timed_block_and_its_choice(monkeypatch):
    from jaxoffload.bench import models
    from jaxoffload.bench.measure import measure
    from jaxoffload.bench.models import flax_resnet, plain_model
    from jaxoffload.bench.record import Record
    from jaxoffload.bench.step import uniform_strategy
    from jaxoffload.bench.workload import Workload

    def tiny(name, *, strategy, dtype, num_classes):  # two blocks, the second with a projection
        return plain_model(
            flax_resnet.ResNet, flax_resnet.ResNetBlock, uniform_strategy(strategy),
            num_filters=4, stage_sizes=(1, 1), num_classes=num_classes, dtype=dtype,
        )  # fmt: skip

    monkeypatch.setattr(models, "create", tiny)
    workload = Workload(
        model="flax-resnet18", batch=2, image_size=32, dtype="float32", strategy="lean-timed"
    )
    record = measure(workload, steps=1, warmup=1)
    names = {"Lean(max_recompute=0.25)", "Lean(max_recompute=0.0)", "Store()"}
    assert len(record.fallbacks) == len(fallbacks.CHOSEN) == 2 and record.trace_s > 0
    for block in record.fallbacks:  # the lean cut beside Store first, and what it took
        first, *_ = pairs = block["times_ms"]
        assert list(first) == ["Lean(max_recompute=0.25)", "Store()"]
        assert all(set(pair) <= names for pair in pairs)
        assert block["strategy"] in pairs[-1]
        assert block["inputs"].startswith("float32[2, ")
    assert Record.from_json(json.loads(json.dumps(record.to_json()))) == record
