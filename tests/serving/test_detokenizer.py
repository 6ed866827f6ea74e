"""Incremental detokenization: multi-byte characters split across tokens, stop strings."""

from __future__ import annotations

from hybrid_jax.tokenizer import Tokenizer, byte_level_tokenizer
from serving.detokenizer import IncrementalDetokenizer

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
