"""The ``jaxoffload`` command: ``jaxoffload bench`` compares memory strategies on a model.

A thin layer over :mod:`jaxoffload.bench.benchmark`: it parses arguments, runs each
strategy in a fresh process, and writes a table, JSON records and a plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

from jaxoffload import __version__
from jaxoffload.bench import benchmark, models
from jaxoffload.bench.envelope import UNIFORM_STRATEGIES, envelope_step, pareto_front

# "plan" comes from --budget, not from --strategies.
STRATEGIES = (
    *benchmark.STRATEGIES,
    *(s for s in benchmark.PLANNED_STRATEGIES if s != "plan"),
    *benchmark.ACCUMULATED_STRATEGIES,
)
DEFAULT_MODEL = "flax-resnet18"
# What a plain-Flax model takes: one strategy for all its blocks, no checkpoint names.
DEFAULT_STRATEGIES = "none,lean,remat,remat-dots,offload,offload-inputs"

RECORDS = "records.json"
# The 'none' run's gradient, kept in --out until the run is complete, for --resume.
REFERENCE = "reference_gradient.npz"
# The flags whose values every record of a run shares, and the records' keys for them.
_RUN_FLAGS = {
    "--model": "model",
    "--batch": "batch",
    "--image-size": "image_size",
    "--dtype": "dtype",
    "--steps": "steps",
    "--window": "window",
    "--micro-batch": "micro_batch",
    "--devices": "num_devices",
    "--spatial": "spatial",
    "--memory-cap": "memory_cap_gib",
}
# What a record without one of those fields was measured with: they came later.
_RUN_DEFAULTS = {"spatial": 1}
# The size searches: each axis of jaxoffload.bench.fit, its flag, and the speed at the size
# found, as that module names its field, with the speed's unit.
# Seconds that one size search compiles for, unless --time-limit says otherwise.
_DEFAULT_TIME_LIMIT = 300.0

SIZE_SEARCHES = {
    "batch": ("--max-batch", "images_per_s", "images/s"),
    "image_size": ("--max-image-size", "ms_per_megapixel", "ms/MP"),
}


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
    bench.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"one of: {', '.join(models.MODEL_NAMES)}"
    )
    bench.add_argument(
        "--batch", type=int, default=8, help="images per step, over all the --devices"
    )
    bench.add_argument("--image-size", type=int, default=32, help="height and width of the images")
    bench.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype"
    )
    bench.add_argument("--steps", type=int, default=3, help="timed steps per strategy")
    bench.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help=f"comma-separated, from: {', '.join(STRATEGIES)} (grad-accum and grad-accum-lean need --micro-batch)",
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
        choices=benchmark.BLOCK_COSTS,
        default="timed",
        help="how --budget's planner costs the blocks: each distinct block program compiled "
        "and timed alone (timed), or from its traced FLOPs at the plain step's ms per FLOP "
        "(traced, which compiles no block program)",
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
        f"{', '.join(_RUN_FLAGS)}, and measure only the strategies it lacks (failed ones "
        f"again), then run only the size searches it lacks; without it, a run starts afresh "
        f"and replaces {RECORDS}",
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
        default=_DEFAULT_TIME_LIMIT,
        metavar="SECONDS",
        help="per size search: after this long it compiles no more sizes and takes the largest "
        "that fitted, then runs its confirming step",
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
    return budgets


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        bench(args, command=shlex.join(["jaxoffload", *argv]))
    except BenchError as e:
        parser.exit(2, f"jaxoffload bench: error: {e}\n")
    except KeyboardInterrupt:
        parser.exit(
            130,
            f"jaxoffload bench: interrupted: {pathlib.Path(args.out, RECORDS)} holds what was "
            "measured; run the same command with --resume to measure the rest\n",
        )


class BenchError(ValueError):
    """A problem with the command's arguments or environment, said in words."""


