"""benchmarks/recall.py: the synthetic recall rows hold what the task says, checked by a plain
Python scan of each row (independent of the generator's index arithmetic), and the three
models of the comparison have equal parameter counts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

SPEC = importlib.util.spec_from_file_location(
    "recall_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "recall.py")
recall = importlib.util.module_from_spec(SPEC)
sys.modules[SPEC.name] = recall  # dataclasses look their module up
SPEC.loader.exec_module(recall)


def _scan_row(task, row: np.ndarray) -> list[tuple[int, int, int]]:
    """(query position, expected value, distance back to it) per query, from the tokens alone."""
    is_key = (row >= task.key0) & (row < task.value0)
    key_pos = np.flatnonzero(is_key)
    assert len(key_pos) == 2 * task.pairs
    first, queries = key_pos[:task.pairs], key_pos[task.pairs:]
    out = []
    for q in queries:
        (p,) = [p for p in first if row[p] == row[q]]  # the key was given exactly once
        out.append((int(q), int(row[p + 1]), int(q - (p + 1))))
    return out


@pytest.mark.parametrize("gap", [0, 5, 40])
def test_rows_hold_pairs_then_the_same_keys_with_their_values(gap):
    task = recall.RecallTask(length=96, pairs=4, keys=16, values=8, filler=20)
    batch = jax.jit(task.batch, static_argnums=1)
    toks, mask, dist = jax.device_get(batch(jax.random.key(gap), 16, gap, gap))
    assert toks.shape == (16, 97) and mask.shape == (16, 96)
    assert toks.min() >= 0 and toks.max() < task.vocab_size and (toks[:, 0] == recall.BOS).all()
    for row, m, d in zip(toks, mask, dist, strict=True):
        answers = _scan_row(task, row)
        assert [q for q, _, _ in answers] == list(np.flatnonzero(m))  # loss exactly on the answers
        assert all(row[q + 1] == v for q, v, _ in answers)  # the row's target is the stored value
        assert [x for _, _, x in answers] == list(d)
        assert min(d) >= gap + 1 and max(d) <= gap + 4 * task.pairs - 3
        assert ((row >= task.value0) & (row < task.filler0)).sum() == 2 * task.pairs


def test_the_longest_gap_lies_beyond_the_stack_reach_and_bands_cover_it():
    task = recall.RecallTask(length=256, pairs=4, keys=64, values=16, filler=64)
    bands = recall.distance_bands(task, window=32, layers=2)
    assert bands["past_reach"][0] == 2 * 31 + 1
    batch = jax.jit(task.batch, static_argnums=1)
    _, _, dist = jax.device_get(batch(jax.random.key(0), 64, task.max_gap, task.max_gap))
    assert dist.max() <= bands["past_reach"][1] and dist.min() >= task.max_gap + 1 > bands["past_reach"][0]


def test_the_three_models_have_equal_parameters():
    task = recall.RecallTask(length=96, pairs=4, keys=16, values=8, filler=20)
    models = recall.variants(recall.recall_model(task, d=64, layers=2, window=16))
    count = {k: recall.param_count(jax.eval_shape(lambda c=c: recall.init_params(c, 0)))
             for k, c in models.items()}
    assert {c.layers[0].kind.value for c in models.values()} == {"hybrid", "attention", "mamba2"}
    assert max(count.values()) - min(count.values()) < 0.01 * count["hybrid"], count
