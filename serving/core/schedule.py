"""The Schedule: what one engine step computes, as plain host data, and its flattening.

`Scheduler.schedule()` returns a `Schedule`; the runner turns it into device
arrays with `flatten` (numpy only), pads them to a shape bucket and calls the
jitted step; `Scheduler.update()` takes the sampled tokens back. This module
knows nothing of scheduling policy, tokenization or devices.

Batch order: the first `num_decodes` entries are decodes (one token, start > 0,
sampled); prefill chunks follow, partially-prefilled sequences before newly
admitted ones. Letters follow docs/shapes.md: b sequences, t tokens, s page
size, T a group's ring width.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from itertools import chain
from typing import NamedTuple, Protocol

import numpy as np

from serving.core.sequence import Sequence

PENDING = -1  # a token id not known on the host yet: fed on device from the last step's samples


class Block(Protocol):
    """What a step needs of a pure decode step's columns (`decode_block.DecodeBlock`,
    which builds on this module: named here as a protocol so the import goes one way)."""

    seqs: tuple[Sequence, ...]
    out_index: np.ndarray  # [b] int32: output tokens preceding the one sampled

    def __len__(self) -> int: ...

    def flatten(self) -> StepArrays: ...


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens [start, start + c) of `seq.token_ids`.

    slot: its recurrent-state slot (never 0).
    ring_rows[g]: group g's page-table row, int32 [T_g], logical page i at
      column i % T_g, dummy page 0 in unused columns; a copy taken after this
      step's pages were allocated (pages that leave the window are freed in `update`).
    slot_mappings[g]: len c, where each new token's K/V goes in group g:
      page * s + offset, an index into the flattened `[num_pages * s]` axis.
    samples: a token is sampled after this step (a decode, or the chunk that
      completes the prompt / the recompute after a preemption).
    token_ids holds PENDING (-1) for a token sampled by the step still in flight
      (the overlapped loop); the runner feeds its value on the device.
    Treat an entry as immutable: it is not a frozen dataclass only because a frozen
    one's __init__ costs ~2 us per entry (one per running sequence per step).
    """

    seq: Sequence
    token_ids: tuple[int, ...]
    start: int
    slot: int
    ring_rows: tuple[np.ndarray, ...]
    slot_mappings: tuple[tuple[int, ...], ...]
    samples: bool
    out_index: int = 0  # when sampling: how many output tokens precede the one sampled here
    # Prefix caching. restore >= 0: a cache hit, resumed at `start` from checkpoint
    # `restore` (0 when the model has no recurrent state), copied into `slot` before the
    # forward; the slot's penalty statistics restart. save > 0: after the forward the
    # slot's state (position start + c) is copied into checkpoint `save`.
    restore: int = -1
    save: int = 0
    # Speculative decoding: >= 0 for a verification entry, whose token_ids are the last
    # sampled token then `num_drafts` drafted tokens, padded to the step's q tokens.
    num_drafts: int = -1

    @property
    def num_tokens(self) -> int:
        """c, the tokens computed for this sequence in this step."""
        return len(self.token_ids)

    @property
    def is_first_chunk(self) -> bool:
        """True when the slot's state must start from zero (no initial state)."""
        return self.start == 0


@dataclass(frozen=True, slots=True)
class Schedule:
    """Everything one step computes, in batch order (decodes first, then prefill chunks).

    preempted: sequences preempted (pages and slot freed, requeued) while this
      schedule was built; informational, they are not in `entries`.
    """

    entries: SequenceABC[ScheduledSeq]
    num_decodes: int
    group_names: tuple[str, ...]
    ring_widths: tuple[int, ...]
    page_size: int
    preempted: tuple[Sequence, ...] = ()
    spec_q: int = 0  # > 0: a verification step, every entry a decode of spec_q tokens
    # A pure decode step's columns (serving/core/decode_block.py; `entries` then makes its
    # entries when first read), else None.
    block: Block | None = None

    @property
    def is_verify(self) -> bool:
        return self.spec_q > 0

    @property
    def num_seqs(self) -> int:
        return len(self.entries)

    @property
    def seqs(self) -> SequenceABC[Sequence]:
        """The sequences in batch order (a decode block's without making its entries)."""
        if self.block is not None:
            return self.block.seqs
        return [e.seq for e in self.entries]

    @property
    def num_tokens(self) -> int:
        if self.block is not None:
            return len(self.block)
        return sum(e.num_tokens for e in self.entries)

    @property
    def is_empty(self) -> bool:
        return not self.entries


class StepOutput(NamedTuple):
    """What one step produced for one sequence that sampled."""

    seq: Sequence
    new_token_ids: list[int]
    finished: bool