def bench(args: argparse.Namespace, command: str | None = None) -> list[dict[str, Any]]:
    """Runs ``jaxoffload bench``; returns the records it wrote.

    Args:
      args: the parsed command line.
      command: the command as typed, stored in each record so it can be rerun.
    """
    strategies = _strategies(args)
    axes = _searched_axes(args)
    workloads = _workloads(args, strategies)
    out = _writable_folder(args.out)
    if args.resume:
        earlier = _earlier_records(out / RECORDS, args)
    else:
        earlier = {}
        (out / REFERENCE).unlink(missing_ok=True)  # its gradient is another run's
    device = benchmark.probe_device()
    _check_device_count(args, device)
    env = _measuring_env(args, device, axes)
    console = _stderr_console()
    if device["platform"] == "cpu" and set(benchmark.COMPUTE_TWIN) & set(strategies):
        console.print(
            "[yellow]note:[/] on CPU, host placement has no effect: offload strategies move "
            "nothing, so their memory equals 'none'. Measure memory on a GPU."
        )
    _add_needed_strategies(workloads, strategies, console)
    # The plain model runs first: it is every other strategy's gradient reference.
    # Planned strategies run last: they are planned from their twin's run.
    workloads.sort(key=lambda w: (w.strategy != "none", w.strategy in benchmark.PLANNED_STRATEGIES))
    records = _measure(
        workloads, args, out, earlier, axes=axes, device=device, env=env, console=console,
        command=command,
    )  # fmt: skip
    _print_table(records)
    _say_notes(records, console)
    plots = [plot_records(records, out / "pareto.png")]
    plots += [plot_sizes(records, axis, out / f"max_{axis}.png") for axis in axes]
    plotted = ", ".join(str(p) for p in plots if p)
    console.print(f"wrote {out / RECORDS}" + (f" and {plotted}" if plotted else ""))
    failed = [f"{_name(r)}: {r['error']}" for r in records if "error" in r] + [
        f"{_name(r)} {flag}: {r[f'max_{axis}_error']}"
        for r in records
        for axis, (flag, *_) in SIZE_SEARCHES.items()
        if f"max_{axis}_error" in r
    ]
    if failed:
        raise BenchError(
            f"{len(failed)} failed ({RECORDS} has the rest; --resume runs only these again):\n"
            + "\n".join(failed)
        )
    (out / REFERENCE).unlink(missing_ok=True)  # nothing left to compare with it
    return records


def _strategies(args: argparse.Namespace) -> list[str]:
    """``--strategies`` as a list, checked with ``--steps`` and the flags that depend on it."""
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise BenchError(
            f"unknown strategies {unknown or strategies}; choose from {', '.join(STRATEGIES)}"
        )
    if args.steps < 1:
        raise BenchError(f"--steps must be at least 1, got {args.steps}")
    windowed = [s for s, value in benchmark.STRATEGIES.items() if value.to_host]
    if args.window != 1 and not set(strategies) & set(windowed):
        raise BenchError(
            f"--window {args.window} has no effect on {', '.join(strategies)}: only "
            f"{', '.join(windowed)} take it"
        )
    accumulated = list(benchmark.ACCUMULATED_STRATEGIES)
    if args.micro_batch is not None and not set(strategies) & set(accumulated):
        raise BenchError(
            f"--micro-batch {args.micro_batch} has no effect on {', '.join(strategies)}: only "
            f"{', '.join(accumulated)} take it"
        )
    # The bench's planners for one batch time their blocks on one device, without the mesh.
    one_device = [
        option
        for option, given in [
            ("--budget", bool(args.budget)),
            ("offload-hidden", "offload-hidden" in strategies),
        ]
        if given and args.devices * args.spatial > 1
    ]
    if one_device:
        raise BenchError(
            f"{' and '.join(one_device)} with --devices or --spatial is not supported yet"
        )
    return strategies


def _searched_axes(args: argparse.Namespace) -> list[str]:
    """The axes of the size searches asked for (:data:`SIZE_SEARCHES`), checked with the model."""
    axes = [axis for axis, (flag, *_) in SIZE_SEARCHES.items() if getattr(args, _dest(flag))]
    if axes and models.is_nnx(args.model):
        flags = " and ".join(SIZE_SEARCHES[axis][0] for axis in axes)
        raise BenchError(
            f"{flags} searches the linen models, and {args.model} is an NNX one: not supported yet"
        )
    if args.time_limit <= 0:
        raise BenchError(
            f"--time-limit must be a positive number of seconds, got {args.time_limit}"
        )
    if args.min_speed is not None and not (axes and 0 < args.min_speed <= 1):
        raise BenchError(
            f"--min-speed {args.min_speed:g} is a share of the plain step's speed, in (0, 1], "
            "for the planned model's size search: add --max-batch or --max-image-size"
        )
    if not axes and args.time_limit != _DEFAULT_TIME_LIMIT:
        raise BenchError(
            f"--time-limit {args.time_limit:g} has no effect without a size search: add "
            "--max-batch or --max-image-size"
        )
    return axes


def _dest(flag: str) -> str:
    """The attribute of the parsed arguments that holds ``flag``: ``--max-batch`` -> ``max_batch``."""
    return flag[2:].replace("-", "_")


def _workloads(args: argparse.Namespace, strategies: list[str]) -> list[benchmark.Workload]:
    """One workload per strategy, then one plan per ``--budget``."""

    def workload(strategy: str, **fields: Any) -> benchmark.Workload:
        return benchmark.Workload(
            args.model, args.batch, args.image_size, args.dtype, strategy,
            num_devices=args.devices, spatial=args.spatial, **fields,
        )  # fmt: skip

    try:
        return [
            workload(
                s,
                window=args.window,
                micro_batch=args.micro_batch if s in benchmark.ACCUMULATED_STRATEGIES else None,
            )
            for s in strategies
        ] + [workload("plan", budget=b, block_costs=args.block_costs) for b in args.budget]
    except ValueError as e:
        raise BenchError(str(e)) from None


