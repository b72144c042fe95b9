"""Compiles training steps without running them: device temp, host copies, and what is alive at the peak.

    python benchmarks/probes/compile_probe.py MODEL BATCH STRATEGY [STRATEGY ...] [--peaks] [--hlo DIR]

For each strategy (a ``jaxoffload bench`` name, with ``@W`` for an ``Offload``
window of W, as in ``offload@2``), in this process: the compiled
step's ``memory_analysis()``, its host copies (``S(5)``, ``copy-start``), and, for
strategies that offload, the same program compiled with host placement off (the
twin), so that the device bytes the copies free can be read. With ``--peaks``,
XLA's live-range dump of each step is summarised too: the jax operations
alive at the device peak. With ``--hlo``, each step's compiled program is written to
DIR/MODEL-BATCH-STRATEGY.hlo (``deviceless.py kernels`` reads it). One JSON line per
strategy goes to stdout. Image size 224, bf16. ``deviceless.py run`` runs it for the H200
on a machine without one.
"""

import argparse
import collections
import glob
import json
import os
import re
import shutil
import tempfile
import time


def peak_breakdown(dump_dir):
    """The jax operations alive at the device peak, from XLA's live-range dump."""
    (path,) = glob.glob(f"{dump_dir}/*after_optimizations-live-range.txt")
    lines = open(path).read().splitlines()
    start = next(n for n, line in enumerate(lines) if "Stack trace breakdown for peak" in line)
    alive = collections.Counter()
    for line in lines[start + 2 :]:
        match = re.match(r"\s+[├└]── (.*) \(\d+\.\d+%, total: ([\d ]+) bytes", line)
        if not match:
            break
        alive[match.group(1)] += int(match.group(2).replace(" ", ""))
    return lines[start].strip(), alive.most_common(25)


def _clear(folder):
    shutil.rmtree(folder)
    os.makedirs(folder)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("batch", type=int)
    parser.add_argument("strategies", nargs="+")
    parser.add_argument("--peaks", action="store_true")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--hlo", metavar="DIR", help="write each compiled program here")
    args = parser.parse_args()
    dump = tempfile.mkdtemp()
    if args.peaks:
        # Before jax is imported: it reads them once.
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_dump_to={dump} --xla_dump_hlo_module_re=.*step.*"
        )
    for name in args.strategies:
        print(json.dumps(_probe(name, args, dump if args.peaks else None)), flush=True)
    shutil.rmtree(dump)


def _probe(name, args, dump):
    """One strategy's record: the compiled step, its twin if it asks for host copies, their peaks."""
    from jaxoffload.bench.measure import compile_twin
    from jaxoffload.bench.step import train_step
    from jaxoffload.bench.workload import Workload
    from jaxoffload.internal import analyze

    strategy, _, window = name.partition("@")
    workload = Workload(
        args.model, args.batch, args.image_size, "bfloat16", strategy, window=int(window or 1)
    )
    start = time.perf_counter()
    step, state, batch, _ = train_step(workload, abstract=True)
    traced = step.trace(state, batch)
    compiled = traced.lower().compile()
    report = analyze(traced, compiled, on_dropped="ignore")
    record = {
        "model": args.model, "batch": args.batch, "strategy": name,
        "argument_bytes": report.argument_bytes, "temp_bytes": report.temp_bytes,
        "host_temp_bytes": report.host_temp_bytes,
        "requested_bytes": report.requested_bytes,
        "device_to_host_copies": report.device_to_host,
        "device_to_host_bytes": report.device_to_host_bytes,
        "compile_s": round(time.perf_counter() - start, 1),
    }  # fmt: skip
    if args.hlo:
        with open(os.path.join(args.hlo, f"{args.model}-{args.batch}-{name}.hlo"), "w") as f:
            f.write(compiled.as_text())
    if dump:
        record["peak"], record["alive_at_peak"] = peak_breakdown(dump)
        _clear(dump)
    if report.requested_transfers:
        twin, _ = compile_twin(workload)
        record["twin_temp_bytes"] = twin.memory_analysis().temp_size_in_bytes
        if dump:
            record["twin_peak"], record["twin_alive_at_peak"] = peak_breakdown(dump)
            _clear(dump)
    return record


if __name__ == "__main__":
    main()
