"""The one error every trace reader raises for input it cannot read: where, and what was expected."""
from __future__ import annotations


class TraceFormatError(ValueError):
    """A trace file that is not what its format promises.

    ``str(err)`` is ``"<file>:<line>: expected <what>; got <found>"`` (``line`` is 1-based; for a
    JSON document it is the line the parser stopped at, or the request's position such as
    ``requests[3].subagent.requests[1]``). Commands print it and exit with status 2, never a traceback.
    """

    def __init__(self, path: str, where: int | str | None, expected: str, got: str = ""):
        self.path, self.where, self.expected, self.got = str(path), where, expected, got
        loc = self.path if where is None else f"{self.path}:{where}"
        msg = f"{loc}: expected {expected}"
        if got:
            msg += f"; got {got}"
        super().__init__(msg)


def shorten(text: object, limit: int = 80) -> str:
    """``repr``-like preview of bad input for error messages."""
    s = str(text).strip().replace("\n", "\\n")
    return repr(s if len(s) <= limit else s[:limit] + "...")
