"""Tokenizers from `tokenizer.json` files (the `tokenizers` library), plus the byte-level
tokenizer that the native presets use.

Only text <-> ids. Incremental (streaming) detokenization lives with the engine.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

BYTE_SPECIALS = ("<pad>", "<bos>", "<eos>")


class Tokenizer:
    """Text <-> token ids. `bos_id` is prepended by `encode` when `add_bos` and set."""

    def __init__(self, tok: tokenizers.Tokenizer, *, bos_id: int | None = None):
        self.tok = tok
        self.bos_id = bos_id

    @classmethod
    def from_file(cls, path: str | Path, *, bos_id: int | None = None) -> Tokenizer:
        """`path` is a tokenizer.json file or a directory holding one."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found")
        return cls(tokenizers.Tokenizer.from_file(str(path)), bos_id=bos_id)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (byte-level pieces such as 'Ġcat')."""
        return [self.tok.id_to_token(int(i)) or "" for i in ids]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, seqs: list[list[int]], *, skip_special_tokens: bool = True) -> list[str]:
        """`decode` of each list, in one call into the Rust library."""
        seqs = [x if isinstance(x, list) else list(x) for x in seqs]
        return self.tok.decode_batch(seqs, skip_special_tokens=skip_special_tokens)


def byte_level_tokenizer() -> tokenizers.Tokenizer:
    """Specials <pad>=0, <bos>=1, <eos>=2, then one token per byte (ids 3..258)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))
    vocab = {s: i for i, s in enumerate(BYTE_SPECIALS)}
    vocab |= {ch: len(BYTE_SPECIALS) + i for i, ch in enumerate(alphabet)}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIALS))
    return tok


def _byte_of(ch: str) -> int:
    """The byte that GPT-2's byte-level alphabet maps to the character `ch`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    if ord(ch) in printable:
        return ord(ch)
    missing = [b for b in range(256) if b not in printable]
    return missing[ord(ch) - 256]
