"""Runs a probe with ``Lean()``'s cut keeping more of the products' inputs. A GPU probe, not a test.

    KEEP=all|dot|weights python benchmarks/probes/keep_products.py PROBE.py [ARGS ...]

For that process, :func:`jaxoffload._src.cut.prices` never recomputes an input of a matrix
product that the backward pass reads: of every convolution and ``dot_general`` (``all``),
of ``dot_general`` alone (``dot``: on ConvNeXt, LayerNorm's output, which the first
``Dense`` reads), or the smaller operand of each where the function's inputs make it by
elementwise operations alone (``weights``: a weight cast to bf16). Then PROBE.py runs as it
is (``overlap_probe.py``, ``compile_probe.py``), so that a cut that keeps those inputs can be
timed and compiled beside the library's.
"""

import os
import runpy
import sys

from jax.extend import core as jex_core

from jaxoffload.internal import cut

KEPT = {"all": cut._MATMULS, "dot": frozenset({"dot_general"}), "weights": cut._MATMULS}


def keeping(primitives, prices=cut.prices, weights=False):
    """``prices``, with the inputs of ``primitives`` that the backward pass reads kept; with
    ``weights``, only the smaller operand of each, where the function's inputs make it by
    elementwise operations alone (a weight cast to bf16, say)."""

    def kept(jaxpr, needed):
        needed = list(needed)
        found = prices(jaxpr, needed)
        producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
        inputs = set()
        for e in jaxpr.eqns:
            if e.primitive.name in primitives:
                operands = [u for u in e.invars if isinstance(u, jex_core.Var)][:2]
                if weights:
                    operands = sorted(operands, key=lambda u: cut.nbytes(u.aval))[:1]
                    operands = [u for u in operands if _from_inputs(jaxpr, u, producer)]
                inputs.update(operands)
        for v in needed:
            if v in inputs and v in producer:
                found[producer[v]] = cut.Price(never="a product's input (keep_products.py)")
        return found

    return kept


def _from_inputs(jaxpr, v, producer):
    """Whether elementwise operations alone make ``v`` from the function's inputs."""
    todo, seen = [v], set()
    while todo:
        u = todo.pop()
        if not isinstance(u, jex_core.Var) or u in seen or u not in producer:
            continue  # a literal, or one of the function's inputs
        seen.add(u)
        eqn = jaxpr.eqns[producer[u]]
        if eqn.primitive.name not in cut._ELEMENTWISE:
            return False
        todo.extend(eqn.invars)
    return True


if __name__ == "__main__":
    cut.prices = keeping(KEPT[os.environ["KEEP"]], weights=os.environ["KEEP"] == "weights")
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
