"""Do host copies hide behind compute inside one jitted program? A GPU probe, not a test.

    python benchmarks/probes/overlap_probe.py minimal OUT
    python benchmarks/probes/overlap_probe.py resnet50 VARIANT OUT [option=value ...]

``minimal``: a 1 GiB copy to the host (and one back) beside independent matrix products, in
one program, each alone and together. ``resnet50``: Flax's ImageNet ResNet-50, b256, bf16,
224², its blocks under VARIANT (store, lean, lean-timed, remat, off10, off40, off150, full, or a plan's JSON file, as in
``benchmarks/probes/plans/``), compiled with the given
XLA options (``compiler_options``), timed and traced; ``MODEL``, ``BATCH`` and ``IMAGE`` in the
environment choose another plain-Flax bench model and shape. Writes VARIANT.json (and traces)
to OUT.
The option ``fdo=1`` compiles again with each host copy priced at its bytes over the link, as
the bench does (since ``xla_options`` prices each fetch at every fetch's link time, what the
records of ``call14.json`` name ``fdo=queue-h2d``); ``fdo=queue`` prices the copies to the host
so too (:func:`queued`); ``fdo=ahead`` prices each at the copies to the host before it and its
own (:func:`ahead`); ``fdo=fetches`` prices the fetches alone (:func:`fetches_only`); ``fdo=tiny`` and
``fdo=huge`` price every copy to the host at 1 µs and at 100 ms (:func:`out_at`), as
``copy_start_probe.py`` compiles them; ``fdo=vast`` at 10 s, and ``fdo=vastall`` every copy both
ways at 10 s; ``fdo=lat`` gives each copy the library's price as the latency from its start to
its done rather than as its start's own cost (:func:`as_latencies`).
"""

import glob
import gzip
import itertools
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jaxoffload
from jaxoffload import Lean, Offload, Remat, Store
from jaxoffload.internal import host_copies, measure_link, with_copy_costs

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def options_of(args):
    out = {}
    for a in args:
        k, v = a.split("=", 1)
        out[k] = {"true": True, "false": False}.get(
            v.lower(), int(v) if v.lstrip("-").isdigit() else v
        )
    return out


def compiled_facts(compiled):
    m = compiled.memory_analysis()
    text = compiled.as_text()
    return {
        "temp_bytes": m.temp_size_in_bytes,
        "host_temp_bytes": getattr(m, "host_temp_size_in_bytes", None),
        "argument_bytes": m.argument_size_in_bytes,
        "copy_starts": text.count("copy-start("),
        "s5": text.count("S(5)"),
    }, text


def time_ms(fn, runs=10, warmup=3):
    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts), ts


def pipelined_ms(compiled, holder, batch, runs=20):
    """The bench's step time: each step from the end of the one before, the next one queued."""
    from jaxoffload.bench.measure import timed_steps

    holder["state"], _, seconds = timed_steps(compiled, holder["state"], batch, runs)
    times = [t * 1e3 for t in seconds]
    return statistics.median(times[1:]), times


def lines_of(folder):
    """Each GPU stream line of the trace: its name and how many events of each name kind."""
    (path,) = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    data = jax.profiler.ProfileData.from_file(path)
    out = []
    for p in data.planes:
        if not p.name.startswith("/device:GPU"):
            continue
        for line in p.lines:
            names = {}
            for e in line.events:
                key = (
                    e.name
                    if e.name.startswith("Memcpy") or e.name.startswith("Memset")
                    else "kernel"
                )
                names[key] = names.get(key, 0) + 1
            sample = [
                (e.name[:60], e.duration_ns, dict(e.stats).get("memcpy_details"))
                for e in list(line.events)[:3]
            ]
            out.append({"plane": p.name, "line": line.name, "counts": names, "sample": sample})
    return out


def kernel_ms(timeline):
    """Each kind of kernel's ms in a traced step, the longest first, as ``[ms, count]``: XLA's
    kernels without the numbers that end their names (``loop_add_fusion_12``), a library's
    (whose names carry tile sizes, ``128x128``) as named. ``kernel_diff.py`` compares two
    records by it."""
    out = {}
    for a in timeline:
        if a.kind == "compute":
            key = a.name if re.search(r"\d+x\d+", a.name) else re.sub(r"(_\d+)+$", "", a.name)
            ms, count = out.get(key, (0.0, 0))
            out[key] = (ms + (a.end_ns - a.start_ns) / 1e6, count + 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0]))


