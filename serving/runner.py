"""The model runner: the only place that builds device arrays and calls the jitted step.

One pure step function - merge the NNX graph with the parameters (passed as an
argument, never baked into the HLO), run the ragged forward, sample on device - is
compiled ahead of time for every shape bucket (tokens x sequences, plus one
decode-only bucket per sequence count) at start-up. Serving calls those compiled
executables only, so it cannot recompile: a shape outside the buckets is an error.
KV pages and recurrent states are donated and updated in place. Arrays are placed
with shardings over a `jax.sharding.Mesh` (one device by default; tensor parallelism
is a mesh change). The runner knows nothing of requests or scheduling policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybrid_jax.cache import RaggedBatch, init_caches
from hybrid_jax.model import CausalLM
from hybrid_jax.ragged import forward_ragged
from serving.penalties import TokenStats, apply_penalties, init_token_stats, update_token_stats
from serving.sampling import SamplingArrays, sample
from serving.schedule import StepArrays

log = logging.getLogger(__name__)
TOP_LOGPROBS = 20  # top-n logprobs computed every step (n <= 20 per request)


class StepResult(NamedTuple):
    tokens: np.ndarray  # [b] int32
    logprobs: np.ndarray  # [b] f32, of the sampled token
    top_ids: np.ndarray  # [b, TOP_LOGPROBS]
    top_logprobs: np.ndarray  # [b, TOP_LOGPROBS]


@dataclass(frozen=True)
class Bucket:
    tokens: int
    seqs: int
    decode: bool


def _pow2_ladder(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= 2
    return [*out, hi]


def make_buckets(max_num_seqs: int, max_num_batched_tokens: int, min_tokens: int = 16,
                 min_seqs: int = 8, *, seq_sizes: tuple[int, ...] | None = None,
                 token_sizes: tuple[int, ...] | None = None) -> list[Bucket]:
    """Decode buckets (t == b) and mixed buckets (t tokens, b <= t sequences).

    The ladders are powers of two up to the limits unless `seq_sizes` / `token_sizes`
    give them (fewer buckets: faster start-up, more padding); the limits always close them.
    """
    seqs = sorted({*(seq_sizes or _pow2_ladder(min(min_seqs, max_num_seqs), max_num_seqs)),
                   max_num_seqs})
    toks = sorted({*(token_sizes or _pow2_ladder(min(min_tokens, max_num_batched_tokens),
                                                 max_num_batched_tokens)), max_num_batched_tokens})
    if seqs[-1] > max_num_seqs or toks[-1] > max_num_batched_tokens:
        raise ValueError(f"bucket sizes {seqs} / {toks} exceed max_num_seqs={max_num_seqs} / "
                         f"max_num_batched_tokens={max_num_batched_tokens}")
    out = [Bucket(b, b, True) for b in seqs]
    out += [Bucket(t, b, False) for t in toks for b in seqs if b <= t or b == seqs[0]]
    return out


def _step_fn(graphdef: nnx.GraphDef, decode: bool) -> Callable:
    """The step: forward, penalties from per-slot token statistics, sampling, logprobs.

    Logprobs (of the sampled token and the top-n) are the model's raw distribution,
    before penalties and filters.
    """

    def step(params, caches, stats: TokenStats, batch: RaggedBatch, sampling: SamplingArrays):
        model = nnx.merge(graphdef, params)
        logits, caches = forward_ragged(model, batch, caches, decode=decode)
        # Statistics only matter to rows with penalties: a slot's row is rebuilt from its
        # first chunk, so steps without any penalised row may leave them untouched.
        penalised = jnp.any((sampling.repetition != 1.0) | (sampling.presence != 0.0)
                            | (sampling.frequency != 0.0))
        stats = jax.lax.cond(
            penalised,
            lambda st: update_token_stats(st, batch.tokens, batch.positions, batch.cu_seqlens,
                                          batch.slot_ids, batch.has_initial, sampling.prompt_len),
            lambda st: st, stats)
        shaped = apply_penalties(logits, stats, batch.slot_ids, sampling.repetition,
                                 sampling.presence, sampling.frequency)
        tokens, _ = sample(shaped, sampling)
        raw = jax.nn.log_softmax(logits, axis=-1)
        # Top-n logprobs only when some request in the step asked for them.
        b = raw.shape[0]
        top_lp, top_ids = jax.lax.cond(
            jnp.any(sampling.want_top), lambda r: tuple(jax.lax.top_k(r, TOP_LOGPROBS)),
            lambda r: (jnp.zeros((b, TOP_LOGPROBS), r.dtype), jnp.zeros((b, TOP_LOGPROBS), jnp.int32)),
            raw)
        logprobs = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
        return caches, stats, tokens, logprobs, top_ids.astype(jnp.int32), top_lp

    return jax.jit(step, donate_argnums=(1, 2))


class ModelRunner:
    """Holds parameters and caches on the mesh; runs one padded step per call."""

    def __init__(self, model: CausalLM, *, num_pages: tuple[int, ...], page_size: int,
                 num_slots: int, ring_widths: tuple[int, ...], max_num_seqs: int,
                 max_num_batched_tokens: int, mesh: Mesh | None = None,
                 seq_sizes: tuple[int, ...] | None = None,
                 token_sizes: tuple[int, ...] | None = None):
        self.cfg = model.cfg
        self.mesh = mesh or Mesh(np.asarray(jax.devices()[:1]), ("tp",))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.graphdef, params = nnx.split(model)
        self.params = jax.device_put(params, self.replicated)
        caches = init_caches(self.cfg, num_pages=num_pages, page_size=page_size,
                             num_slots=num_slots, dtype=model.dtype)
        self.caches = jax.device_put(caches, self.replicated)
        self.stats = jax.device_put(init_token_stats(num_slots, self.cfg.vocab_size), self.replicated)
        self.ring_widths = ring_widths
        self.page_size = page_size
        self.num_pages, self.num_slots = num_pages, num_slots
        self.buckets = make_buckets(max_num_seqs, max_num_batched_tokens, seq_sizes=seq_sizes,
                                    token_sizes=token_sizes)
        self.compiled: dict[Bucket, Callable] = {}

    def compile_all(self, progress: Callable[[int, int, Bucket], None] | None = None) -> None:
        """Compile every bucket ahead of serving (the only compilations the runner does)."""
        fns = {d: _step_fn(self.graphdef, d) for d in (True, False)}
        for i, bucket in enumerate(self.buckets):
            batch, sampling = self._dummy(bucket)
            lowered = fns[bucket.decode].lower(self.params, self.caches, self.stats, batch, sampling)
            self.compiled[bucket] = lowered.compile()
            if progress is not None:
                progress(i + 1, len(self.buckets), bucket)

    def pick(self, arrays: StepArrays) -> Bucket:
        b, t = len(arrays.slot_ids), len(arrays.token_ids)
        decode = arrays.num_decodes == b
        for bucket in self.buckets:
            if bucket.decode == decode and bucket.seqs >= b and bucket.tokens >= t:
                return bucket
        raise ValueError(f"no bucket holds {t} tokens x {b} sequences (decode={decode})")

    def run(self, arrays: StepArrays, sampling: SamplingArrays) -> StepResult:
        """Pad to a bucket, run the compiled step (caches donated), return host results."""
        bucket = self.pick(arrays)
        batch = self._pad(arrays, bucket)
        samp = SamplingArrays(*(_pad_rows(np.asarray(x), bucket.seqs) for x in sampling))
        self.caches, self.stats, tokens, lps, top_ids, top_lps = self.compiled[bucket](
            self.params, self.caches, self.stats, batch, samp)
        b = len(arrays.slot_ids)
        tokens, lps, top_ids, top_lps = jax.device_get((tokens, lps, top_ids, top_lps))
        return StepResult(tokens[:b], lps[:b], top_ids[:b], top_lps[:b])

    def state_lost(self) -> bool:
        """Whether the donated device state (caches, statistics) is gone, e.g. a step died mid-call."""
        try:
            return any(x.is_deleted() for x in jax.tree.leaves((self.caches, self.stats)))
        except Exception:  # the device itself is unusable
            return True

    def _check_indices(self, a: StepArrays) -> None:
        """Every index is checked on the host: on device, JAX clamps out-of-range silently."""
        def within(name: str, x: np.ndarray, hi: int) -> None:
            if x.size and not (x.min() >= 0 and x.max() < hi):
                raise AssertionError(f"{name} outside [0, {hi}): {x.min()}..{x.max()}")

        within("token_ids", a.token_ids, self.cfg.vocab_size)
        within("slot_ids", a.slot_ids, self.num_slots)
        for g, n in enumerate(self.num_pages):
            within(f"page_tables[{g}]", a.page_tables[g], n)
            within(f"slot_mappings[{g}]", a.slot_mappings[g], n * self.page_size)

    def _pad(self, a: StepArrays, bucket: Bucket) -> RaggedBatch:
        self._check_indices(a)
        t, bs = bucket.tokens, bucket.seqs
        b = len(a.slot_ids)
        cu = np.concatenate([a.cu_seqlens, np.full(bs - b, a.cu_seqlens[-1], np.int32)])
        return RaggedBatch(
            tokens=_pad_rows(a.token_ids, t), positions=_pad_rows(a.positions, t),
            cu_seqlens=cu, lengths=_pad_rows(a.seq_lens, bs), slot_ids=_pad_rows(a.slot_ids, bs),
            has_initial=_pad_rows(a.has_initial, bs),
            page_tables=tuple(_pad_rows(p, bs) for p in a.page_tables),
            slot_mappings=tuple(_pad_rows(m, t) for m in a.slot_mappings),
            last_token=_pad_rows(a.logits_indices, bs))

    def _dummy(self, bucket: Bucket) -> tuple[RaggedBatch, SamplingArrays]:
        t, b = bucket.tokens, bucket.seqs
        z = lambda n: np.zeros(n, np.int32)
        batch = RaggedBatch(z(t), z(t), z(b + 1), z(b), z(b), np.zeros(b, bool),
                            tuple(np.zeros((b, w), np.int32) for w in self.ring_widths),
                            tuple(z(t) for _ in self.ring_widths), z(b))
        return batch, SamplingArrays.from_rows([{}] * b)


def _pad_rows(x: np.ndarray, n: int) -> np.ndarray:
    """Zero-pad the leading axis to n rows (zeros = dummy slot/page 0, greedy, empty)."""
    if len(x) > n:
        raise ValueError(f"{len(x)} rows do not fit a bucket of {n}")
    return np.concatenate([x, np.zeros((n - len(x), *x.shape[1:]), x.dtype)])
