"""The bench's peers of a step too large for one device: grad-accum, --devices, and the sizes that fit.

``grad-accum`` accumulates the plain model's gradients over micro-batches in one
``lax.scan`` and makes one update (``grad-accum-lean`` the lean model's); ``--devices N`` shards the batch over N devices;
``jaxoffload.bench.size_search`` finds the largest batch or image side whose step fits. The
named models are swapped for tiny ones of the same families, so that each compiles in a
second or two: a ResNet with BatchNorm (linen and NNX), and a VGG without BatchNorm, with
dropout or without.
"""

import dataclasses

import jax
import numpy as np
import pytest
from helpers import rel_err
from jax.sharding import PartitionSpec as P

import jaxoffload
from jaxoffload._src.jaxprs import equations
from jaxoffload.bench import models, size_search
from jaxoffload.bench.gradients import draws_random_numbers, has_batch_statistics
from jaxoffload.bench.measure import measure
from jaxoffload.bench.models import flax_nnx_resnet, flax_resnet, flax_vgg, plain_model
from jaxoffload.bench.step import train_step, uniform_strategy
from jaxoffload.bench.workload import Workload

TINY = dict(num_filters=4, stage_sizes=(1,))
# The stand-ins: a name's model, with what makes accumulation differ from the whole batch.
VGG = {"vgg11": 0.0, "flax-vgg11": 0.5}  # dropout rates


def _tiny_linen(name, *, strategy, dtype, num_classes):
    strategy = uniform_strategy(strategy)
    if name in VGG:
        return plain_model(
            flax_vgg.VGG, flax_vgg.VGGStage, strategy, **TINY, classifier_width=8,
            dropout_rate=VGG[name], num_classes=num_classes, dtype=dtype,
        )  # fmt: skip
    return plain_model(
        flax_resnet.ResNet, flax_resnet.ResNetBlock, strategy, **TINY, num_classes=num_classes,
        dtype=dtype,
    )  # fmt: skip


def _tiny_nnx(name, *, strategy, dtype, num_classes, rngs):
    model = flax_nnx_resnet.ResNet(
        **TINY, block_cls=flax_nnx_resnet.ResNetBlock, num_classes=num_classes, dtype=dtype,
        rngs=rngs,
    )  # fmt: skip
    return models.wrap_nnx_blocks(model, strategy)


def _tiny_plannable(name, *, dtype, num_classes):
    block = jaxoffload.linen.plannable(flax_resnet.ResNetBlock)
    return flax_resnet.ResNet(**TINY, block_cls=block, num_classes=num_classes, dtype=dtype)


@pytest.fixture(autouse=True)
def tiny(monkeypatch):
    monkeypatch.setattr(models, "create", _tiny_linen)
    monkeypatch.setattr(models, "create_nnx", _tiny_nnx)
    monkeypatch.setattr(models, "plannable_model", _tiny_plannable)


needs_four = pytest.mark.skipif(
    jax.device_count() < 4,
    reason="needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4",
)


def _workload(model, strategy="none", **fields):
    return Workload(model, 8, 32, "float32", strategy, num_classes=10, **fields)


def _first_update(workload):
    """The step's update of the initial parameters, and how many convolutions its program has.

    SGD with momentum starts from no momentum: its first update is the gradient times the
    learning rate, so comparing updates compares the gradients too.
    """
    step, state, batch, _ = train_step(workload)
    jaxpr = step.trace(state, batch).jaxpr
    convs = sum(eqn.primitive.name == "conv_general_dilated" for eqn in equations(jaxpr))
    before = jax.device_get(state[0])
    (after, _, _), _ = step(state, batch)
    return jax.tree.map(lambda a, b: np.asarray(a) - b, after, before), convs


def _lean_rules(workload) -> int:
    """How many of the step's equations are lean rules (``custom_vjp`` calls)."""
    step, state, batch, _ = train_step(workload)
    jaxpr = step.trace(state, batch).jaxpr
    return sum("custom_vjp" in eqn.primitive.name for eqn in equations(jaxpr))


@pytest.mark.parametrize(("accumulating", "whole"), [("grad-accum", "none"),
                                                      ("grad-accum-lean", "lean")])  # fmt: skip
