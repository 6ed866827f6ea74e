"""The `hybrid-jax` command line: generate, serve, client, presets.

  generate  one prompt through the engine in this process, streamed to the terminal
  serve     a gRPC server (+ Prometheus metrics, + the OpenAI HTTP API with --http-port) on the
            continuous-batching engine
  client    stream one prompt from a running server to the terminal
  presets   list the model presets
  train     train a model (hybrid_jax.train): optax AdamW, orbax checkpoints, exact resume
  bench     benchmarks: throughput | serving | scaling | sweep (JSON + PNG)

MODEL is a Hugging Face directory, a native (orbax) directory, a preset name
(presets have random weights until trained) or a Hugging Face repo id `org/name`
(from the local HF cache, downloaded when online). A user error (unknown model, a
port in use, a missing file, a configuration that does not fit) is one line on
stderr and exit code 2; HYBRID_JAX_DEBUG=1 shows the traceback.

This module is the entry point (`main`, the `hybrid-jax` console script); the parser is
serving/entrypoints/cli_args.py, what each subcommand does serving/entrypoints/cli_commands.py,
the user-error handling and checks before loading serving/entrypoints/cli_support.py. None of
them imports JAX at import time, so `--help` and `hybrid-jax client` start fast.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from serving.entrypoints.cli_args import build_parser
from serving.entrypoints.cli_commands import dispatch
from serving.entrypoints.cli_support import run_user_command


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; a user error is one line on stderr and exit code 2 (cli_support)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:
        from hybrid_jax.train.__main__ import main as train_main

        return train_main(argv[1:], prog="hybrid-jax train")
    return run_user_command(dispatch, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
