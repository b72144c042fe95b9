"""Measure `offload-hidden` with plans given by hand, against `lean`, each in a fresh process.

    python benchmarks/hidden_plans.py OUT.json 0,3,7,13 0,3 [--window 2]

ResNet-50, batch 256, 224², bf16. Each PLAN lists the offloaded blocks; the others run
`lean`. `lean` runs first, with windows 1,2,2,2. The plans do not go through the
planner, so nothing checks that their transfers hide. Prints one line per run and
writes the records (`jaxoffload.benchmark.measure`'s, with the plan under `spec`).
"""

import argparse
import json

from jaxoffload import benchmark


def resnet50(strategy, plan=None, window=(1, 2, 2, 2)):
    return benchmark.Workload("resnet50", 256, 224, "bfloat16", strategy, plan=plan, window=window)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("plans", nargs="+", help="offloaded blocks, e.g. 0,3,7,13")
    parser.add_argument("--window", type=int, default=2)
    args = parser.parse_args()
    workloads = [("lean", resnet50("lean"))]
    for spec in args.plans:
        chosen = {int(b) for b in spec.split(",")}
        plan = tuple("offload" if i in chosen else "lean" for i in range(16))
        workloads.append((spec, resnet50("offload-hidden", plan, args.window)))
    records = []
    for spec, workload in workloads:
        record = {**benchmark.measure_in_subprocess(workload), "spec": spec}
        records.append(record)
        print(
            f"{spec:24s} temp {record['compiled_temp_bytes'] / 2**30:.3f} GiB, "
            f"peak {record['peak_bytes_in_use'] / 2**30:.3f} GiB, "
            f"step {record['step_time_ms']:.2f} ms",
            flush=True,
        )
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
