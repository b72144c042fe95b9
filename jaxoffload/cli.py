"""The ``jaxoffload`` command: ``jaxoffload bench`` compares memory strategies on a model.

A thin layer over :mod:`jaxoffload.benchmark`: it parses arguments, runs each
strategy in a fresh process, and writes a table, JSON records and a plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shlex
import sys
from typing import Any

from jaxoffload import benchmark, models
from jaxoffload.strategies import Offload

# "plan" comes from --budget, not from --strategies.
STRATEGIES = (*benchmark.STRATEGIES, *(s for s in benchmark.PLANNED_STRATEGIES if s != "plan"))
DEFAULT_MODEL = "flax-resnet18"
# What a plain-Flax model takes: one strategy for all its blocks, no checkpoint names.
DEFAULT_STRATEGIES = "none,lean,remat,remat-dots,offload,offload-inputs"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxoffload", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser(
        "bench",
        help="measure memory and step time of each strategy on a model",
        description="Measure each memory strategy's compiled temp, runtime peak, step time and "
        "gradient error on one model, each in a fresh process. The defaults run on CPU.",
    )
    bench.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"one of: {', '.join(models.MODEL_NAMES)}"
    )
    bench.add_argument("--batch", type=int, default=8)
    bench.add_argument("--image-size", type=int, default=32)
    bench.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    bench.add_argument("--steps", type=int, default=3, help="timed steps per strategy")
    bench.add_argument(
        "--strategies",
        default=DEFAULT_STRATEGIES,
        help=f"comma-separated, from: {', '.join(STRATEGIES)} (default: {DEFAULT_STRATEGIES})",
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
        "--budget",
        type=parse_budgets,
        default=(),
        metavar="SHARES",
        help="also plan the model (jaxoffload.plan) at each budget, as shares of 'none's "
        "peak, e.g. 0.75,0.5,0.35,0.25, and measure each plan (plain-Flax models)",
    )
    bench.add_argument("--out", default="bench-out", help="folder for records.json and pareto.png")
    bench.add_argument(
        "--max-batch",
        action="store_true",
        help="also find, per strategy, the largest batch that trains: by compiling, then "
        "one step to confirm (GPU only)",
    )
    bench.add_argument(
        "--memory-cap",
        type=float,
        default=None,
        metavar="GIB",
        help="emulate a GPU with this much memory (sets XLA_PYTHON_CLIENT_MEM_FRACTION)",
    )
    return parser


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


class BenchError(ValueError):
    """A problem with the command's arguments or environment, said in words."""


