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