def overlap_record(run, folder, steps=5):
    o = jaxoffload.measure_overlap(run, steps=steps, warmup=1, log_dir=folder)
    rec = o.fields()
    rec["summary"] = o.summary()
    rec["timeline"] = [(a.kind, a.start_ns, a.end_ns, a.name[:40], a.nbytes) for a in o.timeline]
    rec["kernel_ms"] = kernel_ms(o.timeline)
    rec["lines"] = lines_of(folder)
    return rec


def minimal(out):
    x = jnp.ones((int(os.environ.get("WORDS", 2**28)),), jnp.float32)  # 1 GiB
    a = jax.random.normal(jax.random.key(0), (int(os.environ.get("SIDE", 8192)),) * 2, jnp.bfloat16)
    host_sh = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    xh = jax.device_put(x, host_sh)

    def compute(a):
        for _ in range(16):
            a = jnp.tanh(a @ a)
        return a

    progs = {
        "compute": (jax.jit(compute), (a,)),
        "d2h": (jax.jit(lambda x: jax.device_put(x, HOST)), (x,)),
        "d2h+compute": (jax.jit(lambda x, a: (jax.device_put(x, HOST), compute(a))), (x, a)),
        "h2d": (jax.jit(lambda xh: jax.device_put(xh, DEVICE).sum()), (xh,)),
        "h2d+compute": (
            jax.jit(lambda xh, a: (jax.device_put(xh, DEVICE).sum(), compute(a))),
            (xh, a),
        ),
        "d2h+compute+fdo": (jax.jit(lambda x, a: (jax.device_put(x, HOST), compute(a))), (x, a)),
    }
    res = {}
    for name, (f, args) in progs.items():
        try:
            c = f.lower(*args).compile()
            if name.endswith("fdo"):
                c = f.lower(*args).compile(with_copy_costs({}, c.as_text(), LINK_GBPS))
            facts, text = compiled_facts(c)
            ms, _ = time_ms(lambda c=c, args=args: c(*args))
            rec = {"ms": ms, **facts}
            if "+" in name:
                rec.update(
                    overlap_record(
                        lambda c=c, args=args: c(*args),
                        os.path.join(out, "trace-" + name.replace("+", "_")),
                    )
                )
                with gzip.open(
                    os.path.join(out, f"hlo-{name.replace('+', '_')}.txt.gz"), "wt"
                ) as fh:
                    fh.write(text)
        except Exception as e:  # noqa: BLE001
            rec = {"error": repr(e)[:2000]}
        res[name] = rec
        print(name, {k: v for k, v in rec.items() if k not in ("timeline", "lines")}, flush=True)
    json.dump(res, open(os.path.join(out, "minimal.json"), "w"), indent=1, default=str)


VARIANTS = {
    "store": Store(),
    "lean": Lean(),
    "lean-timed": Lean(max_slowdown=0.03),
    "remat": Remat(),
    "off10": Offload(window=2, max_bytes=10_000_000),
    "off40": Offload(window=2, max_bytes=40_000_000),
    "off150": Offload(window=2, max_bytes=150_000_000),
    "full": Offload(),
    "full2": Offload(window=2),
    "full4": Offload(window=4),
    "off40w4": Offload(window=4, max_bytes=40_000_000),
    "full21": Offload(window=2, fetch_window=1),
    "full12": Offload(window=1, fetch_window=2),
    "full31": Offload(window=3, fetch_window=1),
    "off150w3": Offload(window=3, max_bytes=150_000_000),
    "off150w4": Offload(window=4, max_bytes=150_000_000),
}


# Each host copy is priced at its bytes over this (the link as measured), for fdo_profile.
LINK_GBPS = float(os.environ.get("LINK_GBPS", 52.0))


