"""Continuous-batching scheduler: who runs in the next step, with which pages and slot.

Policy (FCFS by arrival):
  1. decodes: every running sequence with one token left to compute gets it;
     when a decode's pages cannot be had, the NEWEST running sequence not yet
     in this step is preempted by recompute (its pages and slot are freed and
     it goes back to the waiting queue in arrival order, so normally at its
     front; the victim may be the decode itself);
  2. chunked prefill of running, partially prefilled sequences (oldest first),
     preempting newer unscheduled sequences only if not even one token fits;
  3. admission of waiting sequences (FCFS, stopping at the first that does not
     fit; none at all in a step that preempted): a free slot, fewer than
     max_num_seqs running, token budget left, and pages for its chunk; while
     sequences run, only in a step `admission_interval_steps` or more steps after the
     last admission or when `admission_batch` or more wait (SchedulerConfig).
A chunk is min(tokens left, max_prefill_chunk, budget left, what the free pages
hold). The oldest running sequence is never preempted for a newer one, and a
sequence alone always fits (SchedulerConfig checks it), so every step makes
progress.

The scheduler knows nothing of tokenization, text, devices or the model: it
moves ints between pools and sequences. Stop strings are the engine's (it
calls `finish`). Not thread-safe: call it from the engine loop only.

Overlap: at most two schedules may await `update` (the overlapped loop dispatches
step N+1 before step N's tokens reach the host). A schedule commits its work at
once (tokens computed, pages allocated); a token it samples is PENDING until its
`update` (`Sequence.num_pending`), and the next step's decode of that sequence
carries a PENDING placeholder that the runner fills on the device. Sequences
whose pending tokens reach max_tokens are not scheduled again; a stop (EOS, stop
id, stop string) seen one step late discards the extra step's sample. Freed pages
and slots are only reused by steps dispatched later, which the device runs after
the in-flight ones, so an early free never corrupts a running step.

Speculative decoding (`schedule(spec)`): when at most `spec.max_seqs` sequences run, every
one decodes, may verify and has the pages for q = k + 1 tokens, nothing waiting can be
admitted and nothing is in flight, the step is a verification step. Which sequences may
verify, their entries, and what `update` keeps of them: serving/core/verify_step.py.

Prefix caching (`config.prefix_caching`, serving/core/prefix_cache.py): a sequence admitted
with nothing computed starts at the longest cached prefix where every layer group can
resume (shared pages, a state checkpoint restored into its slot in its first step);
prefill chunks of models with recurrent state end at checkpoint positions (multiples
of the stride, the last page boundary of the known tokens), whose state the step copies
into the checkpoint pool. Pages and checkpoints are keyed when the step that computed
them is resolved in `update`, never earlier, so nothing in flight is matched.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from serving.core import decode_block, verify_step
from serving.core.block_table import KVGroup
from serving.core.decode_block import DecodeBlock
from serving.core.pools import DUMMY_INDEX, SlotPool
from serving.core.prefix_cache import PrefixCache
from serving.core.schedule import PENDING, Schedule, ScheduledSeq, StepOutput
from serving.core.scheduler_config import SchedulerConfig
from serving.core.sequence import FinishReason, Sequence, SequenceStatus, check_stop
from serving.core.verify_step import SpecPlan

RUNNING = SequenceStatus.RUNNING
FINISHED = SequenceStatus.FINISHED


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Pool usage for metrics. Totals exclude the dummy index 0."""

    num_waiting: int
    num_running: int
    slots_in_use: int
    slots_total: int
    pages_in_use: dict[str, int]
    pages_total: dict[str, int]
    num_preemptions: int
    pages_cached: dict[str, int] = field(default_factory=dict)  # idle, keyed (prefix caching)
    prefix: dict[str, object] = field(default_factory=dict)  # PrefixCache.stats(), if on


