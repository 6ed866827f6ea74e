"""Incremental detokenization: multi-byte characters split across tokens, stop strings."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_jax.tokenizer import Tokenizer, byte_level_tokenizer
from serving.engine import detokenizer
from serving.engine.detokenizer import IncrementalDetokenizer

TOK = Tokenizer(byte_level_tokenizer(), bos_id=1)


def stream(text: str, stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    d = IncrementalDetokenizer(TOK, [1] + TOK.encode("prompt "), stop)
    pieces = [d.add([tok]) for tok in TOK.encode(text)]
    pieces.append(d.flush())
    return pieces, d


def test_split_multibyte_characters_are_held_back_until_complete():
    text = "a 世界 🙂 é!"
    pieces, d = stream(text)
    assert "".join(pieces) == text == d.text
    assert all("\ufffd" not in p for p in pieces)
    assert "世" in pieces  # emitted whole, on its third byte


def test_stop_string_truncates_output_and_spans_tokens():
    pieces, d = stream("hello STOP world", stop=("STOP",))
    assert d.stopped_on == "STOP"
    assert "".join(pieces) == d.text == "hello "


def test_earliest_stop_string_wins():
    _, d = stream("xx ab cd", stop=("cd", "b c"))
    assert d.stopped_on == "b c" and d.text == "xx a"


def test_flush_emits_an_incomplete_tail():
    d = IncrementalDetokenizer(TOK, [1], ())
    assert d.add(TOK.encode("ok")[:1]) == "o"
    assert d.add(TOK.encode("é")[:1]) == ""  # first byte of a two-byte character
    assert d.flush() == "\ufffd"


def test_add_batch_equals_add_per_request():
    """The engine's batched path (one decode_batch call per step) gives each request the
    pieces that `add` gives it alone: split characters, stop strings, a finished request."""
    texts = ["a 世界 🙂 é!", "hello STOP world", "xx ab cd", "plain text", "🙂🙂"]
    stops = [(), ("STOP",), ("cd", "b c"), ("zz",), ()]
    ids = [TOK.encode(t) for t in texts]
    alone = [stream(t, s)[0][:-1] for t, s in zip(texts, stops, strict=True)]
    ds = [IncrementalDetokenizer(TOK, [1] + TOK.encode("prompt "), s) for s in stops]
    batched: list[list[str]] = [[] for _ in texts]
    for k in range(max(map(len, ids))):
        live = [i for i in range(len(texts)) if k < len(ids[i])]
        out = IncrementalDetokenizer.add_batch([(ds[i], [ids[i][k]]) for i in live])
        for i, piece in zip(live, out, strict=True):
            batched[i].append(piece)
    assert batched == alone
    assert [d.stopped_on for d in ds] == [None, "STOP", "b c", None, None]


def _metaspace_tokenizer() -> Tokenizer:
    """Word-level tokens with SentencePiece's '▁' spaces: decoding a window drops the
    leading space of its first token, so context handling shows in the text."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", "▁hello", "▁world", "!", "▁a", "b", "▁", "é"]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(tok, bos_id=1)


@pytest.mark.parametrize("streamed", [True, False], ids=["decode_stream", "windows"])
@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_random_streams_give_the_full_decode(kind, streamed, monkeypatch):
    """Random token streams (split multi-byte characters, special tokens mid-stream, ids
    past the tokenizer's vocabulary as a padded model vocabulary samples): the pieces
    plus the flush are the full decode's text after the prompt, through the Rust
    DecodeStream and through the window path alike, piece for piece."""
    tok = TOK if kind == "byte_level" else _metaspace_tokenizer()
    if not streamed:
        monkeypatch.setattr(detokenizer, "DecodeStream", None)
    rng = np.random.default_rng(0 if kind == "byte_level" else 1)
    prompt = [1, *tok.encode("hello world" if kind == "metaspace" else "prompt ")]
    vocab = tok.vocab_size
    for _ in range(20):
        out = [int(t) for t in rng.integers(0, vocab + 3, size=int(rng.integers(1, 40)))]
        d = IncrementalDetokenizer(tok, prompt)
        assert (d._stream is not None) == (streamed and detokenizer.DecodeStream is not None)
        pieces = [d.add([t]) for t in out] + [d.flush()]
        full = tok.decode(prompt + out)
        assert "".join(pieces) == full[len(tok.decode(prompt)):]
        if streamed:  # the same pieces as the window path
            with monkeypatch.context() as m:
                m.setattr(detokenizer, "DecodeStream", None)
                w = IncrementalDetokenizer(tok, prompt)
                assert [w.add([t]) for t in out] + [w.flush()] == pieces
