"""Model names on the command line: a directory, a preset, or a Hugging Face repo id.

    resolve_model("native-tiny")              -> "native-tiny"        (a preset: unchanged)
    resolve_model("./my-model")               -> "./my-model"         (a directory: unchanged)
    resolve_model("tiiuae/Falcon-H1-0.5B")    -> ".../snapshots/<commit>"  (the HF cache)

A name of the form `org/name` that is not a local path is looked up in the local
Hugging Face cache (`huggingface_hub`, which comes with transformers; it is optional),
downloaded when the machine is online, and otherwise refused with a ValueError that
says where a local directory goes. Only what loading needs is fetched: `*.json`
(config, tokenizer) and `*.safetensors`. This module knows nothing of models or
engines; `hybrid_jax.loading.load_model` loads the directory it returns.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
PATTERNS = ["*.json", "*.safetensors"]  # config.json, tokenizer.json, weights (+ index)


def is_repo_id(name: str) -> bool:
    """True for `org/name` that is not an existing local path."""
    return REPO_ID.fullmatch(name) is not None and not Path(name).exists()


def resolve_model(name: str, *, cache_dir: str | Path | None = None, offline: bool | None = None) -> str:
    """A directory for an `org/name` repo id (cached or downloaded); other names unchanged.

    offline: None reads HF_HUB_OFFLINE; True never touches the network.
    ValueError: huggingface_hub missing, no such repo, or not cached while offline.
    """
    if not is_repo_id(name):
        return name
    try:
        import huggingface_hub
        from huggingface_hub import snapshot_download
    except ImportError as err:
        raise ValueError(f"model={name!r} looks like a Hugging Face repo id, but huggingface_hub is not "
                         f"installed (pip install huggingface_hub); or {_local_dir_hint(name)}") from err
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return snapshot_download(name, cache_dir=cache_dir, allow_patterns=PATTERNS, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    if offline if offline is not None else huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ValueError(f"model={name!r} is not in the Hugging Face cache "
                         f"({cache_dir or huggingface_hub.constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE "
                         f"is set; {_local_dir_hint(name)}")
    try:
        return snapshot_download(name, cache_dir=cache_dir, allow_patterns=PATTERNS)
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise ValueError(f"model={name!r}: no such model on the Hugging Face Hub, or it is private or "
                         f"gated (log in with `hf auth login` or set HF_TOKEN): {_first_line(err)}") from err
    except Exception as err:  # offline, DNS, proxy, disk: huggingface_hub raises many kinds
        raise ValueError(f"model={name!r} is not in the Hugging Face cache and could not be downloaded "
                         f"({type(err).__name__}: {_first_line(err)}); {_local_dir_hint(name)}") from err


def _local_dir_hint(name: str) -> str:
    return (f"download it where there is network (`hf download {name} --local-dir DIR`), copy DIR "
            "here and pass --model DIR: a directory holding config.json, *.safetensors and "
            "tokenizer.json")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""
