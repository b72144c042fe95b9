"""Test set-up: four CPU devices for sharding tests, the ``gpu`` marker, a quiet end of xdist."""

import gc
import getpass
import importlib.util
import os
import tempfile

# Must be set before jax initialises its backends.
_XLA_FLAGS = ["--xla_force_host_platform_device_count=4"]
# XLA:CPU's LLVM at level 0, without its expensive passes: most of a cold suite's time is
# compiling small programs that run for milliseconds. Buffers, and so every memory figure,
# are XLA's, above LLVM; values may round otherwise, within the tests' tolerances. Not where
# a GPU plugin is installed: the GPU tests time the kernels that LLVM emits there.
if not any(importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
    _XLA_FLAGS += ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
os.environ.setdefault("XLA_FLAGS", " ".join(_XLA_FLAGS))
# One compilation cache for the run's workers and the processes they start: many tests
# compile the same small programs, and XLA's compiles are most of the suite's time (a fresh
# clone's suite took 324 s without it, 273 s with it).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"jaxoffload-tests-{getpass.getuser()}-xla-cache"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# The same examples on every run: the suite cannot fail by the draw.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU; skipped elsewhere")


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(
        reason=f"needs a GPU; this machine's backend is {jax.default_backend()}"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session):
    """Collects the run's garbage before an xdist worker says that it has finished.

    Then the controller ends the run and closes each worker's gateway, and a worker still
    running 5 s later sends itself SIGINT (execnet's ``_terminate_execution``). pytest's
    last full collection comes after that report, at unconfigure: on a loaded machine, it
    and jax's gc callback, which frees compiled programs, could outlast the 5 s, and the
    SIGINT landed in the callback, printing a KeyboardInterrupt traceback from a passing
    run. This runs inside xdist's own ``pytest_sessionfinish``, before it reports: it
    collects here, where pytest still reports what a finalizer raises, then freezes what
    is left, so that the collections after the report have nothing to walk.
    """
    gc.collect()
    gc.freeze()
