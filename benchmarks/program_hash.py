"""Print a short hash of each strategy's training-step jaxpr: equal hashes, equal programs.

    python benchmarks/program_hash.py vgg19 none lean offload offload-hidden jax-offload \
        [--offload 0,8] [--window 2]

Traces `jaxoffload.benchmark.train_step` with abstract values (batch 2, 64², bf16), on
any machine, and hashes the printed jaxpr. Run it at two commits to tell whether a change
touched a model's programs. `offload-hidden` offloads the blocks given by `--offload`
and keeps the others `lean`.
"""

import argparse
import hashlib

from jaxoffload import benchmark, models


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("strategies", nargs="+")
    parser.add_argument("--offload", default="0,8", help="offload-hidden's offloaded blocks")
    parser.add_argument("--window", type=int, default=2)
    args = parser.parse_args()
    chosen = {int(b) for b in args.offload.split(",")}
    for strategy in args.strategies:
        plan = None
        if strategy in models.PLANNED_STRATEGIES:
            n = models.num_blocks(args.model)
            plan = tuple("offload" if i in chosen else "lean" for i in range(n))
        workload = benchmark.Workload(
            args.model, 2, 64, "bfloat16", strategy, window=args.window, plan=plan
        )
        step, state, batch, _ = benchmark.train_step(workload, abstract=True)
        text = str(step.trace(state, batch).jaxpr)
        print(strategy, hashlib.sha1(text.encode()).hexdigest()[:12])


if __name__ == "__main__":
    main()
