"""Training data: text files -> documents -> token ids -> packed fixed-length rows.

- `collect_files` expands files and directories (recursively, by suffix), reads them
  as UTF-8 (files that are not are skipped and counted), drops exact duplicates by
  content hash, and sorts by relative path so the corpus does not depend on the
  file system's listing order.
- `split_by_file` holds out whole files (a stable hash of the relative path), so no
  held-out text is seen in training.
- `train_bpe` trains a byte-level BPE tokenizer (`tokenizers`), specials first:
  <pad>=0, <bos>=1, <eos>=2.
- `pack` lays documents out as  <bos> doc <eos> <bos> doc <eos> ...  in one stream and
  cuts it into rows of seq_len + 1 tokens (inputs and shifted targets). Two documents
  therefore never touch without a separator between them.
- `batch_indices` picks the rows of step s from (seed, s) alone, so a resumed run
  sees exactly the batches an uninterrupted run sees.

This module knows nothing of models or optimizers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from hybrid_jax.tokenizer import BYTE_SPECIALS, Tokenizer

PAD, BOS, EOS = 0, 1, 2


@dataclass(frozen=True)
class Document:
    name: str  # the root directory's name / the path below it
    text: str


@dataclass(frozen=True)
class Corpus:
    docs: tuple[Document, ...]
    skipped_undecodable: int
    duplicates: int
    skipped_too_large: int = 0

    @property
    def num_bytes(self) -> int:
        return sum(len(d.text.encode()) for d in self.docs)

    def manifest(self) -> dict:
        """File list and hashes: sha256 of the sorted name list and of the joined texts."""
        names = "\n".join(d.name for d in self.docs)
        h = hashlib.sha256()
        for d in self.docs:
            h.update(d.text.encode())
            h.update(b"\0")
        return {"files": [d.name for d in self.docs], "num_files": len(self.docs),
                "num_bytes": self.num_bytes, "file_list_sha256": hashlib.sha256(names.encode()).hexdigest(),
                "corpus_sha256": h.hexdigest(), "skipped_undecodable": self.skipped_undecodable,
                "duplicates_dropped": self.duplicates, "skipped_too_large": self.skipped_too_large}


def _expand(path: Path, suffixes: tuple[str, ...], exclude: tuple[str, ...]) -> list[tuple[str, Path]]:
    if path.is_file():
        return [(path.name, path)]
    if not path.is_dir():
        raise ValueError(f"data={str(path)!r} does not exist")
    out = []
    for p in path.rglob("*"):
        rel = p.relative_to(path).as_posix()
        if p.is_file() and p.suffix in suffixes and not any(part in exclude for part in rel.split("/")):
            out.append((f"{path.name}/{rel}", p))
    return out


def collect_files(paths: list[str | Path], *, suffixes: tuple[str, ...] = (".py",),
                  exclude: tuple[str, ...] = ("site-packages", "dist-packages", "__pycache__"),
                  max_file_bytes: int | None = None, keep: set[str] | None = None) -> Corpus:
    """Read every file under `paths`, de-duplicated by content, sorted by name.

    A file's name is its path from the directory given, that directory's own name first
    (`python3.12/json/decoder.py`, `numpy/linalg/linalg.py`). Files larger than
    `max_file_bytes` (generated tables, vendored bundles) are skipped and counted. Of
    files with the same text, the one named in `keep` (held-out files) survives, else the
    first by name: a held-out file's vendored copy elsewhere must not be training text.
    """
    if not paths:
        raise ValueError("data=[] names no files or directories")
    found: dict[str, Path] = {}
    for root in paths:
        for rel, p in _expand(Path(root), suffixes, exclude):
            found.setdefault(rel, p)
    seen: set[str] = set()
    docs, bad, dups, big = [], 0, 0, 0
    keep = keep or set()
    for rel in sorted(found, key=lambda r: (r not in keep, r)):
        if max_file_bytes is not None and found[rel].stat().st_size > max_file_bytes:
            big += 1
            continue
        try:
            text = found[rel].read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            bad += 1
            continue
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest in seen:
            dups += 1
            continue
        if text.strip():
            seen.add(digest)
            docs.append(Document(rel, text))
    docs.sort(key=lambda d: d.name)
    if not docs:
        raise ValueError(f"data={[str(p) for p in paths]} holds no non-empty {'/'.join(suffixes)} files")
    return Corpus(tuple(docs), bad, dups, big)


def is_held_out(name: str, fraction: float) -> bool:
    """Stable per-file choice: the first 8 bytes of sha256(name) as a fraction of 2**64."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") < fraction * 2**64


