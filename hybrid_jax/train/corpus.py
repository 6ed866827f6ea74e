"""The default model's corpus: this Python's standard library `.py` files.

Every machine with Python has it offline. `stdlib_dir()` is the directory; the
`stdlib` data name in `hybrid-jax train --data stdlib` resolves to it. Files are read
by `data.collect_files` (site-packages and __pycache__ skipped, UTF-8 only, exact
duplicates dropped, sorted by relative path); the run's corpus.json records the file
list and its sha256, so two machines can check they trained on the same text.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def resolve_data(paths: list[str]) -> list[str]:
    """Replace the alias `stdlib` by this interpreter's standard-library directory."""
    return [str(stdlib_dir()) if p == "stdlib" else p for p in paths]
