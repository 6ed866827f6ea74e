"""The CLI fails fast and in one line: user errors are one stderr line and exit code 2
(no traceback), checked before weights load or the engine compiles; refusals name flags
the subcommand has; `org/name` comes from the Hugging Face cache or is refused saying
where a local directory goes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybrid_jax.presets import load_preset
from serving.engine.engine_config import EngineConfig, plan_pools
from serving.entrypoints.cli import main
from serving.entrypoints.cli_args import build_parser
from serving.entrypoints.cli_support import user_message
from serving.entrypoints.hub import resolve_model

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
ENV.pop("HYBRID_JAX_DEBUG", None)


def _cli(*args: str, timeout: float = 120, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "serving.entrypoints.cli", *args]
    out = subprocess.run(cmd, cwd=ROOT, env={**ENV, **env}, capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - t0


def _one_error_line(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("loading model")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"hybrid-jax {command}: error: ") and "Traceback" not in err
    return lines[0]


def _hf_dir(tmp_path: Path, architecture: str, *, tokenizer: bool) -> Path:
    d = tmp_path / architecture
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": [architecture], "model_type": "mistral", "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 64, "sliding_window": 8}))
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return d


@pytest.fixture
def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_port_in_use_is_refused_before_anything_loads(free_port):
    out, seconds = _cli("serve", "--port", str(free_port), "--metrics-port", "-1")
    line = _one_error_line(out.stderr, "serve")
    assert out.returncode == 2 and f"--port {free_port}" in line and "in use" in line
    assert seconds < 15  # no weights, no compile
    out, _ = _cli("serve", "--port", "0", "--metrics-port", str(free_port))
    assert out.returncode == 2 and f"--metrics-port {free_port}" in _one_error_line(out.stderr, "serve")


def test_http_flags_are_checked_before_anything_loads(free_port, tmp_path):
    out, seconds = _cli("serve", "--port", "0", "--metrics-port", "-1", "--http-port", str(free_port))
    line = _one_error_line(out.stderr, "serve")
    assert out.returncode == 2 and f"--http-port {free_port}" in line and "in use" in line
    assert seconds < 15
    from serving.entrypoints.cli_commands import http_config

    def check(*flags: str) -> None:
        http_config(build_parser().parse_args(["serve", *flags]))

    with pytest.raises(ValueError, match="--chat-template needs --http-port"):
        check("--chat-template", str(tmp_path / "t.jinja"))
    with pytest.raises(ValueError, match="--default-chat-template-kwargs: not JSON"):
        check("--http-port", "0", "--default-chat-template-kwargs", "{enable_thinking: false}")
    with pytest.raises(ValueError, match="must be a JSON object"):
        check("--http-port", "0", "--default-chat-template-kwargs", "[1]")
    with pytest.raises(FileNotFoundError, match="missing.jinja: no such file"):
        check("--http-port", "0", "--chat-template", str(tmp_path / "missing.jinja"))
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    config = http_config(build_parser().parse_args(["serve", "--model", "native-tiny", "--http-port", "0",
                                                    "--chat-template", str(tmp_path / "t.jinja"),
                                                    "--default-chat-template-kwargs", '{"a": false}']))
    assert config.model_name == "native-tiny" and config.default_chat_template_kwargs == {"a": False}


def test_tls_flags_are_checked_before_anything_loads(tmp_path):
    out, _ = _cli("serve", "--port", "0", "--tls-cert", str(tmp_path / "c.pem"))
    assert out.returncode == 2 and "--tls-key go together" in _one_error_line(out.stderr, "serve")
    out, _ = _cli("serve", "--port", "0", "--tls-cert", str(tmp_path / "c.pem"), "--tls-key",
                  str(tmp_path / "k.pem"))
    assert out.returncode == 2 and "--tls-key" in _one_error_line(out.stderr, "serve")


def test_unsupported_architecture_is_one_line(tmp_path, capsys):
    model = _hf_dir(tmp_path, "FooForCausalLM", tokenizer=True)
    assert main(["generate", "--model", str(model), "x"]) == 2
    assert "FooForCausalLM" in _one_error_line(capsys.readouterr().err, "generate")


def test_missing_tokenizer_is_refused_before_the_weights(tmp_path, capsys):
    model = _hf_dir(tmp_path, "MistralForCausalLM", tokenizer=False)  # and no weights at all
    assert main(["generate", "--model", str(model), "x"]) == 2
    line = _one_error_line(capsys.readouterr().err, "generate")
    assert "tokenizer.json" in line and "safetensors" not in line


def test_debug_env_keeps_the_traceback(monkeypatch):
    monkeypatch.setenv("HYBRID_JAX_DEBUG", "1")
    with pytest.raises(ValueError, match="no-such-model"):
        main(["generate", "--model", "no-such-model", "x"])


def test_multi_line_errors_become_one_line():
    args = build_parser().parse_args(["generate", "x"])
    assert user_message(ValueError("missing:\n  a.b\n  c.d"), args) == "missing:; a.b; c.d"


def _budget_refusal() -> str:
    with pytest.raises(ValueError, match="budget") as err:
        plan_pools(load_preset("native-tiny"), EngineConfig(max_model_len=4096), free_bytes=1 << 20,
                   weight_bytes=0, dtype="float32")
    return str(err.value)


@pytest.mark.parametrize(("command", "want", "absent"), [
    ("generate", "lower --max-tokens", "memory_fraction"),
    ("serve", "lower --max-model-len or --max-prefill-chunk, or raise --memory-fraction", "max_model_len or"),
])
def test_memory_refusal_names_flags_the_subcommand_has(command, want, absent):
    args = build_parser().parse_args([command, "x"] if command == "generate" else [command])
    message = user_message(ValueError(_budget_refusal()), args)
    assert want in message and absent not in message.split(": ")[-1]


def _fake_cache(root: Path, repo: str, files: dict[str, str]) -> Path:
    """The huggingface_hub cache layout for one cached snapshot of `repo`."""
    folder = root / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    for name, text in files.items():
        (snap / name).write_text(text)
    return snap


def test_repo_id_resolves_to_the_cached_snapshot(tmp_path):
    pytest.importorskip("huggingface_hub")
    snap = _fake_cache(tmp_path, "org/tiny", {"config.json": "{}"})
    assert Path(resolve_model("org/tiny", cache_dir=tmp_path, offline=True)) == snap
    assert resolve_model("native-tiny") == "native-tiny"  # presets and directories unchanged
    assert resolve_model(str(tmp_path)) == str(tmp_path)


def test_repo_id_not_cached_offline_says_where_a_local_directory_goes(tmp_path):
    pytest.importorskip("huggingface_hub")
    with pytest.raises(ValueError, match="not in the Hugging Face cache") as err:
        resolve_model("org/absent", cache_dir=tmp_path, offline=True)
    assert "--local-dir" in str(err.value) and "--model DIR" in str(err.value)


def test_repo_id_through_the_cli_uses_the_cache_before_loading(tmp_path, monkeypatch, capsys):
    hub = pytest.importorskip("huggingface_hub")
    snap = _fake_cache(tmp_path, "org/notok", {"config.json": "{}"})  # no tokenizer.json
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["generate", "--model", "org/notok", "x"]) == 2
    assert str(snap) in _one_error_line(capsys.readouterr().err, "generate")
    assert main(["generate", "--model", "org/absent", "x"]) == 2
    assert "--local-dir" in _one_error_line(capsys.readouterr().err, "generate")
