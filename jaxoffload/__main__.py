"""``python -m jaxoffload``: the same as the ``jaxoffload`` command."""

from jaxoffload.cli import main

if __name__ == "__main__":
    main()
