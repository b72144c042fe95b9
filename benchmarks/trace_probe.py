"""Time one training-step variant on a GPU, and optionally profile it. One variant per process.

    python benchmarks/trace_probe.py run NAME --strategy lean [--window 8 | 1,2,2,2] [--offload 8]
        [--min-bytes 8000000] [--trace]
    python benchmarks/trace_probe.py read NAME [--folder DIR]

`run` builds the `jaxoffload bench` step (ResNet-50, batch 256, 224², bf16 by default),
times 15 steps after 3 warm-up steps, and appends a JSON line (compiled temp, runtime
peak, median step ms) to $OUT/trace_probe.jsonl. `--offload 8` offloads block 8 and
keeps the others `lean` (an `offload-hidden` plan picked by hand); `--min-bytes` keeps
smaller residuals of offloading blocks on the device. `--trace` also writes the
compiled HLO and a profile of 3 steps (NAME.hlo.txt.gz, NAME.perfetto.json.gz).

`read` prints, from those two files: each block's forward and backward kernel time per
step, the compute stream's stalls longer than 0.1 ms, and the host copies over 1 MB.
Profile with XLA_FLAGS=--xla_gpu_enable_command_buffer=: inside a command buffer the
profile does not say which HLO op a kernel ran.
"""

import argparse
import collections
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROFILED_STEPS = 3


def run(args):
    import jax

    from jaxoffload import benchmark
    from jaxoffload.models import common

    if args.min_bytes:
        offload = common.offload_linen.offload

        def with_min_bytes(block, **kwargs):
            if kwargs.get("to_host", True):
                kwargs["min_bytes"] = args.min_bytes
            return offload(block, **kwargs)

        common.offload_linen.offload = with_min_bytes
    plan, strategy = None, args.strategy
    if args.offload is not None:
        n = benchmark.models.num_blocks(args.model)
        plan = tuple("offload" if i == args.offload else "lean" for i in range(n))
        strategy = "offload-hidden"
    workload = benchmark.Workload(
        args.model,
        args.batch,
        args.image_size,
        "bfloat16",
        strategy,
        window=args.window,
        plan=plan,
    )
    step, state, batch, _ = benchmark.train_step(workload)
    compiled = step.lower(state, batch).compile()
    out = Path(os.environ["OUT"])
    for _ in range(3):
        state, loss = compiled(state, batch)
    jax.block_until_ready(loss)
    times = []
    for _ in range(15):
        start = time.perf_counter()
        state, loss = compiled(state, batch)
        jax.block_until_ready(loss)
        times.append((time.perf_counter() - start) * 1e3)
    if args.trace:
        with gzip.open(out / f"{args.name}.hlo.txt.gz", "wt") as f:
            f.write(compiled.as_text())
        folder = tempfile.mkdtemp()
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(PROFILED_STEPS):
                state, loss = compiled(state, batch)
            jax.block_until_ready(loss)
        (trace,) = Path(folder).rglob("*perfetto_trace.json.gz")
        shutil.copy(trace, out / f"{args.name}.perfetto.json.gz")
    record = {
        "name": args.name,
        "model": args.model,
        "batch": args.batch,
        "image_size": args.image_size,
        "strategy": strategy,
        "window": args.window,
        "offload": args.offload,
        "min_bytes": args.min_bytes,
        "temp": compiled.memory_analysis().temp_size_in_bytes,
        "peak": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
        "ms": statistics.median(times),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    print(json.dumps(record), flush=True)
    with open(out / "trace_probe.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def read(args):
    folder = Path(args.folder)
    hlo = gzip.open(folder / f"{args.name}.hlo.txt.gz", "rt").read()
    op_names = dict(re.findall(r'%([\w.\-]+) = [^\n]*?op_name="([^"]*)"', hlo))
    events = json.load(gzip.open(folder / f"{args.name}.perfetto.json.gz"))["traceEvents"]
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("pid") == 1), key=lambda e: e["ts"]
    )
    compute_stream = collections.Counter(e["tid"] for e in gpu).most_common(1)[0][0]
    kernels = [e for e in gpu if e["tid"] == compute_stream]
    per_block = collections.defaultdict(float)
    for e in kernels:
        name = op_names.get(e["args"].get("hlo_op", ""), "")
        block = re.search(r"\b(block\d+|stem)", name)
        phase = "backward" if "transpose(" in name else "forward"
        per_block[(block.group(1) if block else "other", phase)] += e["dur"] / PROFILED_STEPS
    print(f"kernel ms per step: {sum(per_block.values()) / 1e3:.2f}")

    def order(key):
        block, phase = key
        number = int(block[5:]) if block.startswith("block") else (-1 if block == "stem" else 1e9)
        return phase, number

    for (block, phase), us in sorted(per_block.items(), key=lambda item: order(item[0])):
        print(f"  {block:8} {phase:8} {us / 1e3:.3f} ms")
    start = kernels[0]["ts"]
    print("stalls over 0.1 ms, and host copies over 1 MB (ms from the first kernel):")
    rows = []
    for before, after in zip(kernels, kernels[1:]):
        gap = after["ts"] - before["ts"] - before["dur"]
        if gap > 100:
            rows.append((before["ts"] + before["dur"] - start, f"stall {gap / 1e3:.2f} ms"))
    for e in gpu:
        size = re.search(r"size:(\d+)", e["args"].get("memcpy_details", ""))
        if size and int(size.group(1)) > 1e6 and e["name"] in ("MemcpyD2H", "MemcpyH2D"):
            rows.append((e["ts"] - start, f"{e['name']} {int(size.group(1)) / 1e6:.0f} MB, "
                                          f"{e['dur'] / 1e3:.2f} ms"))  # fmt: skip
    for at, what in sorted(rows):
        print(f"  {at / 1e3:8.2f}  {what}")


def main(argv):
    from jaxoffload.cli import parse_window

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run")
    run_parser.add_argument("name")
    run_parser.add_argument("--model", default="resnet50")
    run_parser.add_argument("--batch", type=int, default=256)
    run_parser.add_argument("--image-size", type=int, default=224)
    run_parser.add_argument("--strategy", default="lean")
    # One window, or one per ResNet stage ("1,2,2,2"), as `jaxoffload bench --window` takes.
    run_parser.add_argument("--window", type=parse_window, default=1)
    run_parser.add_argument("--offload", type=int, default=None)
    run_parser.add_argument("--min-bytes", type=int, default=0)
    run_parser.add_argument("--trace", action="store_true")
    read_parser = commands.add_parser("read")
    read_parser.add_argument("name")
    read_parser.add_argument("--folder", default=os.environ.get("OUT", "."))
    args = parser.parse_args(argv)
    run(args) if args.command == "run" else read(args)


if __name__ == "__main__":
    main(sys.argv[1:])
