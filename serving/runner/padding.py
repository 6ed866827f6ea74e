"""A step's host arrays padded to its shape bucket, and their indices checked.

Padding rows are zeros: the dummy page 0 and slot 0, greedy sampling, zero length for
attention (the ragged convention). Every index is checked here, on the host, because
on device JAX clamps out-of-range indices silently. Plain numpy; the ModelRunner
(serving/runner/runner.py) calls these before packing a step's inputs.
"""

from __future__ import annotations

import numpy as np

from hybrid_jax.cache import RaggedBatch
from serving.core.schedule import PENDING, StepArrays
from serving.runner.buckets import Bucket
from serving.runner.step_fns import CkptOps
from serving.sample.sampling import SamplingArrays


def within(name: str, x: np.ndarray, hi: int, lo: int = 0) -> None:
    if x.size and not (x.min() >= lo and x.max() < hi):
        raise AssertionError(f"{name} outside [{lo}, {hi}): {x.min()}..{x.max()}")


def q_bucket(buckets: list[Bucket], q: int, arrays: StepArrays, what: str) -> Bucket:
    """The smallest bucket of q tokens per sequence that holds the step's sequences."""
    b = len(arrays.slot_ids)
    bucket = next((bk for bk in buckets if bk.seqs >= b), None)
    if bucket is None:
        raise ValueError(f"no {what} bucket holds {b} sequences")
    if not np.all(arrays.query_lens == q):
        raise ValueError(f"a {what} needs {q} tokens per sequence")
    return bucket


def pad_rows(x: np.ndarray, n: int, fill: int = 0) -> np.ndarray:
    """Pad the leading axis to n rows (zeros = dummy slot/page 0, greedy, empty)."""
    if len(x) > n:
        raise ValueError(f"{len(x)} rows do not fit a bucket of {n}")
    if len(x) == n:  # a full bucket: nothing to add (the caller packs it, a copy)
        return x
    return np.concatenate([x, np.full((n - len(x), *x.shape[1:]), fill, x.dtype)])


def check_indices(a: StepArrays, *, vocab_size: int, num_slots: int, num_pages: tuple[int, ...],
                  page_size: int) -> None:
    """Every index is checked on the host: on device, JAX clamps out-of-range silently."""
    within("token_ids", a.token_ids, vocab_size, lo=PENDING)
    within("slot_ids", a.slot_ids, num_slots)
    for g, n in enumerate(num_pages):
        within(f"page_tables[{g}]", a.page_tables[g], n)
        within(f"slot_mappings[{g}]", a.slot_mappings[g], n * page_size)


def pad_ckpt_ops(a: StepArrays | None, k: int, *, num_checkpoints: int, num_slots: int) -> CkptOps:
    """A step's checkpoint copies padded to `k` rows (dummy slot and checkpoint 0)."""
    if a is None:
        return CkptOps(*(np.zeros(k, np.int32) for _ in range(4)))
    rows = (a.restore_ckpt, a.restore_slot, a.save_slot, a.save_ckpt)
    hi = (max(num_checkpoints, 1), num_slots, num_slots, max(num_checkpoints, 1))
    for name, x, h in zip(CkptOps._fields, rows, hi, strict=True):
        within(name, x, h)
    return CkptOps(*(pad_rows(x.astype(np.int32), k) for x in rows))


def pad_batch(a: StepArrays, bucket: Bucket) -> RaggedBatch:
    """The step's arrays as a RaggedBatch of the bucket's token and sequence counts."""
    t, bs = bucket.tokens, bucket.seqs
    b = len(a.slot_ids)
    cu = np.concatenate([a.cu_seqlens, np.full(bs - b, a.cu_seqlens[-1], np.int32)])
    return RaggedBatch(
        tokens=pad_rows(np.maximum(a.token_ids, 0), t), positions=pad_rows(a.positions, t),
        cu_seqlens=cu, lengths=pad_rows(a.seq_lens, bs), slot_ids=pad_rows(a.slot_ids, bs),
        has_initial=pad_rows(a.has_initial, bs),
        page_tables=tuple(pad_rows(p, bs) for p in a.page_tables),
        slot_mappings=tuple(pad_rows(m, t) for m in a.slot_mappings),
        last_token=pad_rows(a.logits_indices, bs))


def dummy_batch(bucket: Bucket, ring_widths: tuple[int, ...]) -> tuple[RaggedBatch, SamplingArrays]:
    """An all-padding step of the bucket's shape (it reads and writes only page 0 and slot 0)."""
    t, b = bucket.tokens, bucket.seqs
    z = lambda n: np.zeros(n, np.int32)
    batch = RaggedBatch(z(t), z(t), z(b + 1), z(b), z(b), np.zeros(b, bool),
                        tuple(np.zeros((b, w), np.int32) for w in ring_widths),
                        tuple(z(t) for _ in ring_widths), z(b))
    return batch, SamplingArrays.from_rows([{}] * b)