def placements(text):
    """Each host copy of a compiled program: its shape, whether it fetches, and the lines of
    the entry computation (``text`` from ``ENTRY`` on, split into lines) where the value it
    copies is made, and where it starts and is waited for."""
    body = text[text.index("\nENTRY") :].split("\n")
    where = {}
    for i, line in enumerate(body):
        m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = ", line)
        if m:
            where[m.group(1)] = i
    out = []
    for name, dtype, dims, is_fetch in host_copies(text):
        start = where["%" + name]
        src = re.search(r"copy-start\((%[\w.\-]+)\)", body[start]).group(1)
        done = next(i for i, line in enumerate(body) if f"copy-done(%{name})" in line)
        out.append(
            {"copy": name, "shape": f"{dtype}[{dims}]", "fetch": is_fetch,
             "made": where.get(src), "start": start, "done": done}
        )  # fmt: skip
    return out


def resnet50_training(variant, abstract):
    """``(name, step, state, batch)``: Flax's ResNet-50 training step (not jitted), its blocks
    under VARIANT, a name in ``VARIANTS`` or a plan's JSON file (``plans/``). With MODEL in
    the environment, that plain-Flax bench model instead (``MODEL=flax-vgg19 BATCH=128``)."""
    from jaxoffload.bench import models, workload
    from jaxoffload.bench import step as bench_step

    name = os.environ.get("MODEL", "flax-resnet50")
    w = workload.Workload(
        model=name,
        batch=int(os.environ.get("BATCH", 256)),
        image_size=int(os.environ.get("IMAGE", 224)),
        dtype="bfloat16",
        strategy="lean",
    )
    if variant.endswith(".json"):  # a plan file: one strategy per block
        model = jaxoffload.Plan.load(variant).apply(
            models.plannable_model(name, dtype=jnp.bfloat16, num_classes=1000)
        )
        variant = os.path.basename(variant).removesuffix(".json")
    else:
        model = models.create(
            name,
            strategy=(VARIANTS[variant],) * models.num_blocks(name),
            dtype=jnp.bfloat16,
            num_classes=1000,
        )
    step, state, batch, _ = bench_step.training(w, model, abstract=abstract)
    return variant, step, state, batch


def _costs(profile):
    """A profile's costs, ``{name: µs}``."""
    return {n: float(us) for n, us in re.findall(r'name: "([^"]+)" cost_us: ([\d.]+)', profile)}


def _copies_out(hlo_text):
    """The copies to the host of a program, in its order."""
    return [name for name, _, _, is_fetch in host_copies(hlo_text) if not is_fetch]


def _profile_of(costs):
    return "\n".join(
        f'costs {{ name: "{name}" cost_us: {us:.3f} }}' for name, us in sorted(costs.items())
    )


def queued(profile, hlo_text):
    """``profile`` with each copy to the host priced at the link time of every copy to the host.

    The library prices each fetch at the queue of fetches and each copy to the host alone.
    Priced at their queue too, the copies to the host start together and slow one another
    (``call13.json``).
    """
    costs, out = _costs(profile), _copies_out(hlo_text)
    return _profile_of({**costs, **dict.fromkeys(out, sum(costs[n] for n in out))})


def ahead(profile, hlo_text):
    """``profile`` with each copy to the host priced at the link time of the copies to the host
    before it in the program and its own: the queue it joins when each starts at its producer.
    """
    costs, out = _costs(profile), _copies_out(hlo_text)
    return _profile_of({**costs, **dict(zip(out, itertools.accumulate(costs[n] for n in out)))})


def fetches_only(profile, hlo_text):
    """``profile`` without its copies to the host: the scheduler's default prices them."""
    out = set(_copies_out(hlo_text))
    return _profile_of({n: us for n, us in _costs(profile).items() if n not in out})


def out_at(us, *, fetches=False):
    """A repricing that prices every copy to the host at ``us`` µs, and the fetches as they
    were, or at ``us`` too with ``fetches``."""

    def reprice(profile, hlo_text):
        copies = [name for name, _, _, is_fetch in host_copies(hlo_text) if fetches or not is_fetch]
        return _profile_of({**_costs(profile), **dict.fromkeys(copies, us)})

    return reprice


