"""Training data: tokenizer round trip, packing with separators, held-out split, batches."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_jax.tokenizer import Tokenizer
from hybrid_jax.train.data import (
    BOS,
    EOS,
    PAD,
    Document,
    batch_indices,
    bpe_sample,
    collect_files,
    pack,
    split_by_file,
    train_bpe,
)
from hybrid_jax.train.dataset import read_held_out
from tests.train.helpers import SNIPPETS, write_corpus


def test_bpe_tokenizer_round_trips_the_corpus(tmp_path):
    corpus = collect_files([write_corpus(tmp_path)])
    tok = Tokenizer(train_bpe(list(corpus.docs), 300))
    assert tok.vocab_size == 300
    assert [tok.tok.id_to_token(i) for i in (PAD, BOS, EOS)] == ["<pad>", "<bos>", "<eos>"]
    for doc in corpus.docs:
        ids = tok.encode(doc.text)
        assert tok.decode(ids) == doc.text
    # merges were learnt: fewer tokens than bytes; unseen text still round-trips (byte fallback)
    text = "".join(d.text for d in corpus.docs)
    assert len(tok.encode(text)) < 0.7 * len(text.encode())
    odd = "λ = lambda x:\r\n\t  x ** 2  # 😀 \x00"
    assert tok.decode(tok.encode(odd)) == odd


def test_collect_dedupes_sorts_and_refuses_empty(tmp_path):
    src = write_corpus(tmp_path, copies=1)
    (src / "copy.py").write_text(SNIPPETS[0] + "\nVERSION = 0\n")  # same bytes as pkg0/mod0.py
    (src / "bad.py").write_bytes(b"\xff\xfe not utf-8")
    (src / "notes.txt").write_text("not python")
    corpus = collect_files([src])
    names = [d.name for d in corpus.docs]
    assert names == sorted(names) and "notes.txt" not in names and "bad.py" not in names
    assert corpus.duplicates == 1 and corpus.skipped_undecodable == 1
    m = corpus.manifest()
    assert m["num_files"] == len(names) and len(m["file_list_sha256"]) == 64
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="data=.*holds no"):
        collect_files([empty])
    with pytest.raises(ValueError, match="data=.*does not exist"):
        collect_files([tmp_path / "missing"])


def _docs(lengths):
    """Document k is <bos> (100+k repeated) <eos>: every token names its document."""
    return [np.asarray([BOS, *[100 + k] * n, EOS], np.int32) for k, n in enumerate(lengths)]


@pytest.mark.parametrize("seq_len", [1, 5, 16, 64])
def test_packing_never_joins_documents_without_a_separator(seq_len):
    docs = _docs([3, 17, 1, 40, 9, 2, 25])
    rows = pack(docs, seq_len)
    assert rows.shape[1] == seq_len + 1
    np.testing.assert_array_equal(rows[1:, 0], rows[:-1, -1])  # rows overlap by one token
    stream = np.concatenate([rows[0], *[r[1:] for r in rows[1:]]])
    np.testing.assert_array_equal(stream, np.concatenate(docs)[:len(stream)])
    for row in rows:  # within a row: a change of document passes through <eos> <bos>
        for a, b in zip(row[:-1], row[1:], strict=True):
            if a >= 100 and b >= 100:
                assert a == b
            if a >= 100 and b != a:
                assert b == EOS
            if b >= 100 and a != b:
                assert a == BOS


def test_pack_pads_the_evaluation_tail_and_refuses_a_too_short_corpus():
    rows = pack(_docs([4]), 8, pad_tail=True)
    assert rows.shape == (1, 9) and rows[0, -1] == PAD and rows[0, 5] == EOS
    with pytest.raises(ValueError, match="seq_len"):
        pack(_docs([4]), 8)


def test_split_by_file_is_stable_and_disjoint(tmp_path):
    corpus = collect_files([write_corpus(tmp_path)])
    train, held = split_by_file(corpus.docs, 0.2)
    assert held and train and not {d.name for d in train} & {d.name for d in held}
    assert split_by_file(corpus.docs, 0.2) == (train, held)
    with pytest.raises(ValueError, match="eval_fraction"):
        split_by_file(corpus.docs, 1.0)


def test_batches_depend_on_seed_and_step_only():
    a = [batch_indices(10, 3, s, seed=7) for s in range(9)]
    assert all(np.array_equal(x, batch_indices(10, 3, s, seed=7)) for s, x in enumerate(a))
    assert len(set(np.concatenate(a[:3]).tolist())) == 9  # no row twice within an epoch
    with pytest.raises(ValueError, match="batch_size=11"):
        batch_indices(10, 11, 0, seed=0)


def test_held_out_list_keeps_its_files_over_duplicates_and_large_files_are_skipped(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "copy.py").write_text("x = 1\n")  # sorts first: would win without `keep`
    (tmp_path / "b" / "orig.py").write_text("x = 1\n")
    (tmp_path / "b" / "other.py").write_text("y = 2\n")
    (tmp_path / "b" / "big.py").write_text("z = 3\n" * 100)
    paths = [tmp_path / "a", tmp_path / "b"]
    assert [d.name for d in collect_files(paths).docs] == ["a/copy.py", "b/big.py", "b/other.py"]
    corpus = collect_files(paths, keep={"b/orig.py"}, max_file_bytes=100)
    assert [d.name for d in corpus.docs] == ["b/orig.py", "b/other.py"]
    assert (corpus.duplicates, corpus.skipped_too_large) == (1, 1)
    listing = tmp_path / "held.txt"
    listing.write_text("b/orig.py\nb/gone.py\n")
    names = read_held_out(str(listing))
    train, held = split_by_file(corpus.docs, 0.0, held_out_names=names)
    assert [d.name for d in held] == ["b/orig.py"] and [d.name for d in train] == ["b/other.py"]
    manifest = tmp_path / "corpus.json"
    manifest.write_text('{"held_out_files": ["b/orig.py"]}')
    assert read_held_out(str(manifest)) == {"b/orig.py"}
    with pytest.raises(ValueError, match="held_out"):
        read_held_out(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="held_out"):
        split_by_file(corpus.docs, 0.0, held_out_names={"b/orig.py", "b/other.py"})
    docs = [Document(f"f{i}", "x" * 10) for i in range(10)]
    assert [d.name for d in bpe_sample(docs, max_bytes=35)] == ["f0", "f3", "f6", "f9"]
    assert bpe_sample(docs, max_bytes=1000) == docs
