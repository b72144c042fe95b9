"""Plot an offload_sweep.py results file: device memory and step time against k.

pip install -e ".[bench]"
python benchmarks/plot_sweep.py benchmarks/results/vgg19_offload_sweep_h200.json
"""

from __future__ import annotations

import argparse
import json
import pathlib


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=pathlib.Path)
    p.add_argument(
        "--out", type=pathlib.Path, default=None, help="PNG path (default: beside results)"
    )
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = json.loads(args.results.read_text())
    sweep = sorted(
        (r for r in records if r["strategy"] in ("none", "offload", "offload-plain")),
        key=lambda r: r["offloaded_blocks"],
    )
    remat = [r for r in records if r["strategy"] == "remat"]
    ks = [r["offloaded_blocks"] for r in sweep]
    gib = lambda rs, key: [r[key] / 2**30 for r in rs]  # noqa: E731

    fig, (mem, time) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    mem.plot(ks, gib(sweep, "compiled_temp_bytes"), "o-", label="compiled device temp")
    mem.plot(ks, gib(sweep, "peak_bytes_in_use"), "s-", label="runtime peak")
    mem.plot(ks, gib(sweep, "compiled_host_temp_bytes"), "^--", label="host temp")
    time.plot(ks, [r["step_time_ms"] for r in sweep], "o-", label="offload first k")
    for r in remat:
        mem.axhline(r["peak_bytes_in_use"] / 2**30, color="grey", ls=":", label="nn.remat peak")
        time.axhline(r["step_time_ms"], color="grey", ls=":", label="nn.remat")
    first = records[0]
    title = (
        f"{first['model']} {first['dtype']} {first['image_size']}² batch {first['batch']}, "
        f"{first['device']}, jax {first['jax_version']}, {first['date']}"
    )
    fig.suptitle(title)
    mem.set(xlabel="blocks offloaded (k)", ylabel="GiB", xticks=ks, ylim=(0, None))
    time.set(xlabel="blocks offloaded (k)", ylabel="step time (ms)", xticks=ks, ylim=(0, None))
    mem.legend()
    time.legend()
    out = args.out or args.results.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
