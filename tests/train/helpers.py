"""Tiny corpora and a tiny hybrid config for the training tests (CPU, seconds)."""

from __future__ import annotations

from pathlib import Path

from hybrid_jax.config import AttentionConfig, LayerSpec, Mamba2Config, MLPConfig, ModelConfig
from hybrid_jax.train.config import TrainConfig

SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\n\n\ndef walk(root):\n    for name in os.listdir(root):\n        yield name\n",
    "# température, naïve — ünïcode\nvalue = {'ключ': [1, 2, 3]}\t# tab\n",
    "for i in range(10):\n    if i % 2:\n        print(i)\n    else:\n        continue\n",
]


def write_corpus(root: Path, copies: int = 6) -> Path:
    """Write SNIPPETS as .py files (with variations) under root/src; returns that directory."""
    src = root / "src"
    for k in range(copies):
        for i, text in enumerate(SNIPPETS):
            p = src / f"pkg{k}" / f"mod{i}.py"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text.replace("10", str(10 + k)) + f"\nVERSION = {k}\n")
    return src


def tiny_model(vocab_size: int = 512) -> ModelConfig:
    return ModelConfig(
        architecture="native", vocab_size=vocab_size, hidden_size=32,
        layers=(LayerSpec("hybrid", 8), LayerSpec("hybrid", 8)),
        attention=AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=16),
        mamba2=Mamba2Config(num_heads=2, head_dim=16, state_size=8, chunk_size=8),
        mlp=MLPConfig(intermediate_size=64), norm_eps=1e-5, tie_embeddings=True,
        bos_token_id=1, eos_token_ids=(2,), pad_token_id=0)


def tiny_train(**kw) -> TrainConfig:
    base = dict(steps=8, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=1, vocab_size=300,
                compute_dtype="float32", eval_fraction=0.2, eval_every=100, eval_rows=4,
                ckpt_every=100, log_every=100)
    return TrainConfig(**(base | kw))
