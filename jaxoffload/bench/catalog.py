"""What the bench names, and the checks of a workload's fields, with no jax imported.

The ``jaxoffload`` command checks its flags with these before it imports jax (which
takes seconds on a GPU machine), so that a mistyped flag is refused at once.
:class:`~jaxoffload.bench.workload.Workload` checks itself with the same functions, so
the two refuse a value in the same sentence.
"""

from __future__ import annotations

__all__ = [
    "ACCUMULATED_STRATEGIES",
    "BLOCK_COSTS",
    "BLOCK_STRATEGIES",
    "COMPUTE_TWIN",
    "DTYPES",
    "MODEL_NAMES",
    "NNX_MODELS",
    "PLAIN_MODELS",
    "CHOSEN_STRATEGIES",
    "PLANS",
    "RESNETS",
    "TASKS",
    "TO_HOST",
    "VGGS",
    "check_model",
    "check_workload",
    "default_block_costs",
    "default_num_classes",
    "is_nnx",
    "is_plain",
    "multiples_near",
    "task",
]

DTYPES = ("float32", "bfloat16")

# The strategies that give every block one value (jaxoffload.bench.workload.STRATEGIES
# holds the values), and those of them that move residuals to the host, whose blocks take
# an Offload window.
BLOCK_STRATEGIES = (
    "none", "lean", "lean-timed", "remat", "remat-dots", "offload", "offload-inputs",
    "jax-offload",
)  # fmt: skip
TO_HOST = ("offload", "offload-inputs")

# Strategies whose per-block values are chosen in the run, from earlier records: a hidden
# offload (jaxoffload.bench.planning.hidden_offload_workload), or jaxoffload.plan's plan.
CHOSEN_STRATEGIES = {
    "offload-hidden": "each block moves what the link carries while blocks compute, with its "
    "own windows (jaxoffload.bench.planning.hidden_plan), the others Lean(); a reference "
    "model's blocks whose transfers hide move all, at one window (jaxoffload.bench.reference_hidden)",
    "plan": "the jaxoffload.plan of a budget (bench --budget)",
    "plan-device": "the jaxoffload.plan of each --budget with options Store(), Lean() and "
    "Remat(): nothing moves to the host, to set beside 'plan'",
}
# The strategies planned at each --budget, and the block strategies whose values each plans
# with (None: jaxoffload.plan's default options, offload included).
PLANS = {"plan": None, "plan-device": ("none", "lean", "remat")}

# Strategies whose step runs another's over micro-batches, accumulating their gradients
# (see jaxoffload.bench.step.value_and_grad): the name, and the strategy whose step each
# micro-batch runs. "grad-accum-lean" is the peer of a strategy that fits larger
# micro-batches than Store.
ACCUMULATED_STRATEGIES = {"grad-accum": "none", "grad-accum-lean": "lean"}

# For each strategy that moves residuals to the host, the strategy that runs the
# same layers without moving anything: its times are the compute in the
# transfer bound (see jaxoffload.bench.run.add_transfer_bounds).
COMPUTE_TWIN = {
    "jax-offload": "none",
    "offload": "lean",
    "offload-inputs": "remat",
    "offload-hidden": "lean",
}

# How jaxoffload.plan costs the blocks (its block_costs).
BLOCK_COSTS = ("timed", "traced")

# The models, by kind: plain-Flax linen and NNX models, whose code knows nothing of
# jaxoffload, and the reference models, built by hand (jaxoffload.bench.models builds them).
PLAIN_MODELS = (
    "flax-resnet18", "flax-resnet34", "flax-resnet50", "flax-resnet101", "flax-vgg11",
    "flax-vgg16", "flax-vgg19", "flax-mobilenetv2", "flax-convnext-t", "flax-efficientnet-b0",
    "flax-unet",
)  # fmt: skip
NNX_MODELS = ("flax-nnx-resnet18", "flax-nnx-resnet50")
VGGS = ("vgg11", "vgg13", "vgg16", "vgg19")
# The reference ResNets: name: (blocks per stage, block kind).
RESNETS = {
    "resnet18": ((2, 2, 2, 2), "basic"),
    "resnet34": ((3, 4, 6, 3), "basic"),
    "resnet50": ((3, 4, 6, 3), "bottleneck"),
    "resnet101": ((3, 4, 23, 3), "bottleneck"),
    "resnet152": ((3, 8, 36, 3), "bottleneck"),
}
MODEL_NAMES = tuple(
    [*PLAIN_MODELS, *NNX_MODELS]
    + sorted([*VGGS, *(f"{name}_bn" for name in VGGS), *RESNETS], key=lambda n: (n[:3], len(n), n))
)