def bench(args: argparse.Namespace, command: str | None = None) -> list[dict[str, Any]]:
    """Runs ``jaxoffload bench``; returns the records it wrote.

    Args:
      args: the parsed command line.
      command: the command as typed, stored in each record so it can be rerun.
    """
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown or not strategies:
        raise BenchError(
            f"unknown strategies {unknown or strategies}; choose from {', '.join(STRATEGIES)}"
        )
    if args.steps < 1:
        raise BenchError(f"--steps must be at least 1, got {args.steps}")
    windowed = [s for s in benchmark.STRATEGIES if isinstance(benchmark.STRATEGIES[s], Offload)]
    if args.window != 1 and not set(strategies) & set(windowed):
        raise BenchError(
            f"--window {args.window} has no effect on {', '.join(strategies)}: only "
            f"{', '.join(windowed)} take it"
        )
    try:
        workloads = [
            benchmark.Workload(
                args.model, args.batch, args.image_size, args.dtype, s, window=args.window
            )
            for s in strategies
        ] + [
            benchmark.Workload(
                args.model, args.batch, args.image_size, args.dtype, "plan", budget=b
            )
            for b in args.budget
        ]
    except ValueError as e:
        raise BenchError(str(e)) from None
    out = pathlib.Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "records.json").touch()
    except OSError as e:
        raise BenchError(f"--out {args.out}: cannot write records there ({e.strerror})") from None
    device = benchmark.probe_device()
    platform = device["platform"]
    env = {}
    if args.memory_cap is not None or args.max_batch:
        if platform != "gpu":
            option = "--memory-cap" if args.memory_cap is not None else "--max-batch"
            raise BenchError(
                f"{option} needs a GPU: this machine's jax backend is {platform}, where device "
                "memory is host memory and running out of it stops the machine, not the step"
            )
    if args.memory_cap is not None:
        env = _memory_cap_env(args.memory_cap, device["bytes_limit"])

    from rich.console import Console
    from rich.progress import Progress

    console = Console(stderr=True)
    if platform == "cpu" and set(benchmark.COMPUTE_TWIN) & set(strategies):
        console.print(
            "[yellow]note:[/] on CPU, host placement has no effect: offload strategies move "
            "nothing, so their memory equals 'none'. Measure memory on a GPU."
        )
    for needed, why in [("none", "gradients are compared with it")] + [
        (benchmark.COMPUTE_TWIN[s], f"{s!r} is planned from its run")
        for s in strategies
        if s in benchmark.PLANNED_STRATEGIES and s != "plan"
    ]:
        if needed not in strategies:
            console.print(f"note: adding the {needed!r} strategy: {why}.")
            workloads.append(dataclasses.replace(workloads[0], strategy=needed))
            strategies.append(needed)
    # The plain model runs first: it is every other strategy's gradient reference.
    # Planned strategies run last: they are planned from their twin's run.
    workloads.sort(key=lambda w: (w.strategy != "none", w.strategy in benchmark.PLANNED_STRATEGIES))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("measuring", total=len(workloads) * (1 + args.max_batch))

        def on_start(w):
            if w.strategy == "plan" and w.planned is None and w.budget == args.budget[0]:
                progress.update(task, description=f"planning at {len(args.budget)} budgets")
            else:
                progress.update(task, description=f"{_name(w)}: compile and {args.steps} steps")
            if w is not workloads[0]:
                progress.advance(task)

        def on_record(records):
            (out / "records.json").write_text(json.dumps(records, indent=1) + "\n")

        records = benchmark.measure_all(
            workloads, steps=args.steps, env=env, on_start=on_start, on_record=on_record
        )
        progress.advance(task)
        for w, r in zip(workloads, records):
            r["memory_cap_gib"] = args.memory_cap
            r["command"] = command
            if args.max_batch and w.strategy != "plan":  # a plan is made for one batch
                progress.update(task, description=f"{w.strategy}: largest batch")
                if r.get("plan"):  # search with the plan that was measured
                    w = dataclasses.replace(w, plan=tuple(r["plan"]), window=r["window"])
                r["max_batch"] = benchmark.find_max_batch(w, env=env)
                progress.advance(task)
    (out / "records.json").write_text(json.dumps(records, indent=1) + "\n")
    out_console = Console()
    if not out_console.is_terminal:  # a file or a pipe: no width to fit, so do not squeeze
        out_console = Console(width=120)
    out_console.print(_table(records))
    for r in records:
        if r.get("copies_free_little"):
            console.print(
                f"[yellow]note:[/] {r['strategy']!r} moves {_gib(r['device_to_host_bytes'])} GiB to "
                f"the host but its device temp is {_gib(r['compiled_temp_bytes'])} GiB against "
                f"{_gib(r['twin_temp_bytes'])} GiB without "
                "the copies: they free less than a tenth of what they move. The peak is a "
                "working set, not residuals; 'lean' keeps as little without the transfers."
            )
        if r["strategy"] == "offload-hidden" and r.get("offloaded_blocks") == 0:
            console.print(
                f"[yellow]note:[/] {r['strategy']!r} offloads nothing here: no block's transfers "
                f"fit behind the compute around it, so it ran as {r['plan'][0]!r}."
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
            console.print(f"{_name(r)}: {choices}; outside the blocks {r['plan_outside']}")
    plotted = plot_records(records, out / "pareto.png")
    console.print(f"wrote {out / 'records.json'}" + (f" and {plotted}" if plotted else ""))
    failed = [r for r in records if "error" in r]
    if failed:
        details = "\n".join(f"{r['strategy']}: {r['error']}" for r in failed)
        raise BenchError(f"{len(failed)} strategies failed (records.json has the rest):\n{details}")
    return records


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
    """A record's or workload's strategy, with its budget for plans: ``plan@0.5``."""
    get = r.get if isinstance(r, dict) else lambda k, d=None: getattr(r, k, d)
    return f"plan@{get('budget'):g}" if get("strategy") == "plan" else get("strategy")


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.3f}"


