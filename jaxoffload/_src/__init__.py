"""jaxoffload's machinery. Nothing here is public: the faces (``jaxoffload``,
``jaxoffload.linen``, ``jaxoffload.nnx``, ``jaxoffload.strategies``) export what is.

``docs/design.md`` maps these modules and the order in which they import each other.
"""
