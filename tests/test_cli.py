"""The hybrid-jax CLI: generate streams the reference greedy continuation; errors exit 2
(one line on stderr; tests/test_cli_errors.py has the rest)."""

from __future__ import annotations

from hybrid_jax.generate import greedy_generate
from hybrid_jax.loading import load_model
from serving.entrypoints.cli import main


def test_generate_prints_the_greedy_continuation(capsys):
    assert main(["generate", "--model", "native-tiny", "--max-tokens", "6", "--temperature", "0", "Hi"]) == 0
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    assert err.startswith("loading model native-tiny\n")  # said before the first compile
    assert [line for line in err.splitlines() if "random weights" in line] == [  # once, on stderr
        "native-tiny is a preset with random weights (untrained): its output is noise, not text; "
        "for real text use the default model or a trained checkpoint directory"]
    lm = load_model("native-tiny")
    tokens = greedy_generate(lm.model, lm.tokenizer.encode("Hi", add_bos=True), 6,
                             eos_ids=lm.config.eos_token_ids)
    assert out == "Hi" + lm.tokenizer.decode(tokens) + "\n"


def test_presets_lists_native_tiny(capsys):
    assert main(["presets"]) == 0
    assert "native-tiny" in capsys.readouterr().out.split()


def test_bad_max_tokens_is_an_error(capsys):
    assert main(["generate", "--max-tokens", "0", "x"]) == 2
    assert "--max-tokens=0" in capsys.readouterr().err


def test_unknown_model_is_one_line_and_exit_2(capsys):
    assert main(["generate", "--model", "no-such-model", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-model" in err and "native-tiny" in err
    assert err.startswith("hybrid-jax generate: error: ")


def test_generate_needs_no_grpc():
    """`generate` imports no gRPC (the server's stubs need a recent grpcio; a machine with
    an older one, or none, still generates): run with every grpc import refused."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class NoGrpc:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'grpc' or name.startswith('grpc.') or name.startswith('grpc_'):\n"
        "            raise ImportError('grpc refused by the test')\n"
        "sys.meta_path.insert(0, NoGrpc())\n"
        "from serving.entrypoints.cli import main\n"
        "sys.exit(main(['generate', '--model', 'native-tiny', '--max-tokens', '3',\n"
        "               '--temperature', '0', 'Hi']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("Hi")


def test_each_subcommand_shows_its_own_examples(capsys):
    import pytest

    helps = {}
    for command in (["generate"], ["presets"], ["serve"], ["client"], ["bench"], []):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        helps[" ".join(command)] = capsys.readouterr().out
    gen = helps["generate"]
    assert "hybrid-jax client" not in gen and "hybrid-jax serve" not in gen  # not the top-level list
    assert "random weights" in gen and "hybrid-jax generate" in gen.split("examples:")[1]
    dtype_help = " ".join(gen.split("  --dtype {float32,bfloat16}\n")[1].split()[:6])
    assert dtype_help.startswith("dtype of the weights and activations"), dtype_help
    assert "random weights" in helps["presets"] and "hybrid-jax client" not in helps["presets"]
    for command in ("serve", "client", "bench"):
        assert "hybrid-jax generate" not in helps[command]
    assert len(set(helps.values())) == len(helps)


def test_serve_logging_shows_other_libraries_from_warning_up_only():
    """`serve --log-level info`: this project's info lines, JAX's / absl's backend probes and
    orbax internals (INFO) hidden, their warnings kept; at --log-level debug likewise."""
    import logging

    from serving.entrypoints.request_log import OwnLevelFilter

    def passes(level: str, name: str, levelno: int) -> bool:
        record = logging.LogRecord(name, levelno, __file__, 1, "m", None, None)
        return OwnLevelFilter(logging.getLevelName(level.upper())).filter(record)

    assert passes("info", "serving.requests", logging.INFO)
    assert not passes("info", "jax._src.xla_bridge", logging.INFO)  # "Unable to initialize backend 'tpu'"
    assert not passes("info", "absl", logging.INFO)  # orbax's checkpoint internals
    assert passes("info", "absl", logging.WARNING) and passes("info", "jax", logging.ERROR)
    assert passes("debug", "hybrid_jax.loading", logging.DEBUG) and not passes("debug", "jax", logging.INFO)
    assert not passes("error", "serving.engine.llm_engine", logging.WARNING)
    assert not passes("error", "jax", logging.WARNING) and passes("error", "jax", logging.ERROR)


def test_help_and_client_start_without_jax():
    """`--help` (top level and each subcommand's) and the client's parser import neither
    JAX nor gRPC: the CLI modules (cli, cli_args, cli_commands, cli_support) defer them to
    the commands that need them, so help and `hybrid-jax client` start fast."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\n"
        "from serving.entrypoints.cli import main\n"
        "for argv in (['--help'], ['serve', '--help'], ['generate', '--help'], ['bench', '--help'],\n"
        "             ['client', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as e:\n"
        "            assert e.code == 0, (argv, e.code)\n"
        "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'grpc')))\n"
        "print(bad)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout[-500:]