def test_accumulated_update_is_the_whole_batch_s_without_batch_norm(accumulating, whole):
    update, convs = _first_update(_workload("vgg11", whole))
    accumulated, accumulated_convs = _first_update(_workload("vgg11", accumulating, micro_batch=2))
    # A mean loss, and nothing else coupling the images: the same but for rounding.
    assert rel_err(accumulated, update) <= 1e-5
    # One loop over the four micro-batches: its body is traced once, not unrolled.
    assert accumulated_convs == convs
    # Each micro-batch runs the step it accumulates: lean's with its rules, plain Flax's without.
    rules = _lean_rules(_workload("vgg11", accumulating, micro_batch=2))
    assert rules == _lean_rules(_workload("vgg11", whole))
    assert (rules > 0) == (whole == "lean")


@pytest.mark.parametrize(
    ("model", "num_devices", "statistics", "masks"),
    [("vgg11", 1, False, False), ("flax-resnet18", 1, True, False),
     pytest.param("flax-nnx-resnet18", 4, True, False, marks=needs_four)],
)  # fmt: skip
def test_a_grad_accum_record_says_what_differs_from_the_whole_batch(
    model, num_devices, statistics, masks
):
    workload = _workload(model, "grad-accum", micro_batch=4, num_devices=num_devices)
    record = measure(workload, steps=1, warmup=1, reference=None).to_json()
    assert (record["batch"], record["micro_batch"], record["accumulation_steps"]) == (8, 4, 2)
    assert record["num_devices"] == num_devices
    # At most a micro-batch, in two micro-batches that still split over the devices.
    check = 4 if num_devices == 1 else 8
    assert record["grad_check_batch"] == check
    per_micro_batch = "per micro-batch of 4"
    assert record["batch_norm_statistics"] == (per_micro_batch if statistics else None)
    assert record["dropout_masks"] == (per_micro_batch if masks else None)
    note = record["grad_rel_err_note"]
    assert f"whole batch of {check}, accumulated over two micro-batches of {check // 2}" in note
    if statistics or masks:
        assert record["grad_rel_err"] > 1e-2
        assert ("BatchNorm's batch statistics" in note) == statistics
        assert ("dropout's masks" in note) == masks and "are per micro-batch" in note
    else:
        assert record["grad_rel_err"] <= 1e-5 and "the same but for rounding" in note


@pytest.mark.parametrize(
    ("model", "statistics", "masks"),
    [("vgg11", False, False), ("flax-vgg11", False, True), ("flax-resnet18", True, False),
     ("flax-nnx-resnet18", True, False)],
)  # fmt: skip
def test_what_each_micro_batch_has_of_its_own_is_found_in_the_traced_model(
    model, statistics, masks
):
    # Traced, not compiled: the record's batch_norm_statistics and dropout_masks come from here.
    _, state, batch, loss_fn = train_step(_workload(model), abstract=True)
    assert has_batch_statistics(state[1]) == statistics
    assert draws_random_numbers(loss_fn, *state[:2], batch) == masks


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(micro_batch=24, batch=100), "--batch 100 is not a multiple of --micro-batch 24: "
         "use 96 or 120"),
        (dict(micro_batch=24, batch=10), "--batch 10 is not a multiple of --micro-batch 24: use 24"),
        (dict(micro_batch=None), "'grad-accum' needs --micro-batch M"),
        (dict(micro_batch=6, num_devices=4, batch=24), "--micro-batch 6 does not split over "
         "--devices 4: use 4 or 8"),
        (dict(micro_batch=4, num_devices=4, batch=6), "--batch 6 does not split over --devices 4: "
         "use 4 or 8"),
        (dict(micro_batch=0), "--micro-batch must be at least 1, got 0"),
    ],
)  # fmt: skip
def test_splits_that_do_not_divide_are_refused_with_the_nearest(fields, message):
    with pytest.raises(ValueError) as error:
        Workload("flax-resnet18", **{"batch": 8, **fields}, image_size=32,
                           dtype="float32", strategy="grad-accum")  # fmt: skip
    assert message in str(error.value)
    with pytest.raises(
        ValueError, match="micro_batch is for grad-accum, grad-accum-lean, not 'none'"
    ):
        _workload("flax-resnet18", micro_batch=4)


@needs_four
def test_four_devices_give_one_device_s_gradients(tmp_path):
    reference = str(tmp_path / "one_device.npz")
    one, four = (
        measure(
            _workload("flax-resnet18", num_devices=n), steps=1, warmup=1, reference=reference
        ).to_json()
        for n in (1, 4)
    )
    assert (one["num_devices"], four["num_devices"], four["batch"]) == (1, 4, 8)
    # BatchNorm's statistics are over the whole batch: every device's images.
    assert four["grad_rel_err"] <= 1e-5
    # The compiled bytes are one device's: a quarter of the batch's activations.
    assert four["compiled_temp_bytes"] < one["compiled_temp_bytes"]


