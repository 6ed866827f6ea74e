"""`python -m serving.entrypoints.bench MODE ...`: the same as `hybrid-jax bench MODE ...`, without the
rest of the CLI (no gRPC import unless the serving mode needs it)."""

from __future__ import annotations

import argparse
import sys

from serving.entrypoints.bench import main
from serving.entrypoints.bench.args import BENCH_EPILOG, add_args


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m serving.entrypoints.bench", epilog=BENCH_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(p)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main(_parse(sys.argv[1:])))
