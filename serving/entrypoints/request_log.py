"""Structured request logs: one JSON object per line per request event.

    {"ts": "2026-01-01T12:00:00.123Z", "event": "request.finished", "request_id": "req-ab12",
     "finish_reason": "length", "prompt_tokens": 5, "completion_tokens": 16, "e2e_s": 0.41}

Events: request.accepted, request.rejected (with code and field), request.finished,
request.cancelled (client cancel or deadline), server.* lifecycle events. `log_event`
writes through the `serving.requests` logger; `setup_logging` makes every record of
the process (JAX's and gRPC's included) a JSON line. This module knows nothing of
the engine or gRPC.
"""

from __future__ import annotations

import json
import logging
import sys
import time

log = logging.getLogger("serving.requests")


class JsonFormatter(logging.Formatter):
    """Render a record as one JSON line; `extra={"fields": {...}}` adds keys."""

    def format(self, record: logging.LogRecord) -> str:
        ms = int(record.msecs)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{ms:03d}Z"
        out: dict[str, object] = {"ts": ts, "level": record.levelname.lower(), "logger": record.name}
        fields = getattr(record, "fields", None)
        if fields:
            out |= fields
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def log_event(event: str, level: int = logging.INFO, **fields: object) -> None:
    """Log one request or server event as structured fields (event first)."""
    log.log(level, event, extra={"fields": {"event": event, **fields}})


def setup_logging(level: str = "info") -> None:
    """Send every log record of the process to stderr as JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
