"""The verification step's bookkeeping: which sequences may verify, their entries, and
what `update` keeps of each.

Speculative decoding (`Scheduler.schedule(spec)`, serving/spec_decode/speculative.py): when
every running sequence decodes, is eligible, nothing waiting can be admitted, at most
`spec.max_seqs` run and the pages for q = k + 1 tokens of each are free, the step is a
verification step (unless nothing at all was proposed: then the plain decode step runs):
each sequence computes its last token plus up to k drafts (`num_drafts`), and `update`
takes the accepted drafts and the next token (a list per entry), rewinding
`num_computed_tokens` to the last accepted position. K/V written for rejected drafts stay
in held pages and are overwritten later. Otherwise the step is planned as usual.
Verification needs the synchronous loop (no schedule in flight). Multi-step decoding
(serving/engine/llm_engine.py) rides on the same steps, with drafts of padding.

The scheduler keeps the queue-level conditions (nothing in flight, nothing to admit);
this module holds the per-sequence ones, plans the entries and resolves them. Like the
scheduler it moves ints between pools and sequences and knows nothing of devices.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import NamedTuple

from serving.core.block_table import KVGroup
from serving.core.prefix_cache import PrefixCache
from serving.core.schedule import ScheduledSeq, StepOutput
from serving.core.sequence import FinishReason, Sequence, SequenceStatus, check_stop

RUNNING = SequenceStatus.RUNNING


class SpecPlan(NamedTuple):
    """What the engine offers for a verification step (see the module docstring)."""

    q: int  # tokens per sequence: 1 + k
    max_seqs: int  # speculate only while at most this many sequences run
    eligible: Callable[[Sequence], bool]  # the sequence may be verified (its sampling allows it)
    # (sequence, n) pairs -> up to n drafts following each sequence's token_ids
    propose: Callable[[list[tuple[Sequence, int]]], list[list[int]]]


def fits(spec: SpecPlan, running: list[Sequence], groups: tuple[KVGroup, ...], max_model_len: int,
         *, drained: bool) -> bool:
    """Every running sequence may verify q tokens and every group has the pages for all of
    them. `drained` False: as if the steps in flight were resolved (their tokens pending now)."""
    need = [0] * len(groups)
    for seq in running:
        n = seq.num_computed_tokens
        if (seq.status is not RUNNING or seq.num_uncomputed_tokens != 1
                or (seq.num_pending and drained)
                or n + spec.q > max_model_len or not spec.eligible(seq)):
            return False
        for i, (g, ring) in enumerate(zip(groups, seq.rings, strict=True)):
            need[i] += g.pages_needed(ring, n, spec.q)
    return all(k <= g.cache.num_free for k, g in zip(need, groups, strict=True))


def plan(spec: SpecPlan, running: list[Sequence], groups: tuple[KVGroup, ...]) -> list[ScheduledSeq]:
    """The step's entries, one per running sequence in order, with their pages allocated;
    [] (nothing committed) when no sequence got a draft: the plain decode step runs."""
    work = [(seq, max(0, min(spec.q - 1, seq.params.max_tokens - seq.num_output_tokens - 1)))
            for seq in running]
    drafts = [d[:n] for (_, n), d in zip(work, spec.propose(work), strict=True)]
    if not any(drafts):
        return []
    return [commit(seq, spec.q, d, groups) for (seq, _), d in zip(work, drafts, strict=True)]


def commit(seq: Sequence, q: int, drafts: list[int], groups: tuple[KVGroup, ...]) -> ScheduledSeq:
    """Pages for q tokens from the last one; tokens: it, the drafts, padding (id 0)."""
    n = seq.num_computed_tokens
    pairs = tuple(zip(groups, seq.rings, strict=True))
    for group, ring in pairs:
        group.allocate(ring, n, q)
    entry = ScheduledSeq(
        seq=seq, token_ids=(seq.token_ids[n], *drafts, *([0] * (q - 1 - len(drafts)))),
        start=n, slot=seq.slot, ring_rows=tuple(g.row(r) for g, r in pairs),
        slot_mappings=tuple(tuple(g.slot_mapping(r, n, q)) for g, r in pairs),
        samples=True, out_index=seq.num_output_tokens, num_drafts=len(drafts))
    seq.num_computed_tokens += 1  # the drafts count once accepted (update)
    seq.num_pending += 1
    return entry


def update(entry: ScheduledSeq, tokens: list[int], *, groups: tuple[KVGroup, ...],
           prefix: PrefixCache | None, eos_token_ids: Collection[int],
           finish: Callable[[Sequence, FinishReason], None]) -> StepOutput | None:
    """A verification entry: `tokens` = accepted drafts then the next token. None when the
    sequence finished since the step was scheduled; `finish` ends one that stops now."""
    seq = entry.seq
    accepted = len(tokens) - 1
    assert 0 <= accepted <= entry.num_drafts, (accepted, entry.num_drafts)
    if seq.is_finished:
        return None
    seq.num_pending -= 1
    new: list[int] = []
    reason = None
    for tok in tokens:
        seq.append_token(tok)
        new.append(tok)
        reason = check_stop(seq, eos_token_ids)
        if reason is not None:
            break
    if seq.status is RUNNING:
        seq.num_computed_tokens += accepted  # the state chosen is the last accepted position's
        if prefix is not None:  # pages computed up to it are real (none hold a rejection)
            prefix.commit(entry, end=entry.start + 1 + accepted)
        for group, ring in zip(groups, seq.rings, strict=True):
            group.release(ring, seq.num_computed_tokens)
    if reason is not None:
        finish(seq, reason)
    return StepOutput(seq, new, reason is not None)
