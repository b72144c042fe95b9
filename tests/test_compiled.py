"""The planner's oracle: steps compiled several at once, each as soon as it is traced."""

import queue
import threading
import time
import types

from jaxoffload import Lean, Plan, Store
from jaxoffload._src.planner.compiled import CompiledSteps


class _Lowered:
    """A stand-in lowered step whose compile notes when it began."""

    def __init__(self, name, events):
        self.name, self.events = name, events

    def compile(self):
        self.events.append(("compile", self.name))
        memory = types.SimpleNamespace(temp_size_in_bytes=10, argument_size_in_bytes=1)
        return types.SimpleNamespace(memory_analysis=lambda: memory)


def _steps():
    steps = CompiledSteps.__new__(CompiledSteps)  # no model: the stand-ins are lowered already
    steps.say, steps.compiled, steps.compile_s = (lambda line: None), {}, {}
    steps.executables, steps.lowered, steps.measured_ms = {}, {}, {}
    return steps


def test_an_iterator_that_another_thread_fills_compiles_each_plan_as_it_comes():
    steps, events = _steps(), []
    plans = [Plan((("Block_0", s),), Lean()) for s in (Store(), Lean(max_recompute=0.5), Lean())]
    given = queue.SimpleQueue()

    def tracer():  # lowers each plan, as the planner's thread does, and hands it over
        for n, plan in enumerate(plans):
            if n == 2:  # the first compiles before the last is traced, or the wait runs out
                deadline = time.monotonic() + 5
                while ("compile", 0) not in events and time.monotonic() < deadline:
                    time.sleep(0.01)
            steps.lowered[plan] = _Lowered(n, events)
            events.append(("given", n))
            given.put(plan)
        given.put(None)

    thread = threading.Thread(target=tracer)
    thread.start()
    steps.compile(iter(given.get, None))
    thread.join()
    assert set(steps.compiled) == set(plans) and all(b == 11 for b in steps.compiled.values())
    assert events.index(("compile", 0)) < events.index(("given", 2))
    assert not steps.lowered  # each lowered program was handed to the compiler once
    steps.compile(plans)  # compiled already: nothing to do
    assert events.count(("compile", 0)) == 1
