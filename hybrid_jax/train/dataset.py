"""A run's data: corpus -> held-out split -> tokenizer (trained or given) -> packed rows.

The tokenizer is written into the run directory (`tokenizer.json`) and reused on
resume, so a resumed run tokenizes exactly as the interrupted one did.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import pre_tokenizers

from hybrid_jax.tokenizer import BYTE_SPECIALS, Tokenizer
from hybrid_jax.train.config import TrainConfig
from hybrid_jax.train.data import BOS, EOS, PAD, collect_files, encode_docs, pack, split_by_file, train_bpe


@dataclass
class Dataset:
    tokenizer: Tokenizer
    tokenizer_file: Path
    train_rows: np.ndarray  # [n, seq_len + 1] int32
    eval_rows: np.ndarray  # [m, seq_len + 1] int32, the tail padded with <pad> (masked)
    token_bytes: np.ndarray  # [vocab] UTF-8 bytes each id stands for (specials: 0)
    manifest: dict

    def eval_bytes(self, rows: np.ndarray) -> int:
        """Bytes of text that the targets of `rows` stand for (for bits per byte)."""
        return int(self.token_bytes[rows[:, 1:]].sum())


def _check_specials(tok: Tokenizer, source: str) -> None:
    for want, name in ((PAD, "<pad>"), (BOS, "<bos>"), (EOS, "<eos>")):
        if tok.tok.token_to_id(name) != want:
            raise ValueError(f"tokenizer={source!r} must map {name} to id {want} "
                             f"(found {tok.tok.token_to_id(name)})")


def token_bytes(tok: Tokenizer) -> np.ndarray:
    """Bytes per id: byte-level tokens are one alphabet character per byte; specials 0."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    out = np.zeros(tok.vocab_size, np.int64)
    for i in range(tok.vocab_size):
        s = tok.tok.id_to_token(i)
        if s is None or s in BYTE_SPECIALS:
            continue
        out[i] = len(s) if set(s) <= alphabet else len(s.encode())
    return out


def _tokenizer(train_docs, tc: TrainConfig, run_dir: Path, given: str | None) -> Path:
    dest = run_dir / "tokenizer.json"
    if given is not None:
        if not Path(given).is_file():
            raise ValueError(f"tokenizer={given!r} is not a file")
        if Path(given).absolute() != dest.absolute():
            dest.write_text(Path(given).read_text())
    elif not dest.is_file():  # a resumed run keeps the tokenizer it was trained with
        train_bpe(train_docs, tc.vocab_size).save(str(dest))
    return dest


def read_held_out(path: str) -> set[str]:
    """File names to hold out: a run's corpus.json (its `held_out_files`) or one name a line."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"held_out={path!r} is not a file")
    text = p.read_text()
    if p.suffix == ".json":
        names = json.loads(text).get("held_out_files")
        if not isinstance(names, list):
            raise ValueError(f"held_out={path!r} has no 'held_out_files' list")
        return set(names)
    return {line.strip() for line in text.splitlines() if line.strip()}


def prepare(data: list[str], tc: TrainConfig, run_dir: str | Path, *,
            tokenizer: str | None = None, held_out: str | None = None,
            max_file_bytes: int | None = None) -> Dataset:
    """Read, split, tokenize and pack `data` (files or directories of .py files).

    `held_out` (a corpus.json or a list of names) fixes the held-out files instead of
    `eval_fraction`; the names it lists that the corpus lacks are counted in the manifest.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    names = read_held_out(held_out) if held_out is not None else None
    corpus = collect_files(data, max_file_bytes=max_file_bytes, keep=names)
    train_docs, held = split_by_file(corpus.docs, tc.eval_fraction, held_out_names=names)
    tok_file = _tokenizer(train_docs, tc, run_dir, tokenizer)
    tok = Tokenizer.from_file(tok_file, bos_id=BOS)
    _check_specials(tok, tokenizer or str(tok_file))
    train_rows = pack(encode_docs(tok, train_docs), tc.seq_len)
    eval_rows = (pack(encode_docs(tok, held), tc.seq_len, pad_tail=True) if held
                 else np.zeros((0, tc.seq_len + 1), np.int32))
    if tc.batch_size > len(train_rows):
        raise ValueError(f"batch_size={tc.batch_size} exceeds the {len(train_rows)} packed training "
                         f"rows of seq_len={tc.seq_len}: add data or lower batch_size/seq_len")
    manifest = corpus.manifest() | {
        "held_out_files": [d.name for d in held], "train_files": len(train_docs),
        "held_out_missing": sorted(names - {d.name for d in held}) if names is not None else [],
        "train_tokens": int(train_rows.size - len(train_rows)), "eval_rows": len(eval_rows)}
    (run_dir / "corpus.json").write_text(json.dumps(manifest, indent=1))
    return Dataset(tok, tok_file, train_rows, eval_rows, token_bytes(tok), manifest)
