"""Where the library's lowered program lets each offloaded residual be waited for and fetched.

    python benchmarks/probes/fetch_order.py PLAN.json

Runs on any machine (no GPU): traces Flax's ResNet-50 training step (b256, bf16, 224², as
``overlap_probe.py`` builds it) under the plan, lowers it for CUDA, and reads the StableHLO
text. For each array placed in pinned host memory it prints the line of the placement, the line
of the forward-pass barrier that ties its copy's token to a later block (where the copy is
waited for), and the line that defines the token gating its fetch in the backward pass (the
earliest the fetch may start). XLA's scheduler may move a copy's wait earlier and its fetch
later; comparing these lines with the compiled HLO shows which of the two placed them.
"""

import re
import sys

import jax
from overlap_probe import resnet50_training  # beside this script

VALUE = r"%[\w#]+"


def barriers(lines):
    """Each optimisation barrier: ``{result: (line, operands)}``."""
    out = {}
    for n, line in enumerate(lines, 1):
        m = re.match(r"\s*(%\w+)(?::\d+)? = stablehlo.optimization_barrier (.*?) :", line)
        if m:
            out[m.group(1)] = (n, re.findall(VALUE, m.group(2)))
    return out


def definition(lines, value):
    name = value.split("#")[0]
    return next(n for n, line in enumerate(lines, 1) if re.match(rf"\s*{name}(?::\d+)? = ", line))


def report(text):
    lines = text.splitlines()
    bars = barriers(lines)
    users = {}  # operand -> the barriers that take it
    for result, (n, operands) in bars.items():
        for k, operand in enumerate(operands):
            users.setdefault(operand, []).append((n, result, k, len(operands)))
    for n, line in enumerate(lines, 1):
        m = re.match(rf"\s*({VALUE}) = stablehlo.custom_call @annotate_device_placement", line)
        if not m or '"pinned_host"' not in line:
            continue
        shape = re.search(r"-> tensor<([^>]*)>", line).group(1)
        # The placement's barrier groups it with its block's statistics; the next one adds the
        # copy's token, whose output a later block's barrier takes: the copy's wait.
        if m.group(1) not in users:
            print(f"line {n}: {shape} to the host; in no barrier")
            continue
        _, first, k, _ = min(users[m.group(1)])
        waits, fetches = [], []
        for _, second, j, size in users.get(f"{first}#{k}", []):
            token = f"{second}#{size - 1}"
            waits += [u[0] for u in users.get(token, [])]
            for _, third, _, _ in users.get(f"{second}#{j}", []):
                gate = bars[third][1][-1]  # the fetch's barrier: host values, then its token
                fetches.append(definition(lines, gate))
        print(f"line {n}: {shape} to the host; waited for at {waits}; fetch gated at {fetches}")


if __name__ == "__main__":
    _, step, state, batch = resnet50_training(sys.argv[1], abstract=True)
    traced = jax.jit(step, donate_argnums=0).trace(state, batch)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    print(f"{len(text.splitlines())} lines")
    report(text)