@needs_four
def test_rows_split_over_devices_give_one_device_s_gradients(tmp_path):
    reference = str(tmp_path / "one_device.npz")
    one, split = (
        measure(
            _workload("flax-resnet18", num_devices=d, spatial=s),
            steps=1,
            warmup=1,
            reference=reference,
        ).to_json()  # fmt: skip
        for d, s in [(1, 1), (2, 2)]
    )
    assert (split["num_devices"], split["spatial"], split["mesh"]) == (
        2,
        2,
        {"data": 2, "space": 2},
    )
    assert "spatial" not in one and split["image_size"] == 32  # the whole image's side
    # BatchNorm's statistics are over every row of every image, on whichever device.
    assert split["grad_rel_err"] <= 1e-5
    assert isinstance(split["spatial_gathers"], list)  # a ResNet's convolutions all split
    assert split["compiled_temp_bytes"] < one["compiled_temp_bytes"]
    _, _, batch, _ = train_step(_workload("flax-resnet18", spatial=4), abstract=True)
    images, labels = batch
    assert (images.sharding.spec, labels.sharding.spec) == (P("data", "space"), P("data"))
    with pytest.raises(ValueError, match="--image-size 32 does not split over --spatial 3"):
        _workload("flax-resnet18", spatial=3)


@needs_four
def test_a_size_search_over_a_mesh_keeps_the_sizes_that_split():
    workload = _workload("flax-resnet18", num_devices=2, spatial=2)
    budget = (
        _compiled_bytes(workload, image_size=64) + _compiled_bytes(workload, image_size=128)
    ) // 2
    found = size_search.largest(workload, "image_size", budget_bytes=budget, limit=128).to_json()
    probes = dict(found["max_image_size_probes"])
    # Multiples of 16 per device's rows: each device's part of a U-Net level meets its skip.
    assert probes and all(side % 32 == 0 for side in probes), probes
    # Each probe compiled with the rows split: its bytes are one device's (Auto axes, which
    # eval_shape does not keep in the structs' types).
    assert found["max_image_size"] == 96 and probes[96] <= budget < probes[128]
    assert not found["max_image_size_confirmed"]  # a CPU reports no runtime peak


@needs_four
def test_accumulating_over_four_devices_updates_as_one_device_s_whole_batch():
    update, _ = _first_update(_workload("vgg11"))
    accumulated = _workload("vgg11", "grad-accum", micro_batch=4, num_devices=4)
    _, state, batch, _ = train_step(accumulated, abstract=True)
    assert all(x.sharding.spec[0] == "data" for x in batch)  # the images and the labels
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state))
    got, _ = _first_update(accumulated)
    assert rel_err(got, update) <= 1e-5


def _compiled_bytes(workload, **size):
    """The compiled step's device bytes at a size, as the search compares them with its budget."""
    step, state, batch, _ = train_step(dataclasses.replace(workload, **size), abstract=True)
    memory = step.trace(state, batch).lower().compile().memory_analysis()
    return memory.temp_size_in_bytes + memory.argument_size_in_bytes


@pytest.mark.parametrize(
    ("axis", "low", "high", "plan"),
    [("batch", 4, 8, False), ("image_size", 32, 64, True)],
    ids=["batch", "planned image side"],
)
def test_the_size_search_finds_the_largest_size_that_compiles_within_the_budget(
    axis, low, high, plan
):
    workload = dataclasses.replace(_workload("flax-resnet18"), batch=4)
    budget = (
        _compiled_bytes(workload, **{axis: low}) + _compiled_bytes(workload, **{axis: high})
    ) // 2
    found = size_search.largest(
        workload, axis, plan=plan, budget_bytes=budget, limit=high
    ).to_json()
    size, probes = found[f"max_{axis}"], dict(found[f"max_{axis}_probes"])
    # It compiled within the budget, and a size 2% (or one multiple) above it did not.
    over = min(s for s, nbytes in probes.items() if nbytes > budget)
    assert low <= size < high and probes[size] <= budget
    assert over <= size * 1.02 + size_search.AXES[axis][0]
    assert found[f"max_{axis}_budget_bytes"] == budget
    speed = "images_per_s" if axis == "batch" else "ms_per_megapixel"
    assert found[f"max_{axis}_{speed}"] > 0
    # A CPU reports no runtime peak: the size stands on its compiled bytes, and says so.
    assert not found[f"max_{axis}_confirmed"]
    assert found[f"max_{axis}_stopped"].startswith("no runtime peak was read")
    assert (f"max_{axis}_plan" in found) == plan
    assert found["jax_version"] == jax.__version__ and found["platform"] == "cpu"
