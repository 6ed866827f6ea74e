"""Prefix caching on the host: keys, page reference counts, matching, registration, no leaks.

No device: the scheduler is driven by hand (fake sampled tokens), as the overlapped
engine drives it (up to two schedules awaiting update, rollbacks, aborts).
"""

from __future__ import annotations

import numpy as np
import pytest

from serving.core.pools import PageCache, PagePool, PoolError
from serving.core.prefix_cache import page_keys
from serving.core.scheduler import Scheduler
from serving.core.scheduler_config import SchedulerConfig
from serving.core.sequence import Sequence
from serving.sample.sampling_params import SamplingParams

S = 8  # page size


def make(groups=(("w16", 16, 40),), *, ckpts: int = 17, stride: int = 16, chunk: int = 16,
         seqs: int = 4, budget: int = 32, max_len: int = 128, ops: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(
        max_num_seqs=seqs, max_num_batched_tokens=budget, max_prefill_chunk=chunk, max_model_len=max_len,
        page_size=S, num_slots=seqs + 1, groups=groups, prefix_caching=True, prefix_state_stride=stride,
        num_checkpoints=ckpts, max_checkpoint_ops=ops))


def seq(rid: str, tokens, max_tokens: int = 2, **kw) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))


def drain(s: Scheduler, token: int = 5) -> list:
    """Run synchronously (one schedule at a time) until nothing is left; returns the schedules."""
    out = []
    while s.has_unfinished():
        sc = s.schedule()
        out.append(sc)
        s.update(sc, [token] * len(sc.entries))
    return out


def hits(schedules) -> dict[str, int]:
    return {e.seq.request_id: e.start for sc in schedules for e in sc.entries if e.restore >= 0}


def assert_no_leak(s: Scheduler) -> None:
    """Every page is free or cached-and-unreferenced; every checkpoint free or cached."""
    assert not s.running and not s.waiting and s.slots.num_used == 0
    for g in s.groups:
        assert not g.cache.refs, f"{g.name}: pages still referenced {g.cache.refs}"
        assert g.pool.num_used == len(g.cache.idle) == len(g.cache.key_of)
    c = s.prefix.ckpts
    if c is not None:
        assert c.pool.num_used == c.num_cached == len(c.lru)


def test_chain_keys_name_the_whole_prefix():
    a = list(range(40))
    b = [99] + a[1:]
    ka, kb = page_keys(a, S, 5, []), page_keys(b, S, 5, [])
    assert len(set(ka)) == 5
    assert all(x != y for x, y in zip(ka, kb, strict=True))  # page 0 differs: every key differs
    assert page_keys(a[:16] + [7] * 24, S, 5, [])[:2] == ka[:2]
    assert page_keys(a, S, 5, ka[:2]) == ka  # extending a partial list


def test_page_cache_refcounts_and_lru_eviction():
    pool = PagePool(5, S)
    c = PageCache(pool)
    p = c.take(3)
    for i, page in enumerate(p):
        c.register(bytes([i]), page)
    c.share(p[0])
    c.put(p[0])
    assert p[0] in c.refs and c.num_free == 1
    for page in reversed(p):
        c.put(page)
    assert c.num_free == 4 and list(c.idle) == [p[2], p[1], p[0]]
    c.share(p[1])  # a hit takes an idle page back
    assert c.num_free == 3 and p[1] not in c.idle
    got = c.take(3)  # the free page, then the least recently idled cached ones
    assert c.evictions == 2 and bytes([2]) not in c.page_of and bytes([0]) not in c.page_of
    assert bytes([1]) in c.page_of and p[2] in got and p[0] in got
    with pytest.raises(PoolError):
        c.take(1)


def test_checkpoints_at_stride_and_prompt_end_and_hit_at_the_longest_prefix():
    s = make(chunk=32, budget=32)
    base = list(range(3, 48))  # 45 tokens
    s.add(seq("a", base))
    first = drain(s)
    # chunks end at 16, 32 (stride) and 40 (last page boundary of the prompt)
    assert [(e.start, e.num_tokens, e.save > 0) for sc in first for e in sc.entries][:4] == [
        (0, 16, True), (16, 16, True), (32, 8, True), (40, 5, False)]
    for rid, n, want in (("on-ckpt", 33, 32), ("end-ckpt", 44, 40), ("off-page", 37, 32),
                         ("repeat", 45, 40), ("short", 20, 16), ("tiny", 9, 0)):
        s.add(seq(rid, base[:n] + [200 + n] * 6))
        got = hits(drain(s)).get(rid, 0)
        assert got == want, (rid, got, want)
    assert s.prefix.hit_tokens == 32 + 40 + 32 + 40 + 16
    assert_no_leak(s)


def test_global_groups_need_every_page_and_swa_only_the_window():
    s = make(groups=(("w16", 16, 40), ("global", None, 40)), chunk=32)
    base = list(range(3, 60))
    s.add(seq("a", base))
    drain(s)
    g_swa, g_glob = s.groups
    # Evict the first cached page of each group: only the global group loses its hit.
    far = page_keys(base, S, 1, [])[0]
    for g in (g_swa,):
        page = g.cache.page_of.pop(far)
        del g.cache.key_of[page], g.cache.idle[page]
        g.pool.free(page)
    s.add(seq("b", base[:50] + [1] * 4))
    assert hits(drain(s)) == {"b": 48}  # the SWA group needs pages 4.. only (window 16)
    page = g_glob.cache.page_of.pop(far)
    del g_glob.cache.key_of[page], g_glob.cache.idle[page]
    g_glob.pool.free(page)
    s.add(seq("c", base[:50] + [2] * 4))
    assert hits(drain(s)) == {}
    assert_no_leak(s)


