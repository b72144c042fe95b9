"""Compile for the H200 on a machine without one: compile-only probes, from a CPU.

    python benchmarks/probes/deviceless.py run PROBE.py [ARGS ...]
    python benchmarks/probes/deviceless.py plan MODEL BATCH SHARES [--offload] [--points FILE]
    python benchmarks/probes/deviceless.py kernels A.hlo [B.hlo] [--by-op]

XLA:GPU compiles without a GPU from a description of one (``jax.experimental.topologies``
with a ``target_config``), here the device tool's H200 (:data:`H200`). ``run`` makes it jax's
default device and runs a compile-only probe as it is (``compile_probe.py``,
``copy_start_probe.py``): programs traced from abstract arguments compile for the H200, and
their ``memory_analysis()``, host buffers (``S(5)``), ``copy-start`` schedule and kernels can
be read. Nothing runs and nothing is autotuned, so no time is read: an autotuned compile on
the GPU may pick other GEMM and convolution kernels, with other workspaces.

``plan`` runs the planner over SHARES (``0.75,0.5,0.35``) of the plain step's compiled bytes
on the bench's plain-Flax MODEL at BATCH (224², bf16, the state donated, block costs
traced), with a stand-in clock (:func:`stand_in_ms`) where the planner times steps and a
52 GB/s link: its compiled bytes and byte estimates are the H200's compiler's, its times and
so its choices are not. One JSON line a budget (the plan, its compiled and estimated bytes);
the progress and every plan compiled go to stderr, and with ``--points`` every plan compiled
and the blocks' traced bytes to FILE (``jaxoffload.internal.compiled_points``), for
``peak_loo.py``.

``kernels`` reads HLO text that ``compile_probe.py --hlo`` kept (the scheduled program): the
bytes each kernel of the entry computation reads and writes, by kind of kernel, and with B,
where B's differ from A's; ``--by-op`` by the jax operation named in each kernel's metadata.

Set-up, once: jax 0.11.2 is the GPU's, and needs Python 3.12; its CUDA wheels carry the
compiler's libraries (no driver is needed). ``run`` and ``plan`` need it, ``kernels`` not::

    python3.12 -m venv .venv-h200
    .venv-h200/bin/pip install "jax[cuda13]==0.11.2" flax==0.12.10 optax==0.2.8 matplotlib
    .venv-h200/bin/pip install --no-deps -e .
    .venv-h200/bin/python benchmarks/probes/deviceless.py run benchmarks/probes/compile_probe.py \\
        flax-resnet50 256 none
"""

import argparse
import collections
import json
import math
import os
import re
import runpy
import sys
import time

# The H200 that the device tool lends, as XLA describes a GPU to compile for: its 132
# multiprocessors, 143,771 MiB and 1.98 GHz as read there; the rest Hopper's and the card's
# published figures. cuDNN's version is the one installed here (read at start).
H200_MEMORY = 143771 * 2**20
H200 = """
gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 62914560 clock_rate_ghz: 1.98
  device_memory_size: {memory}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
  cuda_compute_capability {{ major: 9 minor: 0 }}
}}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn_major} minor: {cudnn_minor} }}
runtime_version {{ major: 13 minor: 0 }}
device_description_str: "NVIDIA H200"
"""


def use_h200():
    """Makes a deviceless H200 jax's default device: abstract arguments lower and compile for it."""
    # The CUDA plugin checks its libraries against a driver at start; there is none here.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from importlib import metadata

    import jax
    from jax.experimental import topologies

    major, minor = map(int, metadata.version("nvidia-cudnn-cu13").split(".")[:2])
    config = H200.format(memory=H200_MEMORY, cudnn_major=major, cudnn_minor=minor)
    topology = topologies.get_topology_desc(platform="cuda", target_config=config, topology="1x1x1")
    jax.config.update("jax_default_device", topology.devices[0])
    return topology.devices[0]


# --- kernels: the bytes each kernel of a scheduled HLO module reads and writes ---------------

