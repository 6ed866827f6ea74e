"""Pool sizing from a memory budget: refusal with a useful message, lowering with a warning."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest

from hybrid_jax.presets import load_preset
from serving.engine.engine_config import EngineConfig, plan_pools

MODEL = load_preset("native-tiny")


def plan(cfg: EngineConfig, free: int):
    return plan_pools(MODEL, cfg, free_bytes=free, weight_bytes=1 << 20, dtype=jnp.float32)


def test_budget_gives_pages_for_every_sequence():
    p = plan(EngineConfig(max_num_seqs=8, max_model_len=256, memory_fraction=0.5), free=1 << 30)
    sc = p.scheduler
    assert sc.max_num_seqs == 8 and sc.num_slots == 9
    assert p.kv_bytes + p.state_bytes <= 0.5 * ((1 << 30) - (1 << 20))
    assert [g.window for g in sc.groups] == [64]


def test_spare_slots_up_to_min_slots_within_the_budget():
    """One sequence still gets the decode bucket's slot count (never admitted beyond
    max_num_seqs) when the budget has room; not at the cost of the sequence itself."""
    cfg = EngineConfig(max_num_seqs=1, max_model_len=256, memory_fraction=0.5)
    base = plan(cfg, free=1 << 30)
    spare = plan_pools(MODEL, cfg, free_bytes=1 << 30, weight_bytes=1 << 20, dtype=jnp.float32,
                       min_slots=9)
    assert base.scheduler.num_slots == 2 and spare.scheduler.num_slots == 9
    assert spare.scheduler.max_num_seqs == 1
    assert spare.state_bytes == 9 * base.state_bytes // 2
    assert spare.kv_bytes + spare.state_bytes <= 0.5 * ((1 << 30) - (1 << 20))
    # max_num_seqs >= min_slots - 1: nothing added.
    eight = EngineConfig(max_num_seqs=8, max_model_len=256, memory_fraction=0.5)
    assert plan_pools(MODEL, eight, free_bytes=1 << 30, weight_bytes=1 << 20, dtype=jnp.float32,
                      min_slots=9).scheduler.num_slots == 9
    # A budget that holds max_num_seqs sequences but not the spare slots too: none are
    # added, and max_num_seqs is not lowered for them.
    one = base.kv_bytes + base.state_bytes
    tight = plan_pools(MODEL, cfg, free_bytes=(1 << 20) + int(one / 0.5) + 64, weight_bytes=1 << 20,
                       dtype=jnp.float32, min_slots=64)
    assert tight.scheduler.num_slots == 2 and tight.scheduler.max_num_seqs == 1
    four = EngineConfig(max_num_seqs=4, max_model_len=256, memory_fraction=0.5)
    need = plan(four, free=1 << 30)
    snug = plan_pools(MODEL, four, free_bytes=(1 << 20) + int((need.kv_bytes + need.state_bytes) / 0.5) + 64,
                      weight_bytes=1 << 20, dtype=jnp.float32, min_slots=9)
    assert snug.scheduler.max_num_seqs == 4 and snug.scheduler.num_slots == 5


def test_config_that_cannot_fit_one_sequence_is_refused():
    with pytest.raises(ValueError, match="lower max_model_len"):
        plan(EngineConfig(max_model_len=256), free=(1 << 20) + 1000)


# native-tiny: window 64, pages of 16, max_model_len 256, prefill chunks of 256 and 512
# tokens per step. A sequence holds ceil(63/16)+1 = 5 pages between steps; a prefilling
# one up to min(16, 1+ceil((64+256-2)/16)) = 16, i.e. 11 more, for each of the
# ceil(512/256) = 2 chunks a step can carry.
HELD, EXTRA = 5, 2 * 11


def test_prefill_pages_are_reserved_per_chunk_not_per_sequence():
    p = plan(EngineConfig(max_num_seqs=8, max_model_len=256), free=1 << 30)
    assert p.scheduler.groups[0].num_pages == HELD * 8 + EXTRA + 1  # + the dummy page


def test_too_many_sequences_are_lowered_with_a_warning(caplog):
    one = plan(EngineConfig(max_num_seqs=1, max_model_len=256), free=1 << 30)
    per_seq = HELD * one.page_bytes[0] + one.slot_bytes  # one sequence's share
    extra = EXTRA * one.page_bytes[0]
    free = (1 << 20) + int(2 * (extra + 3.5 * per_seq))  # room for 3 sequences at fraction 0.5
    # The handler goes on the module's logger itself: a server test earlier in the session
    # may have stopped "serving" loggers from propagating to the root (its JSON log).
    logger = logging.getLogger("serving.engine.engine_config")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="serving.engine.engine_config"):
            p = plan(EngineConfig(max_num_seqs=8, max_model_len=256, memory_fraction=0.5), free=free)
    finally:
        logger.removeHandler(caplog.handler)
    assert p.scheduler.max_num_seqs == 3
    assert p.scheduler.groups[0].num_pages == HELD * 3 + EXTRA + 1
    assert "max_num_seqs=8 lowered to 3" in caplog.text


def test_explicit_pages_that_cannot_hold_a_sequence_are_refused():
    with pytest.raises(ValueError, match="num_pages=3"):
        plan(EngineConfig(num_pages=3, max_model_len=256), free=None)


def test_sizing_defaults_follow_the_device_and_explicit_settings_win():
    from serving.engine.engine_config import CPU_SIZING

    cpu = EngineConfig().with_device_sizing("cpu", None)
    assert {k: getattr(cpu, k) for k in CPU_SIZING} == CPU_SIZING
    gpu = EngineConfig(max_num_seqs=8).with_device_sizing("gpu", 60 << 30)
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens, gpu.max_prefill_chunk, gpu.memory_fraction) \
        == (8, 8192, 2048, 0.5)
    small = EngineConfig(memory_fraction=0.3).with_device_sizing("gpu", 20 << 30)
    assert (small.max_num_seqs, small.max_num_batched_tokens, small.memory_fraction) == (128, 4096, 0.3)
    # Settings that depend on a sizing one are checked once it is known.
    EngineConfig(speculative_method="ngram", num_speculative_tokens=8)
    with pytest.raises(ValueError, match="num_speculative_tokens=8"):
        EngineConfig(speculative_method="ngram", num_speculative_tokens=8, max_prefill_chunk=4)
