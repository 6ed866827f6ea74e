"""`python -m hybrid_jax.train ...` = `hybrid-jax train ...`.

A user error (a missing data path, an empty corpus, an unknown preset, a batch that
does not fit, a bad setting) is one line on stderr and exit code 2;
HYBRID_JAX_DEBUG=1 shows the traceback.
"""

from __future__ import annotations

import argparse
import sys

from configs import switches
from hybrid_jax.train.cli import add_train_args, run_train


def main(argv: list[str] | None = None, prog: str = "python -m hybrid_jax.train") -> int:
    p = argparse.ArgumentParser(prog=prog, description="train a hybrid model on text files",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(p)
    args = p.parse_args(argv)
    try:
        return run_train(args)
    except (ValueError, OSError) as err:
        if switches.debug():
            raise
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted (re-run the same command to resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
