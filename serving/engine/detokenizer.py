"""Incremental detokenization and stop-string matching for one request.

Text is produced as tokens arrive: each step decodes a short window of recent
tokens and emits only what is new, holding back a trailing U+FFFD (a multi-byte
character split across tokens) until its remaining bytes arrive. With a
`tokenizers` tokenizer this runs in Rust (`tokenizers.decoders.DecodeStream`, one
call per token: the host's detokenization at batch 256 costs a fraction of decoding
two windows per request); other tokenizers decode the windows here. Stop strings are
matched on the text; a match truncates the output before the stop string. This
module knows nothing of devices or scheduling.
"""

from __future__ import annotations

import tokenizers

from hybrid_jax.tokenizer import Tokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21: the windows are decoded here
    DecodeStream = None

REPLACEMENT = "\ufffd"
CONTEXT = 6  # tokens of left context decoded with the new ones (merges, leading spaces)


def _decode_stream(tokenizer: Tokenizer, context: list[int]):
    """A DecodeStream that has seen `context` (its text not emitted), or None."""
    rust = getattr(tokenizer, "tok", None)
    if DecodeStream is None or not isinstance(rust, tokenizers.Tokenizer):
        return None
    try:
        return DecodeStream(ids=context, skip_special_tokens=True)
    except TypeError:  # no `ids` argument (older tokenizers): step through the context
        stream = DecodeStream(skip_special_tokens=True)
        for t in context:
            stream.step(rust, t)
        return stream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.prefix = max(0, len(self.ids) - CONTEXT)  # start of the decoded window
        self.read = len(self.ids)  # tokens whose text has been emitted
        self.text = ""
        self.stop = tuple(s for s in stop if s)
        self.stopped_on: str | None = None
        self.shown = 0  # characters of `text` already returned
        self._stream = _decode_stream(tokenizer, self.ids[self.prefix:])

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly visible text (possibly empty)."""
        if self._stream is not None:
            return self._add_streamed(token_ids)
        done, window = self._extend(token_ids)
        return self._accept(self.tokenizer.decode(done), self.tokenizer.decode(window))

    def _add_streamed(self, token_ids: list[int]) -> str:
        """`add` through the DecodeStream: None from a step holds the token back (a split
        character, or no text yet), as a trailing U+FFFD does in `_accept`."""
        text, rust = "", self.tokenizer.tok
        for t in token_ids:
            self.ids.append(t)
            piece = self._stream.step(rust, t)
            if piece is not None:
                self.read = len(self.ids)
                text += self._append(piece)
        return text

    @staticmethod
    def add_batch(items: list[tuple[IncrementalDetokenizer, list[int]]]) -> list[str]:
        """`add` for several requests: one `decode_batch` call per tokenizer instead of two
        `decode` calls per request (host time per step at large batches)."""
        out: list[str] = [""] * len(items)
        groups: dict[int, list[int]] = {}
        for i, (d, ids) in enumerate(items):
            if d._stream is not None:
                out[i] = d._add_streamed(ids)
            else:
                groups.setdefault(id(d.tokenizer), []).append(i)
        for idx in groups.values():
            windows = [items[i][0]._extend(items[i][1]) for i in idx]
            tok = items[idx[0]][0].tokenizer
            flat = [w for pair in windows for w in pair]
            batch = getattr(tok, "decode_batch", None)
            texts = batch(flat) if batch is not None else [tok.decode(w) for w in flat]
            for j, i in enumerate(idx):
                out[i] = items[i][0]._accept(texts[2 * j], texts[2 * j + 1])
        return out

    def _extend(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Append tokens; the windows to decode: emitted tokens, and all of them."""
        self.ids += token_ids
        return self.ids[self.prefix:self.read], self.ids[self.prefix:]

    def _accept(self, prefix_text: str, full: str) -> str:
        """The newly visible text, given the two windows of `_extend` decoded."""
        if full.endswith(REPLACEMENT) or len(full) < len(prefix_text):
            return ""  # wait for the rest of a split character
        new = full[len(prefix_text):]
        self.prefix = max(self.prefix, self.read - CONTEXT)
        self.read = len(self.ids)
        return self._append(new)

    def flush(self) -> str:
        """At the end of a request: whatever was held back, even if incomplete."""
        self.prefix = max(self.prefix, self.read - CONTEXT)
        rest = self.tokenizer.decode(self.ids[self.prefix:])
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        self.read = len(self.ids)
        return self._append(rest[len(done):], final=True)

    def _append(self, new: str, final: bool = False) -> str:
        """Add text; return what may be shown now.

        While streaming, a tail that could still grow into a stop string is held
        back (shown later, or never if the stop string completes).
        """
        if self.stopped_on is not None:
            return ""
        before = len(self.text)
        # Extend in place: CPython grows a string held by one reference without copying
        # it, while `self.text += new` copies the whole text (O(output) per token).
        text, self.text = self.text, ""
        text += new
        self.text = text
        end = len(text)
        if self.stop:
            window_start = max(0, before - max(map(len, self.stop)) + 1)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, window_start)) >= 0]
            if hits:
                end, self.stopped_on = min(hits)
                self.text = self.text[:end]
            elif not final:
                end -= self._partial_stop_suffix()
        shown, self.shown = self.text[self.shown:end], max(self.shown, end)
        return shown

    def _partial_stop_suffix(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
