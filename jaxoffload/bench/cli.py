"""The ``jaxoffload`` command: ``jaxoffload bench`` compares memory strategies on a model.

It only parses: the flags are checked (:func:`jaxoffload.bench.options.check`) and become
arguments of :func:`jaxoffload.bench.command.bench`, which measures each strategy in a
fresh process, and writes a table, JSON records and a plot. Until the flags are checked,
nothing that imports jax is imported, so that a mistyped flag is refused at once.
"""

from __future__ import annotations

import argparse
import pathlib
import shlex
import sys
import typing

from jaxoffload import __version__
from jaxoffload.bench import options
from jaxoffload.bench.catalog import BLOCK_COSTS, DTYPES, MODEL_NAMES
from jaxoffload.bench.folder import RECORDS, REFERENCE, RUN_FLAGS
from jaxoffload.bench.options import DEFAULT_TIME_LIMIT, STRATEGY_FLAGS, BenchError

if typing.TYPE_CHECKING:
    from jaxoffload.bench.child import Children

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_STRATEGIES",
    "build_parser",
    "main",
    "parse_budgets",
    "parse_window",
]


DEFAULT_MODEL = "flax-resnet18"


# What a plain-Flax model takes: one strategy for all its blocks, no checkpoint names. The
# four strategy values, whose points make the envelope (jaxoffload.bench.envelope): each is
# a process of its own, and the default run must end within two minutes on a 2-core CPU.
DEFAULT_STRATEGIES = "none,lean,remat,offload"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, but not the empty ones ("default: None"), which say nothing."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == ():
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxoffload", description=__doc__.splitlines()[0], formatter_class=_HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser(
        "bench",
        help="measure memory and step time of each strategy on a model",
        description="Measure each memory strategy's compiled temp, runtime peak, step time and "
        "gradient error on one model, each in a fresh process. The defaults run on CPU. "
        "Progress goes to stderr: a live bar on a terminal, else (stdout or stderr a file or a "
        "pipe) one line per step.",
        formatter_class=_HelpFormatter,
    )
    _add_workload_arguments(bench)
    _add_run_arguments(bench)
    return parser


def _add_workload_arguments(bench: argparse.ArgumentParser) -> None:
    """What to measure: the model, its step, the strategies and the budgets."""
    bench.add_argument("--model", default=DEFAULT_MODEL, help=f"one of: {', '.join(MODEL_NAMES)}")
    bench.add_argument(
        "--batch", type=int, default=8, help="images per step, over all the --devices"
    )
    bench.add_argument("--image-size", type=int, default=32, help="height and width of the images")
    bench.add_argument("--dtype", default="float32", choices=DTYPES, help="compute dtype")
    bench.add_argument("--steps", type=int, default=3, help="timed steps per strategy")
    bench.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="time each strategy and plan in N fresh processes: after the first round, which "
        "plans and measures them all, N - 1 more rounds run each again, in alternation, its "
        "steps timed and nothing else; step_time_ms is the median of the processes' medians, "
        "step_time_ms_runs lists them (3 for differences of a few percent)",
    )
    bench.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help=f"comma-separated, from: {', '.join(STRATEGY_FLAGS)} (grad-accum and grad-accum-lean need --micro-batch)",
    )
    bench.add_argument(
        "--window",
        type=parse_window,
        default=1,
        help="the Offload window of offloading blocks, or one per stage of a reference "
        "ResNet, e.g. 1,2,2,2 ('offload-hidden' plans its own; a window with no offloading "
        "strategy is an error)",
    )
    bench.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        metavar="M",
        help="grad-accum's micro-batch (an error without it): none's step (lean's under "
        "grad-accum-lean) over "
        "--batch / M micro-batches of M images in one lax.scan, their gradients averaged, then "
        "one SGD update, as users who run out of memory train. BatchNorm's batch statistics are "
        "per micro-batch (each updates the running averages in turn), and so are dropout's "
        "masks: only without them is the gradient the whole batch's. Its grad err is against "
        "the step's own at a batch that it runs whole, as two micro-batches; the record says which "
        "(grad_check_batch) and why they differ (grad_rel_err_note)",
    )
    bench.add_argument(
        "--devices",
        type=int,
        default=1,
        metavar="N",
        help="data parallel over the first N devices: a 1-D mesh of axis 'data', the batch "
        "split over it, the parameters and optimizer state replicated. --batch (and "
        "--micro-batch) are over all N, and must divide by N. Memory readings are per device: "
        "the compiled bytes are one device's, the peak the largest device's (on CPU, "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N gives N devices); a size search "
        "keeps batches that divide by N; not yet with --budget or offload-hidden",
    )
    bench.add_argument(
        "--spatial",
        type=int,
        default=1,
        metavar="N",
        help="split each image's rows over N devices more: a mesh axis 'space' beside "
        "--devices' 'data' (both Auto), so that every activation is split along its height "
        "and the partitioner exchanges the halos of each convolution; --image-size must "
        "divide by N. Records get spatial, mesh and spatial_gathers: the all-gathers that "
        "undo the split, by the operation each comes from (jaxoffload.spatial_gathers). "
        "Memory readings are per device, and --max-image-size keeps sides that are multiples "
        "of 16 N; not yet with --budget or offload-hidden",
    )
    bench.add_argument(
        "--budget",
        type=parse_budgets,
        default=(),
        metavar="SHARES",
        help="also plan the model (jaxoffload.plan) at each budget, as shares of 'none's "
        "peak, e.g. 0.75,0.5,0.35,0.25, and measure each plan (plain-Flax models)",
    )
    bench.add_argument(
        "--block-costs",
        choices=BLOCK_COSTS,
        default=None,
        help="how --budget's planner, and offload-hidden's on a plain-Flax model, cost the "
        "blocks: from their traced FLOPs at the plain step's ms per FLOP (traced, the "
        "default, which compiles no block program; offload-hidden takes the 'lean' step's), "
        "or each distinct block program compiled and timed alone (timed, which a reference "
        "model's offload-hidden always does)",
    )


