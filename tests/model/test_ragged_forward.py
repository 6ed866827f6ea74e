"""The serving path (ragged batch, paged K/V, slot states) reproduces the full forward.

The harness here builds RaggedBatch arrays by hand (no engine): every sequence gets its
own state slot and its own physical pages (a random permutation, page 0 reserved), and
is processed in prefill chunks of `chunk` tokens, then decoded greedily - either in the
decode specialisation (one token per sequence) or through the ragged prefill path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.cache import RaggedBatch, init_caches
from hybrid_jax.config import (
    AttentionConfig,
    LayerSpec,
    Mamba2Config,
    MLPConfig,
    ModelConfig,
    RGLRUConfig,
)
from hybrid_jax.generate import greedy_generate
from hybrid_jax.model import CausalLM
from hybrid_jax.ragged import forward_ragged

PAGE = 8
MAX_LEN = 48


def all_kinds_config() -> ModelConfig:
    return ModelConfig(
        architecture="native", vocab_size=64, hidden_size=32,
        layers=(LayerSpec("hybrid", 6), LayerSpec("attention", None), LayerSpec("mamba2"),
                LayerSpec("rglru"), LayerSpec("attention", 6)),
        attention=AttentionConfig(4, 2, 16, softcap=20.0),
        mamba2=Mamba2Config(4, 16, 16, n_groups=2, chunk_size=16),
        rglru=RGLRUConfig(32, 4), mlp=MLPConfig(64), max_position_embeddings=MAX_LEN)


class Harness:
    """Hand-built batches: slot i + 1 and a private page set for sequence i."""

    def __init__(self, model: CausalLM, n: int, seed: int = 0, fresh: bool = False):
        """fresh: a step function of this harness's own, traced anew. jax.jit shares its
        traces between jits of the same function, so a second harness of the same model
        reuses the first's trace, and module switches patched in between (read at trace
        time) would not take effect."""
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        per_seq = MAX_LEN // PAGE
        pages = np.random.default_rng(seed).permutation(np.arange(1, n * per_seq + 1))
        self.tables = pages.reshape(n, per_seq).astype(np.int32)
        self.caches = init_caches(cfg, num_pages=(n * per_seq + 1,) * len(cfg.windows),
                                  page_size=PAGE, num_slots=n + 1, dtype=jnp.float32)
        self.cached = [0] * n
        step = (lambda m, b, c, decode: forward_ragged(m, b, c, decode=decode)) if fresh else forward_ragged
        self.step = jax.jit(step, static_argnames="decode")

    def run(self, chunks: dict[int, list[int]], decode: bool) -> dict[int, np.ndarray]:
        """Process chunks {seq: tokens}; returns logits at each sequence's last token.

        Shapes are bucketed as the engine's runner does: b is always the number of
        sequences (absent ones are padding rows: slot 0, no tokens, length 0) and t is
        padded to a power of two, so the step compiles a handful of times.
        """
        n = len(self.cached)
        toks, pos, maps, cu, lengths, slots, init = [], [], [], [0], [], [], []
        for s in range(n):
            chunk = chunks.get(s, [])
            start = self.cached[s]
            p = np.arange(start, start + len(chunk))
            toks += chunk
            pos += p.tolist()
            maps += (self.tables[s][p // PAGE] * PAGE + p % PAGE).tolist()
            cu.append(len(toks))
            lengths.append(start + len(chunk) if chunk else 0)
            slots.append(s + 1 if chunk else 0)
            init.append(bool(chunk) and start > 0)
        t = n if decode else max(16, 1 << (len(toks) - 1).bit_length())
        pad = t - len(toks)
        assert pad >= 0
        cu = np.asarray(cu, np.int32)
        groups = len(self.cfg.windows)
        batch = RaggedBatch(
            tokens=jnp.asarray(toks + [0] * pad, jnp.int32),
            positions=jnp.asarray(pos + [0] * pad, jnp.int32),
            cu_seqlens=jnp.asarray(cu), lengths=jnp.asarray(lengths, jnp.int32),
            slot_ids=jnp.asarray(slots, jnp.int32), has_initial=jnp.asarray(init),
            page_tables=(jnp.asarray(self.tables),) * groups,
            slot_mappings=(jnp.asarray(maps + [0] * pad, jnp.int32),) * groups,
            last_token=jnp.asarray(np.maximum(cu[1:] - 1, 0)))
        logits, self.caches = self.step(self.model, batch, self.caches, decode=decode)
        for s, chunk in chunks.items():
            self.cached[s] += len(chunk)
        return {s: np.asarray(logits[s]) for s in chunks}


def decode_after(h: Harness, prompts: list[list[int]], steps: int) -> np.ndarray:
    """`steps` decode steps of every sequence after its prompt (already prefilled in `h`):
    token (last prompt token + step) % 64 each step (no sampling: any logits bug shows).
    Returns the logits [steps, sequences, vocabulary]."""
    out, last = [], [p[-1] for p in prompts]
    for step in range(steps):
        logits = h.run({i: [(last[i] + step) % 64] for i in range(len(prompts))}, decode=True)
        out.append(np.stack([logits[i] for i in range(len(prompts))]))
    return np.stack(out)


def serve_greedy(model, prompts, new, chunk, decode_mode) -> list[list[int]]:
    h = Harness(model, len(prompts))
    out: list[list[int]] = [[] for _ in prompts]
    todo = {i: list(p) for i, p in enumerate(prompts)}
    while todo:  # chunked prefill, all sequences in one ragged batch per step
        step = {i: t[:chunk] for i, t in todo.items()}
        logits = h.run(step, decode=False)
        for i in step:
            todo[i] = todo[i][chunk:]
            if not todo[i]:
                out[i].append(int(np.argmax(logits[i])))
        todo = {i: t for i, t in todo.items() if t}
    for _ in range(new - 1):
        logits = h.run({i: [o[-1]] for i, o in enumerate(out)}, decode=decode_mode)
        for i in logits:
            out[i].append(int(np.argmax(logits[i])))
    return out


@pytest.fixture(scope="module")
def model():
    return CausalLM(all_kinds_config(), rngs=nnx.Rngs(0))


PROMPTS = [np.random.default_rng(n).integers(0, 64, n).tolist() for n in (1, 9, 17, 30)]
NEW = 12


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    return [greedy_generate(model, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("chunk,decode_mode", [(1, True), (5, True), (64, False), (7, False)])
def test_serving_path_matches_full_forward_greedy(model, reference, chunk, decode_mode):
    """Prompts of 1..30 tokens (windows 6, pages 8, SSD chunks 16) in ragged chunks."""
    assert serve_greedy(model, PROMPTS, NEW, chunk, decode_mode) == reference


def test_serving_logits_match_full_forward(model):
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 64, 20).tolist()
    h = Harness(model, 1)
    first = h.run({0: prompt[:13]}, decode=False)[0]
    second = h.run({0: prompt[13:]}, decode=False)[0]
    full = np.asarray(model(jnp.asarray([prompt])))[0]
    np.testing.assert_allclose(first, full[12], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(second, full[19], rtol=1e-4, atol=1e-4)