def _check_device_count(args: argparse.Namespace, device: dict[str, Any]) -> None:
    """``--devices`` by ``--spatial`` is at most what the measuring processes' jax sees."""
    count, needed = device.get("device_count", 1), args.devices * args.spatial
    if needed > count:
        flag = f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}"
        more = f"; on CPU, {flag} gives more" if device["platform"] == "cpu" else ""
        asked = f"--devices {args.devices}" + (
            f" by --spatial {args.spatial}" if args.spatial > 1 else ""
        )
        raise BenchError(f"{asked}: jax sees {count} {device['platform']} devices here{more}")


def _measuring_env(
    args: argparse.Namespace, device: dict[str, Any], axes: list[str]
) -> dict[str, str]:
    """The measuring processes' environment, for ``--memory-cap``; it and the size searches need a GPU."""
    options = ["--memory-cap"] * (args.memory_cap is not None)
    options += [SIZE_SEARCHES[axis][0] for axis in axes]
    if options and device["platform"] != "gpu":
        raise BenchError(
            f"{' and '.join(options)} need{'s' * (len(options) == 1)} a GPU: this machine's jax "
            f"backend is {device['platform']}, where device memory is host memory and running "
            "out of it stops the machine, not the step"
        )
    if args.memory_cap is None:
        return {}
    return _memory_cap_env(args.memory_cap, device["bytes_limit"])


def _stderr_console():
    """The console of progress and notes: stderr, its lines whole when it is a log."""
    from rich.console import Console

    console = Console(stderr=True)
    console.soft_wrap = not console.is_terminal  # a log's lines are not cut at 80 columns
    return console


def _add_needed_strategies(
    workloads: list[benchmark.Workload], strategies: list[str], console: Any
) -> None:
    """Adds, in place and with a note, the strategies that others need: ``none`` and planned ones' twins.

    An accumulating strategy checks its gradient against its own step on a whole batch,
    so a run of those alone does not add ``none``, whose step at the global batch is the
    one that does not fit.
    """
    compared = any(map(_compared_with_none, strategies))
    for needed, why in [("none", "gradients are compared with it")] * compared + [
        (benchmark.COMPUTE_TWIN[s], f"{s!r} is planned from its run")
        for s in strategies
        if s in benchmark.PLANNED_STRATEGIES and s != "plan"
    ]:
        if needed not in strategies:
            console.print(f"note: adding the {needed!r} strategy: {why}.")
            workloads.append(dataclasses.replace(workloads[0], strategy=needed, micro_batch=None))
            strategies.append(needed)


def _compared_with_none(strategy: str) -> bool:
    """Whether a strategy's gradient is compared with ``none``'s: an accumulating one
    checks itself against its own step on a whole batch."""
    return strategy != "none" and strategy not in benchmark.ACCUMULATED_STRATEGIES


def _print_table(records: list[dict[str, Any]]) -> None:
    """The records' table, on stdout."""
    from rich.console import Console

    out_console = Console()
    if not out_console.is_terminal:  # a file or a pipe: no width to fit, so do not squeeze
        out_console = Console(width=200)  # the widest table: both size searches, × bound
    out_console.print(_table(records))


def _say_notes(records: list[dict[str, Any]], console: Any) -> None:
    """What the table does not say: copies that free little, empty plans, gradients, plans."""
    for r in records:
        if r.get("copies_free_little"):
            console.print(
                f"[yellow]note:[/] {r['strategy']!r} moves {_gib(r['device_to_host_bytes'])} GiB to "
                f"the host but its device temp is {_gib(r['compiled_temp_bytes'])} GiB against "
                f"{_gib(r['twin_temp_bytes'])} GiB without "
                "the copies: they free less than a tenth of what they move. The peak is a "
                "working set, not residuals; 'lean' keeps as little without the transfers."
            )
        if gathers := r.get("spatial_gathers"):
            sources = sorted({g["op_name"] for g in gathers})
            console.print(
                f"[yellow]note:[/] {_name(r)!r} gathers {len(gathers)} activations whole on every "
                f"device, undoing the row split ({_gib(sum(g['nbytes'] for g in gathers))} GiB in "
                f"all), from: {'; '.join(sources)}."
            )
        if r["strategy"] == "offload-hidden" and r.get("offloaded_blocks") == 0:
            console.print(
                f"[yellow]note:[/] {r['strategy']!r} offloads nothing here: no block's transfers "
                f"fit behind the compute around it, so it ran as {r['plan'][0]!r}."
            )
    for r in records:
        if r.get("grad_rel_err_note"):
            console.print(
                f"{_name(r)} ({r['accumulation_steps']} micro-batches of {r['micro_batch']}): grad "
                f"err {r['grad_rel_err']:.1e} {r['grad_rel_err_note']}."
            )
    compiled_high = [
        _name(r)
        for r in records
        if r.get("compile_peak_bytes") and r["compile_peak_bytes"] >= r["peak_bytes_in_use"]
    ]
    if compiled_high:
        console.print(
            f"[yellow]note:[/] the runtime peak of {', '.join(compiled_high)} was reached while "
            "compiling (autotuning), not by the step: compare their compiled bytes."
        )
    flagged = gradient_flags(records)
    if flagged:
        control = next(r for r in records if r["strategy"] == GRADIENT_CONTROL)["grad_rel_err"]
        console.print(
            "[yellow]note:[/] gradient error over twice the same-arithmetic control's "
            f"({GRADIENT_CONTROL!r}, {control:.1e}) in this run: "
            + ", ".join(f"{_name(r)} {r['grad_rel_err']:.1e}" for r in flagged)
            + " (marked !)."
        )
    for r in records:
        if r["strategy"] == "plan" and "plan_choices" in r:
            choices = ", ".join(
                f"{c} x{r['plan_choices'].count(c)}" for c in dict.fromkeys(r["plan_choices"])
            )
            console.print(
                f"{_name(r)}: {choices}; outside the blocks {r['plan_outside']}"
                + _against_envelope(r, records)
            )