TASKS = ("classify", "segment")
# What each model is trained for, when not "classify" (see `task`).
_TASKS = {"flax-unet": "segment"}
# The number of classes a model is built with by default, when not ImageNet's 1000: the
# U-Net paper's two (cell and background), which also keep its per-pixel logits small.
_NUM_CLASSES = {"flax-unet": 2}


def check_model(name: str) -> None:
    """Raises ``ValueError`` unless ``name`` is one of :data:`MODEL_NAMES`."""
    if name not in MODEL_NAMES:
        raise ValueError(f"Unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}.")


def is_plain(name: str) -> bool:
    """Whether the named model is a plain-Flax one, whose code knows nothing of jaxoffload."""
    check_model(name)
    return name in PLAIN_MODELS or name in NNX_MODELS


def is_nnx(name: str) -> bool:
    """Whether the named model is a plain Flax NNX one (build it with ``models.create_nnx``)."""
    check_model(name)
    return name in NNX_MODELS


def task(name: str) -> str:
    """What the named model is trained for: one of ``TASKS``.

    ``"classify"``: logits ``(batch, num_classes)``, one label per image.
    ``"segment"``: logits ``(batch, height, width, num_classes)``, one label per pixel.

    Example:
      >>> task("flax-resnet18"), task("flax-unet")
      ('classify', 'segment')
    """
    check_model(name)
    return _TASKS.get(name, "classify")


def default_num_classes(name: str) -> int:
    """The classes the named model is built with unless told: 1000 (ImageNet's), 2 for ``flax-unet``.

    Example:
      >>> default_num_classes("flax-resnet18"), default_num_classes("flax-unet")
      (1000, 2)
    """
    check_model(name)
    return _NUM_CLASSES.get(name, 1000)


def multiples_near(n: int, m: int) -> str:
    """The positive multiples of ``m`` nearest to ``n``, either side, for an error message.

    Example:
      >>> multiples_near(100, 24), multiples_near(10, 24)
      ('96 or 120', '24')
    """
    below = n // m * m
    return f"{below} or {below + m}" if below else f"{m}"


def check_workload(
    model: str,
    batch: int,
    image_size: int,
    dtype: str,
    strategy: str,
    *,
    blocks: int | None = None,
    window: int | tuple[int, ...] = 1,
    budget: float | None = None,
    block_costs: str | None = None,
    micro_batch: int | None = None,
    num_devices: int = 1,
    spatial: int = 1,
) -> None:
    """Raises ``ValueError``, in words, unless the fields make a workload the bench can run.

    The fields are :class:`~jaxoffload.bench.workload.Workload`'s; the sentences name
    the command's flags where one sets the field. ``block_costs=None`` is
    :func:`default_block_costs`.
    """
    block_costs = block_costs or default_block_costs(model, strategy)
    _check_names_and_sizes(model, batch, image_size, dtype, strategy)
    _check_splits(strategy, batch, image_size, micro_batch, num_devices, spatial)
    if (strategy in PLANS) != (budget is not None):
        raise ValueError(
            f"the {strategy!r} strategy takes a budget"
            if strategy in PLANS
            else f"{strategy!r} takes no budget: only {' and '.join(map(repr, PLANS))} do."
        )
    if strategy in PLANS:
        _check_budget_plan(model, budget, block_costs)
    else:
        _check_block_strategies(model, strategy, blocks, window)
    if strategy == "offload-hidden":
        _check_hidden(model, block_costs)


def _check_names_and_sizes(model, batch, image_size, dtype, strategy) -> None:
    check_model(model)
    names = [*BLOCK_STRATEGIES, *CHOSEN_STRATEGIES, *ACCUMULATED_STRATEGIES]
    if strategy not in names:
        raise ValueError(f"Unknown strategy {strategy!r}; choose one of {', '.join(names)}.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}.")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}.")
    if image_size < 32:
        raise ValueError(f"image_size must be at least 32, got {image_size}.")


