"""Planning: a strategy per block that fits a memory budget at the least step time.

``plan.py`` is the value, ``apply.py`` puts it on a model, ``program.py`` compiles a
step under it, ``costs.py`` says what blocks cost and models the step's time, ``peak.py``
its peak, ``calibration.py`` calibrates the time to compiled steps, ``search.py`` searches,
``planning.py`` is the ``plan()`` call, and ``fit.py`` finds the largest size that fits:
``bracket.py`` searches the sizes, ``size_steps.py`` compiles the step at each.
"""

from jaxoffload._src.errors import NoPlanFits as NoPlanFits
from jaxoffload._src.planner.costs import BlockCost as BlockCost
from jaxoffload._src.planner.costs import BlockCosts as BlockCosts
from jaxoffload._src.planner.costs import estimate_step_ms as estimate_step_ms
from jaxoffload._src.planner.fit import Fit as Fit
from jaxoffload._src.planner.fit import largest_size as largest_size
from jaxoffload._src.planner.peak import estimate_peak_bytes as estimate_peak_bytes
from jaxoffload._src.planner.plan import Plan as Plan
from jaxoffload._src.planner.planning import plan as plan
from jaxoffload._src.planner.program import compiled_bytes as compiled_bytes
from jaxoffload._src.planner.search import BLOCK_COSTS as BLOCK_COSTS
from jaxoffload._src.planner.search import Planner as Planner
from jaxoffload._src.planner.search import default_options as default_options
from jaxoffload._src.timing import measure_link as measure_link
from jaxoffload._src.timing import median_ms as median_ms
from jaxoffload._src.timing import zeros as zeros
