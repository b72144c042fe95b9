"""``offload-hidden``'s plan of Flax's ResNet-50 b256 with ``hidden_copies`` counting on a share of
the link, from the README run's GPU figures (``resnet50-b256-h200/records.json`` at ``45ed3d3``:
its ``lean`` twin's forward pass and the rest of its step, and the link measured there).

    python benchmarks/probes/hidden_share.py SHARE PLAN.json

Traces on any machine (the blocks' times are their FLOP shares of the twin's step) and writes
the plan, with its notes, to PLAN.json: ``plans/hidden-share1.json`` is ``SHARE=1.0``.
"""

import sys

from jaxoffload.bench import planning
from jaxoffload.bench.workload import Workload
from jaxoffload.internal import hidden_copies

LINK_GBPS = (52.3, 52.2)  # d2h, h2d
TWIN_MS = (12.96, 24.54)  # forward pass, the rest of the step

share, out = float(sys.argv[1]), sys.argv[2]
planning.hidden_copies = lambda *a, **k: hidden_copies(*a, link_share=share, **k)
workload = Workload(
    model="flax-resnet50", batch=256, image_size=224, dtype="bfloat16",
    strategy="offload-hidden", block_costs="traced",
)  # fmt: skip
planning.hidden_plan(workload, LINK_GBPS, twin_ms=TWIN_MS).save(out)
