"""Prefix caching on the host: content-addressed KV pages and recurrent-state checkpoints.

Keys. Page i of a sequence (token positions [i*s, (i+1)*s)) is named by a chain hash
`key_i = blake2b(key_{i-1} || tokens of page i)` (128 bits, so a collision is not a
practical concern), which names the whole prefix [0, (i+1)*s). The same key names the
page in every window group (each group has its own pool and map) and the recurrent
state checkpoint at position (i+1)*s.

Pages (`serving.core.pools.PageCache`, one per window group). Every page held by a sequence has a
reference count; a full page whose step has been resolved gets a key. When its last
holder lets it go, a keyed page is not freed but becomes idle (cached and
unreferenced, kept in LRU order); allocation takes a free page first and otherwise
evicts the least recently idled one. A cache hit takes a reference on idle or shared
pages. Pages before a hit position are full and never written again (a sequence only
writes at positions >= its hit), so sharing is read-only.

Checkpoints (`CheckpointCache`). Indices into the device checkpoint pool (conv + SSM +
RG-LRU states of every layer, one position each). A save reserves an index when its
step is scheduled (a free one, else the least recently used cached one) and keys it
when the step is resolved; a rolled-back step gives it back. No reference counts are
needed: a restore copies the checkpoint into the slot at the start of the step that
was scheduled with it, and an index evicted later is only written by steps that the
device runs after it (and within one step, restores run before saves).

Registration happens when the step that computed a page or a state is resolved
(`Scheduler.update`), so the overlapped loop never matches a page or a checkpoint
still being computed by a step in flight, and a failed step registers nothing.

This module knows nothing of devices or tokens' meaning; `PrefixCache` is the
scheduler's helper (matching, where to end chunks, what to register).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from serving.core.pools import IndexPool
from serving.core.sequence import SequenceStatus


def page_keys(tokens: list[int], page_size: int, count: int, keys: list[bytes]) -> list[bytes]:
    """Extend `keys` (the chain hashes of the first pages of `tokens`) to `count` pages."""
    for i in range(len(keys), count):
        page = np.asarray(tokens[i * page_size:(i + 1) * page_size], dtype=np.int64)
        parent = keys[i - 1] if i else b""
        keys.append(hashlib.blake2b(parent + page.tobytes(), digest_size=16).digest())
    return keys


class CheckpointCache:
    """Keys -> indices into the device checkpoint pool, LRU; index 0 is the dummy."""

    def __init__(self, size: int) -> None:
        self.pool = IndexPool(size, "checkpoints")
        self.index_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()  # keyed indices, least recent first
        self.evictions = 0

    @property
    def num_cached(self) -> int:
        return len(self.key_of)

    def lookup(self, key: bytes) -> int | None:
        return self.index_of.get(key)

    def touch(self, index: int) -> None:
        self.lru.move_to_end(index)

    def reserve(self) -> int | None:
        """An index to save into (free, else the LRU cached one); None if all are in flight."""
        if self.pool.num_free:
            return self.pool.allocate()
        if not self.lru:
            return None
        index, _ = self.lru.popitem(last=False)
        del self.index_of[self.key_of.pop(index)]
        self.evictions += 1
        return index

    def commit(self, index: int, key: bytes) -> None:
        """The step that saved into `index` was resolved: key it (or give it back if cached)."""
        if key in self.index_of:
            self.pool.free(index)
            return
        self.index_of[key] = index
        self.key_of[index] = key
        self.lru[index] = None

    def cancel(self, index: int) -> None:
        """The step that was to save into `index` was rolled back."""
        self.pool.free(index)


@dataclass(frozen=True, slots=True)
class Hit:
    """Where a waiting sequence resumes: `tokens` cached, pages per group, checkpoint index."""

    tokens: int
    first_pages: tuple[int, ...]  # per group: the logical page the shared range starts at
    pages: tuple[tuple[int, ...], ...]  # per group: physical pages [first, tokens / s)
    checkpoint: int  # 0 when the model has no recurrent state


class PrefixCache:
    """The scheduler's prefix-caching logic over its groups and a checkpoint cache.

    stride: tokens between state checkpoints (a multiple of the page size);
    checkpoints: size of the checkpoint pool including the dummy (0: the model has
    no recurrent state, so no checkpoint is needed to resume).
    """

    def __init__(self, groups, page_size: int, stride: int, checkpoints: int) -> None:
        self.groups = groups
        self.page_size = page_size
        self.stride = stride
        self.ckpts = CheckpointCache(checkpoints) if checkpoints else None
        self.hit_tokens = 0  # prompt tokens not recomputed (cumulative)
        self.query_tokens = 0  # tokens of admitted sequences that looked for a hit

    @property
    def has_state(self) -> bool:
        return self.ckpts is not None

    def keys(self, seq, pages: int) -> list[bytes]:
        """The first `pages` chain keys of `seq` (computed once, kept on the sequence)."""
        return page_keys(seq.token_ids, self.page_size, pages, seq.page_keys)[:pages]

    # -- matching ------------------------------------------------------------

    def match(self, seq) -> Hit | None:
        """The longest prefix at which every group can resume (at most num_tokens - 1).

        Recurrent layers need a checkpoint at the position, each sliding-window group
        the pages in its window before it, each global group all pages before it.
        Requests with penalties take no hit (their statistics need every prompt token).
        """
        p = seq.params
        if seq.num_computed_tokens or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 \
                or p.frequency_penalty != 0.0:
            return None
        s = self.page_size
        keys = self.keys(seq, (seq.num_tokens - 1) // s)
        for k in range(len(keys), 0, -1):
            ckpt = 0
            if self.ckpts is not None:
                ckpt = self.ckpts.lookup(keys[k - 1])
                if ckpt is None:
                    continue
            firsts, pages = [], []
            for g in self.groups:
                first = g.first_needed(k * s)
                got = [g.cache.page_of.get(key) for key in keys[first:k]]
                if None in got:
                    break
                firsts.append(first)
                pages.append(tuple(got))
            else:
                return Hit(k * s, tuple(firsts), tuple(pages), ckpt)
        return None

    def attach(self, seq, hit: Hit) -> None:
        """Give `seq` the hit's pages (references taken) and start it at `hit.tokens`."""
        for g, ring, first, pages in zip(self.groups, seq.rings, hit.first_pages, hit.pages,
                                         strict=True):
            g.attach(ring, first, pages)
        if self.ckpts is not None:
            self.ckpts.touch(hit.checkpoint)
        seq.num_computed_tokens = hit.tokens

    def count(self, seq, hit: Hit | None) -> None:
        """An admission looked up the cache (and resumed at `hit`, if any)."""
        self.query_tokens += seq.num_tokens
        self.hit_tokens += hit.tokens if hit is not None else 0

    def detach(self, seq) -> None:
        """Undo `attach` (the sequence could not be admitted after all)."""
        for g, ring in zip(self.groups, seq.rings, strict=True):
            g.free(ring)
        seq.num_computed_tokens = 0

    # -- checkpoints ----------------------------------------------------------

    def boundary(self, seq, n: int) -> int | None:
        """The next position > n where a checkpoint is wanted and not cached yet, or None.

        Wanted: multiples of `stride`, and the last page boundary of the known tokens
        (the end of the prompt, which the next turn of a chat re-sends).
        """
        if self.ckpts is None:
            return None
        s = self.page_size
        end = seq.num_tokens // s * s
        nxt = (n // self.stride + 1) * self.stride
        for b in (min(nxt, end), max(nxt, end)) if end > n else (nxt,):
            if b <= n or b > seq.num_tokens:
                continue
            if self.ckpts.lookup(self.keys(seq, b // s)[b // s - 1]) is None:
                return b
        return None

    def commit(self, entry, end: int | None = None) -> None:
        """A step was resolved: key its checkpoint and the full pages it computed.

        `end`: one past the last position whose K/V and state are real (a verification
        step computed rejected drafts beyond it); default the entry's end.
        """
        seq, s = entry.seq, self.page_size
        end = entry.start + entry.num_tokens if end is None else end
        if entry.save:
            self.ckpts.commit(entry.save, self.keys(seq, end // s)[end // s - 1])
        if seq.status is not SequenceStatus.RUNNING or end < s:
            return
        keys = self.keys(seq, end // s)
        for g, ring in zip(self.groups, seq.rings, strict=True):
            for i in range(max(entry.start // s, ring.first), min(end // s, ring.end)):
                g.cache.register(keys[i], ring.pages[i - ring.first])

    def rollback(self, entry) -> None:
        """A step failed before it ran: give back its checkpoint and uncount its hit."""
        if entry.save:
            self.ckpts.cancel(entry.save)
        if entry.restore >= 0:
            self.hit_tokens -= entry.start
            self.query_tokens -= entry.seq.num_tokens

    def stats(self) -> dict[str, object]:
        c = self.ckpts
        return {
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_query_tokens": self.query_tokens,
            "prefix_cache_hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "prefix_cache_pages_cached": {g.name: len(g.cache.key_of) for g in self.groups},
            "prefix_cache_page_evictions": {g.name: g.cache.evictions for g in self.groups},
            "prefix_state_checkpoints_in_use": c.pool.num_used if c else 0,
            "prefix_state_checkpoints_cached": c.num_cached if c else 0,
            "prefix_state_checkpoints_total": c.pool.capacity if c else 0,
            "prefix_state_checkpoint_evictions": c.evictions if c else 0,
        }
