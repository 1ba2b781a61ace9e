"""The process's log: one handler, configured once as ``python app.py`` starts, one line per record.

Every module of the package logs to its own ``logging.getLogger(__name__)`` (all under ``sdxl_engine``);
the messages keep the prefix that says which side speaks: ``[app]`` the server and the page, ``[sdxl_engine]``
the engine, ``[replicas]`` the Ray front. :func:`configure` sends them, with the other libraries' warnings, to
stderr as ``<ISO time> <LEVEL> <logger>: <message>``, each line written and flushed as it is logged: a log
redirected to a file (``nohup``, Docker, systemd) fills while the app runs, not at its exit.

Standard library only: serving.main imports it before Gradio or JAX, and serving.signals formats its
last line with it.
"""

from __future__ import annotations

import logging
import sys
from datetime import datetime
from typing import TextIO

ENV = "SDXL_LOG_LEVEL"  # the level when --log-level is not given
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LEVEL = "INFO"
PACKAGE = "sdxl_engine"  # the loggers --log-level sets: this package's modules
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
HANDLER_NAME = "sdxl_engine"  # the name of the handler configure installs, so a second call replaces it


class LogFormatter(logging.Formatter):
    """:data:`FORMAT` with the time in ISO 8601: local time, milliseconds and the UTC offset
    (``2025-06-01T14:03:07.412+02:00``), so lines from several hosts or time zones still sort and compare."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds")


FORMATTER = LogFormatter(FORMAT)


def parse_level(text: str) -> str:
    """``text`` as one of :data:`LEVELS` (any case, spaces around ignored).

    Raises:
        ValueError: any other word, naming the levels there are.
    """
    word = text.strip().upper()
    if word not in LEVELS:
        raise ValueError(f"{text!r} is not a log level ({', '.join(LEVELS[:-1])} or {LEVELS[-1]})")
    return word


def configure(level: str = DEFAULT_LEVEL, stream: TextIO | None = None) -> logging.Handler:
    """Send the process's log records to ``stream`` (None: ``sys.stderr``), one formatted line each.

    The package's loggers log from ``level`` (one of :data:`LEVELS`) up; other libraries' loggers (Gradio,
    uvicorn, JAX, httpx) from WARNING up, or from ``level`` if that is higher: their INFO lines are their own
    bookkeeping (httpx logs each HTTP call). One handler, on the root logger: calling this again (a Ray replica
    in a process that had one already) replaces it rather than printing every line twice.
    Returns the handler.
    """
    number = logging.getLevelName(parse_level(level))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
        root.removeHandler(old)
    # StreamHandler flushes after each record: that, not the stream's buffering, puts each line in the file at once.
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(FORMATTER)
    root.addHandler(handler)
    root.setLevel(max(number, logging.WARNING))
    logging.getLogger(PACKAGE).setLevel(number)
    return handler


def line(level: int, name: str, message: str) -> str:
    """One record as :func:`configure`'s handler writes it (without the newline), for a place that must not take
    the logging module's locks: a signal handler writes it with ``os.write``."""
    return FORMATTER.format(logging.LogRecord(name, level, __file__, 0, message, None, None))
