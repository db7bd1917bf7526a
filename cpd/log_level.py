"""The log level of a cpd process, from ``$CPD_LOG_LEVEL`` (default WARNING)."""
from __future__ import annotations

import logging
import os

LOG_LEVEL_ENV = "CPD_LOG_LEVEL"


def configure_logging(program: str, environ: dict[str, str] | None = None) -> None:
    """``logging.basicConfig`` at ``$CPD_LOG_LEVEL``: a level name (any case) or a number. Exits
    with one line naming the variable for anything else (logging itself raises a ValueError)."""
    raw = (os.environ if environ is None else environ).get(LOG_LEVEL_ENV, "WARNING").strip()
    level = int(raw) if raw.isdigit() else logging.getLevelName(raw.upper())
    if not isinstance(level, int):
        raise SystemExit(f"{program}: error: {LOG_LEVEL_ENV}={raw!r} is not a log level "
                         "(DEBUG, INFO, WARNING, ERROR, CRITICAL or a number)")
    logging.basicConfig(level=level)
