"""structlog JSON logs for every service; a request id travels in a context variable."""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


def setup_logging(service: str, level: str = "INFO") -> structlog.stdlib.BoundLogger:
    """JSON lines on stderr, each with the service name, and the request id when one is bound."""
    global _configured
    if not _configured:
        logging.basicConfig(stream=sys.stderr, level=getattr(logging, level.upper(), logging.INFO), format="%(message)s")
        for chatty in ("httpx", "httpx2", "huggingface_hub"):  # a line per HTTP request (Hub downloads)
            logging.getLogger(chatty).setLevel(logging.WARNING)
        structlog.configure(
            processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                        structlog.processors.TimeStamper(fmt="iso", utc=True),
                        structlog.processors.format_exc_info, structlog.processors.JSONRenderer()],
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=True)
        _configured = True
    return structlog.get_logger(service=service)


def bind_request_id(request_id: str) -> None:
    structlog.contextvars.bind_contextvars(request_id=request_id)


def clear_request_id() -> None:
    structlog.contextvars.unbind_contextvars("request_id")
