"""Shape buckets: the padded (tokens, sequences) shapes the runner compiles a step for.

`make_buckets` builds the decode and mixed ladders; `late_buckets` names the GPU
ladder's padding-only rungs (compiled in the background); `decode_row_floor` is the
smallest decode bucket's row count on this backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bucket:
    tokens: int
    seqs: int
    decode: bool
    verify: bool = False  # speculative verification: seqs sequences of tokens // seqs each


def _geometric(lo: int, hi: int, factor: int) -> list[int]:
    out, v = [], lo
    while v < hi:
        out.append(v)
        v *= factor
    return [*out, hi]


def _ladder(name: str, sizes: tuple[int, ...] | None, limit: int, lo: int, factor: int) -> list[int]:
    """Explicit sizes (clamped to the limit, which the memory plan may have lowered) or a
    geometric ladder lo, lo*factor, ... closed by the limit."""
    if sizes is None:
        return _geometric(lo, limit, factor)
    if max(sizes) > limit:
        log.warning("%s=%s: sizes above %d (the limit in force) are replaced by it", name, sizes, limit)
    return sorted({*(min(x, limit) for x in sizes), limit})


COARSE_TOKENS = (256, 512, 768)  # the GPU's mixed-step token rungs below 1024


def late_buckets(buckets: list[Bucket], coarse_default: bool) -> frozenset[Bucket]:
    """The mixed buckets of the GPU's default ladder that only trim padding (the 512- and
    768-token rungs, never the ladder's top): with background compilation on they compile
    after the engine serves, as the large buckets do, so start-up compiles what it did
    before these rungs existed (a step picks the smallest compiled bucket that holds it:
    the next rung up meanwhile)."""
    if not coarse_default:
        return frozenset()
    top = max(b.tokens for b in buckets if not b.decode)
    return frozenset(b for b in buckets
                     if not b.decode and b.tokens in COARSE_TOKENS[1:] and b.tokens < top)


def make_buckets(max_num_seqs: int, max_num_batched_tokens: int, min_tokens: int = 64,
                 min_seqs: int = 8, *, seq_sizes: tuple[int, ...] | None = None,
                 token_sizes: tuple[int, ...] | None = None, min_decode_rows: int = 1,
                 single_row_decode: bool = False, coarse_mixed: bool = False) -> list[Bucket]:
    """Decode buckets (t == b) and mixed buckets (t tokens, b <= t sequences).

    The ladders are geometric up to the limits (sequences x2 from 8, tokens x4 from 64)
    unless `seq_sizes` / `token_sizes` give them (fewer buckets: faster start-up, more
    padding); the limits always close them, and sizes above a limit are clamped to it.
    Decode buckets have at least `min_decode_rows` rows (padding rows beyond
    max_num_seqs; see `decode_row_floor`), except a one-row decode bucket added when
    `single_row_decode` (a model whose one-row projections are reductions at full
    bandwidth: hybrid_jax/layers/linear.py), which then replaces the padded bucket
    when max_num_seqs is 1.

    `coarse_mixed` (the GPU default, where each executable costs ~2.2 s of serial
    lowering at start-up): where a ladder is not given, mixed buckets take every other
    rung of the sequence ladder (x4 from 16) and tokens `COARSE_TOKENS` below 1024
    (where a prompt arriving under load lands: its step's padding is what the decodes
    beside it wait for, docs/benchmarks.md "Serving under load"), x4 from 1024 above.
    A mixed step's cost is its tokens'; padding its sequence count costs the padded
    rows' state traffic only. 256 sequences and 8192 tokens: 32 executables instead of 42.
    """
    seqs = _ladder("seq_buckets", seq_sizes, max_num_seqs, min(min_seqs, max_num_seqs), 2)
    if coarse_mixed and token_sizes is None:
        toks = sorted({min(x, max_num_batched_tokens) for x in COARSE_TOKENS}
                      | set(_geometric(min(1024, max_num_batched_tokens), max_num_batched_tokens, 4)))
    else:
        toks = _ladder("token_buckets", token_sizes, max_num_batched_tokens,
                       min(min_tokens, max_num_batched_tokens), 4)
    mixed = seqs
    if coarse_mixed and seq_sizes is None:
        mixed = _geometric(min(2 * min_seqs, max_num_seqs), max_num_seqs, 4)
    rows = {max(b, min_decode_rows) for b in seqs if b > 1 or not single_row_decode}
    out = [Bucket(b, b, True) for b in sorted(rows | ({1} if single_row_decode else set()))]
    out += [Bucket(t, b, False) for t in toks for b in mixed if b <= t or b == mixed[0]]
    return out


GPU_MIN_DECODE_ROWS = 8


def decode_row_floor() -> int:
    """Rows of the smallest decode bucket: 8 on GPUs, where XLA lowers a decode step's
    projections with fewer rows to reduction fusions at ~45% of bandwidth and with 8 to
    GEMMs (H100, native-1b-parallel at batch 1: 4.21 ms per engine step in an 8-row
    bucket against 5.51 ms in a 1-row one, measured with Triton GEMMs;
    docs/history/benchmarks-2026.md). So one sequence
    (`hybrid-jax generate`, max_num_seqs=1) decodes in padded 8-row steps there.

    The engine also allocates at least this many slots (plus the dummy) when the memory
    budget allows: with max_num_seqs=1 (2 slots) the overlapped loop's host enqueue of
    each step took 7.7 ms against 1.3 ms with 9 slots, same executable shape otherwise
    (H100, native-1b-parallel, one sequence: engine step 10.4 ms against 3.25 ms;
    `num_slots=9` alone makes the difference, `num_pages` does not). The enqueue then
    costs what launching the step without CUDA graphs costs (9.6 ms), as if XLA rebuilt
    the graph on every call; why the slot count decides it is not known."""
    return GPU_MIN_DECODE_ROWS if jax.default_backend() == "gpu" else 1
