"""Plot ``jaxoffload bench`` records together with the PyTorch peer's, on one memory/time plane.

    pip install -e ".[bench]"
    python -m jaxoffload.bench.plot_bench bench-out/records.json torch_vgg19_b128.json \
        --out vgg19_b128.png

The records are ``jaxoffload bench``'s (``records.json``) and the PyTorch peer's
(:mod:`jaxoffload.bench.torch_reference`), of one workload.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from jaxoffload.bench.plots import plot_records
from jaxoffload.bench.record import Record


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=pathlib.Path, nargs="+", help="JSON record files")
    parser.add_argument("--out", type=pathlib.Path, required=True, help="PNG path")
    args = parser.parse_args(argv)
    records = [Record.from_json(r) for path in args.records for r in json.loads(path.read_text())]
    models = {(r.model, r.batch, r.image_size) for r in records}
    if len(models) != 1:
        parser.error(f"the files hold different workloads: {sorted(models)}")
    if plot_records(records, args.out) is None:
        parser.error("nothing to plot: no record has a step time, or matplotlib is missing")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
