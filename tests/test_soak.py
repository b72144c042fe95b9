"""Soak: 1000 training steps of a plain-Flax ResNet under each strategy, as a user's loop runs them.

Each strategy's loss curve and final state stay within Remat's drift from the
plain model's, and resident memory stays flat after warm-up.
"""

import ctypes
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import normal, rel_err

import jaxoffload
from jaxoffload.bench.models import flax_resnet, plain_model
from jaxoffload.bench.step import cross_entropy, sgd_step

STEPS = 1000
WARM_UP = 100
STRATEGIES = {
    "plain": jaxoffload.Store(),
    "remat": jaxoffload.Remat(),
    "lean": jaxoffload.Lean(),
    "offload": jaxoffload.Offload(),
}

# Lean's and Offload's rules compute in another order than plain's, so each step
# rounds differently and training carries it on: after 1000 steps their curve is
# 8e-6 off plain's, their parameters and statistics 1.1e-4 and 1.3e-4 off. The
# curve's floor, one ulp of the initial loss per step, is 2.4e-4; the state's is
# 1e-3. A block's gradient of the wrong sign moves the curve by 2.2e-3, a 10%
# wrong one the parameters by 1.7e-3, and a dropped BatchNorm update the
# statistics by 1.0.
STATE_FLOOR = 1e-3
# Keeping every step's state alive grows RSS by 40 to 56 MB between step 100
# and 1000; a flat loop grows by under 1.5 MB.
RSS_GROWTH_BYTES = 8 << 20
# glibc keeps freed memory for reuse, so a leak can grow into what earlier tests
# freed without raising RSS (500 MB freed first hid 49 of those 56 MB); trimming
# makes RSS follow the live heap.
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)


def _rss_bytes() -> int:
    if _malloc_trim is not None:
        _malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _model(strategy):
    return plain_model(
        flax_resnet.ResNet, flax_resnet.ResNetBlock, strategy,
        stage_sizes=(1, 1), num_filters=8, num_classes=10,
    )  # fmt: skip


def _train(strategy, variables, batch):
    """A jitted, donating loop's losses, final state, and growth from WARM_UP to STEPS.

    The growth is ``(RSS bytes, live jax arrays)``.
    """
    model = _model(strategy)
    tx = optax.sgd(1e-2, momentum=0.9)

    def loss_fn(params, model_state, batch):
        x, labels = batch
        logits, model_state = model.apply(
            {"params": params, **model_state}, x, True, mutable=["batch_stats"]
        )
        return cross_entropy(logits, labels), model_state

    # The bench's step: SGD with momentum on (params, model_state, opt_state).
    step = jax.jit(sgd_step(loss_fn, tx), donate_argnums=0)
    params, model_state = variables["params"], {"batch_stats": variables["batch_stats"]}
    # Copies, since the step donates its state and every strategy starts from these.
    state = jax.tree.map(jnp.copy, (params, model_state, tx.init(params)))
    losses = np.empty(STEPS, np.float32)
    for i in range(STEPS):
        state, loss = step(state, batch)
        losses[i] = loss  # waits for the step, as logging does
        if i + 1 == WARM_UP:
            rss, arrays = _rss_bytes(), len(jax.live_arrays())
    return losses, state[:2], (_rss_bytes() - rss, len(jax.live_arrays()) - arrays)


@pytest.mark.soak
@pytest.mark.filterwarnings("ignore::jaxoffload.OffloadWarning")  # on CPU nothing moves
def test_long_training_matches_plain_and_keeps_memory_flat():
    # One test, not one per strategy: under xdist each would train plain and remat again.
    batch = normal(0, (8, 16, 16, 3)), jax.random.randint(jax.random.key(1), (8,), 0, 10)
    variables = jax.jit(lambda x: _model(jaxoffload.Store()).init(jax.random.key(1), x, True))(
        batch[0]
    )
    runs = {name: _train(s, variables, batch) for name, s in STRATEGIES.items()}

    plain_losses, plain_state, _ = runs["plain"]
    loss_floor = STEPS * np.finfo(np.float32).eps * plain_losses[0]
    remat_losses, remat_state, _ = runs["remat"]
    d_remat = np.max(np.abs(remat_losses - plain_losses))
    for name, (losses, state, (rss_growth, arrays_growth)) in runs.items():
        assert losses[-1] < losses[0] / 10, (name, losses[0], losses[-1])
        drift = np.abs(losses - plain_losses)
        assert drift.max() <= 2 * d_remat + loss_floor, (name, drift.max(), d_remat, drift.argmax())
        # The parameters and the BatchNorm statistics, each against its own scale.
        for part, got, remat, plain in zip(
            ("params", "batch_stats"), state, remat_state, plain_state
        ):
            error, e_remat = rel_err(got, plain), rel_err(remat, plain)
            assert error <= 2 * e_remat + STATE_FLOOR, (name, part, error, e_remat)
        assert rss_growth < RSS_GROWTH_BYTES, (name, rss_growth)
        # Exact, where RSS is not: no array outlives its step (a collection may free some).
        assert arrays_growth <= 0, (name, arrays_growth)
