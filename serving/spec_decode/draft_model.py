"""The draft-model drafter: a smaller model with the same vocabulary proposes k tokens.

The draft model has its own runner (parameters, K/V pages, state slots, compiled
buckets) and its own host bookkeeping, one entry per target sequence it drafted for:
two state slots (`base`: the state after every token the draft has consumed;
`scratch`: the state while drafting) and one page ring per window group. A proposal
for a batch of sequences is:
  1. catch-up: the tokens the draft has not consumed yet (the accepted ones since the
     last proposal, the whole prompt the first time) run through the draft's ragged
     forward on the `base` slots, in chunks; greedy sampling at each sequence's last
     token gives draft 1;
  2. `base` is copied to `scratch` (a state copy of the small model, on the device);
  3. drafts 2..n are k - 1 greedy one-token decode steps on the `scratch` slots.
The last catch-up step and the decode steps are enqueued back to back, each fed the
previous step's samples on the device (the runner's `feed`, as in the overlapped
loop): a proposal waits for the device once, at the end.
So a rejected draft never reaches `base`: the draft is re-synced by feeding the
accepted tokens, and K/V written at drafted positions are overwritten by the next
catch-up, as for the target. Drafts are greedy, i.e. a point mass, which the target's
acceptance (serving/spec_decode/speculative.py) assumes.

This module knows nothing of the target's scheduling beyond request ids and token lists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from hybrid_jax.cache import CacheStacks, states_of, with_states
from hybrid_jax.loading import DTYPES, LoadedModel, load_model
from serving.core.block_table import KVGroup, PageRing, ring_width
from serving.core.pools import SlotPool
from serving.core.schedule import PENDING, Schedule, ScheduledSeq, flatten
from serving.engine.engine_config import EngineConfig, PoolPlan
from serving.runner.runner import ModelRunner
from serving.sample.sampling import SamplingArrays

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    base: int
    scratch: int
    rings: tuple[PageRing, ...]
    consumed: int = 0  # tokens whose K/V and state the draft holds (in `base`)


def _copy_slots(caches: CacheStacks, src, dst) -> CacheStacks:
    """Every recurrent layer's state of slots `src` copied into slots `dst`."""
    return with_states(caches, jax.tree.map(lambda x: x.at[:, dst].set(x[:, src]), states_of(caches)))


