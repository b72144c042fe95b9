"""Every exception and warning class that jaxoffload raises or gives."""

__all__ = ["NoPlanFits", "OffloadDroppedError", "OffloadWarning"]


class OffloadWarning(UserWarning):
    """A requested host placement had no effect, or moves bytes that free little."""


class OffloadDroppedError(RuntimeError):
    """The compiler removed every requested host transfer."""


class NoPlanFits(ValueError):
    """No plan of the options fits the budget; the message gives the least reached."""
