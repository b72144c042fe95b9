"""Every exception and warning class that jaxoffload raises or gives."""

__all__ = ["NoPlanFits", "OffloadDroppedError", "OffloadWarning"]


class OffloadWarning(UserWarning):
    """A requested host placement or strategy had no effect, or moves bytes that free little."""


class OffloadDroppedError(RuntimeError):
    """The compiler removed every requested host transfer."""


class NoPlanFits(ValueError):
    """No plan of the options fits the budget; the message gives the least reached.

    Attributes:
      least_bytes: the fewest device bytes that a compiled plan reached.
      plain_bytes: the plain step's, for a share.
    """

    def __init__(
        self, message: str, *, least_bytes: int | None = None, plain_bytes: int | None = None
    ):
        super().__init__(message)
        self.least_bytes, self.plain_bytes = least_bytes, plain_bytes
