"""The planner's model of a step's peak on families that are not BatchNorm-ReLU ResNets.

EfficientNet's block (an expanding 1x1, a depthwise convolution, squeeze-and-excitation,
SiLU) is compiled on the CPU under the plans that the planner compiles first to fit its
model, and each plan's estimate from the others is checked against its compiled bytes: the
estimate that the planner prints for a plan it returns, and that it makes of a plan before
compiling it. ConvNeXt's block (a 7x7 depthwise convolution, LayerNorm, GELU, a layer scale)
is checked on the plans that a planning of ConvNeXt-T compiled for the H200, as XLA:CPU
compiles its lean cut to bytes that no model of what a GPU step holds fits (see
``test_the_search_s_plans_on_a_depthwise_layernorm_family_are_estimated_within_10_percent``).
"""

import concurrent.futures
import json
import pathlib
import runpy

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxoffload
from jaxoffload import Lean, Plan, Remat, Store
from jaxoffload._src.planner import BlockCost, BlockCosts
from jaxoffload._src.planner.costs import trace_blocks, traced_blocks
from jaxoffload._src.planner.peak import calibrate_peak, live_bytes, mixed_checks
from jaxoffload.bench.models import flax_efficientnet
from jaxoffload.internal import device_bytes, discover, lower_step

OPTIONS = (Store(), Lean(), Remat())
ROOT = pathlib.Path(__file__).parents[1]

SIDE = 64
FAMILIES = {
    # The expansion-1 block, then a strided expanding one and a residual one, each with its
    # squeeze-and-excitation.
    "efficientnet": lambda: flax_efficientnet.EfficientNet(
        stages=((1, 3, 1, 8, 1), (4, 3, 2, 16, 2)),
        stem_features=8,
        head_features=16,
        num_classes=4,
        block_cls=jaxoffload.linen.plannable(flax_efficientnet.MBConv),
    ),
}


def step(model, params, state, x, labels):
    def loss(params):
        logits, new_state = model.apply({"params": params, **state}, x, True, mutable=list(state))
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), new_state

    return jax.grad(loss, has_aux=True)(params)


def _checks(paths) -> list[Plan]:
    """The plans that the planner compiles to fit its model of bytes, where it options
    Store, Lean and Remat: the plain step; every block under each option, the code outside
    them lean; every block stored, the outside lean; and the mixed checks."""
    n = len(paths)
    kinds = [[s] * n for s in OPTIONS] + [[Store()] * n] + list(mixed_checks(n, OPTIONS))
    return [Plan(tuple(zip(paths, kinds[0])))] + [
        Plan(tuple(zip(paths, k)), Lean()) for k in kinds[1:]
    ]


def _compiled_points(family):
    """Each check plan's ``(live bytes, outside stores, moves, compiled bytes)``."""
    model = FAMILIES[family]()
    x = jax.ShapeDtypeStruct((8, SIDE, SIDE, 3), jnp.float32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, SIDE, SIDE, 3))))
    params = variables.pop("params")
    args = (params, dict(variables), x, jax.ShapeDtypeStruct((8,), jnp.int32))
    paths, calls = discover(model, step, args, None)
    blocks = traced_blocks(paths, calls, trace_blocks(calls, OPTIONS), ms_per_flop=1.0)
    plans = _checks(paths)
    lowered = [lower_step(model, step, args, p, ()) for p in plans]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        compiled = list(pool.map(lambda low: device_bytes(low.compile()), lowered))
    return [
        (live_bytes(blocks, p.strategies), p.outside.is_identity, False, got)
        for p, got in zip(plans, compiled)
    ]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_check_plan_is_estimated_within_10_percent_from_the_others(family):
    """The planner prints, for a plan it returns, what its model fitted to every other plan
    compiled says of it; the issue asks for that within 10% of the compiled bytes. The
    check plans are the hardest case: compiled first, no round has told the model more.

    The model's weights absorb what the CPU's buffers do differently from a GPU's (XLA:CPU
    hoists recomputation and schedules by its own rules); its structure is what each plan
    holds at its peak. Under a least-squares fit that clamped a negative byte count after
    solving, the model fitted to all but the stored check missed the plain step it was
    fitted to, and the stored check, by more than the tolerance, on both families.
    """
    points = _compiled_points(family)
    scale = float(points[0][-1])  # the plain step's bytes, as the planner scales
    for n, (live, stores, _, got) in enumerate(points):
        others = points[:n] + points[n + 1 :]
        model = calibrate_peak(others, scale)
        assert model(live, stores) == pytest.approx(got, rel=0.10), (family, n)
        # A model that misses the plans it was fitted to says nothing of any other.
        for o_live, o_stores, _, o_got in others:
            assert model(o_live, o_stores) == pytest.approx(o_got, rel=0.03), (family, n)


def _pyramid(n=6):
    """Blocks whose activations halve from the first to the last, as a CNN's do, and whose
    lean cut keeps a quarter of what jax keeps (as inverted residuals and ConvNeXt's do)."""
    blocks = []
    for i in range(n):
        size = 2**30 >> i
        costs = {
            Store(): BlockCost(8 * size, size, 0, 0, 0, 1.0, 2.0),
            Lean(): BlockCost(2 * size, size, 0, 0, 0, 1.0, 2.2),
            Remat(): BlockCost(0, size, 0, 0, 8 * size, 1.0, 3.0),
        }
        blocks.append(BlockCosts(f"Block_{i}", size, size, costs))
    return blocks


