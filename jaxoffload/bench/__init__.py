"""The benchmark harness: the reference models, the benchmark and the ``jaxoffload bench`` command."""
