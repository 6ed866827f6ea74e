"""Progress display (stderr) and the run's JSON-lines log.

The bar shows step, loss, tokens/s and ETA; on a terminal it redraws one line, else
it prints one line per update. Every record also goes to `train_log.jsonl` in the
run directory: a `start` record (configs, corpus, devices), `train` records, `eval`
records and an `end` record.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def _duration(s: float) -> str:
    s = int(max(s, 0))
    h, rem = divmod(s, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


class RunLog:
    def __init__(self, path: str | Path, *, total_steps: int, stream: TextIO = sys.stderr,
                 quiet: bool = False):
        self.path = Path(path)
        self.file = self.path.open("a")
        self.total = total_steps
        self.stream = stream
        self.quiet = quiet
        self.tty = stream.isatty()

    def record(self, kind: str, **fields: Any) -> None:
        self.file.write(json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n")
        self.file.flush()

    def progress(self, step: int, loss: float, tokens_per_s: float, eta_s: float) -> None:
        if self.quiet:
            return
        bar = "#" * (20 * step // self.total)
        line = (f"step {step}/{self.total} [{bar:<20}] loss {loss:.3f} | "
                f"{tokens_per_s / 1e3:.1f}k tok/s | ETA {_duration(eta_s)}")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=self.stream,
              flush=True)

    def message(self, text: str) -> None:
        if not self.quiet:
            print(("\n" if self.tty else "") + text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=self.stream)
        self.file.close()