def test_mixed_checks_tell_each_kind_what_uniform_plans_cannot():
    """A uniform plan holds its kind's bytes alone: fitted to the other uniform plans, its
    estimate rests on a prior weight, and the rest takes the difference. Stand-in compiled
    bytes weigh a lean cut's residuals fully (it keeps only what the backward pass needs)
    and jax's own at a third, as XLA:GPU's did on MobileNetV2 and U-Net, and the code
    outside the blocks keeps nothing (what it keeps is told by the plain step and the stored
    check alone, each by the other); with the mixed checks beside the uniform ones, every
    check is estimated from the others."""
    blocks, n = _pyramid(), 6
    weight = {"Store()": 0.35, "Lean()": 1.0, "recomputed": 0.4, "kept edges": 1.0, "edges": 1.0}
    mixed = mixed_checks(n, OPTIONS)
    assert mixed == [(Lean(),) * 3 + (Remat(),) * 3, (Remat(),) * 3 + (Lean(),) * 3]

    def points(choices):
        found = []
        for choice, stores in choices:
            live = live_bytes(blocks, choice)
            peak = max(sum(weight.get(k, 0.0) * b for k, b in at.items()) for at in live)
            found.append((live, stores, False, int(5e8 + peak)))
        return found

    uniform = points([((s,) * n, s == Store()) for s in OPTIONS] + [((Store(),) * n, False)])
    with_mixed = uniform + points([(m, False) for m in mixed])

    def worst(checks):
        misses = []
        for k, (live, stores, _, got) in enumerate(checks):
            model = calibrate_peak(checks[:k] + checks[k + 1 :], 2**33)
            misses.append(abs(model(live, stores) / got - 1))
        return max(misses)

    assert worst(uniform) > 0.2  # the case the check plans were added for
    assert worst(with_mixed) < 0.05


# Plannings compiled for the H200 without it (``deviceless.py plan MODEL BATCH SHARES --offload
# --points``, benchmarks/results/MANIFEST.md): ResNet-50 b256 at 0.3 of its plain step, and
# ConvNeXt-T b128 at 0.75, 0.5 and 0.35.
H200 = ROOT / "benchmarks" / "results" / "deviceless-h200"
RESNET50_POINTS = H200 / "points-flax-resnet50-0.3.json"
CONVNEXT_POINTS = H200 / "points-flax-convnext-t-d8098b1.json"


def _h200_points(path):
    """Each compiled plan's ``(live bytes, outside stores, moves, compiled bytes)``, its
    blocks' strategies, and the file's record of it."""
    loader = runpy.run_path(str(ROOT / "benchmarks" / "probes" / "peak_loo.py"))
    points = json.loads(path.read_text())
    blocks = loader["blocks_of"](points)
    found = []
    for p in points["plans"]:
        strategies = [loader["strategy"](s) for s in p["strategies"]]
        moves = any(s.to_host for s in strategies)
        outside_stores = loader["strategy"](p["outside"]).is_identity
        fitted = (live_bytes(blocks, strategies), outside_stores, moves, p["compiled_bytes"])
        found.append((fitted, strategies, p))
    return found


def _is_check(strategies) -> bool:
    """A plan that the planner compiles before its first round: a uniform plan, a half under
    ``Lean()`` and a half under ``Remat()``, or the hidden offloads' check (capped offloads).
    For points written before they said which plans were checks."""
    kinds = {type(s) for s in strategies if s.max_bytes is None}
    return len(kinds) == 1 or kinds == {Lean, Remat} or any(s.max_bytes for s in strategies)


def test_offloaded_inputs_beside_remat_are_estimated_from_the_checks_alone():
    """Below `Remat()`'s bytes the planner mixes `Remat()` with blocks whose inputs go to the
    host (`Offload(recompute=True)`) and offloads. The activations kept between blocks are
    whole arrays: every check plan keeps nearly all of them, so no fit tells their weight from
    the rest of the step, and pulled to ½ the model halved what moving the first blocks'
    inputs frees: it overstated such plans by 20-36%, each predicted from all the others
    (compiled for the H200, deviceless-h200/plans-flax-resnet50-c9abc04.log). Held at 1 and
    fitted to the checks alone, it predicts each of them within 5%."""
    found = _h200_points(RESNET50_POINTS)
    checks = [f for f, st, _ in found if _is_check(st)]
    mixes = [f for f, st, _ in found if not _is_check(st)]
    assert len(checks) >= 6 and sum(moves for _, _, moves, _ in mixes) >= 4
    model = calibrate_peak(checks, float(max(got for *_, got in checks + mixes)))
    for live, stores, _, got in mixes:
        assert model(live, stores) == pytest.approx(got, rel=0.05)


def test_the_search_s_plans_on_a_depthwise_layernorm_family_are_estimated_within_10_percent():
    """ConvNeXt-T's lean cut keeps GELU's output, which the backward pass's matmul reads, and
    XLA:CPU compiles it to bytes that no weighing of what each plan holds at its peak fits
    (fitted to all but the plain step, the model missed another of the plans it was fitted to
    by 10%), so the family is checked on what the planner compiled for the H200. Each plan the search proposed is estimated from
    the checks alone (as the search saw it before compiling it) and from every other plan (as
    the planner prints it), within 10% of its compiled bytes. The checks are compiled whatever
    the model says, each to tell it what no other plan does."""
    found = _h200_points(CONVNEXT_POINTS)
    checks = [f for f, _, p in found if p["check"]]
    searched = [f for f, _, p in found if not p["check"]]
    assert len(checks) >= 6 and len(searched) >= 3
    scale = float(max(got for *_, got in checks + searched))
    before = calibrate_peak(checks, scale)
    for n, (live, stores, _, got) in enumerate(searched):
        assert before(live, stores) == pytest.approx(got, rel=0.10), n
        others = [f for f, *_ in found if f[0] is not live]
        assert calibrate_peak(others, scale)(live, stores) == pytest.approx(got, rel=0.10), n
