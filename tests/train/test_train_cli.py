"""`hybrid-jax train`: bad arguments fail at once, in one line naming the setting (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import configs
from serving.entrypoints.cli import main
from tests.train.helpers import write_corpus


def _run(capsys, *args: str) -> str:
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybrid-jax train: error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return str(write_corpus(tmp_path_factory.mktemp("corpus"), copies=2))


def test_missing_data_and_empty_corpus(capsys, tmp_path):
    assert "data=" in _run(capsys, "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "r"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.py").write_text("  \n")
    err = _run(capsys, "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "r"))
    assert "data=" in err and "holds no" in err


def test_unknown_preset_and_bad_settings(capsys, src, tmp_path):
    err = _run(capsys, "--data", src, "--preset", "native-tny", "--out", str(tmp_path))
    assert "preset='native-tny'" in err and "native-tiny" in err
    assert "batch_size=6" in _run(capsys, "--data", src, "--out", str(tmp_path), "--batch-size", "6",
                                  "--grad-accum", "4")
    assert "warmup_steps=10" in _run(capsys, "--data", src, "--out", str(tmp_path), "--steps", "10",
                                     "--warmup-steps", "10")
    assert "num_devices=64" in _run(capsys, "--data", src, "--out", str(tmp_path), "--num-devices", "64")
    assert "model_config=" in _run(capsys, "--data", src, "--model-config", str(tmp_path / "x.json"),
                                   "--out", str(tmp_path))
    assert "init_from=" in _run(capsys, "--data", src, "--init-from", str(tmp_path), "--out", str(tmp_path))


def test_batch_larger_than_the_corpus(capsys, src, tmp_path):
    err = _run(capsys, "--data", src, "--preset", "native-tiny", "--out", str(tmp_path),
               "--vocab-size", "300", "--seq-len", "64", "--batch-size", "4096", "--dtype", "float32")
    assert "batch_size=4096" in err and "rows" in err


def test_tokenizer_without_the_special_ids_is_refused(capsys, src, tmp_path):
    tok = json.loads((Path(configs.__file__).parent / "tokenizers" / "byte-level.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "<bos>"]
    tok["model"]["vocab"].pop("<bos>")
    (tmp_path / "t.json").write_text(json.dumps(tok))
    err = _run(capsys, "--data", src, "--preset", "native-tiny", "--out", str(tmp_path / "r"),
               "--tokenizer", str(tmp_path / "t.json"))
    assert "tokenizer=" in err and "<bos>" in err