def _add_run_arguments(bench: argparse.ArgumentParser) -> None:
    """Where the records go, and how the run goes: resumed, searching batches, capped."""
    bench.add_argument(
        "--out",
        default="bench-out",
        help=f"folder for {RECORDS}, rewritten as each strategy is measured, and pareto.png; "
        f"until the run is complete, also {REFERENCE}, which --resume needs",
    )
    bench.add_argument(
        "--resume",
        action="store_true",
        help=f"keep the records in OUT/{RECORDS} of an interrupted run with the same "
        f"{', '.join(RUN_FLAGS)}, and measure only the strategies it lacks (failed ones "
        f"again), then run only the size searches it lacks; without it, a run starts afresh "
        f"and replaces {RECORDS}",
    )
    bench.add_argument(
        "--trace",
        action="store_true",
        help="also trace 5 steps of each strategy with jax.profiler, after its peak is read: "
        "records get compute_busy_ms, d2h_busy_ms, h2d_busy_ms, their overlaps and "
        "d2h_overlap_fraction and h2d_overlap_fraction (the share of each copy direction's "
        "busy time that ran under compute), and OUT/timeline.png draws one step of each",
    )
    bench.add_argument(
        "--max-batch",
        action="store_true",
        help="GPU only: also find the largest batch whose step fits the device's memory (or "
        "--memory-cap) less a few percent for the allocator, with jaxoffload.largest_size: the step "
        "compiled at a few batches, then one real step to confirm, each search in a fresh "
        "process. Each strategy's record gets max_batch, max_batch_images_per_s and "
        "the search's other max_batch_* fields; a plain-Flax linen model is also planned at "
        "each batch, and the largest batch that some plan fits is a record of its own "
        "(strategy 'plan', with no budget). Not grad-accum(-lean), whose micro-batch sets its memory, "
        "nor offload-hidden and --budget's plans, made for one batch. Adds two table columns "
        "and OUT/max_batch.png",
    )
    bench.add_argument(
        "--max-image-size",
        action="store_true",
        help="GPU only: as --max-batch, for the images' side (multiples of 16) at --batch: "
        "max_image_size, max_image_size_ms_per_megapixel, ..., and OUT/max_image_size.png",
    )
    bench.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT,
        metavar="SECONDS",
        help="per size search: it starts no compile that would not finish within this long, "
        "takes the largest size that fitted, then runs its confirming step",
    )
    bench.add_argument(
        "--min-speed",
        type=float,
        default=None,
        metavar="SHARE",
        help="the planned model's size search: the largest size at which some plan keeps this "
        "share of the plain step's speed per image at --batch (0.7: 70%%); by default, any speed",
    )
    bench.add_argument(
        "--memory-cap",
        type=float,
        default=None,
        metavar="GIB",
        help="GPU only (an error on CPU): emulate a GPU with this much memory, by setting "
        "XLA_PYTHON_CLIENT_MEM_FRACTION in the measuring and searching processes",
    )


def parse_window(text: str) -> int | tuple[int, ...]:
    """Parses ``--window``: one window, or one per ResNet stage.

    Example:
      >>> parse_window("2"), parse_window("1,2,2,2")
      (2, (1, 2, 2, 2))
    """
    try:
        windows = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a window or comma-separated windows, got {text!r}"
        ) from None
    return windows[0] if len(windows) == 1 else windows


def parse_budgets(text: str) -> tuple[float, ...]:
    """Parses ``--budget``: comma-separated shares in (0, 1].

    Example:
      >>> parse_budgets("0.75,0.5")
      (0.75, 0.5)
    """
    try:
        budgets = tuple(float(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected shares such as 0.75,0.5, got {text!r}"
        ) from None
    bad = [b for b in budgets if not 0 < b <= 1]
    if bad:
        raise argparse.ArgumentTypeError(f"budgets are shares of 'none's peak in (0, 1], got {bad}")
    repeated = list(dict.fromkeys(b for b in budgets if budgets.count(b) > 1))
    if repeated:
        raise argparse.ArgumentTypeError(
            f"{', '.join(f'{b:g}' for b in repeated)} given more than once: each budget is planned "
            "and measured once; --repeat N times each plan in N processes"
        )
    return budgets


def main(argv: list[str] | None = None, *, children: Children | None = None) -> None:
    """Runs the command on ``argv`` (``sys.argv[1:]`` by default), exiting 2 on a bad argument.

    ``children`` stands in for the child processes that probe and measure
    (:class:`~jaxoffload.bench.child.Children` by default).
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        strategies, axes = options.check(args)
        # Only now, the flags checked: it imports jax, which takes seconds on a GPU machine.
        from jaxoffload.bench.command import bench

        typed = shlex.join(["jaxoffload", *argv])
        bench(args, strategies, axes, command=typed, children=children)
    except BenchError as e:
        parser.exit(2, f"jaxoffload bench: error: {e}\n")
    except KeyboardInterrupt:
        parser.exit(
            130,
            f"jaxoffload bench: interrupted: {pathlib.Path(args.out, RECORDS)} holds what was "
            "measured; run the same command with --resume to measure the rest\n",
        )


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
