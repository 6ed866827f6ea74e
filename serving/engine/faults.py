"""Fault isolation for the engine loop: a step that raises harms only the request it is pinned on.

When a step raises, the step is rolled back (`Scheduler.rollback`: every sequence of
it goes back to waiting, to be recomputed, which never changes its output) and the
engine goes on. Every sequence of the failed step becomes a suspect. Suspects are
then probed one at a time: all but one are held back from admission, so the probe
runs beside innocent sequences only. A probe whose step succeeds is cleared; a
failed step with a single sequence in it pins the fault on that sequence, which is
finished with finish_reason "error". Everyone else ends with the output they
would have had without the fault.

A fault the engine cannot recover from - the device arrays it donated are gone (the
device failed mid-step), or `max_consecutive` steps in a row failed - raises
`EngineFatal`: the caller must stop serving (health NOT_SERVING, exit non-zero).

This module knows nothing of devices beyond asking the runner whether its state
survived; it holds no JAX arrays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from serving.core.schedule import Schedule
from serving.core.scheduler import Scheduler
from serving.engine.outputs import RequestDelta

log = logging.getLogger(__name__)


class EngineFatal(RuntimeError):
    """The engine cannot go on (device state lost or every step failing); restart the process."""


class FaultIsolator:
    def __init__(self, scheduler: Scheduler, *, state_lost: Callable[[], bool],
                 fail: Callable[[str], RequestDelta | None], max_consecutive: int = 8):
        """`state_lost`: whether the runner's donated device state is gone; `fail`: finish
        a request with finish_reason "error" and return its delta."""
        self.scheduler, self.state_lost, self.fail = scheduler, state_lost, fail
        self.max_consecutive = max_consecutive
        self.suspects: list[str] = []  # in the order they were suspected
        self.consecutive = 0
        self.num_faults = 0  # steps that raised, cumulative
        self.num_failed_requests = 0  # requests finished with "error", cumulative
        self.last_error: str | None = None  # the last failed step's exception, one line

    def succeeded(self, schedule: Schedule) -> None:
        self.consecutive = 0
        if self.suspects:
            ran = {e.seq.request_id for e in schedule.entries}
            self.suspects = [r for r in self.suspects if r not in ran]
            self._hold()

    def failed(self, schedule: Schedule, err: Exception) -> list[RequestDelta]:
        """Roll the step back, pin the fault if it can be, and return deltas of failed requests."""
        self.num_faults += 1
        self.consecutive += 1
        self.last_error = " ".join(f"{type(err).__name__}: {err}".split())
        lost = self.state_lost()
        requeued = self.scheduler.rollback(schedule)
        ids = [s.request_id for s in requeued]
        log.warning("engine step failed (%s: %s); %d sequence(s) rolled back: %s",
                    type(err).__name__, err, len(ids), ids[:8])
        if lost:
            raise EngineFatal(f"device state lost in a failed step: {err}") from err
        if self.consecutive >= self.max_consecutive:
            raise EngineFatal(f"{self.consecutive} engine steps failed in a row; last: {err}") from err
        deltas: list[RequestDelta] = []
        if len(ids) == 1:  # alone in its step: the fault is its own
            delta = self.fail(ids[0])
            self.num_failed_requests += delta is not None
            deltas += [delta] if delta is not None else []
            self.suspects = [r for r in self.suspects if r != ids[0]]
        else:
            self.suspects += [r for r in ids if r not in self.suspects]
        self._hold()
        return deltas

    def _hold(self) -> None:
        """Hold back every live suspect but the first (the probe)."""
        live = [r for r in self.suspects if self.scheduler.get(r) is not None]
        self.suspects = live
        self.scheduler.held = set(live[1:])