def _table(records: list[dict[str, Any]]):
    from rich.table import Table

    first = records[0]
    table = Table(
        title=f"{first['model']}, batch {first['batch']}, {first['image_size']}², {first['dtype']}"
    )
    columns = ["strategy", "temp GiB", "host GiB", "peak GiB", "step ms", "images/s", "grad err"]
    flagged = gradient_flags(records)
    if any("bound_ratio" in r for r in records):
        columns.append("× bound")
    if any("max_batch" in r for r in records):
        columns.append("max batch")
    for c in columns:
        table.add_column(c, justify="left" if c == "strategy" else "right")
    for r in records:
        if r.get("out_of_memory") or "error" in r:
            failure = "out of memory" if r.get("out_of_memory") else "failed"
            table.add_row(_name(r), *[failure] + [""] * (len(columns) - 2))
            continue
        err = r["grad_rel_err"]
        flag = " !" if r in flagged else ""
        row = [
            _name(r),
            _gib(r["compiled_temp_bytes"]),
            _gib(r["compiled_host_temp_bytes"]),
            _gib(r["peak_bytes_in_use"]),
            f"{r['step_time_ms']:.1f}",
            f"{r['images_per_s']:.1f}",
            "-" if err is None else f"{err:.1e}{flag}",
        ]
        if "× bound" in columns:
            row.append(f"{r['bound_ratio']:.2f}" if "bound_ratio" in r else "-")
        if "max_batch" in r:
            row.append(str(r["max_batch"]))
        table.add_row(*row)
    return table


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


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (lower is better).

    Example:
      >>> pareto_front([(1, 5), (2, 2), (3, 3), (4, 1)])
      [0, 1, 3]
    """
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (u <= x and v <= y) and (u, v) != (x, y) for j, (u, v) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def plot_records(records: list[dict[str, Any]], path: pathlib.Path) -> pathlib.Path | None:
    """Plots memory against step time, one point per record, with the Pareto front.

    Records of other frameworks (``framework`` other than ``"jax"``, such as
    ``benchmarks/peers/torch_reference.py``'s) are drawn as squares and named
    with their framework. Returns ``path``, or ``None`` if matplotlib is missing
    or no record has a step time.
    """
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    done = [r for r in records if "step_time_ms" in r]
    if not done:
        return None
    # Without a runtime peak (CPU), the compiled temp is the memory reading.
    key = (
        "peak_bytes_in_use" if all(r["peak_bytes_in_use"] for r in done) else "compiled_temp_bytes"
    )
    points = [(r["step_time_ms"], r[key] / 2**30) for r in done]
    fig, ax = plt.subplots(figsize=(8, 4.2), constrained_layout=True)
    for r, (x, y) in zip(done, points):
        jax_record = r.get("framework", "jax") == "jax"
        label = _name(r) if jax_record else f"{r['framework']} {r['strategy']}"
        ax.scatter(x, y, s=45, marker="o" if jax_record else "s", label=label, zorder=3)
    front = pareto_front(points)
    ax.plot(*zip(*[points[i] for i in front]), "k--", lw=1, label="Pareto front")
    first = done[0]
    times = [x for x, _ in points]
    if max(times) > 10 * min(times):  # offload and recompute differ by orders of magnitude
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        # Label 20, 50, 200, 500...: every minor tick would crowd the axis.
        ax.xaxis.set_minor_formatter(
            matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else "")
        )
    else:
        ax.set_xlim(0, 1.15 * max(times))
    ax.set(
        xlabel="step time (ms)",
        ylabel=("runtime peak" if key == "peak_bytes_in_use" else "compiled device temp")
        + " (GiB)",
        title=f"{first['model']} b{first['batch']} {first['image_size']}² {first['dtype']}, "
        f"{first['device']}",
    )
    ax.set_ylim(0, max(y for _, y in points) * 1.05)
    # Outside the axes, so that it never hides a point.
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