_LINE = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
# Instructions that launch nothing, or whose work is the copy engines' (host copies).
_NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-start",
              "copy-done", "opt-barrier", "after-all", "add-dependency"}  # fmt: skip


def _operation(op_name: str) -> str:
    """A kernel's jax operation as two plans' programs both name it: the pass it runs in, and
    the layer and primitive, without numbers (a custom_vjp rule nests its names otherwise)."""
    backward = "transpose(" in op_name
    path = re.sub(r"\d+", "#", re.sub(r"(transpose|jvp|jit)\(|\)", "", op_name)).split("/")
    return ("backward: " if backward else "forward: ") + "/".join(path[-2:])


def kernels(text: str) -> list[dict]:
    """Each kernel of the entry computation: its kind, the device bytes it reads (its operands)
    and writes (its result), and the jax operation that its metadata names (:func:`_operation`)."""
    from jaxoffload.internal import device_bytes_of

    body = text[text.index("\nENTRY") :].split("\n")[1:]
    sizes, out = {}, []
    for line in body:
        if line.startswith("}"):
            break
        m = _LINE.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        sizes[name] = device_bytes_of(shape)
        if opcode in _NO_KERNEL:
            continue
        operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
        kind = re.search(r"kind=(k\w+)", line)
        target = re.search(r'custom_call_target="([^"]+)"', line)
        fused = re.search(r'"fusion_backend_config":\{"kind":"(\w+)"', line)
        op = re.search(r'op_name="([^"]*)"', line)
        out.append({
            "kind": ":".join([opcode] + [x.group(1) for x in (kind, target, fused) if x]),
            "read": sum(sizes.get(o, 0) for o in operands),
            "write": sizes[name],
            "op": _operation(op.group(1)) if op else "",
        })  # fmt: skip
    return out


def _by(ks, key):
    totals = collections.defaultdict(lambda: [0, 0])
    for k in ks:
        totals[k[key]][0] += 1
        totals[k[key]][1] += k["read"] + k["write"]
    return totals


def print_kernels(a_path, b_path=None, by_op=False, top=30):
    key = "op" if by_op else "kind"
    a = kernels(open(a_path).read())
    b = kernels(open(b_path).read()) if b_path else []
    ta, tb = _by(a, key), _by(b, key)
    zero = (0, 0)
    rows = sorted(
        set(ta) | set(tb), key=lambda k: (-abs(tb.get(k, zero)[1] - ta.get(k, zero)[1]), k)
    )
    header = f"{'A n':>5} {'A GB':>7}"
    print(header + (f" {'B n':>5} {'B GB':>7} {'B-A GB':>7}" if b else "") + "  " + key)
    for k in rows[:top]:
        (na, ga), (nb, gb) = ta.get(k, zero), tb.get(k, zero)
        line = f"{na:5d} {ga / 1e9:7.2f}"
        line += f" {nb:5d} {gb / 1e9:7.2f} {(gb - ga) / 1e9:+7.2f}" if b else ""
        print(f"{line}  {k[:110]}")
    for name, ks in ((a_path, a), (b_path, b)):
        if ks:
            moved = sum(k["read"] + k["write"] for k in ks)
            print(f"{name}: {len(ks)} kernels, {moved / 1e9:.2f} GB read and written")


# --- plan: the planner, with the H200's compiler and a stand-in clock -------------------------


def stand_in_ms(flops: float, text: str) -> float:
    """A step's time, for a planner with no device to time on: its traced FLOPs at 400 TFLOP/s,
    its kernels' bytes at 3 TB/s, 3 µs a kernel, and its host copies at 52 GB/s each way, none
    of them hidden (as on the H200 today: design §13). A stand-in that orders plans, not a
    measurement."""
    from jaxoffload.internal import device_bytes_of, host_copies

    ks = kernels(text)
    moved = sum(k["read"] + k["write"] for k in ks)
    copied = [device_bytes_of(f"{dtype}[{dims}]") for _, dtype, dims, _ in host_copies(text)]
    return 1e3 * (flops / 400e12 + moved / 3e12 + sum(copied) / 52e9) + 3e-3 * len(ks)


