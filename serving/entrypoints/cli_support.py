"""What the CLI does before the slow part, and how it reports what a user can fix.

- `run_user_command`: a subcommand's user errors (ValueError, which includes
  CheckpointError; OSError, which includes FileNotFoundError and a port in use)
  become one line on stderr, `hybrid-jax CMD: error: ...`, and exit code 2, never a
  traceback; HYBRID_JAX_DEBUG=1 shows the traceback. Other exceptions are bugs and
  keep theirs.
- `reword`: the engine's advice ("lower max_model_len ..., or raise memory_fraction")
  names the flags this subcommand has, and drops what it cannot set.
- `prepare_model`: refuses an unknown model name, resolves `org/name`
  (`serving.entrypoints.hub`), checks for tokenizer.json before any weight is read, and says
  "loading model ..." before the first compile.
- `check_bindable`: a port in use is refused before the engine compiles.

This module imports no JAX.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from configs import switches
from serving.entrypoints.hub import is_repo_id, resolve_model

USER_ERRORS = (ValueError, OSError)
EXIT_USER_ERROR = 2
_ADVICE = re.compile(r"\b(lower|raise) (\w+(?: or \w+)*)")
# Engine settings that a subcommand derives from another flag instead of taking them.
DERIVED = {"generate": {"max_model_len": "--max-tokens"}}


def run_user_command(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """command(args), with user errors as one stderr line and exit code 2."""
    try:
        return command(args)
    except KeyboardInterrupt:
        print(f"hybrid-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        if switches.debug():
            raise
        print(f"hybrid-jax {args.command}: error: {user_message(err, args)}", file=sys.stderr)
        return EXIT_USER_ERROR


def user_message(err: BaseException, args: argparse.Namespace) -> str:
    """One line: the error's text (lines joined), its advice naming this command's flags."""
    text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__
    if isinstance(err, OSError) and err.filename and str(err.filename) not in text:
        text = f"{err.filename}: {text}"
    sub = getattr(args, "_subparser", None)
    return reword(text, flags_of(sub, args.command)) if sub is not None else text


def flags_of(parser: argparse.ArgumentParser, command: str) -> dict[str, str]:
    """{engine setting name: the flag that sets it} for one subcommand."""
    flags = {opt[2:].replace("-", "_"): opt for opt in re.findall(r"--[\w-]+", parser.format_usage())}
    for name, flag in DERIVED.get(command, {}).items():
        flags.setdefault(name, flag)
    return flags


def reword(message: str, flags: dict[str, str]) -> str:
    """Rewrite a trailing "lower a or b, or raise c" with flags; drop what no flag sets.

    The message is left as it is when no setting in the advice has a flag.
    """
    head, sep, advice = message.rpartition(": ")
    if not sep or not _ADVICE.match(advice):
        return message
    parts = []
    for verb, names in _ADVICE.findall(advice):
        mapped = dict.fromkeys(flags[n] for n in names.split(" or ") if n in flags)
        if mapped:
            parts.append(f"{verb} {' or '.join(mapped)}")
    return f"{head}: {', or '.join(parts)}" if parts else message


def tokenizer_status(model: str) -> bool | None:
    """For a model directory: whether it will come with a tokenizer; None for other names.

    Read from the files alone (no weights): tokenizer.json, or a native checkpoint of the
    native architecture (which uses the shipped byte-level tokenizer).
    """
    path = Path(model)
    if not path.is_dir():
        return None
    if (path / "tokenizer.json").is_file():
        return True
    native = path / "hybrid_jax_config.json"
    if native.is_file():
        try:
            return json.loads(native.read_text()).get("architecture") == "native"
        except (OSError, ValueError):
            return None  # load_model reports the broken config
    return False


RANDOM_PRESET = ("{model} is a preset with random weights (untrained): its output is noise, not "
                 "text; for real text use the default model or a trained checkpoint directory")


def prepare_model(model: str, *, needs_tokenizer: bool, announce: Callable[[str], None],
                  warn: Callable[[str], None] | None = None) -> str:
    """The loadable name of `model` (an `org/name` becomes its cached directory), checked.

    ValueError for a name that is no directory, preset or repo id; FileNotFoundError
    before any weight is read when a text prompt needs a tokenizer the directory lacks;
    then `announce("loading model ...")`, and for a preset `warn` (default `announce`)
    says, in one line, that its weights are random.
    """
    presets = preset_names()
    if not (Path(model).is_dir() or model in presets or is_repo_id(model)):
        raise ValueError(f"model={model!r} is neither a model directory, a preset ({', '.join(presets)}) "
                         "nor a Hugging Face repo id (org/name)")
    path = resolve_model(model)
    if tokenizer_status(path) is False:
        if needs_tokenizer:
            raise FileNotFoundError(f"{model}: no tokenizer.json in {path}; copy the model's "
                                    "tokenizer.json there (a text prompt needs it)")
        announce(f"{model}: no tokenizer.json; text prompts will be refused, token ids work")
    where = "" if path == model else f" from {path}"
    announce(f"loading model {model}{where}")
    if model in presets and not Path(model).is_dir():
        (warn or announce)(RANDOM_PRESET.format(model=model))
    return path


def preset_names() -> list[str]:
    """The presets in configs/models (as `hybrid_jax.presets`, without importing JAX)."""
    root = resources.files("configs") / "models"
    return sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json"))


def check_bindable(host: str, port: int, flag: str = "--port") -> None:
    """OSError naming `flag` when `host:port` cannot be listened on now (in use, not local).

    A cheap check before a long engine compile; port 0 (any free port) always passes.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise OSError(f"--host {host}: cannot resolve it ({err.strerror})") from err
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError as err:
                raise OSError(f"cannot listen on {host}:{port} ({flag} {port}): {err.strerror}") from err
