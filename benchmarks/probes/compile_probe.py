"""Compiles training steps without running them: device temp, host copies, and what is alive at the peak.

    python benchmarks/probes/compile_probe.py MODEL BATCH STRATEGY [STRATEGY ...] [--peaks] [--hlo DIR]

For each strategy (a ``jaxoffload bench`` name, with ``@W`` for an ``Offload``
window of W, as in ``offload@2``), in this process: the compiled
step's ``memory_analysis()``, its host copies (``S(5)``, ``copy-start``), and, for
strategies that offload, the same program compiled with host placement off (the
twin), so that the device bytes the copies free can be read. With ``--peaks``,
the device peak is read from XLA's dump of each step (:func:`peak_breakdown`): the
instruction where most of the temporaries are alive, and the jax operations whose
buffers are alive there. With ``--hlo``, each step's compiled program is written to
DIR/MODEL-BATCH-STRATEGY.hlo (``deviceless.py kernels`` reads it). With ``--options``,
each step compiles with :func:`jaxoffload.compiler_options` (the bench's), else with XLA's
defaults. One JSON line per strategy goes to stdout. Image size 224, bf16. ``deviceless.py run`` runs it for the H200
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
    """The device peak from XLA's dump: the temporaries' allocation and the jax operations
    whose buffers in it are alive at the instruction where most of it is.

    Read from the buffer assignment (each temporary's offset and size in the one device
    allocation the runtime makes; host memory's, ``color 5``, is left out) and the live
    ranges (from which instruction to which each is alive): the union of the spans alive at
    each instruction. The live-range
    dump's own "stack trace breakdown for peak usage" is not that peak: it counts fewer
    bytes than the allocation holds at once, and puts the peak elsewhere (docs/design.md,
    "Compiling for the H200 without it").
    """
    (assignment,) = glob.glob(f"{dump_dir}/*after_optimizations-buffer-assignment.txt")
    (ranges_path,) = glob.glob(f"{dump_dir}/*after_optimizations-live-range.txt")
    (hlo,) = glob.glob(f"{dump_dir}/*after_optimizations.txt")
    temp = re.search(
        r"allocation \d+: size (\d+), (?!color)[^\n]*preallocated-temp:\n((?: value:[^\n]*\n)+)",
        open(assignment).read(),
    )
    if temp is None:
        return "no temporaries", []
    values = re.findall(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\)", temp.group(2))
    ranges = open(ranges_path).read()
    sequence = {int(n): name for n, name in re.findall(r"^\s+(\d+):(\S+)$", ranges, re.M)}
    live = dict(re.findall(r"^\s+(\S+\{[\d,]*\}):(\d+-\d+)$", ranges, re.M))
    spans = []
    for name, size, offset in values:
        first, last = map(int, live[name if "{" in name else name + "{}"].split("-"))
        spans.append((first, last, int(offset), int(size), name))
    most, at = 0, 0
    for t in range(max(s[1] for s in spans) + 1):
        covered, end = 0, -1
        for a, b in sorted((o, o + n) for first, last, o, n, _ in spans if first <= t <= last):
            covered, end = covered + max(0, b - max(a, end)), max(end, b)
        if covered > most:
            most, at = covered, t
    text = open(hlo).read()

    def operation(name):
        found = re.search(
            rf"\s%?{re.escape(name.split('{')[0])} = [^\n]*op_name=\"([^\"]+)\"", text
        )
        return found.group(1) if found else name

    alive = collections.Counter()
    for first, last, _, size, name in spans:
        if first <= at <= last:
            alive[operation(name)] += size
    head = (
        f"temporaries {int(temp.group(1)):,} bytes; most alive at once {most:,} bytes, "
        f"at instruction {at} of {len(sequence)} ({sequence.get(at, '?')})"
    )
    return head, alive.most_common(25)


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
    parser.add_argument(
        "--options", action="store_true", help="compile with jaxoffload.compiler_options()"
    )
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
    from jaxoffload import compiler_options
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
    compiled = traced.lower().compile(compiler_options() if args.options else None)
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
        os.makedirs(args.hlo, exist_ok=True)
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
