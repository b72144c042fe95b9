"""Runs a probe with ``Lean()``'s cut keeping more of the products' inputs. A GPU probe, not a test.

    KEEP=all|dot python benchmarks/probes/keep_products.py PROBE.py [ARGS ...]

For that process, :func:`jaxoffload._src.cut.prices` never recomputes an input of a matrix
product that the backward pass reads: of every convolution and ``dot_general`` (``all``),
or of ``dot_general`` alone (``dot``: on ConvNeXt, LayerNorm's output, which the first
``Dense`` reads). Then PROBE.py runs as it is (``overlap_probe.py``, ``compile_probe.py``),
so that a cut that keeps those inputs can be timed and compiled beside the library's.
"""

import os
import runpy
import sys

from jaxoffload.internal import cut

KEPT = {"all": cut._MATMULS, "dot": frozenset({"dot_general"})}


def keeping(primitives, prices=cut.prices):
    """``prices``, with the inputs of ``primitives`` that the backward pass reads kept."""

    def kept(jaxpr, needed):
        needed = list(needed)
        found = prices(jaxpr, needed)
        producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
        inputs = {u for e in jaxpr.eqns if e.primitive.name in primitives for u in e.invars}
        for v in needed:
            if v in inputs and v in producer:
                found[producer[v]] = cut.Price(never="a product's input (keep_products.py)")
        return found

    return kept


if __name__ == "__main__":
    cut.prices = keeping(KEPT[os.environ["KEEP"]])
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