def _check_splits(strategy, batch, image_size, micro_batch, num_devices, spatial) -> None:
    """The batch splits over the devices, and into micro-batches that split over them too."""
    accumulated = strategy in ACCUMULATED_STRATEGIES
    if accumulated and micro_batch is None:
        raise ValueError(
            f"{strategy!r} needs --micro-batch M: the images of each micro-batch whose "
            "gradients it accumulates, a divisor of --batch."
        )
    if not accumulated and micro_batch is not None:
        raise ValueError(
            f"micro_batch is for {', '.join(ACCUMULATED_STRATEGIES)}, not {strategy!r}."
        )
    for name, value in [("--devices", num_devices), ("--micro-batch", micro_batch),
                        ("--spatial", spatial)]:  # fmt: skip
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}.")
    if image_size % spatial:
        raise ValueError(
            f"--image-size {image_size} does not split over --spatial {spatial}: "
            f"use {multiples_near(image_size, spatial)}."
        )
    n = num_devices
    if batch % n:
        raise ValueError(
            f"--batch {batch} does not split over --devices {n}: use {multiples_near(batch, n)}."
        )
    if micro_batch is None:
        return
    if micro_batch % n:
        raise ValueError(
            f"--micro-batch {micro_batch} does not split over --devices {n}: use "
            f"{multiples_near(micro_batch, n)}."
        )
    if batch % micro_batch:
        raise ValueError(
            f"--batch {batch} is not a multiple of --micro-batch {micro_batch}: use "
            f"{multiples_near(batch, micro_batch)}."
        )


def default_block_costs(model: str, strategy: str) -> str:
    """How a workload's planner costs the blocks unless told: by their traced FLOPs
    (``"traced"``), except ``offload-hidden`` on a reference model, which only times them."""
    return "timed" if strategy == "offload-hidden" and not is_plain(model) else "traced"


def _check_budget_plan(model, budget, block_costs) -> None:
    """A ``"plan"`` workload plans a plain-Flax model at a share of ``"none"``'s peak."""
    if not is_plain(model):
        raise ValueError(
            f"'plan' plans the plain-Flax models' plannable blocks; {model} is a reference model."
        )
    if not 0 < budget <= 1:
        raise ValueError(f"budget is a share of 'none's peak in (0, 1], got {budget}.")
    if block_costs not in BLOCK_COSTS:
        raise ValueError(f"block_costs is one of {BLOCK_COSTS}, got {block_costs!r}.")


def _check_hidden(model, block_costs) -> None:
    """``offload-hidden`` plans a linen model's blocks: a plain one's from their costs, timed
    or traced; a reference one's from their forward passes, timed."""
    if is_nnx(model):
        raise ValueError(
            f"'offload-hidden' plans the blocks of a linen model, plain-Flax or reference; "
            f"{model} is an NNX model: not supported yet."
        )
    if block_costs not in BLOCK_COSTS:
        raise ValueError(f"block_costs is one of {BLOCK_COSTS}, got {block_costs!r}.")
    if not is_plain(model) and block_costs != "timed":
        raise ValueError(
            f"'offload-hidden' times a reference model's blocks: --block-costs {block_costs} "
            f"is for the plain-Flax linen models, and {model} is a reference model."
        )


def _check_block_strategies(model, strategy, blocks, window) -> None:
    """The model takes the strategy, its blocks and its windows."""
    plain = is_plain(model)
    if plain and blocks is not None:
        raise ValueError(
            f"{model} wraps one block class, so all its blocks take one strategy: "
            f"{strategy!r} with blocks needs a reference model."
        )
    if plain and strategy == "jax-offload":
        raise ValueError(
            f"'jax-offload' offloads the values that the reference models name with "
            f"checkpoint_name; {model} names none."
        )
    if isinstance(window, tuple) and model not in RESNETS:
        raise ValueError(f"{model} takes one window, not one per stage.")
    if isinstance(window, tuple) and len(window) != len(RESNETS[model][0]):
        raise ValueError(
            f"window has {len(window)} entries, but {model} has {len(RESNETS[model][0])} stages."
        )
    for w in window if isinstance(window, tuple) else (window,):
        # As jaxoffload.Offload checks it, which the Workload's blocks are given.
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"window must be an int of at least 1, got {w!r}.")