def split_by_file(docs: tuple[Document, ...], fraction: float, *,
                  held_out_names: set[str] | None = None) -> tuple[list[Document], list[Document]]:
    """(train, held_out); held-out is never empty when fraction > 0 and there are 2+ files.

    With `held_out_names` exactly the files of those names are held out (another run's
    held-out list, so two models are compared on the same files) and `fraction` is unused.
    """
    if held_out_names is not None:
        held = [d for d in docs if d.name in held_out_names]
        train = [d for d in docs if d.name not in held_out_names]
        if not train:
            raise ValueError("held_out names every file: no training files are left")
        return train, held
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"eval_fraction={fraction} must be in [0, 1)")
    held = [d for d in docs if is_held_out(d.name, fraction)]
    train = [d for d in docs if not is_held_out(d.name, fraction)]
    if fraction > 0 and not held and len(train) > 1:
        held, train = train[-1:], train[:-1]
    if not train:
        raise ValueError(f"eval_fraction={fraction} leaves no training files")
    return train, held


# The BPE merges are learnt from at most this much text (every k-th training file): merge
# statistics settle long before that, and training on a large corpus would take minutes.
BPE_SAMPLE_BYTES = 48 * 2**20


def bpe_sample(docs: list[Document], max_bytes: int = BPE_SAMPLE_BYTES) -> list[Document]:
    """Every k-th document, k the smallest stride that keeps the sample under max_bytes."""
    total = sum(len(d.text) for d in docs)
    k = max(1, -(-total // max_bytes))
    return docs[::k]


def train_bpe(docs: list[Document], vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer with <pad>, <bos>, <eos> as ids 0, 1, 2.

    The byte-level pre-tokenizer's regex keeps a run of whitespace before a word as its
    own piece ("\\n" + indentation, then " return"), so the merges learn whole indentation
    runs as single tokens. Learnt from `bpe_sample(docs)`.
    """
    if vocab_size < 256 + len(BYTE_SPECIALS):
        raise ValueError(f"vocab_size={vocab_size} must be >= {256 + len(BYTE_SPECIALS)} (bytes + specials)")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BYTE_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    sample = bpe_sample(docs)
    tok.train_from_iterator((d.text for d in sample), trainer=trainer, length=len(sample))
    return tok


def encode_docs(tok: Tokenizer, docs: list[Document]) -> list[np.ndarray]:
    """Each document's ids wrapped as <bos> ids <eos> (int32)."""
    enc = tok.tok.encode_batch([d.text for d in docs], add_special_tokens=False)
    return [np.asarray([BOS, *e.ids, EOS], np.int32) for e in enc]


def pack(encoded: list[np.ndarray], seq_len: int, *, pad_tail: bool = False) -> np.ndarray:
    """Concatenated documents cut into rows [n, seq_len + 1].

    Rows overlap by one token so every position of the stream is a target exactly once.
    The ragged tail is dropped, or with `pad_tail` kept and padded with <pad> (masked in
    the loss), for evaluation.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    stream = np.concatenate(encoded) if encoded else np.zeros((0,), np.int32)
    if pad_tail and len(stream) > 1:
        stream = np.concatenate([stream, np.full(-(len(stream) - 1) % seq_len, PAD, np.int32)])
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(f"the corpus has {len(stream)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


def batch_indices(num_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Rows for `step`: epochs are seeded permutations, so the order depends on (seed, step) only."""
    if batch_size > num_rows:
        raise ValueError(f"batch_size={batch_size} exceeds the {num_rows} packed training rows")
    per_epoch = num_rows // batch_size
    epoch, k = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(num_rows)
    return perm[k * batch_size:(k + 1) * batch_size]
