"""The MTP drafter: the model's own multi-token-prediction head drafts k tokens.

After every target step (plain or verification) the engine enqueues the MTP step on
the device (`ModelRunner.mtp_dispatch`, serving/runner/step_fns.py `_mtp_fn`): the head
runs over the step's positions with the target's hidden states and the step's tokens
shifted by one (position p takes x_{p+1}: the next token in the batch, the next prompt
token for a chunk that does not complete its prompt, the step's own sample for the
last token of a sequence that samples: fed on the device, the host never waits), which
writes the head's K/V at those positions; from each sequence's last valid position it
then drafts k tokens greedily (hybrid_jax/mtp_ragged.py `mtp_propose`). After a
verification step the shifted tokens are the step's output row (accepted drafts, then
the token after them) and the last valid position is the last accepted one; positions
after it hold rejected work, overwritten by the next step like the target's K/V.

The drafts stay on the device until the scheduler asks for them (`propose_batch`, at
the next step's scheduling): one transfer per step, and none for steps that end up
plain. Drafts are kept per request with the sequence length they follow; a sequence
whose length differs (nothing drafted for it since) gets no drafts. Drafts are greedy,
a point mass, as the acceptance (serving/spec_decode/speculative.py) assumes.

This module knows nothing of the scheduling policy; it reads schedules and token lists.
"""

from __future__ import annotations

import jax
import numpy as np

from serving.core.schedule import PENDING, Schedule, StepArrays


class MTPDrafter:
    def __init__(self, runner, k: int):
        self.runner, self.k = runner, k
        # request id -> (drafts [b, k] on the device, its row, the sequence length they follow)
        self.drafts: dict[str, tuple[jax.Array, int, int]] = {}

    def sync(self, scheduler) -> None:
        """Forget sequences that stopped running (finished, aborted, preempted)."""
        running = {s.request_id for s in scheduler.running}
        for rid in [r for r in self.drafts if r not in running]:
            del self.drafts[rid]

    def after_step(self, schedule: Schedule, arrays: StepArrays) -> None:
        """Enqueue the MTP step after a plain target step (just dispatched)."""
        cu = arrays.cu_seqlens
        b, t = len(cu) - 1, int(cu[-1])
        tokens = np.empty(t, np.int32)
        tokens[:-1] = arrays.token_ids[1:]
        feed = np.full(t, -1, np.int32)
        ends = cu[1:] - 1
        if schedule.block is not None:  # a pure decode step: every row samples
            seqs, samples = schedule.block.seqs, np.ones(b, bool)
            lengths = arrays.seq_lens + 1
        else:
            entries = schedule.entries
            seqs = [e.seq for e in entries]
            samples = np.fromiter((e.samples for e in entries), bool, count=b)
            lengths = arrays.seq_lens + 1
            for i in np.flatnonzero(~samples).tolist():  # a chunk before the prompt's end
                ids, n = entries[i].seq.token_ids, int(arrays.seq_lens[i])
                tokens[ends[i]] = ids[n] if n < len(ids) else 0
        rows = np.flatnonzero(samples)
        tokens[ends[rows]] = PENDING
        feed[ends[rows]] = rows
        drafts = self.runner.mtp_dispatch(arrays, tokens, feed, ends)
        for i, seq in enumerate(seqs):
            if samples[i]:
                self.drafts[seq.request_id] = (drafts, i, int(lengths[i]))
            else:
                self.drafts.pop(seq.request_id, None)

    def after_verify(self, schedule: Schedule, arrays: StepArrays, out: np.ndarray,
                     accepted: np.ndarray) -> None:
        """Enqueue the MTP step after a verification step: out [b, q] its tokens (accepted
        drafts, then the next token), accepted [b]."""
        cu = arrays.cu_seqlens
        drafts = self.runner.mtp_dispatch(arrays, out.reshape(-1), None, cu[:-1] + accepted)
        for i, e in enumerate(schedule.entries):
            self.drafts[e.seq.request_id] = (drafts, i, e.start + int(accepted[i]) + 2)

    def propose_batch(self, work: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """work: (request id, token ids, drafts wanted) per sequence -> its drafts (greedy)."""
        host: dict[int, np.ndarray] = {}
        out = []
        for rid, tokens, n in work:
            entry = self.drafts.get(rid)
            if n <= 0 or entry is None or entry[2] != len(tokens):
                out.append([])
                continue
            dev, row, _ = entry
            if id(dev) not in host:
                host[id(dev)] = np.asarray(jax.device_get(dev))
            out.append(host[id(dev)][row, :n].tolist())
        return out
