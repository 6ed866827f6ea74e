"""`python -m hybrid_jax.train ...` = `hybrid-jax train ...` (no serving imports)."""

from __future__ import annotations

import argparse
import sys

from hybrid_jax.train.cli import add_train_args, run_train


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybrid_jax.train", description="train a hybrid model",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(p)
    args = p.parse_args(argv)
    try:
        return run_train(args)
    except ValueError as err:
        print(f"train: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
