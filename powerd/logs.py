"""Structured logging: one event name per thing that happens, JSON under systemd."""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal

import structlog

LogFormat = Literal["auto", "json", "console"]


def configure_logging(fmt: LogFormat = "auto", level: str = "info") -> None:
    """Set up structlog once per process. `auto`: JSON under systemd or without a TTY."""
    if fmt == "auto":
        under_systemd = "JOURNAL_STREAM" in os.environ or "INVOCATION_ID" in os.environ
        fmt = "json" if under_systemd or not sys.stderr.isatty() else "console"
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        # Look sys.stderr up at each write, not once: whoever replaces it later (pytest's
        # capture, a daemon's redirection) must not leave the logger on a closed file.
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )


def _stderr_logger(*_args: object) -> structlog.PrintLogger:
    return structlog.PrintLogger(sys.stderr)
