"""The pure decode step as columns: planned, flattened and updated without a Python
object per sequence where numpy can do the work.

Most steps of a busy server are pure decode: every running sequence computes one token,
nobody is admitted, nobody lacks a page. For such a step the scheduler calls `plan`,
which reads each sequence's counters once, tests in numpy which decodes enter a page not
yet held, allocates those pages (in batch order, as the general path would) and builds
the step's arrays (token ids, positions, slots, page-table rows, slot mappings) in
numpy. The Schedule carries the `DecodeBlock`; `flatten` uses its columns as they are,
its `entries` are made only when something reads them (a rollback, a test), and `update`
applies the samples row by row with the tests a decode needs. The general path
(Scheduler._schedule_decodes and the rest) would plan the same entries and pages: the
tests run both in lockstep (tests/serving/test_decode_block.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import numpy as np

from serving.core.block_table import KVGroup
from serving.core.prefix_cache import PrefixCache
from serving.core.schedule import PENDING, Schedule, ScheduledSeq, StepArrays, StepOutput
from serving.core.sequence import FinishReason, Sequence, SequenceStatus, check_stop

RUNNING = SequenceStatus.RUNNING
FINISHED = SequenceStatus.FINISHED


@dataclass(frozen=True, slots=True)
class DecodeBlock:
    """A pure decode step, one row per sequence in batch order. Row i is `entry(i)`: one
    token at position `starts[i]`, sampled.

    page_tables[g] [b, T_g]: copies of the ring rows taken after the step's pages were
    allocated; slot_mappings[g] [b]: where each row's K/V goes (page * s + offset).
    """

    seqs: tuple[Sequence, ...]
    token_ids: np.ndarray  # [b] int32, PENDING where the token is not on the host yet
    starts: np.ndarray  # [b] int32: tokens in cache before the step
    slots: np.ndarray  # [b] int32
    out_index: np.ndarray  # [b] int32: output tokens preceding the one sampled
    page_tables: tuple[np.ndarray, ...]
    slot_mappings: tuple[np.ndarray, ...]

    def __len__(self) -> int:
        return len(self.seqs)

    def entry(self, i: int) -> ScheduledSeq:
        return ScheduledSeq(
            seq=self.seqs[i], token_ids=(int(self.token_ids[i]),), start=int(self.starts[i]),
            slot=int(self.slots[i]), ring_rows=tuple(t[i] for t in self.page_tables),
            slot_mappings=tuple((int(m[i]),) for m in self.slot_mappings), samples=True,
            out_index=int(self.out_index[i]))

    def flatten(self) -> StepArrays:
        """`schedule.flatten` of this step: the columns are the arrays (one token per row)."""
        b, i32 = len(self), np.int32
        cu = np.arange(b + 1, dtype=i32)
        return StepArrays(
            token_ids=self.token_ids, positions=self.starts, cu_seqlens=cu, query_lens=np.ones(b, i32),
            seq_lens=self.starts + 1, slot_ids=self.slots, has_initial=self.starts > 0,
            page_tables=self.page_tables, slot_mappings=self.slot_mappings,
            sample_mask=np.ones(b, bool), logits_indices=cu[:-1], num_decodes=b)

    def schedule(self, groups: tuple[KVGroup, ...], page_size: int) -> Schedule:
        return Schedule(BlockEntries(self), len(self), tuple(g.name for g in groups),
                        tuple(g.width for g in groups), page_size, block=self)


class BlockEntries(SequenceABC):
    """A DecodeBlock's rows as ScheduledSeq entries, made on first use."""

    __slots__ = ("block", "_made")

    def __init__(self, block: DecodeBlock) -> None:
        self.block = block
        self._made: tuple[ScheduledSeq, ...] | None = None

    def _entries(self) -> tuple[ScheduledSeq, ...]:
        if self._made is None:
            self._made = tuple(self.block.entry(i) for i in range(len(self.block)))
        return self._made

    def __len__(self) -> int:
        return len(self.block)

    def __getitem__(self, i):
        return self._entries()[i]

    def __iter__(self):
        return iter(self._entries())