@dataclass
class _Step:
    """The schedule under construction."""

    budget: int
    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)
    preempted: list[Sequence] = field(default_factory=list)
    restores: int = 0  # checkpoint copies into slots (prefix-cache hits)
    saves: int = 0  # checkpoint copies out of slots

    def add(self, entry: ScheduledSeq, *, decode: bool) -> None:
        (self.decodes if decode else self.prefills).append(entry)
        self.scheduled.add(entry.seq.request_id)
        self.budget -= entry.num_tokens


class Scheduler:
    """Owns the waiting/running queues, the slot pool and one page pool per group."""

    def __init__(self, config: SchedulerConfig, eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.groups = tuple(
            KVGroup(g.name, g.window, g.num_pages, config.page_size,
                    config.max_prefill_chunk, config.max_model_len)
            for g in config.groups
        )  # fmt: skip
        # (index, group) of each sliding-window group: global groups never release a page.
        self._windowed = tuple((i, g, g.window - 1) for i, g in enumerate(self.groups)
                               if g.window is not None)
        self.slots = SlotPool(config.num_slots)
        # Limits in force (`set_limits`): the config's, or lower ones while the engine's
        # larger executables are still compiling (serving/engine/llm_engine.py).
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        # Steps since the last admission (config.admission_interval_steps: each mixed step
        # costs the running decodes a fixed ~3 ms on a GPU, so close arrivals may share one).
        self._since_admit = 0
        self.prefix = (PrefixCache(self.groups, config.page_size, config.prefix_state_stride,
                                   config.num_checkpoints) if config.prefix_caching else None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival: the last is the newest
        self.num_preemptions = 0
        self._live: dict[str, Sequence] = {}  # unfinished sequences by request id
        self._arrivals = itertools.count()
        self._inflight: deque[Schedule] = deque()  # schedules awaiting update(), oldest first
        # Waiting sequences not to admit for now (the engine isolates a suspected fault).
        self.held: set[str] = set()

    # -- requests -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. ValueError if it could never be served or its id is live."""
        if seq.request_id in self._live:
            raise ValueError(f"request_id={seq.request_id!r} is already queued or running")
        if seq.status is not SequenceStatus.WAITING or seq.arrival >= 0:
            raise ValueError(f"request {seq.request_id!r}: only a new sequence can be added")
        total = seq.num_tokens + seq.params.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"request {seq.request_id!r}: prompt ({seq.num_tokens} tokens) + "
                f"max_tokens ({seq.params.max_tokens}) = {total} exceeds "
                f"max_model_len={self.config.max_model_len}"
            )
        seq.arrival = next(self._arrivals)
        # Ids that may stop it (update's fast path skips check_stop for any other token).
        eos = () if seq.params.ignore_eos else self.eos_token_ids
        seq.stop_ids = frozenset((*eos, *seq.params.stop_token_ids))
        seq.rings = tuple(g.new_ring() for g in self.groups)
        self.waiting.append(seq)
        self._live[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a live request as ABORT, freeing its pages and slot now. None if not live."""
        seq = self._live.get(request_id)
        if seq is not None:
            self._finish(seq, FinishReason.ABORT)
        return seq

    def finish(
        self,
        seq: Sequence,
        reason: FinishReason = FinishReason.STOP,
        stop_reason: int | str | None = None,
    ) -> None:
        """Finish `seq` now (e.g. the engine matched a stop string); frees its pages and slot.

        A sequence that is already finished is left as it is.
        """
        if seq.is_finished:
            return
        seq.stop_reason = stop_reason
        self._finish(seq, reason)

    def get(self, request_id: str) -> Sequence | None:
        return self._live.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def set_limits(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        """Lower (or restore, with None) the running-sequence and per-step token limits, within
        the config's. Only admission and the step's budget see them: a lower sequence limit
        admits nobody until the running count falls under it (nothing is preempted), and a
        chunk is cut by the budget as under load, so outputs do not depend on them."""
        c = self.config
        seqs = c.max_num_seqs if max_num_seqs is None else max_num_seqs
        tokens = c.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
        if not (1 <= seqs <= c.max_num_seqs and seqs <= tokens <= c.max_num_batched_tokens):
            raise ValueError(f"limits max_num_seqs={seqs}, max_num_batched_tokens={tokens} outside "
                             f"1 <= seqs <= {c.max_num_seqs}, seqs <= tokens <= {c.max_num_batched_tokens}")
        self.max_num_seqs, self.max_num_batched_tokens = seqs, tokens

    # -- one step -------------------------------------------------------------

    def schedule(self, spec: SpecPlan | None = None) -> Schedule:
        """Choose the next step's work and allocate its pages (see the module docstring).

        With `spec`, the step is a verification step when the conditions hold.
        """
        if len(self._inflight) >= 2:
            raise RuntimeError("schedule() called with two Schedules still awaiting update()")
        step = _Step(budget=self.max_num_batched_tokens)
        self._since_admit += 1
        # Pages that left every window since the last update: a sequence admitted in the
        # step still in flight has had no update yet, and its next chunk must fit its ring.
        for seq in self.running:
            self._release_window(seq)
        q = 0
        if spec is not None and self._can_verify(spec):
            entries = verify_step.plan(spec, self.running, self.groups)
            if entries:  # else the plain decode step: nothing to verify
                q = spec.q
                for entry in entries:
                    step.add(entry, decode=True)
        if not q:
            block = self._decode_block()
            if block is not None:  # the common step, planned over columns
                schedule = block.schedule(self.groups, self.config.page_size)
                self._inflight.append(schedule)
                return schedule
            self._schedule_decodes(step)
            self._schedule_partial_prefills(step)
            if not step.preempted:  # pages are short: let the preempted go first next step
                self._admit_waiting(step)
        schedule = Schedule(
            entries=tuple(step.decodes + step.prefills),
            num_decodes=len(step.decodes),
            group_names=tuple(g.name for g in self.groups),
            ring_widths=tuple(g.width for g in self.groups),
            page_size=self.config.page_size,
            preempted=tuple(step.preempted),
            spec_q=q,
        )
        if not schedule.is_empty:
            self._inflight.append(schedule)
        return schedule

    def update(self, schedule: Schedule, sampled_token_ids: SequenceABC[int]) -> list[StepOutput]:
        """Record a finished step: advance caches, free out-of-window pages, append samples.

        `sampled_token_ids[i]` is the token sampled for `schedule.entries[i]`
        (ignored where `samples` is False). Entries whose sequence finished
        or was aborted since `schedule()` are skipped. Returns one StepOutput per
        sequence that sampled; finished ones have already released everything.
        """
        if len(sampled_token_ids) != len(schedule.entries):
            raise ValueError(
                f"{len(sampled_token_ids)=} must equal the number of entries ({len(schedule.entries)})"
            )
        if schedule.is_empty:
            return []
        if not self._inflight or schedule is not self._inflight[0]:
            raise RuntimeError("update() needs the oldest Schedule that awaits it")
        self._inflight.popleft()
        if schedule.block is not None:
            return decode_block.update(schedule.block, sampled_token_ids, page_size=self.config.page_size,
                                       prefix=self.prefix, eos_token_ids=self.eos_token_ids,
                                       release_window=self._release_window, finish=self._finish)
        outputs: list[StepOutput] = []
        for entry, token in zip(schedule.entries, sampled_token_ids, strict=True):
            seq = entry.seq
            if entry.num_drafts >= 0:
                out = verify_step.update(entry, [int(t) for t in token], groups=self.groups,
                                         prefix=self.prefix, eos_token_ids=self.eos_token_ids,
                                         finish=self._finish)
                if out is not None:
                    outputs.append(out)
                continue
            if self.prefix is not None:  # the step ran: its pages and checkpoint are real
                self.prefix.commit(entry)
            status = seq.status
            if status is FINISHED:
                continue  # aborted or stopped since: a late step's sample is dropped
            if status is RUNNING:
                self._release_window(seq)
            if not entry.samples:
                continue
            # A running or requeued (preempted, rolled back) sequence keeps its sample.
            token = int(token)
            seq.num_pending -= 1
            ids = seq.token_ids
            ids.append(token)
            # check_stop's answer without calling it when the token stops nothing and
            # max_tokens is not reached (the common case: host time per sequence per step).
            if token in seq.stop_ids or len(ids) - seq.num_prompt_tokens >= seq.params.max_tokens:
                reason = check_stop(seq, self.eos_token_ids)
                if reason is not None:
                    self._finish(seq, reason)
            else:
                reason = None
            outputs.append(StepOutput(seq, [token], reason is not None))
        return outputs

    def verify_ready(self, spec: SpecPlan) -> bool:
        """Whether a verification step could run once the steps in flight are resolved:
        what the engine asks before waiting for them (multi-step decoding)."""
        return self._can_verify(spec, drained=False)

    def _can_verify(self, spec: SpecPlan, drained: bool = True) -> bool:
        """Whether this step may verify: see the module docstring. `drained` False: as if
        the steps in flight were resolved (their tokens pending now)."""
        if not self.running or len(self.running) > spec.max_seqs or (self._inflight and drained):
            return False
        if self.waiting and self._can_admit() and any(s.request_id not in self.held and not s.num_pending
                                                      for s in self.waiting):
            return False
        return verify_step.fits(spec, self.running, self.groups, self.config.max_model_len, drained=drained)

    def rollback(self, schedule: Schedule) -> list[Sequence]:
        """Undo a step that failed: its sequences go back to waiting, to be recomputed.

        Every still-running sequence of `schedule` releases its pages and slot and
        returns to the waiting queue with nothing computed (as a preemption by
        recompute does, which keeps its output identical), so pools and queues are
        exactly as consistent as after any step. Not counted as a preemption.
        Returns the sequences requeued.
        """
        if not self._inflight or schedule is not self._inflight[-1]:
            raise RuntimeError("rollback() needs the Schedule returned by the last schedule()")
        self._inflight.pop()
        requeued = []
        for entry in schedule.entries:
            seq = entry.seq
            if self.prefix is not None:
                self.prefix.rollback(entry)
            if entry.samples and not seq.is_finished:
                seq.num_pending -= 1
            if seq.status is RUNNING:
                self._requeue(seq)
                requeued.append(seq)
        return requeued

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            slots_in_use=self.slots.num_used,
            slots_total=self.slots.capacity,
            pages_in_use={g.name: g.cache.num_held for g in self.groups},
            pages_total={g.name: g.pool.capacity for g in self.groups},
            num_preemptions=self.num_preemptions,
            pages_cached={g.name: len(g.cache.idle) for g in self.groups},
            prefix=self.prefix.stats() if self.prefix is not None else {},
        )

    # -- internals ------------------------------------------------------------

    def _decode_block(self) -> DecodeBlock | None:
        """The step planned over columns (serving/core/decode_block.py) when it is pure decode
        and nothing waiting can be admitted; else None and the general path plans it."""
        if not self.running or self._can_admit():
            return None
        return decode_block.plan(self.running, self.groups, self.config.page_size)

    def _schedule_decodes(self, step: _Step) -> None:
        """One token for every running sequence that has one left, oldest first.

        Per sequence this is the host's hottest loop (every running sequence, every
        step): the tests of `num_uncomputed_tokens` and `is_exhausted` are spelled out.
        """
        for seq in list(self.running):
            if seq.status is not RUNNING:
                continue
            n, known, pending = seq.num_computed_tokens, len(seq.token_ids), seq.num_pending
            if known + pending - n != 1:  # num_uncomputed_tokens
                continue
            if pending and known - seq.num_prompt_tokens + pending >= seq.params.max_tokens:
                continue  # is_exhausted
            entry = self._commit_held(seq, n, known, pending)
            if entry is not None:
                step.decodes.append(entry)
                step.scheduled.add(seq.request_id)
                step.budget -= 1
            elif self._make_room(seq, step, may_preempt_self=True):
                step.add(self._commit(seq, 1), decode=True)

    def _commit_held(self, seq: Sequence, n: int, known: int, pending: int) -> ScheduledSeq | None:
        """`_commit(seq, 1)` for a decode whose page every group already holds, else None.

        n, known, pending: the sequence's computed tokens, len(token_ids), num_pending.
        The common decode (15 of 16 tokens with 16-token pages): nothing to allocate or
        preempt, so the host's per-sequence work per step stays a few microseconds.
        """
        s = self.config.page_size
        page, offset = divmod(n, s)
        maps = []
        for ring in seq.rings:
            i = page - ring.first
            if not 0 <= i < len(ring.pages):
                return None
            maps.append((ring.pages[i] * s + offset,))
        samples = n + 1 == known + pending
        entry = ScheduledSeq(
            seq=seq,
            token_ids=(seq.token_ids[n],) if n < known else (PENDING,),
            start=n,
            slot=seq.slot,
            ring_rows=tuple([ring.row.copy() for ring in seq.rings]),
            slot_mappings=tuple(maps),
            samples=samples,
            out_index=known - seq.num_prompt_tokens + pending,
        )
        seq.num_computed_tokens = n + 1
        if samples:
            seq.num_pending = pending + 1
        return entry

    def _release_window(self, seq: Sequence) -> None:
        """`release` the pages that left the window, in the sliding-window groups only,
        testing first whether the ring's first page left it (every running sequence,
        every step: the call is skipped when nothing goes)."""
        n, rings, s = seq.num_computed_tokens, seq.rings, self.config.page_size
        for i, group, w1 in self._windowed:
            if rings[i].first < (n - w1) // s:  # first_needed(n), without its call
                group.release(rings[i], n)

    def _schedule_partial_prefills(self, step: _Step) -> None:
        """Next chunks of running sequences still in their prefill, oldest first."""
        for seq in list(self.running):
            if step.budget == 0:
                return
            if seq.status is not RUNNING or seq.request_id in step.scheduled or seq.is_exhausted:
                continue
            if self._make_room(seq, step, may_preempt_self=False):
                step.add(self._commit(seq, self._chunk(seq, step), step), decode=False)

    def _admit_waiting(self, step: _Step) -> None:
        """Admit waiting sequences in order until one does not fit (strict FCFS).

        Sequences in `held` are passed over (they stay waiting, in order).
        """
        if not self._admission_open():
            return
        i = 0
        while step.budget > 0 and self._has_room() and i < len(self.waiting):
            seq = self.waiting[i]
            if seq.request_id in self.held or seq.num_pending:  # pending: its recompute needs the value
                i += 1
                continue
            hit = self.prefix.match(seq) if self.prefix is not None else None
            if hit is not None and step.restores >= self.config.max_checkpoint_ops:
                return  # this step's checkpoint copies are spent: admit it next step
            if hit is not None:
                self.prefix.attach(seq, hit)
            c = self._chunk(seq, step)
            if c < 1:
                if hit is not None:
                    self.prefix.detach(seq)
                return
            del self.waiting[i]
            self._since_admit = 0
            self._admit(seq)
            if self.prefix is not None:
                self.prefix.count(seq, hit)
                step.restores += hit is not None
            restore = hit.checkpoint if hit is not None else -1
            step.add(self._commit(seq, c, step, restore=restore), decode=False)

    def _chunk(self, seq: Sequence, step: _Step) -> int:
        want = min(seq.num_uncomputed_tokens, self.config.max_prefill_chunk, step.budget)
        if self.prefix is not None and step.saves < self.config.max_checkpoint_ops:
            # End the chunk where a state checkpoint is wanted: the state after the step is it.
            b = self.prefix.boundary(seq, seq.num_computed_tokens)
            if b is not None:
                want = min(want, b - seq.num_computed_tokens)
        return self._fit(seq, want)

    def _can_admit(self) -> bool:
        return self._has_room() and self._admission_open()

    def _has_room(self) -> bool:
        return bool(self.waiting) and len(self.running) < self.max_num_seqs and self.slots.num_free > 0

    def _admission_open(self) -> bool:
        """The admission interval allows admitting in this step (decided once per step:
        a step that admits takes every waiting sequence that fits)."""
        return (self.config.admission_interval_steps <= 1 or not self.running
                or self._since_admit >= self.config.admission_interval_steps
                or len(self.waiting) >= self.config.admission_batch)

    def _fit(self, seq: Sequence, want: int) -> int:
        """Largest chunk <= want whose new pages are free in every group (may be 0)."""
        n = seq.num_computed_tokens
        fits = [g.max_chunk(ring, n) for g, ring in zip(self.groups, seq.rings, strict=True)]
        return max(0, min([want, *fits]))

    def _make_room(self, seq: Sequence, step: _Step, *, may_preempt_self: bool) -> bool:
        """Preempt the newest unscheduled running sequences until one token of `seq` fits.

        False when `seq` cannot run this step (it was preempted itself, or may
        not be and is the newest unscheduled one).
        """
        while self._fit(seq, 1) < 1:
            victim = next((s for s in reversed(self.running) if s.request_id not in step.scheduled), None)
            if victim is None or (victim is seq and not may_preempt_self):
                return False
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _commit(self, seq: Sequence, c: int, step: _Step | None = None, *,
                restore: int = -1) -> ScheduledSeq:
        """Allocate the pages for tokens [n, n + c) of `seq` and describe the work.

        With `step` (a prefill chunk) a checkpoint is saved when the chunk ends where one
        is wanted and the step has a copy left.
        """
        assert c >= 1 and seq.status is RUNNING, (c, seq)
        n = seq.num_computed_tokens
        pairs = tuple(zip(self.groups, seq.rings, strict=True))
        for group, ring in pairs:
            group.allocate(ring, n, c)
        known = seq.token_ids[n : n + c]
        samples = n + c == seq.num_tokens + seq.num_pending
        save = 0
        if (step is not None and self.prefix is not None and step.saves < self.config.max_checkpoint_ops
                and self.prefix.boundary(seq, n) == n + c):
            save = self.prefix.ckpts.reserve() or 0
            step.saves += save > 0
        entry = ScheduledSeq(
            seq=seq,
            token_ids=(*known, *([PENDING] * (c - len(known)))),
            start=n,
            slot=seq.slot,
            ring_rows=tuple(g.row(r) for g, r in pairs),
            slot_mappings=tuple(tuple(g.slot_mapping(r, n, c)) for g, r in pairs),
            samples=samples,
            out_index=seq.num_output_tokens + seq.num_pending,
            restore=restore,
            save=save,
        )
        seq.num_computed_tokens += c  # committed now: the next schedule builds on it
        if samples:
            seq.num_pending += 1
        return entry

    def _admit(self, seq: Sequence) -> None:
        seq.slot = self.slots.allocate()
        seq.status = RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)

    def _release(self, seq: Sequence) -> None:
        """Give back the pages and slot of a running sequence and take it off `running`."""
        for group, ring in zip(self.groups, seq.rings, strict=True):
            group.free(ring)
        self.slots.free(seq.slot)
        seq.slot = DUMMY_INDEX
        self.running.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        # Back in arrival order: ahead of every request that arrived after it
        # (normally the front of the queue).
        bisect.insort(self.waiting, seq, key=lambda s: s.arrival)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is RUNNING:
            self._release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.held.discard(seq.request_id)
        del self._live[seq.request_id]