def as_latencies(profile, hlo_text):
    """``profile`` with each copy's price given as the latency from its ``copy-start`` to its
    ``copy-done`` (the profile's ``latencies``), not as the cost of the ``copy-start`` itself:
    XLA's profile-guided estimator counts a ``costs`` entry as the instruction's own time too,
    so that scheduling one copy-start pays for the others' waits (docs/design.md §13)."""
    pairs = re.findall(r"%(copy-done[\w.\-]*) = .*?copy-done\(.*?%(copy-start[\w.\-]*)", hlo_text)
    done_of = {start: done for done, start in pairs}
    copies = {name for name, *_ in host_copies(hlo_text)} & set(done_of)
    costs = _costs(profile)
    lines = [
        f'costs {{ name: "{n}" cost_us: {us:.3f} }}'
        for n, us in sorted(costs.items())
        if n not in copies
    ]
    lines += [
        f'latencies {{ source: "{n}" target: "{done_of[n]}" latency_us: {costs[n]:.3f} }}'
        for n in sorted(copies & set(costs))
    ]
    return "\n".join(lines)


# "vast" prices the copies to the host past any stretch of compute, so that each starts as soon
# as the construction lets it; "vastall" prices the fetches so too (docs/design.md §13 says why
# these are tried). "lat" gives the library's prices as latencies.
REPRICINGS = {
    "lat": as_latencies,
    "queue": queued,
    "ahead": ahead,
    "fetches": fetches_only,
    "tiny": out_at(1.0),
    "huge": out_at(100_000.0),
    "vast": out_at(1e7),
    "vastall": out_at(1e7, fetches=True),
}


def resnet50(variant, out, options):
    variant, step, state, batch = resnet50_training(variant, abstract=False)
    step = jax.jit(step, donate_argnums=0)
    fdo = options.pop("fdo", None)
    t = time.perf_counter()
    lowered = step.lower(state, batch)
    compiled = lowered.compile(options) if options else lowered.compile()
    if fdo:
        priced = with_copy_costs(options, compiled.as_text(), LINK_GBPS)
        if fdo in REPRICINGS and "fdo_profile" in priced:
            reprice = REPRICINGS[fdo]
            priced["fdo_profile"] = reprice(
                priced["fdo_profile"].decode(), compiled.as_text()
            ).encode()
        print("copies priced:", "fdo_profile" in priced, flush=True)
        compiled = lowered.compile(priced)
        options["fdo"] = fdo
    compile_s = time.perf_counter() - t
    if os.environ.get("PGLE"):  # jit's own path, which profiles its first runs and recompiles
        jax.config.update("jax_enable_pgle", True)
        jax.config.update("jax_pgle_profiling_runs", int(os.environ["PGLE"]))
        compiled = step
    facts, text = compiled_facts(compiled)
    tag = variant + "".join(f"-{k.replace('xla_gpu_', '')}_{v}" for k, v in options.items())
    tag += "-pgle" if os.environ.get("PGLE") else ""
    tag += os.environ.get("RUN", "")  # repeats of one variant, each in a process of its own
    if variant != "lean":
        with gzip.open(os.path.join(out, f"hlo-{tag}.txt.gz"), "wt") as fh:
            fh.write(text)
    holder = {"state": state}

    def run():
        holder["state"], loss = compiled(holder["state"], batch)
        return loss

    ms, times = time_ms(run, runs=10, warmup=3)
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    pipelined, pipelined_times = pipelined_ms(compiled, holder, batch)
    rec = {
        "pipelined_step_ms": pipelined,
        "pipelined_times": pipelined_times,
        "variant": variant,
        "options": options,
        "compile_s": compile_s,
        "step_ms": ms,
        "times": times,
        "peak_bytes_in_use": peak,
        **facts,
    }
    rec.update(overlap_record(run, os.path.join(out, "trace-" + tag)))
    holder.clear()  # the state, freed before the link is probed
    rec.update(measure_link(2**30, devices=jax.devices()[:1]))
    json.dump(rec, open(os.path.join(out, f"{tag}.json"), "w"), indent=1, default=str)
    print(
        tag, {k: v for k, v in rec.items() if k not in ("timeline", "lines", "times")}, flush=True
    )


if __name__ == "__main__":
    if sys.argv[1] == "minimal":
        minimal(sys.argv[2])
    else:
        resnet50(sys.argv[2], sys.argv[3], options_of(sys.argv[4:]))