def plan(running: list[Sequence], groups: tuple[KVGroup, ...], page_size: int) -> DecodeBlock | None:
    """The step as a DecodeBlock, when every running sequence has one token left to compute
    (or is exhausted) and every group has a free page for each decode entering a new page;
    the caller has checked that nothing waiting can be admitted. Commits the step (pages,
    computed and pending counts). Else None, with nothing changed: the general path plans
    the step (it may preempt)."""
    seqs, ns, toks, outs = [], [], [], []
    for seq in running:
        n, ids, pending = seq.num_computed_tokens, seq.token_ids, seq.num_pending
        known = len(ids)
        if seq.status is not RUNNING or known + pending - n != 1:
            return None  # a prefill chunk to plan
        out = known - seq.num_prompt_tokens + pending
        if pending and out >= seq.params.max_tokens:
            continue  # is_exhausted: nothing to schedule
        seqs.append(seq)
        ns.append(n)
        toks.append(ids[n] if n < known else PENDING)
        outs.append(out)
    if not seqs:
        return None
    b, s = len(seqs), page_size
    n = np.array(ns, np.int32)
    page = n // s
    need = []
    for g, group in enumerate(groups):
        first = np.fromiter((q.rings[g].first for q in seqs), np.int32, b)
        held = np.fromiter((len(q.rings[g].pages) for q in seqs), np.int32, b)
        need.append((page < first) | (page >= first + held))  # its page is not held
        if int(need[-1].sum()) > group.cache.num_free:
            return None  # someone is preempted: the general path chooses whom
    if need:
        for i in np.flatnonzero(np.logical_or.reduce(need)).tolist():  # in order, as _commit
            for group, ring in zip(groups, seqs[i].rings, strict=True):
                group.allocate(ring, ns[i], 1)
    rows = np.arange(b)
    tables = tuple(np.stack([q.rings[g].row for q in seqs]) for g in range(len(groups)))
    maps = tuple(t[rows, page % t.shape[1]] * s + n % s for t in tables)
    for seq in seqs:
        seq.num_computed_tokens += 1
        seq.num_pending += 1
    return DecodeBlock(
        seqs=tuple(seqs), token_ids=np.array(toks, np.int32), starts=n,
        slots=np.fromiter((q.slot for q in seqs), np.int32, b), out_index=np.array(outs, np.int32),
        page_tables=tables, slot_mappings=maps)


def update(block: DecodeBlock, tokens: SequenceABC[int], *, page_size: int,
           prefix: PrefixCache | None, eos_token_ids: Collection[int],
           release_window: Callable[[Sequence], None],
           finish: Callable[[Sequence, FinishReason], None]) -> list[StepOutput]:
    """`Scheduler.update` of a pure decode step, row by row as the general loop goes, with
    its tests reduced to a decode's. `release_window` and `finish`: the scheduler's."""
    # Prefix caching keys a decode's page when its token completes the page (prefix.commit).
    commit = (set(np.flatnonzero((block.starts + 1) % page_size == 0).tolist())
              if prefix is not None else ())
    outputs = []
    for i, (seq, token) in enumerate(zip(block.seqs, tokens, strict=True)):
        if i in commit:
            prefix.commit(block.entry(i))
        status = seq.status
        if status is FINISHED:
            continue  # aborted or stopped since: a late step's sample is dropped
        if status is RUNNING:
            release_window(seq)
        token = int(token)
        seq.num_pending -= 1
        ids = seq.token_ids
        ids.append(token)
        reason = None
        if token in seq.stop_ids or len(ids) - seq.num_prompt_tokens >= seq.params.max_tokens:
            reason = check_stop(seq, eos_token_ids)
            if reason is not None:
                finish(seq, reason)
        outputs.append(StepOutput(seq, [token], reason is not None))
    return outputs
