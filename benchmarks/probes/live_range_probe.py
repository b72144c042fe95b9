"""What is alive at a plan's compiled peak, against its compiled temporaries. A GPU probe, not a test.

    python benchmarks/probes/live_range_probe.py VARIANT OUT [option=value ...]

Flax's ImageNet ResNet-50 (the bench's ``flax-resnet50``), b256, bf16, 224², its blocks under
``Lean()`` (VARIANT ``lean``) or a plan's JSON file (``benchmarks/probes/plans/``), compiled as
``overlap_probe.py`` compiles it (the in-flight limit 64, copies priced), and not run; another
model with ``MODEL`` and ``BATCH`` in the environment, as there. Writes
OUT/NAME-peak.json (the temporaries, and the jax operations alive at the peak of XLA's
live-range dump, which counts host buffers too) and OUT/NAME-live-range.txt.gz (the dump); NAME
is the variant's, with the XLA options given beside it.
"""

import glob
import gzip
import json
import os
import shutil
import sys
import tempfile

DUMP = tempfile.mkdtemp()
# Before jax is imported: it reads the flags once.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_module_re=.*step.*"
)

import jax  # noqa: E402
from compile_probe import peak_breakdown  # noqa: E402  (beside this script)
from overlap_probe import LINK_GBPS, options_of, resnet50_training  # noqa: E402

from jaxoffload.internal import with_copy_costs  # noqa: E402


def main(variant, out, extra):
    name, step, state, batch = resnet50_training(variant, abstract=True)
    lowered = jax.jit(step, donate_argnums=0).lower(state, batch)
    options = {"xla_gpu_experimental_parallel_async_compute_limit": 64, **extra}
    compiled = lowered.compile(options)
    priced = with_copy_costs(options, compiled.as_text(), LINK_GBPS)
    if priced != options:  # copies to price: compile again, and dump only that program
        shutil.rmtree(DUMP)
        os.makedirs(DUMP)
        compiled = lowered.compile(priced)
    name += "".join(f"-{k.removeprefix('xla_gpu_')}_{v}" for k, v in extra.items())
    memory = compiled.memory_analysis()
    peak, alive = peak_breakdown(DUMP)
    record = {
        "variant": name,
        "options": options,
        "temp_bytes": memory.temp_size_in_bytes,
        "host_temp_bytes": memory.host_temp_size_in_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "peak": peak,
        "alive": alive,
    }
    print(json.dumps(record)[:1500], flush=True)
    with open(os.path.join(out, f"{name}-peak.json"), "w") as f:
        json.dump(record, f, indent=1)
    (path,) = glob.glob(f"{DUMP}/*after_optimizations-live-range.txt")
    with open(path) as src, gzip.open(os.path.join(out, f"{name}-live-range.txt.gz"), "wt") as dst:
        dst.write(src.read())
    shutil.rmtree(DUMP)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], options_of(sys.argv[3:]))