def plan(model_name, batch, shares, offload, points=None):
    from jaxoffload import Lean, NoPlanFits, Offload, Remat, Store
    from jaxoffload.bench.planning import planning_inputs
    from jaxoffload.bench.workload import Workload
    from jaxoffload.internal import Planner, compiled_points, step_flops, summary

    class DevicelessPlanner(Planner):
        flops: dict = {}  # each plan's traced FLOPs; on the class: __init__ traces steps first

        def _measure_link(self, options, args):
            return (52.0, 52.0) if any(s.to_host for s in options) else None

        def _traced_step(self, candidate):
            traced = super()._traced_step(candidate)
            self.flops[candidate] = step_flops(traced.jaxpr.jaxpr)
            return traced

        def _run(self, candidate, runs):
            if not self.runs_here(candidate):
                return math.inf
            return stand_in_ms(self.flops[candidate], self.executables[candidate].as_text())

        def steps_together(self, candidates):
            return [(self.step_ms(c), 0.0) for c in candidates]

    w = Workload(model_name, batch, 224, "bfloat16", "none", block_costs="traced")
    model, step, args, blocks = planning_inputs(w)
    start = time.perf_counter()

    def say(line):
        print(f"[plan] {time.perf_counter() - start:6.1f} s  {line}", file=sys.stderr, flush=True)

    options = (Store(), Lean(), Remat())
    options += (Offload(), Offload(window=2), Offload(recompute=True)) if offload else ()
    planner = DevicelessPlanner(
        model, step, args, options, blocks=blocks, runs=5, say=say, donate_argnums=(0,),
        held_bytes=0, run_limit=int(0.9 * H200_MEMORY),
    )  # fmt: skip
    try:
        found = planner.plans_for(shares)
    finally:
        planner.settle()
    for share, got in zip(shares, found):
        line = {"model": model_name, "batch": batch, "share": share}
        if isinstance(got, NoPlanFits):
            line["no_plan"] = str(got)
        else:
            line.update(
                plan=summary(got.strategies), budget_bytes=got.budget_bytes,
                compiled_bytes=got.compiled_bytes, estimated_bytes=got.estimated_bytes,
                estimate_error=round(got.estimated_bytes / got.compiled_bytes - 1, 4),
            )  # fmt: skip
        print(json.dumps(line), flush=True)
    for c, got in planner.compiled.items():
        say(f"compiled {got:,} B: {summary(c.strategies)}, outside {type(c.outside).__name__}")
    if points:
        with open(points, "w") as f:
            commit = os.environ.get("JAXOFFLOAD_COMMIT")
            json.dump(
                {"model": model_name, "batch": batch, "commit": commit, **compiled_points(planner)},
                f,
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a compile-only probe with the H200 as the device")
    run.add_argument("probe")
    run.add_argument("args", nargs=argparse.REMAINDER)
    planning = sub.add_parser("plan", help="plan with the H200's compiler and a stand-in clock")
    planning.add_argument("model")
    planning.add_argument("batch", type=int)
    planning.add_argument("shares", type=lambda s: [float(x) for x in s.split(",")])
    planning.add_argument("--offload", action="store_true", help="offload among the options")
    planning.add_argument(
        "--points", metavar="FILE", help="write every plan compiled here (peak_loo.py reads it)"
    )
    reading = sub.add_parser("kernels", help="bytes by kernel of compiled HLO text")
    reading.add_argument("a")
    reading.add_argument("b", nargs="?")
    reading.add_argument("--by-op", action="store_true")
    args = parser.parse_args()
    if args.command == "kernels":
        return print_kernels(args.a, args.b, args.by_op)
    print(f"compiling for {use_h200().device_kind}, without a device", file=sys.stderr)
    if args.command == "plan":
        return plan(args.model, args.batch, args.shares, args.offload, args.points)
    sys.argv = [args.probe, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.probe)))
    runpy.run_path(args.probe, run_name="__main__")


if __name__ == "__main__":
    main()
