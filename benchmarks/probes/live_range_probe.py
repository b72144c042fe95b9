"""What is alive at a plan's compiled peak, against its compiled temporaries. A GPU probe, not a test.

    python benchmarks/probes/live_range_probe.py VARIANT OUT [option=value ...]

Flax's ImageNet ResNet-50 (the bench's ``flax-resnet50``), b256, bf16, 224², its blocks under
``Lean()`` (VARIANT ``lean``) or a plan's JSON file (``benchmarks/probes/plans/``), compiled as
``overlap_probe.py`` compiles it (the in-flight limit 64, copies priced), and not run. Writes
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
import jax.numpy as jnp  # noqa: E402
from compile_probe import _peak_breakdown  # noqa: E402  (beside this script)
from overlap_probe import copy_profile, options_of  # noqa: E402

import jaxoffload  # noqa: E402
from jaxoffload import Lean  # noqa: E402
from jaxoffload.bench import models, workload  # noqa: E402
from jaxoffload.bench import step as bench_step  # noqa: E402


def main(variant, out, extra):
    w = workload.Workload(
        model="flax-resnet50", batch=256, image_size=224, dtype="bfloat16", strategy="lean"
    )
    if variant.endswith(".json"):
        plain = models.plannable_model("flax-resnet50", dtype=jnp.bfloat16, num_classes=1000)
        model = jaxoffload.Plan.load(variant).apply(plain)
    else:
        model = models.create(
            "flax-resnet50", strategy=(Lean(),) * 16, dtype=jnp.bfloat16, num_classes=1000
        )
    step, state, batch, _ = bench_step.training(w, model, abstract=True)
    lowered = jax.jit(step, donate_argnums=0).lower(state, batch)
    options = {"xla_gpu_experimental_parallel_async_compute_limit": 64, **extra}
    compiled = lowered.compile(options)
    profile = copy_profile(compiled.as_text())
    if profile.count("costs"):  # copies to price: compile again, and dump only that program
        shutil.rmtree(DUMP)
        os.makedirs(DUMP)
        compiled = lowered.compile(
            {
                **options,
                "fdo_profile": profile.encode(),
                "xla_gpu_pgle_accuracy_checker": "PGLE_STRICTNESS_LEVEL_OFF",
            }
        )
    name = os.path.basename(variant).removesuffix(".json")
    name += "".join(f"-{k.removeprefix('xla_gpu_')}_{v}" for k, v in extra.items())
    memory = compiled.memory_analysis()
    peak, alive = _peak_breakdown(DUMP)
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
