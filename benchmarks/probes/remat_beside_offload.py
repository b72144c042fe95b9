"""Does one offloading block change what ``Remat()`` blocks keep? Compiled only.

    python benchmarks/probes/remat_beside_offload.py [--peaks]

Flax's ResNet-50 at b256 (``MODEL``, ``BATCH`` as in ``overlap_probe.py``), the code outside
the blocks ``Lean()``: every block under ``Remat()``; then the last block under ``Offload()``
and the others ``Remat()``, compiled with XLA's default options, with ``compiler_options()``,
and with the latency-hiding scheduler off. One JSON line each: the compiled step's device
bytes (arguments and temporaries) and host bytes each way; with ``--peaks``, the jax
operations alive at the device peak (``compile_probe.peak_breakdown``). ``deviceless.py run``
runs it for the H200 on a machine without one.
"""

import glob
import json
import os
import sys
import tempfile

DUMP = tempfile.mkdtemp()
if "--peaks" in sys.argv:  # before jax is imported: it reads them once
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_module_re=.*step.*"
    )

sys.path.insert(0, os.path.dirname(__file__))
from compile_probe import peak_breakdown  # noqa: E402
from paper_point import compiled  # noqa: E402

import jaxoffload  # noqa: E402
from jaxoffload import Lean, Offload, Remat  # noqa: E402
from jaxoffload.bench.planning import planning_inputs  # noqa: E402
from jaxoffload.bench.workload import Workload  # noqa: E402
from jaxoffload.internal import discover  # noqa: E402

OPTIONS = {
    "default": {},
    "library": jaxoffload.compiler_options(),
    "no latency-hiding scheduler": {"xla_gpu_enable_latency_hiding_scheduler": False},
}


def main():
    name = os.environ.get("MODEL", "flax-resnet50")
    batch = int(os.environ.get("BATCH", 256))
    w = Workload(model=name, batch=batch, image_size=224, dtype="bfloat16", strategy="none")
    paths, _ = discover(*planning_inputs(w))
    last = paths[-1]
    plans = {
        "Remat() on every block": [(p, Remat()) for p in paths],
        "Offload() on the last block, Remat() on the others": [
            (p, Offload() if p == last else Remat()) for p in paths
        ],
    }
    for plan_name, blocks in plans.items():
        for options_name, options in OPTIONS.items():
            if "every" in plan_name and options_name != "library":
                continue  # nothing moves: the options change nothing
            for f in glob.glob(os.path.join(DUMP, "*")):
                os.remove(f)
            plan = jaxoffload.Plan(tuple(blocks), Lean()).to_dict()
            line = {"plan": plan_name, "options": options_name}
            line.update(compiled(plan, name, batch, options))
            if "--peaks" in sys.argv:
                head, alive = peak_breakdown(DUMP)
                line.update(peak=head, alive=alive[:12])
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