def _against_envelope(plan: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """A measured plan's step over the uniform envelope at its budget, and its peak against it.

    The budget is the planner's, ``budget_bytes``. Both figures read runtime peaks, the
    plan's and the uniform strategies': without them (CPU), nothing is said.
    """
    peak = plan.get("peak_bytes_in_use")
    if not peak or "step_time_ms" not in plan:
        return ""
    budget = plan["budget_bytes"]
    uniform = _uniform_points(records, "peak_bytes_in_use")
    envelope = envelope_step(list(uniform.values()), budget)
    if envelope is None:
        versus = f"no uniform strategy of this run ({', '.join(uniform)}) fits its budget"
    else:
        ratio = plan["step_time_ms"] / envelope
        versus = f"{ratio:.2f}× the envelope of {', '.join(uniform)} at its budget"
    within = "within" if peak <= budget else "over"
    return f"; {versus}; peak {_gib(peak)} GiB, {within} its budget of {_gib(budget)} GiB"


def _writable_folder(text: str) -> pathlib.Path:
    """``--out`` as a folder this process can write into, checked before anything is measured."""
    out = pathlib.Path(text)
    if out.exists() and not out.is_dir():
        raise BenchError(
            f"--out {text} is a file, not a folder: give a folder (made if need be) for "
            f"{RECORDS} and pareto.png"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=out).close()
    except OSError as e:
        raise BenchError(
            f"--out {text}: cannot write records there ({e.strerror}): give a folder you can "
            "write to"
        ) from None
    return out


def _earlier_records(path: pathlib.Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The records of ``path`` that ``--resume`` keeps, by name: all but the failed ones.

    Raises:
      BenchError: if a record was measured with other values of :data:`_RUN_FLAGS`.
    """
    if not path.exists():
        return {}
    try:
        records = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise BenchError(
            f"--resume: {path} is not a records file ({e}): leave out --resume to measure afresh"
        ) from None
    for r in records:
        for flag, key in _RUN_FLAGS.items():
            if key == "window" and r["strategy"] in benchmark.PLANNED_STRATEGIES:
                continue  # the planner chose it
            if key == "micro_batch" and r["strategy"] not in benchmark.ACCUMULATED_STRATEGIES:
                continue  # only accumulating strategies take it
            theirs = r.get(key, _RUN_DEFAULTS.get(key))
            theirs = tuple(theirs) if isinstance(theirs, list) else theirs
            ours = getattr(args, _dest(flag))
            if theirs != ours:
                raise BenchError(
                    f"--resume: {path} holds {_name(r)!r} measured with {flag} {theirs}, and this "
                    f"command has {flag} {ours}: give that run's arguments, or leave out --resume "
                    "to measure afresh"
                )
    return {_name(r): r for r in records if "error" not in r}


def _measure(
    workloads: list[benchmark.Workload],
    args: argparse.Namespace,
    out: pathlib.Path,
    earlier: dict[str, dict[str, Any]],
    *,
    axes: list[str],
    device: dict[str, Any],
    env: dict[str, str],
    console: Any,
    command: str | None,
) -> list[dict[str, Any]]:
    """Measures the workloads, then searches the sizes, that ``earlier`` lacks; writes records.json after each."""
    path, reference = out / RECORDS, out / REFERENCE
    kept = {_name(w): earlier[_name(w)] for w in workloads if _name(w) in earlier}
    compared = any(_compared_with_none(w.strategy) for w in workloads if _name(w) not in kept)
    if "step_time_ms" in kept.get("none", {}) and not reference.exists() and compared:
        del kept["none"]  # measured again: the others' gradients are compared with its
    todo = [w for w in workloads if _name(w) not in kept]
    searched = _searched(workloads, axes)
    measuring = {_name(w) for w in todo}  # their records are new: nothing searched yet
    searches = [
        (name, axis)
        for name in searched
        for axis in axes
        if name in measuring
        or f"max_{axis}" not in earlier.get(name, {})
        or (name == "plan" and earlier[name].get(f"max_{axis}_min_speed") != args.min_speed)
    ]
    if args.resume:
        searching = f"; searching {', '.join(f'{n} {a}' for n, a in searches) or 'nothing more'}"
        console.print(
            f"resuming {path}: kept {', '.join(kept) or 'nothing'}; measuring "
            f"{', '.join(map(_name, todo)) or 'nothing more'}{searching if axes else ''}."
        )
    first_plan = next((w for w in todo if w.strategy == "plan"), None)
    with _Progress(console, total=len(todo) + len(searches)) as progress:

        def on_start(w):
            work = f"compile and {args.steps} steps"
            if w is first_plan:  # every budget is planned in one process, before the first plan
                work = f"plan at {sum(v.strategy == 'plan' for v in todo)} budgets, {work}"
            progress.start(f"{_name(w)} on {w.model}, batch {w.batch}: {work}")

        def on_record(records):
            r = records[-1]
            r.update(_run_fields(args, command))
            _write_json(path, records)
            progress.end(f"{_name(r)}: {_outcome(r)}")

        records = benchmark.measure_all(
            workloads,
            steps=args.steps,
            env=env,
            on_start=on_start,
            on_record=on_record,
            measured=list(kept.values()),
            reference=str(reference),
            # A GPU autotunes while compiling, on the device: not in the measured peak.
            compile_first=device["platform"] != "cpu",
        )
        if "plan" in searched:
            records.append(
                earlier.get("plan") or _plan_search_record(workloads[0], device, args, command)
            )
        _search_sizes(records, searched, searches, args, path, env=env, progress=progress)
    _write_json(path, records)  # with the transfer bounds, which need every record
    return records


def _run_fields(args: argparse.Namespace, command: str | None) -> dict[str, Any]:
    """What every record of the run says of it, beyond its workload."""
    return {
        "steps": args.steps,
        "memory_cap_gib": args.memory_cap,
        "command": command,
        "commit": _commit(),
    }


def _commit() -> str | None:
    """The code's commit: ``$JAXOFFLOAD_COMMIT`` (for a copy without its git history), or
    the checkout's, or ``None``."""
    if os.environ.get("JAXOFFLOAD_COMMIT"):
        return os.environ["JAXOFFLOAD_COMMIT"]
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def _searched(
    workloads: list[benchmark.Workload], axes: list[str]
) -> dict[str, benchmark.Workload]:
    """The workloads whose sizes are searched, by the name of the record that takes the fields.

    Each strategy of one value for every block is searched as it is. A plain-Flax
    (linen) model is also planned at each size, from the plain workload, into a record
    of its own, ``"plan"``. ``offload-hidden``'s plans and ``--budget``'s are made for
    the batch measured, and an accumulating strategy's memory is set by its micro-batch: they are
    not searched.
    """
    if not axes:
        return {}
    searched = {_name(w): w for w in workloads if w.strategy in benchmark.STRATEGIES}
    if models.is_plain(workloads[0].model):  # and linen: the searches refuse NNX models
        searched["plan"] = workloads[0]
    return searched


def _plan_search_record(
    plain: benchmark.Workload, device: dict[str, Any], args: argparse.Namespace, command: str | None
) -> dict[str, Any]:
    """The record of the planned model's size searches, before they add their fields.

    Its strategy is ``"plan"`` with no ``budget``: each size is planned for the device's
    memory, not for a share of ``none``'s peak as ``--budget``'s plans are, and no step
    of its own is measured at the run's batch.
    """
    fields = ("model", "batch", "image_size", "dtype", "num_devices")
    return {
        **{k: getattr(plain, k) for k in fields},
        **benchmark.spatial_fields(plain),
        "strategy": "plan",
        "framework": "jax",
        "device": device["device"],
        "platform": device["platform"],
        "date": datetime.date.today().isoformat(),
        **_run_fields(args, command),
    }


def _search_sizes(
    records: list[dict[str, Any]],
    searched: dict[str, benchmark.Workload],
    searches: list[tuple[str, str]],
    args: argparse.Namespace,
    path: pathlib.Path,
    *,
    env: dict[str, str],
    progress: _Progress,
) -> None:
    """Runs each search ``(name, axis)`` in a process of its own; adds its fields to the record named."""
    by_name = {_name(r): r for r in records}
    for name, axis in searches:
        r, what = by_name[name], f"{name}: largest {axis.replace('_', ' ')}"
        progress.start(f"{what}, compiling for up to {args.time_limit:g} s")
        try:
            found = benchmark.largest_in_subprocess(
                searched[name],
                axis,
                plan=name == "plan",
                env=env,
                time_limit_s=args.time_limit,
                min_speed=args.min_speed if name == "plan" else None,
            )
        except RuntimeError as e:  # one failed search must not cost the others
            r[f"max_{axis}_error"] = str(e)
            outcome = f"failed: {str(e).strip().splitlines()[-1]}"
        else:
            r.pop(f"max_{axis}_error", None)  # an earlier run's, searched again
            r.update(found)
            size, speed = _size_cells(r, axis)
            outcome = size + (f", {speed} {SIZE_SEARCHES[axis][2]}" if speed != "-" else "")
            if found[f"max_{axis}_stopped"]:
                outcome += f" ({found[f'max_{axis}_stopped']})"
        _write_json(path, records)
        progress.end(f"{what} {outcome}")


def _write_json(path: pathlib.Path, value: Any) -> None:
    """Writes ``path`` whole or not at all: a kill mid-write leaves the file as it was."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(partial, path)


def _least(r: dict[str, Any]) -> str:
    """The least share of the plain step that any plan reached: ``"least 0.97 on CPU"``."""
    share = r.get("least_share")
    where = " on CPU" if r.get("platform") == "cpu" else ""
    return f"least {share:.2f}{where}" if share is not None else "no plan"


def _outcome(r: dict[str, Any]) -> str:
    """What a measured record came to, in a few words."""
    if r.get("out_of_memory"):
        return "out of memory"
    if "no_plan" in r:
        return f"no plan fits: {_least(r)}"
    if "error" in r:
        return f"failed: {r['error'].strip().splitlines()[-1]}"
    return f"{r['step_time_ms']:.1f} ms a step"


class _Progress:
    """Says each step of the work as it starts and ends, with the time it took.

    It goes to stderr. Where stderr and stdout are both a terminal it is a live
    bar; where either is a log file or a pipe (CI, ``bench > log``) each step is
    a plain, flushed line, which stays where the bar, erased when done, would not.
    """

    def __init__(self, console: Any, total: int):
        self.console, self.total, self.steps, self.began = console, total, 0, 0.0
        self.bar = None
        if console.is_terminal and sys.stdout.isatty():
            from rich.progress import Progress

            self.bar = Progress(console=console, transient=True)
            self.task = self.bar.add_task("measuring", total=total)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def start(self, what: str) -> None:
        self.began = time.monotonic()
        self._say(what)

    def end(self, outcome: str) -> None:
        self._say(f"{outcome} ({time.monotonic() - self.began:.1f} s)")
        self.steps += 1
        if self.bar is not None:
            self.bar.advance(self.task)

    def _say(self, text: str) -> None:
        line = f"[{self.steps + 1}/{self.total}] {text}"
        if self.bar is not None:
            self.bar.update(self.task, description=line)
        else:
            print(line, file=self.console.file, flush=True)


def _memory_cap_env(gib: float, bytes_limit: int | None) -> dict[str, str]:
    """XLA_PYTHON_CLIENT_MEM_FRACTION that gives the children ``gib`` of device memory."""
    if gib <= 0:
        raise BenchError(f"--memory-cap must be positive, got {gib}")
    # bytes_limit is what a child's allocator may take: the default fraction
    # (0.75) of the device, unless the environment set another.
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
    total = (bytes_limit or 0) / fraction
    if gib * 2**30 > total:
        raise BenchError(
            f"--memory-cap {gib} GiB is more than this GPU has ({total / 2**30:.1f} GiB)"
        )
    return {"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{gib * 2**30 / total:.6f}"}


def _name(r) -> str:
    """A record's or workload's strategy, with its budget for plans: ``plan@0.5``.

    The planned model's size searches have no budget: their record is ``plan``.
    """
    get = r.get if isinstance(r, dict) else lambda k, d=None: getattr(r, k, d)
    budget = get("budget")
    return (
        f"plan@{budget:g}" if get("strategy") == "plan" and budget is not None else get("strategy")
    )


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.3f}"


def _table(records: list[dict[str, Any]]):
    from rich.table import Table

    first = records[0]
    devices = first.get("num_devices", 1)
    table = Table(
        title=f"{first['model']}, batch {first['batch']}, {first['image_size']}², {first['dtype']}"
        + (f", {devices} devices" if devices > 1 else "")
        + (f", rows over {first['spatial']} devices" if first.get("spatial", 1) > 1 else "")
    )
    columns = ["strategy", "temp GiB", "host GiB", "peak GiB", "step ms", "images/s", "grad err"]
    bound = any("bound_ratio" in r for r in records)
    if bound:
        columns.append("× bound")
    axes = [
        axis
        for axis in SIZE_SEARCHES
        if any(f"max_{axis}" in r or f"max_{axis}_error" in r for r in records)
    ]
    for axis in axes:
        columns += [f"max {axis.replace('_', ' ')}", f"{SIZE_SEARCHES[axis][2]} at max"]
    table.add_column(columns[0], no_wrap=True)  # the figures' columns wrap first
    for c in columns[1:]:
        table.add_column(c, justify="right")
    flagged = gradient_flags(records)
    for r in records:
        sizes = [cell for axis in axes for cell in _size_cells(r, axis)]
        table.add_row(_name(r), *_measured_cells(r, flagged, bound), *sizes)
    return table


def _measured_cells(r: dict[str, Any], flagged: list[dict[str, Any]], bound: bool) -> list[str]:
    """A record's cells of its measured step, from temp to grad err (and × bound)."""
    blank = [""] * (5 + bound)
    if "no_plan" in r:
        return [_least(r), *blank]
    if r.get("out_of_memory") or "error" in r:
        return ["out of memory" if r.get("out_of_memory") else "failed", *blank]
    if "step_time_ms" not in r:  # the planned model's size searches: no step at the run's size
        return ["-"] * (6 + bound)
    err = r["grad_rel_err"]
    cells = [
        _gib(r["compiled_temp_bytes"]),
        _gib(r["compiled_host_temp_bytes"]),
        _gib(r["peak_bytes_in_use"]),
        f"{r['step_time_ms']:.1f}",
        f"{r['images_per_s']:.1f}",
        "-" if err is None else f"{err:.1e}{' !' if r in flagged else ''}",
    ]
    if bound:
        cells.append(f"{r['bound_ratio']:.2f}" if "bound_ratio" in r else "-")
    return cells


def _size_cells(r: dict[str, Any], axis: str) -> list[str]:
    """A record's cells of one size search: the largest size found and the speed there."""
    if f"max_{axis}_error" in r:
        return ["failed", ""]
    if f"max_{axis}" not in r:  # not searched: grad-accum(-lean), or a plan made for one batch
        return ["-", "-"]
    speed = r.get(f"max_{axis}_{SIZE_SEARCHES[axis][1]}")
    return [str(r[f"max_{axis}"]), "-" if speed is None else f"{speed:.1f}"]


# The run whose arithmetic is the plain model's, rematerialised: its gradient error is
# rounding, the scale against which the other strategies' errors are read.
GRADIENT_CONTROL = "remat"


def gradient_flags(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records whose gradient error is over twice the same-arithmetic control's, same run.

    The control is :data:`GRADIENT_CONTROL`'s record; without it, or with a
    control error of 0 (float64, or a CPU that sums in one order), nothing is
    flagged.

    Example:
      >>> records = [{"strategy": "remat", "grad_rel_err": 1e-3},
      ...            {"strategy": "lean", "grad_rel_err": 3e-3}]
      >>> [r["strategy"] for r in gradient_flags(records)]
      ['lean']
    """
    control = next(
        (r.get("grad_rel_err") for r in records if r.get("strategy") == GRADIENT_CONTROL), None
    )
    if not control:
        return []
    return [
        r for r in records if r.get("grad_rel_err") is not None and r["grad_rel_err"] > 2 * control
    ]


def plot_records(records: list[dict[str, Any]], path: pathlib.Path) -> pathlib.Path | None:
    """Plots memory against step time, one point per record, with the Pareto front and the envelope.

    The envelope is the least step the uniform strategies reach at each memory
    (:func:`~jaxoffload.bench.envelope.envelope_step`), drawn up from the leanest
    of them. Plans are stars; where memory is the runtime peak, each plan's budget
    (``budget_bytes``) is a dotted line of its colour, so that a plan reads against
    its budget and against the envelope where the line crosses it. Records of other
    frameworks (``framework`` other than ``"jax"``, such as
    ``jaxoffload/bench/torch_reference.py``'s) are drawn as squares and named
    with their framework. Returns ``path``, or ``None`` if matplotlib is missing
    or no record has a step time.
    """
    plt = _pyplot()
    done = [r for r in records if "step_time_ms" in r]
    if plt is None or not done:
        return None
    # Without a runtime peak (CPU), the compiled temp is the memory reading; the
    # budgets, in the planner's bytes, are then not on the axis.
    key = (
        "peak_bytes_in_use" if all(r["peak_bytes_in_use"] for r in done) else "compiled_temp_bytes"
    )
    points = [(r["step_time_ms"], r[key] / 2**30) for r in done]
    plans = [r for r in done if r["strategy"] == "plan"] if key == "peak_bytes_in_use" else []
    top = 1.05 * max([y for _, y in points] + [r["budget_bytes"] / 2**30 for r in plans])
    fig, ax = plt.subplots(figsize=(8, 4.2), constrained_layout=True)
    budget_colors = []
    for r, (x, y) in zip(done, points):
        jax_record = r.get("framework", "jax") == "jax"
        label = _name(r) if jax_record else f"{r['framework']} {r['strategy']}"
        marker = "s" if not jax_record else "*" if r["strategy"] == "plan" else "o"
        dot = ax.scatter(x, y, s=90 if marker == "*" else 45, marker=marker, label=label, zorder=3)
        if r in plans:
            budget_colors.append((r["budget_bytes"] / 2**30, dot.get_facecolor()[0]))
    for n, (budget, color) in enumerate(budget_colors):  # one legend entry for them all
        ax.axhline(budget, color=color, ls=":", lw=1, label=None if n else "a plan's budget")
    front = pareto_front(points)
    ax.plot(*zip(*[points[i] for i in front]), "k--", lw=1, label="Pareto front")
    uniform = _uniform_points(done, key).values()
    _plot_envelope(ax, [(m / 2**30, step) for m, step in uniform], top)
    first = done[0]
    _set_time_axis(ax, [x for x, _ in points])
    ax.set(
        xlabel="step time (ms)",
        ylabel=("runtime peak" if key == "peak_bytes_in_use" else "compiled device temp")
        + " (GiB)",
        title=f"{first['model']} b{first['batch']} {first['image_size']}² {first['dtype']}, "
        f"{first['device']}",
    )
    ax.set_ylim(0, top)
    # Outside the axes, so that it never hides a point.
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sizes(records: list[dict[str, Any]], axis: str, path: pathlib.Path) -> pathlib.Path | None:
    """Plots the speed at the largest size found against that size, a labelled point per search.

    ``axis`` is a key of :data:`SIZE_SEARCHES`: images/s against the largest batch, or
    ms per megapixel against the largest image side. The planned model's point is a
    star. Returns ``path``, or ``None`` if matplotlib is missing or no search found a
    size that it timed.
    """
    plt = _pyplot()
    _, speed, unit = SIZE_SEARCHES[axis]
    found = [r for r in records if r.get(f"max_{axis}") and r.get(f"max_{axis}_{speed}")]
    if plt is None or not found:
        return None
    fig, ax = plt.subplots(figsize=(6, 4.2), constrained_layout=True)
    for r in found:
        x, y = r[f"max_{axis}"], r[f"max_{axis}_{speed}"]
        star = r["strategy"] == "plan"
        ax.scatter(x, y, s=90 if star else 45, marker="*" if star else "o", zorder=3)
        ax.annotate(_name(r), (x, y), xytext=(5, 3), textcoords="offset points", fontsize="small")
    label = axis.replace("_", " ")
    first = found[0]
    held = f"{first['image_size']}²" if axis == "batch" else f"batch {first['batch']}"
    cap = f", {first['memory_cap_gib']:g} GiB cap" if first.get("memory_cap_gib") else ""
    ax.set(
        xlabel=f"largest {label} that fits",
        ylabel=f"{unit} at that {label}",
        title=f"{first['model']} {held} {first['dtype']}, {first['device']}{cap}",
    )
    ax.set_xlim(0, 1.15 * max(r[f"max_{axis}"] for r in found))
    ax.set_ylim(0, 1.15 * max(r[f"max_{axis}_{speed}"] for r in found))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _pyplot() -> Any:
    """matplotlib's pyplot, drawing into files; ``None`` if matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _uniform_points(records: list[dict[str, Any]], key: str) -> dict[str, tuple[float, float]]:
    """``(memory at key, step)`` of each measured strategy of :data:`UNIFORM_STRATEGIES`."""
    return {
        r["strategy"]: (r[key], r["step_time_ms"])
        for r in records
        if r["strategy"] in UNIFORM_STRATEGIES and "step_time_ms" in r and r.get(key)
    }


def _plot_envelope(ax: Any, uniform: list[tuple[float, float]], top: float) -> None:
    """The envelope of the ``uniform`` points, from the leanest up to memory ``top``.

    It is sampled, not drawn as the hull's polyline: on a logarithmic time axis a
    segment of the hull is a curve. The points' own memories are among the samples,
    so that each corner of the hull is drawn where it is.
    """
    import numpy as np

    if not uniform:
        return
    leanest = min(m for m, _ in uniform)
    memories = sorted({*np.linspace(leanest, top, 200).tolist(), *(m for m, _ in uniform)})
    steps = [envelope_step(uniform, m) for m in memories]
    ax.plot(steps, memories, color="0.45", lw=1.5, zorder=2, label="uniform envelope")


def _set_time_axis(ax: Any, times: list[float]) -> None:
    """A step-time axis: logarithmic where the times span more than ten times, else from 0."""
    import matplotlib.ticker

    if max(times) > 10 * min(times):  # offload and recompute differ by orders of magnitude
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        # Label 20, 50, 200, 500...: every minor tick would crowd the axis.
        ax.xaxis.set_minor_formatter(
            matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else "")
        )
    else:
        ax.set_xlim(0, 1.15 * max(times))


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
