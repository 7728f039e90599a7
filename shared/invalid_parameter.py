"""The error of a bad request parameter: a ValueError that names the parameter.

Every check of a request's fields raises it (SamplingParams, StructuredOutputs and the engine
request's validation alike), so each front can say which field was wrong: the gateway as OpenAI's
error ``param``, the CLI and the offline API in the message itself.
"""

from __future__ import annotations

# Classes whose own checks prefix their messages with their name ("SamplingParams.n must ..."):
# the Python caller sees which object refused; the gateway's clients see the field alone.
_OWNERS = ("SamplingParams.", "PoolingParams.")


class InvalidParameter(ValueError):
    """A request error that names the offending parameter (the OpenAI error's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param

    @classmethod
    def from_params_error(cls, exc: ValueError, param: str | None = None) -> InvalidParameter:
        """An error of SamplingParams' or PoolingParams' own checks ("<class>.<name> must ...") as a client
        reads it: the message without the class, naming the parameter (``param``, where it says which)."""
        text = str(exc)
        for prefix in _OWNERS:
            if text.startswith(prefix):
                message = text.removeprefix(prefix)
                return cls(message, param or getattr(exc, "param", None) or message.split(" ", 1)[0])
        return cls(text, param or getattr(exc, "param", None))

    def renamed(self, param: str) -> InvalidParameter:
        """The same error under the name a front gives the field (an embedding API's "input" is the prompt)."""
        return InvalidParameter(str(self), param)


def require(ok: object, param: str, why: str, owner: str | None = None) -> None:
    """InvalidParameter "<owner>.<param> <why>" (or "<param> <why>") unless ``ok``."""
    if not ok:
        raise InvalidParameter(f"{owner}.{param} {why}" if owner else f"{param} {why}", param)
