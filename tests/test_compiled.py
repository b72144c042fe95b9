"""The planner's oracle: steps compiled several at once, each once."""

import threading
import types

import jaxoffload
from jaxoffload import Lean, Plan, Store
from jaxoffload._src.planner.compiled import CompiledSteps


class _Lowered:
    """A stand-in lowered step whose compile is noted."""

    def __init__(self, name, events, wait=None):
        self.name, self.events, self.wait = name, events, wait

    def compile(self, options=None):
        self.options = options
        if self.wait is not None:
            self.wait.wait(timeout=5)
        self.events.append(self.name)
        memory = types.SimpleNamespace(temp_size_in_bytes=10, argument_size_in_bytes=1)
        return types.SimpleNamespace(memory_analysis=lambda: memory)


def test_each_plan_compiles_once_those_lowered_already_first():
    steps, events, said = CompiledSteps.__new__(CompiledSteps), [], []
    steps.say, steps.compiled, steps.compile_s = said.append, {}, {}
    steps.executables, steps.lowered, steps.measured_ms = {}, {}, {}
    plans = [Plan((("Block_0", s),), Lean()) for s in (Store(), Lean(max_recompute=0.5), Lean())]
    steps._lowered_step = lambda plan: _Lowered(f"traced {plans.index(plan)}", events)
    lowered = steps.lowered[plans[2]] = _Lowered("lowered 2", events)
    steps.compile([plans[0], plans[1], plans[2], plans[0]])
    assert events[0] == "lowered 2" and sorted(events[1:]) == ["traced 0", "traced 1"]
    assert lowered.options == jaxoffload.compiler_options()  # as a training loop compiles it
    assert steps.compiled == dict.fromkeys(plans, 11) and set(steps.compile_s) == set(plans)
    assert not steps.lowered and said[0].startswith("compiled 3 in ")
    steps.compile(plans)  # compiled already: nothing to do, nothing said
    assert len(events) == 3 and len(said) == 1


def test_a_plan_compiling_in_the_background_is_waited_for_not_compiled_twice():
    """compile_soon traces here and compiles in a thread that leaves the shared state alone
    (the caller may be reading it): a later compile waits for it and keeps what it made."""
    steps, events, said = CompiledSteps.__new__(CompiledSteps), [], []
    steps.say, steps.compiled, steps.compile_s = said.append, {}, {}
    steps.executables, steps.lowered, steps.measured_ms = {}, {}, {}
    plans = [Plan((("Block_0", s),), Lean()) for s in (Store(), Lean())]
    gate = threading.Event()

    def lowered_step(plan):
        events.append(f"traced {plans.index(plan)}")
        return _Lowered(
            f"compiled {plans.index(plan)}", events, wait=gate if plan == plans[0] else None
        )

    steps._lowered_step = lowered_step
    steps.compile_soon([plans[0]], "the first")
    assert events == ["traced 0"] and plans[0] in steps.in_flight and not steps.lowered
    done = threading.Thread(target=steps.compile, args=(plans,))
    done.start()
    done.join(timeout=0.5)
    assert done.is_alive() and plans[1] in steps.compiled  # the other compiled, the first awaited
    assert plans[0] not in steps.compiled
    gate.set()
    done.join(timeout=5)
    assert not done.is_alive() and set(steps.compiled) == set(plans)
    assert events.count("traced 0") == 1 and events.count("compiled 0") == 1
    assert any(line.startswith("the first: compiled 1 in ") for line in said)


def test_what_compiles_in_the_background_is_kept_only_by_a_compile_that_waits_for_it():
    steps, events = CompiledSteps.__new__(CompiledSteps), []
    steps.say, steps.compiled, steps.compile_s = (lambda line: None), {}, {}
    steps.executables, steps.lowered, steps.measured_ms = {}, {}, {}
    plan = Plan((("Block_0", Store()),), Lean())
    steps._lowered_step = lambda p: _Lowered("compiled", events)
    steps.compile_soon([plan])
    steps.in_flight[plan].result(timeout=5)
    assert events == ["compiled"] and not steps.compiled and not steps.executables
    steps.compile([plan])
    assert steps.compiled == {plan: 11} and plan in steps.compile_s and events == ["compiled"]


class _Failing(_Lowered):
    def compile(self, options=None):
        raise RuntimeError("no room")


def test_settle_keeps_every_background_compile_and_says_one_that_failed():
    steps, said = CompiledSteps.__new__(CompiledSteps), []
    steps.say, steps.compiled, steps.compile_s = said.append, {}, {}
    steps.executables, steps.lowered, steps.measured_ms = {}, {}, {}
    fine, failing = (Plan((("Block_0", s),), Lean()) for s in (Store(), Lean()))
    steps._lowered_step = lambda p: (_Lowered if p == fine else _Failing)("x", [])
    steps.compile_soon([fine])
    steps.compile_soon([failing])
    steps.settle()
    assert steps.compiled == {fine: 11} and not steps.in_flight
    assert any("failed, and nothing needed it: RuntimeError('no room')" in line for line in said)