@dataclass(frozen=True, slots=True)
class StepArrays:
    """A Schedule as flat numpy arrays (int32 / bool), unpadded. b = num_seqs, t = num_tokens.

    token_ids [t], positions [t]: the ragged token axis, sequences back to back.
    cu_seqlens [b+1]: query offsets; sequence i owns tokens cu[i]:cu[i+1].
    query_lens [b] (c) and seq_lens [b] (start + c: tokens in cache after the step).
    slot_ids [b]: state slots; has_initial [b]: False for a first chunk (start
      from zero state), True when the slot holds the state after `start` tokens.
    page_tables[g] [b, T_g]: ring rows; slot_mappings[g] [t]: K/V write indices.
    sample_mask [b]: a token is sampled for this sequence.
    logits_indices [b]: cu_seqlens[1:] - 1, each sequence's last token.
    num_decodes: entries [0, num_decodes) are single-token decodes.

    Padding is the runner's: padded tokens go past cu_seqlens[b] (the
    pallas_kernels/ragged.py convention) with slot mapping indices inside the
    dummy page 0 ([0, s)); padded sequences repeat cu_seqlens[-1] (zero
    length) and use slot 0, page-table rows of 0 and sample_mask False.
    """

    token_ids: np.ndarray
    positions: np.ndarray
    cu_seqlens: np.ndarray
    query_lens: np.ndarray
    seq_lens: np.ndarray
    slot_ids: np.ndarray
    has_initial: np.ndarray
    page_tables: tuple[np.ndarray, ...]
    slot_mappings: tuple[np.ndarray, ...]
    sample_mask: np.ndarray
    logits_indices: np.ndarray
    num_decodes: int
    # Checkpoint copies (prefix caching): restore_ckpt[i] -> slot restore_slot[i] before
    # the forward, slot save_slot[i] -> save_ckpt[i] after it.
    restore_ckpt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    restore_slot: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    save_slot: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    save_ckpt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


def flatten(schedule: Schedule) -> StepArrays:
    """Concatenate a Schedule's entries into the arrays a runner pads and transfers."""
    if schedule.block is not None:
        return schedule.block.flatten()
    entries = schedule.entries
    i32 = np.int32
    query_lens = np.fromiter((e.num_tokens for e in entries), dtype=i32, count=len(entries))
    starts = np.fromiter((e.start for e in entries), dtype=i32, count=len(entries))
    cu_seqlens = np.zeros(len(entries) + 1, dtype=i32)
    np.cumsum(query_lens, out=cu_seqlens[1:])
    t = int(cu_seqlens[-1])
    # chain.from_iterable walks the entries' tuples in C (a generator per token cost ~1 ms
    # per 8192-token chunk on the development CPU).
    token_ids = np.fromiter(chain.from_iterable(e.token_ids for e in entries), dtype=i32, count=t)
    # positions: start_i + (0 .. c_i - 1) for each sequence, without a Python loop per token.
    positions = np.arange(t, dtype=i32) - np.repeat(cu_seqlens[:-1] - starts, query_lens)
    num_groups = len(schedule.group_names)
    page_tables = tuple(
        np.stack([e.ring_rows[g] for e in entries]).astype(i32, copy=False)
        if entries
        else np.zeros((0, schedule.ring_widths[g]), dtype=i32)
        for g in range(num_groups)
    )
    slot_mappings = tuple(
        np.fromiter(chain.from_iterable(e.slot_mappings[g] for e in entries), dtype=i32, count=t)
        for g in range(num_groups)
    )
    return StepArrays(
        token_ids=token_ids,
        positions=positions.astype(i32),
        cu_seqlens=cu_seqlens,
        query_lens=query_lens,
        seq_lens=starts + query_lens,
        slot_ids=np.fromiter((e.slot for e in entries), dtype=i32, count=len(entries)),
        has_initial=np.fromiter((e.start > 0 for e in entries), dtype=bool, count=len(entries)),
        page_tables=page_tables,
        slot_mappings=slot_mappings,
        sample_mask=np.fromiter((e.samples for e in entries), dtype=bool, count=len(entries)),
        logits_indices=(cu_seqlens[1:] - 1).astype(i32),
        num_decodes=schedule.num_decodes,
        restore_ckpt=np.array([e.restore for e in entries if e.restore >= 0], dtype=i32),
        restore_slot=np.array([e.slot for e in entries if e.restore >= 0], dtype=i32),
        save_slot=np.array([e.slot for e in entries if e.save], dtype=i32),
        save_ckpt=np.array([e.save for e in entries if e.save], dtype=i32),
    )
