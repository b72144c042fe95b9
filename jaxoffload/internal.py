"""What the bench and the probes may use of jaxoffload's internals: no stability promise.

Like ``equinox.internal``, this module is semi-public. Its names are not the public API
(``jaxoffload``, ``jaxoffload.linen``, ``jaxoffload.nnx``, ``jaxoffload.strategies``): they
may change or go in any release, without notice or deprecation. It is the one way in to
``jaxoffload/_src/`` for the harness (``jaxoffload.bench``) and the probe scripts
(``benchmarks/``), and it names exactly what they use (``tests/test_layout.py`` checks
both), so that the rest of ``_src`` can change without asking them.
"""

# The cut's pricing, which a probe replaces to time what another rule keeps.
from jaxoffload._src import cut as cut

# What Lean(max_slowdown=...)'s blocks timed and took in this process.
from jaxoffload._src import fallbacks as fallbacks

# The host transfers' construction, whose parts a probe takes away to price them.
from jaxoffload._src import transfers as transfers

# Reading traced programs.
from jaxoffload._src.jaxprs import equations as equations
from jaxoffload._src.jaxprs import nbytes as nbytes
from jaxoffload._src.jaxprs import struct_of as struct_of
from jaxoffload._src.jaxprs import trace_vjp as trace_vjp

# The lean layers that the reference models are built from.
from jaxoffload._src.layers import max_pool as max_pool
from jaxoffload._src.layers import relu as relu
from jaxoffload._src.layers import relu_max_pool as relu_max_pool

# The planner, and the steps it compiles.
from jaxoffload._src.planner import Planner as Planner
from jaxoffload._src.planner import default_options as default_options

# What blocks cost, and the copies that the host link carries while they compute.
from jaxoffload._src.planner.costs import BlockCost as BlockCost
from jaxoffload._src.planner.costs import BlockCosts as BlockCosts
from jaxoffload._src.planner.costs import cap_key as cap_key
from jaxoffload._src.planner.costs import cap_sizes as cap_sizes
from jaxoffload._src.planner.costs import cost_blocks as cost_blocks
from jaxoffload._src.planner.costs import step_flops as step_flops
from jaxoffload._src.planner.costs import trace_blocks as trace_blocks
from jaxoffload._src.planner.costs import traced_blocks as traced_blocks
from jaxoffload._src.planner.costs import with_traced_caps as with_traced_caps
from jaxoffload._src.planner.hiding import copy_timeline as copy_timeline
from jaxoffload._src.planner.hiding import hidden_copies as hidden_copies
from jaxoffload._src.planner.messages import summary as summary
from jaxoffload._src.planner.peak import BACKWARD as BACKWARD
from jaxoffload._src.planner.peak import calibrate_peak as calibrate_peak
from jaxoffload._src.planner.peak import compiled_points as compiled_points
from jaxoffload._src.planner.peak import live_bytes as live_bytes
from jaxoffload._src.planner.program import device_bytes as device_bytes
from jaxoffload._src.planner.program import discover as discover
from jaxoffload._src.planner.program import lower_step as lower_step
from jaxoffload._src.planner.program import program as program
from jaxoffload._src.planner.program import trace_step as trace_step

# What a compiled step holds and moves.
from jaxoffload._src.report import analyze as analyze
from jaxoffload._src.report import device_bytes_of as device_bytes_of
from jaxoffload._src.report import read_spatial_gathers as read_spatial_gathers
from jaxoffload._src.report import requested_host_transfers as requested_host_transfers
from jaxoffload._src.report import with_twin as with_twin

# A strategy in a few words.
from jaxoffload._src.strategies import brief as brief

# Timing programs on the device, and the host link.
from jaxoffload._src.timing import compile_all as compile_all
from jaxoffload._src.timing import link_probe_bytes as link_probe_bytes
from jaxoffload._src.timing import measure_link as measure_link
from jaxoffload._src.timing import median_ms as median_ms
from jaxoffload._src.timing import slower_link_gbps as slower_link_gbps
from jaxoffload._src.timing import step_ms as step_ms
from jaxoffload._src.timing import steps_together as steps_together
from jaxoffload._src.timing import vjp_programs as vjp_programs
from jaxoffload._src.timing import zeros as zeros
from jaxoffload._src.transfers import without_host_placement as without_host_placement

# XLA options, and host copies priced for the scheduler.
from jaxoffload._src.xla_options import host_copies as host_copies
from jaxoffload._src.xla_options import with_copy_costs as with_copy_costs

__all__ = [
    "BACKWARD",
    "BlockCost",
    "BlockCosts",
    "Planner",
    "analyze",
    "brief",
    "calibrate_peak",
    "cap_key",
    "cap_sizes",
    "compile_all",
    "compiled_points",
    "copy_timeline",
    "cost_blocks",
    "cut",
    "default_options",
    "device_bytes",
    "device_bytes_of",
    "discover",
    "equations",
    "fallbacks",
    "hidden_copies",
    "host_copies",
    "link_probe_bytes",
    "live_bytes",
    "lower_step",
    "max_pool",
    "measure_link",
    "median_ms",
    "nbytes",
    "program",
    "read_spatial_gathers",
    "relu",
    "relu_max_pool",
    "requested_host_transfers",
    "slower_link_gbps",
    "step_flops",
    "step_ms",
    "steps_together",
    "struct_of",
    "summary",
    "trace_blocks",
    "trace_step",
    "trace_vjp",
    "traced_blocks",
    "transfers",
    "vjp_programs",
    "with_copy_costs",
    "with_traced_caps",
    "with_twin",
    "without_host_placement",
    "zeros",
]
