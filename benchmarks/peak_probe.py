"""What is alive at the device peak of a compiled ResNet-50 step, from XLA's live-range dump.

    python benchmarks/peak_probe.py compile OUT_DIR TAG PLAN [--window W]
    python benchmarks/peak_probe.py diff A.txt.gz B.txt.gz

`compile` compiles one training step (ResNet-50, batch 256, 224², bf16) without
running it. It prints the compiled device temp, and it keeps XLA's live-range dump
as OUT_DIR/live_TAG.txt.gz. PLAN is `lean`, `none`, or the offloaded blocks
(comma-separated), with every other block `lean`. W is one window, or one per stage
(`1,2,2,2`, the default). Run each plan in its own process.

`diff` compares the peaks of two dumps. It lists, by jax operation, the bytes alive at
each peak that differ by at least 4 MB. Entries named `copy-start` are host buffers:
XLA's live-range counts every memory space.
"""

import argparse
import collections
import glob
import gzip
import os
import re
import shutil
import tempfile


def compile_plan(out_dir, tag, plan, window):
    dump = tempfile.mkdtemp()
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_module_re=.*step.*"
    )
    from jaxoffload import benchmark  # after XLA_FLAGS: jax reads them once

    window = tuple(int(w) for w in window.split(",")) if "," in window else int(window)
    if plan in ("lean", "none"):
        workload = benchmark.Workload("resnet50", 256, 224, "bfloat16", plan, window=window)
    else:
        chosen = {int(b) for b in plan.split(",")}
        strategies = tuple("offload" if i in chosen else "lean" for i in range(16))
        workload = benchmark.Workload(
            "resnet50", 256, 224, "bfloat16", "offload-hidden", plan=strategies, window=window
        )
    step, state, batch, _ = benchmark.train_step(workload, abstract=True)
    compiled = step.trace(state, batch).lower().compile()
    print(f"{tag} {plan} window={window} temp {compiled.memory_analysis().temp_size_in_bytes}")
    (live,) = glob.glob(f"{dump}/*after_optimizations-live-range.txt")
    os.makedirs(out_dir, exist_ok=True)
    with open(live, "rb") as src, gzip.open(f"{out_dir}/live_{tag}.txt.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.rmtree(dump)


def peak(path):
    """(where, total, {jax operation: bytes alive at the peak})."""
    lines = gzip.open(path, "rt").read().splitlines()
    start = next(n for n, line in enumerate(lines) if "Stack trace breakdown for peak" in line)
    where = next(line.strip() for line in lines if "(peak):" in line)
    alive = collections.Counter()
    for line in lines[start + 2 :]:
        match = re.match(r"\s+[├└]── (.*) \(\d+\.\d+%, total: ([\d ]+) bytes", line)
        if not match:
            break
        alive[match.group(1)] += int(match.group(2).replace(" ", ""))
    return where, lines[start].strip(), alive


def diff(a, b):
    (where_a, total_a, alive_a), (where_b, total_b, alive_b) = peak(a), peak(b)
    print(f"{a}: {where_a} {total_a}\n{b}: {where_b} {total_b}")
    changes = {k: alive_b[k] - alive_a[k] for k in alive_a.keys() | alive_b.keys()}
    for name, change in sorted(changes.items(), key=lambda kv: kv[1]):
        if abs(change) >= 4e6:
            print(f"{change / 2**20:+9.1f} MiB  {name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    compile_ = commands.add_parser("compile")
    compile_.add_argument("out_dir")
    compile_.add_argument("tag")
    compile_.add_argument("plan")
    compile_.add_argument("--window", default="1,2,2,2")
    diff_ = commands.add_parser("diff")
    diff_.add_argument("a")
    diff_.add_argument("b")
    args = parser.parse_args()
    if args.command == "compile":
        compile_plan(args.out_dir, args.tag, args.plan, args.window)
    else:
        diff(args.a, args.b)


if __name__ == "__main__":
    main()
