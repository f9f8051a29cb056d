"""Errors a caller can act on. Each message says what was wrong and how to fix it."""


class InvalidRequestError(ValueError):
    """A request was rejected before it ran (empty prompt, too long, bad parameter).

    ``param`` names the offending field when there is one (OpenAI's error ``param``).
    Other requests are not affected.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