def test_pure_attention_hits_at_any_page_boundary_and_pure_ssm_at_checkpoints():
    attn = make(ckpts=0)
    base = list(range(3, 40))
    attn.add(seq("a", base))
    drain(attn)
    attn.add(seq("b", base[:27] + [1]))
    assert hits(drain(attn)) == {"b": 24}
    ssm = make(groups=(), stride=16)
    ssm.add(seq("a", base))
    drain(ssm)
    ssm.add(seq("b", base[:27] + [1]))
    assert hits(drain(ssm)) == {"b": 16}
    assert_no_leak(attn)
    assert_no_leak(ssm)


def test_shared_system_prompt_reuses_what_the_arithmetic_says():
    """P = 120 shared tokens, stride 32, page 8: each later request resumes at 96
    (the last stride checkpoint inside the shared prefix; its own prompt end lies beyond)."""
    s = make(stride=32, chunk=32, ckpts=33, max_len=160)
    system = list(range(3, 123))
    for i in range(6):
        s.add(seq(f"r{i}", system + [200 + i] * 10))
        drain(s)
    assert s.prefix.hit_tokens == 5 * 96
    assert s.prefix.query_tokens == 6 * 130
    assert_no_leak(s)


def test_in_flight_pages_and_checkpoints_are_not_matched():
    """A sequence admitted while the step computing the prefix is in flight starts from 0."""
    s = make(chunk=32)
    base = list(range(3, 40))
    s.add(seq("a", base))
    s1 = s.schedule()  # a: [0, 16) with a save, in flight
    s.add(seq("b", base))
    s2 = s.schedule()  # b admitted: a's first chunk is not resolved
    b = next(e for e in s2.entries if e.seq.request_id == "b")
    assert b.start == 0 and b.restore < 0
    s.update(s1, [5])
    s.update(s2, [5] * len(s2.entries))
    s.add(seq("c", base))
    rest = drain(s)
    assert hits(rest)["c"] >= 16
    assert_no_leak(s)


@pytest.mark.parametrize("caching", [False, True])
def test_second_chunk_in_flight_fits_the_ring_when_the_chunk_exceeds_the_window(caching):
    """Overlap: a new sequence's second chunk (32 > window 16) is scheduled before its
    first is updated; pages out of the window must go first or the ring overflows."""
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=32, max_model_len=128,
               page_size=S, num_slots=5, groups=(("w16", 16, 40),))
    s = Scheduler(SchedulerConfig(**cfg, prefix_caching=caching, num_checkpoints=0))
    s.add(seq("a", range(3, 100)))
    first, second = s.schedule(), s.schedule()
    assert [e.num_tokens for e in first.entries + second.entries] == [32, 32]
    s.update(first, [1])
    s.update(second, [1])
    drain(s)


def test_rollback_gives_back_the_checkpoint_and_uncounts_the_hit():
    s = make(chunk=32)
    base = list(range(3, 40))
    s.add(seq("a", base))
    drain(s)
    s.add(seq("b", base))
    sc = s.schedule()
    assert sc.entries[0].restore > 0 and s.prefix.hit_tokens == 32
    in_use = s.prefix.ckpts.pool.num_used
    s.rollback(sc)
    assert s.prefix.hit_tokens == 0 and s.prefix.ckpts.pool.num_used <= in_use
    drain(s)
    assert s.prefix.hit_tokens == 32
    assert_no_leak(s)


def test_penalised_requests_take_no_hit():
    s = make()
    base = list(range(3, 40))
    s.add(seq("a", base))
    drain(s)
    s.add(seq("b", base, repetition_penalty=1.2))
    assert hits(drain(s)) == {}


def test_soak_with_overlap_random_aborts_preemptions_and_rollbacks_leaks_nothing():
    rng = np.random.default_rng(0)
    s = make(groups=(("w16", 16, 10), ("global", None, 14)), ckpts=5, seqs=4, budget=24, chunk=16,
             max_len=64)
    systems = [rng.integers(0, 50, 30).tolist() for _ in range(3)]
    inflight: list = []
    n = 0
    for _ in range(600):
        if rng.random() < 0.4 and n < 200:
            sysp = systems[int(rng.integers(3))]
            cut = int(rng.integers(1, 31))
            s.add(seq(f"r{n}", sysp[:cut] + rng.integers(0, 50, int(rng.integers(1, 12))).tolist(),
                      max_tokens=int(rng.integers(1, 10))))
            n += 1
        if rng.random() < 0.1 and s._live:
            s.abort(str(rng.choice(sorted(s._live))))
        if len(inflight) < 2:
            sc = s.schedule()
            if not sc.is_empty:
                if rng.random() < 0.05:
                    s.rollback(sc)
                else:
                    inflight.append(sc)
        if inflight and (len(inflight) == 2 or rng.random() < 0.5):
            sc = inflight.pop(0)
            s.update(sc, rng.integers(0, 50, len(sc.entries)).tolist())
        # Reference counts equal the rings that hold each page.
        for gi, g in enumerate(s.groups):
            held: dict[int, int] = {}
            for q in s.running:
                for p in q.rings[gi].pages:
                    held[p] = held.get(p, 0) + 1
            assert held == g.cache.refs
    for sc in inflight:
        s.update(sc, [1] * len(sc.entries))
    drain(s)
    assert s.prefix.hit_tokens > 0 and s.num_preemptions > 0
    assert sum(g.cache.evictions for g in s.groups) > 0 and s.prefix.ckpts.evictions > 0
    assert_no_leak(s)