class DraftModelDrafter:
    def __init__(self, cfg: EngineConfig, target: LoadedModel, plan: PoolPlan,
                 draft: LoadedModel | None = None, mesh: Mesh | None = None):
        """`draft`: the draft model, if the engine loaded it already (to plan its memory
        with the pools: engine_config.draft_bytes); else loaded here. `mesh`: the target
        runner's (one device: a data-parallel replica's, not always the first)."""
        device = None if mesh is None else mesh.devices.flat[0]
        lm = draft if draft is not None else load_model(cfg.speculative_model, dtype=cfg.dtype,
                                                        device=device)
        self._config_key = cfg.store_key()
        if lm.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"speculative_model={cfg.speculative_model!r}: vocab_size "
                             f"{lm.config.vocab_size} differs from the target's "
                             f"{target.config.vocab_size} (the draft must share the tokenizer)")
        sc = plan.scheduler
        self.k = cfg.num_speculative_tokens
        self.max_seqs = min(cfg.spec_max_seqs, sc.max_num_seqs)
        self.page_size, self.max_len = sc.page_size, sc.max_model_len
        self.chunk, self.budget = sc.max_prefill_chunk, sc.max_num_batched_tokens
        windows = lm.config.windows
        # Every drafted-for sequence may hold a full ring per group (a catch-up chunk or
        # the k drafted positions in flight): enough pages that drafting never waits.
        widths = [ring_width(w, sc.page_size, max(sc.max_prefill_chunk, self.k + 1), sc.max_model_len)
                  for w in windows]
        self.groups = tuple(KVGroup(f"draft{i}", w, n * self.max_seqs + 1, sc.page_size,
                                    max(sc.max_prefill_chunk, self.k + 1), sc.max_model_len)
                            for i, (w, n) in enumerate(zip(windows, widths, strict=True)))
        self.slots = SlotPool(2 * self.max_seqs + 1, name="draft slots")
        self.runner = ModelRunner(
            lm.model, num_pages=tuple(g.pool.capacity + 1 for g in self.groups), page_size=sc.page_size,
            num_slots=2 * self.max_seqs + 1, ring_widths=tuple(g.width for g in self.groups),
            max_num_seqs=self.max_seqs, max_num_batched_tokens=max(self.budget, self.max_seqs),
            # The geometric token ladder whatever the target's: a catch-up step carries about
            # k + 1 tokens per sequence, which a target-sized bucket (e.g. one 512-token
            # chunk) would pad to a prompt chunk's cost.
            seq_sizes=cfg.seq_buckets, token_sizes=None,
            state_dtype=DTYPES[cfg.ssm_state_dtype], mesh=mesh)
        self._copy = jax.jit(_copy_slots, donate_argnums=(0,))
        self.entries: dict[str, _Entry] = {}
        log.info("draft model %s: %d sequences, pages %s", cfg.speculative_model, self.max_seqs,
                 [g.pool.capacity for g in self.groups])

    def compile_all(self) -> None:
        self.runner.compile_all(None, config_key=f"draft of {self._config_key}")

    # -- bookkeeping ---------------------------------------------------------------

    def sync(self, scheduler) -> None:
        """Forget sequences that stopped running (finished, aborted, preempted)."""
        running = {s.request_id for s in scheduler.running}
        for rid in [r for r in self.entries if r not in running]:
            e = self.entries.pop(rid)
            for g, ring in zip(self.groups, e.rings, strict=True):
                g.free(ring)
            self.slots.free(e.base)
            self.slots.free(e.scratch)

    def _entry(self, rid: str) -> _Entry:
        e = self.entries.get(rid)
        if e is None:
            base, scratch = self.slots.allocate_many(2)
            e = self.entries[rid] = _Entry(base, scratch, tuple(g.new_ring() for g in self.groups))
        return e

    def _work(self, e: _Entry, slot: int, tokens: list[int], start: int) -> ScheduledSeq:
        """Pages for tokens [start, start + len) and the entry describing them."""
        c = len(tokens)
        pairs = tuple(zip(self.groups, e.rings, strict=True))
        for g, ring in pairs:
            g.allocate(ring, start, c)
        return ScheduledSeq(seq=None, token_ids=tuple(tokens), start=start, slot=slot,
                            ring_rows=tuple(g.row(r) for g, r in pairs),
                            slot_mappings=tuple(tuple(g.slot_mapping(r, start, c)) for g, r in pairs),
                            samples=True)

    def _dispatch(self, entries: list[ScheduledSeq], decode: bool, feed: np.ndarray | None = None):
        """Enqueue one greedy step of the draft (no wait); PENDING tokens come from `feed`."""
        schedule = Schedule(tuple(entries), len(entries) if decode else 0,
                            tuple(g.name for g in self.groups), tuple(g.width for g in self.groups),
                            self.page_size)
        greedy = SamplingArrays.from_rows([{}] * len(entries))
        return self.runner.dispatch(flatten(schedule), greedy, feed, full=False)

    def _run(self, entries: list[ScheduledSeq], decode: bool) -> list[int]:
        return self.runner.fetch(self._dispatch(entries, decode)).tokens.tolist()

    # -- proposals -----------------------------------------------------------------

    def propose_batch(self, work: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """work: (request id, token ids, drafts wanted) per sequence -> greedy drafts."""
        todo = [(rid, toks, n) for rid, toks, n in work if n > 0]
        out: dict[str, list[int]] = {rid: [] for rid, _, _ in work}
        if not todo:
            return [out[rid] for rid, _, _ in work]
        entries = {rid: self._entry(rid) for rid, _, _ in todo}
        for rid, toks, _ in todo:  # a sequence whose tokens changed under it starts over
            e = entries[rid]
            if e.consumed > len(toks) - 1:
                e.consumed = 0
        # 1. Catch-up chunks on the base slots; draft 1 at each sequence's last token. The
        #    last catch-up step is only enqueued: its samples stay on the device (`fed`).
        pending = {rid: toks for rid, toks, _ in todo}
        fed: tuple[object, dict[str, int]] | None = None
        while pending:
            batch, budget = [], self.budget
            for rid, toks in pending.items():
                e = entries[rid]
                c = min(len(toks) - e.consumed, self.chunk, budget)
                if c < 1 or len(batch) == self.max_seqs:
                    break
                for g, ring in zip(self.groups, e.rings, strict=True):
                    g.release(ring, e.consumed)
                batch.append((rid, self._work(e, e.base, toks[e.consumed:e.consumed + c], e.consumed)))
                budget -= c
            last = len(batch) == len(pending) and all(
                entries[rid].consumed + w.num_tokens == len(pending[rid]) for rid, w in batch)
            if last:
                fed = (self._dispatch([w for _, w in batch], decode=False),
                       {rid: i for i, (rid, _) in enumerate(batch)})
                for rid, w in batch:
                    entries[rid].consumed += w.num_tokens
                pending.clear()
                break
            sampled = self._run([w for _, w in batch], decode=False)
            for (rid, w), tok in zip(batch, sampled, strict=True):
                e = entries[rid]
                e.consumed += w.num_tokens
                if e.consumed == len(pending[rid]):
                    out[rid].append(int(tok))
                    del pending[rid]
        # 2. base -> scratch (enqueued after the catch-up, on the device).
        src = np.array([entries[rid].base for rid, _, _ in todo], np.int32)
        dst = np.array([entries[rid].scratch for rid, _, _ in todo], np.int32)
        self.runner.caches = self._copy(self.runner.caches, src, dst)
        # 3. Drafts 2..n: greedy decode steps on the scratch slots, each fed the previous
        #    step's samples on the device, so the k steps run back to back; one wait at the end.
        rows = fed[1] if fed is not None else {}
        steps = []
        for j in range(1, max(n for _, _, n in todo)):
            live = [(rid, toks) for rid, toks, n in todo if n > j]
            feed = np.array([rows.get(rid, -1) for rid, _ in live], np.int32)
            batch = [self._work(entries[rid], entries[rid].scratch,
                                [PENDING if rid in rows else out[rid][-1]], len(toks) - 1 + j)
                     for rid, toks in live]
            steps.append((self._dispatch(batch, decode=True, feed=feed), [rid for rid, _ in live]))
            rows = {rid: i for i, (rid, _) in enumerate(live)}
        if fed is not None:
            tokens = self.runner.fetch(fed[0]).tokens
            for rid, i in fed[1].items():
                out[rid].append(int(tokens[i]))
        for pending_step, rids in steps:
            tokens = self.runner.fetch(pending_step).tokens
            for i, rid in enumerate(rids):
                out[rid].append(int(tokens[i]))
        return [out[rid] for rid, _, _ in work]
