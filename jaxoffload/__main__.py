"""``python -m jaxoffload``: the same as the ``jaxoffload`` command."""

from jaxoffload.bench.cli import main

if __name__ == "__main__":
    main()
