"""Structured request logs: one JSON object per line per request event.

    {"ts": "2026-01-01T12:00:00.123Z", "event": "request.finished", "request_id": "req-ab12",
     "finish_reason": "length", "prompt_tokens": 5, "completion_tokens": 16, "e2e_s": 0.41}

Events: request.accepted, request.rejected (with code and field), request.finished,
request.cancelled (client cancel or deadline), server.* lifecycle events. `log_event`
writes through the `serving.requests` logger; `setup_logging` makes every record of
the process a JSON line: this project's own at the chosen level, other libraries'
(JAX's backend probes, absl, orbax, gRPC) only from WARNING up, so start-up shows the
server's lines and real problems, not "Unable to initialize backend 'tpu'". This
module knows nothing of the engine or gRPC.
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


OWN_LOGGERS = ("serving", "hybrid_jax", "pallas_kernels", "configs")


class OwnLevelFilter(logging.Filter):
    """Pass this project's records at `level` and up, other libraries' at WARNING and up
    (or `level`, if higher): their INFO lines are internals, their warnings may matter."""

    def __init__(self, level: int):
        super().__init__()
        self.level, self.foreign = level, max(level, logging.WARNING)

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name.split(".", 1)[0] in OWN_LOGGERS
        return record.levelno >= (self.level if own else self.foreign)


def setup_logging(level: str = "info") -> None:
    """Send the process's log records to stderr as JSON lines (`OwnLevelFilter`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    number = logging.getLevelName(level.upper())
    handler.addFilter(OwnLevelFilter(number))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(number)
