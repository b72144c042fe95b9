"""One child-process entry point, and its parent side: each piece of work in a fresh process.

``peak_bytes_in_use`` never goes down inside a process, and compiling, planning or a
size search would count in it, so the parent runs each as this module's :func:`main`
(``COMMAND JSON...``) in a process of its own, which ends with the parent (``_START``), and
reads the JSON of its last line on stdout. The parent starts no device client: on a GPU,
one would take its share of device memory away from every child.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from jaxoffload.bench import measure, planning, size_search
from jaxoffload.bench.record import Record
from jaxoffload.bench.workload import Workload

__all__ = ["Children", "OutOfMemory", "main"]


class OutOfMemory(RuntimeError):
    """The workload did not fit in device memory."""


class Children:
    """The parent side: each method runs one child process and returns what it printed.

    The bench reaches its child processes through this object alone, so that a test can
    give a stand-in (any object with these methods) where a GPU or a process would be.
    Each method takes ``env``, extra environment variables for the child.

    Raises (each method):
      OutOfMemory: if the child ran out of device memory.
      RuntimeError: if it failed otherwise; the message holds its last output.
    """

    def probe(self, env: dict[str, str] | None = None) -> dict[str, Any]:
        """The default device's platform, kind, memory limit and device count
        (:func:`jaxoffload.bench.measure.probe`)."""
        return _run(["probe"], env)

    def compile(self, workload: Workload, env: dict[str, str]) -> dict[str, float]:
        """:func:`jaxoffload.bench.measure.compile_only`, with ``env`` a
        :func:`~jaxoffload.bench.measure.cache_env`."""
        return _run(["compile", _json(workload)], env)

    def measure(
        self,
        workload: Workload,
        *,
        steps: int = 10,
        reference: str | None = None,
        env: dict[str, str] | None = None,
        **options: Any,
    ) -> Record:
        """:func:`jaxoffload.bench.measure.measure`'s record; ``options`` are its other
        keyword arguments."""
        options = {"steps": steps, "reference": reference, **options}
        return Record.from_json(_run(["measure", _json(workload), json.dumps(options)], env))

    def hidden_offload(
        self, workload: Workload, *, env: dict[str, str] | None = None, **budget: float
    ) -> Workload:
        """The workload with its hidden offload chosen
        (:func:`jaxoffload.bench.planning.hidden_offload_workload`): ``planned`` for a plain-Flax
        linen model, ``block_names`` and ``window`` for a reference one.

        Choosing times each block on the device; in a process of its own, that does not
        count in the runtime peak of the process that then measures the chosen step.

        Args:
          workload: a workload of a ``CHOSEN_STRATEGIES`` strategy.
          env: extra environment variables for the child process.
          **budget: ``fwd_ms``, ``bwd_ms``, ``d2h_gbps`` and ``h2d_gbps``, as
            :func:`~jaxoffload.bench.planning.hidden_offload_workload` takes them.
        """
        chosen = _run(["hidden-offload", _json(workload), json.dumps(budget)], env)
        return dataclasses.replace(workload, **chosen)

    def plan_budgets(
        self,
        workload: Workload,
        budgets_bytes: Sequence[int],
        held_bytes: int = 0,
        *,
        env: dict[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """:func:`jaxoffload.bench.planning.plan_budgets`, whose timing runs then count in
        no measured peak."""
        budgets = json.dumps([list(budgets_bytes), held_bytes])
        return _run(["plan-budgets", _json(workload), budgets], env)

    def largest(
        self,
        workload: Workload,
        axis: str,
        *,
        plan: bool = False,
        env: dict[str, str] | None = None,
        time_limit_s: float = 300.0,
        min_speed: float | None = None,
    ) -> Record:
        """:func:`jaxoffload.bench.size_search.largest` of a workload: the search's own record.

        Its confirming step reads the process's runtime peak, so each search has a
        process of its own.

        Raises:
          OutOfMemory: if the child ran out of device memory other than in the
            confirming step, which steps down instead (in planning's timing runs, say).
        """
        options = {"axis": axis, "plan": plan, "time_limit_s": time_limit_s, "min_speed": min_speed}
        return Record.from_json(_run(["largest", _json(workload), json.dumps(options)], env))


def _json(workload: Workload) -> str:
    return json.dumps(dataclasses.asdict(workload))


def _run(argv: list[str], env: dict[str, str] | None) -> Any:
    """Runs :func:`main` on ``argv`` in a new process (through ``_START``) and returns the
    JSON of its last stdout line.

    The child's ``[plan]`` and ``[fit ...]`` progress lines are passed on to
    this process's stderr as they come; the rest of its stderr is kept for the
    error.
    """
    child = subprocess.Popen(
        [sys.executable, "-c", _START, str(os.getpid()), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    stdout: list[str] = []
    stderr: list[str] = []
    try:
        reader = threading.Thread(target=lambda: stdout.extend(child.stdout), daemon=True)
        reader.start()
        for line in child.stderr:
            stderr.append(line)
            if line.startswith(("[plan]", "[fit ")):
                print(line, end="", file=sys.stderr, flush=True)
        reader.join()
        returncode = child.wait()
    except BaseException:
        # Interrupted: Ctrl-C, or SIGINT sent to this process alone (as a scheduler sends
        # it), which the child does not see. Its work is unfinished; stop it now, rather
        # than wait for it to finish and then throw its result away.
        _stop(child)
        raise
    err = "".join(stderr)
    if returncode == 0:
        return json.loads("".join(stdout).strip().splitlines()[-1])
    if "RESOURCE_EXHAUSTED" in err or "Out of memory" in err:
        raise OutOfMemory(err.strip().splitlines()[-1])
    tail = "\n".join(err.strip().splitlines()[-15:])
    raise RuntimeError(f"the measuring process failed (exit code {returncode}):\n{tail}")


def _stop(child: subprocess.Popen, grace_s: float = 1.0) -> None:
    """Ends ``child``: asked to (SIGTERM), then made to, after ``grace_s`` seconds."""
    child.terminate()
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


# The child's first lines, before any import that takes seconds: on Linux the child asks to
# be ended (SIGTERM) when its parent ends. An interrupt can reach the parent while Popen is
# starting the child, before the parent can stop it, and SIGKILL gives the parent no chance
# at all; then only this keeps the child from measuring for no one. (A preexec_fn would do it
# before exec, but forks a process that JAX may have made multithreaded.)
_START = """
import os, runpy, sys
if sys.platform.startswith("linux"):
    import ctypes, signal
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv.pop(1)):  # the parent ended before the line above
    sys.exit(1)
runpy.run_module("jaxoffload.bench.child", run_name="__main__", alter_sys=True)
"""


def main(argv: Sequence[str]) -> None:
    """The child side: runs ``COMMAND`` on its JSON arguments and prints the result's JSON."""
    command, *args = argv
    values = [json.loads(a) for a in args]
    if command == "probe":
        result = measure.probe()
    elif command == "compile":
        result = measure.compile_only(Workload(**values[0]))
    elif command == "measure":
        result = measure.measure(Workload(**values[0]), **values[1]).to_json()
    elif command == "hidden-offload":
        chosen = planning.hidden_offload_workload(Workload(**values[0]), **values[1])
        result = {
            "block_names": chosen.block_names,
            "window": chosen.window,
            "planned": chosen.planned,
        }
    elif command == "plan-budgets":
        result = planning.plan_budgets(Workload(**values[0]), *values[1])
    elif command == "largest":
        result = size_search.largest(Workload(**values[0]), **values[1]).to_json()
    else:
        raise SystemExit(f"unknown command {command!r}")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
