"""Probe of jaxoffload.schedule on a GPU: one variant per process, one JSON line each.

    python benchmarks/schedule_probe.py VARIANT WINDOW WHAT

VARIANT is "cross", the library's schedule: a call's outputs wait for the copies
of the call window - 1 back. ("own", in which they waited for their own copies,
was a private switch of commit 0a0c1f6; the rebuilt gates of 3f8321b dropped it,
and this probe refuses it rather than run "cross" under its name.) WHAT is "chain" (tests/test_gpu.py's chain of 8 tanh
layers; WINDOW 0 is the plain chain), "dump" (the same chain, compiled only, with
XLA's optimized HLO copied to $OUT/chain_wWINDOW_hlo.txt), or a model name (its
"offload" strategy). Lines are appended to $OUT/probe5.jsonl.
"""

import glob
import json
import os
import shutil
import sys
import time

if sys.argv[3] == "dump":  # XLA reads its flags when jax starts
    os.environ["XLA_FLAGS"] = (
        f"--xla_dump_to=/tmp/dump_w{sys.argv[2]} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*loss.*"
    )
import jax

if sys.argv[1] != "cross":
    sys.exit(f"unknown VARIANT {sys.argv[1]!r}: only 'cross' exists since commit 3f8321b")
window = int(sys.argv[2])
what = sys.argv[3]
out = os.environ["OUT"]
if what == "dump":
    sys.path.insert(0, "tests")
    from test_gpu import _chain, _inputs, _tanh

    import jaxoffload

    f = _chain(jaxoffload.offload(_tanh, device_argnums=0), window=window if window > 1 else None)
    compiled = f.lower(*_inputs()).compile()
    [hlo] = glob.glob(f"/tmp/dump_w{window}/*after_optimizations.txt")
    shutil.copy(hlo, f"{out}/chain_w{window}_hlo.txt")
    r = dict(
        what=what,
        variant=sys.argv[1],
        window=window,
        temp=compiled.memory_analysis().temp_size_in_bytes,
    )
elif what == "chain":
    sys.path.insert(0, "tests")
    from test_gpu import _chain, _inputs, _tanh

    import jaxoffload

    args = _inputs()
    layer = jaxoffload.offload(_tanh, device_argnums=0) if window else _tanh
    f = _chain(layer, window=window if window > 1 else None)
    rep = jaxoffload.memory_report(f, *args)
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    r = dict(
        what=what,
        variant=sys.argv[1],
        window=window,
        temp=rep.temp_bytes,
        d2h=rep.device_to_host_bytes,
        ms=sorted(ts)[2] * 1e3,
        peak=jax.devices()[0].memory_stats()["peak_bytes_in_use"],
    )
else:
    from jaxoffload import benchmark

    wl = benchmark.Workload(
        what, 128 if what == "vgg19" else 256, 224, "bfloat16", "offload", window=window
    )
    rec = benchmark.measure(wl, steps=5)
    r = dict(
        what=what,
        variant=sys.argv[1],
        window=window,
        temp=rec["compiled_temp_bytes"],
        peak=rec["peak_bytes_in_use"],
        ms=rec["step_time_ms"],
    )
print(json.dumps(r), flush=True)
open(f"{out}/probe5.jsonl", "a").write(json.dumps(r) + "\n")
