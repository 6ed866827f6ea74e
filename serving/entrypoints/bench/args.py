"""The `hybrid-jax bench` arguments. Imports neither JAX nor the engine, so that the CLI's
parser (built for every command) stays fast."""

from __future__ import annotations

import argparse
import math

MODES = ("throughput", "serving", "scaling", "sweep")
LEN_DISTS = ("fixed", "uniform", "lognormal")


def add_args(p: argparse.ArgumentParser) -> None:
    """The `bench` subcommand's arguments (imports no JAX)."""
    p.add_argument("mode", choices=MODES)
    p.add_argument("--out", default="bench_out", help="for MODE.json, MODE.png (default bench_out)")
    p.add_argument("--smoke", action="store_true", help="tiny preset and sizes: checks the mode in seconds")
    p.add_argument("--profile", default=None, metavar="DIR", help="write a jax.profiler trace here")
    p.add_argument("--model", default=None, help="preset or model dir (default native-1b-parallel)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="default bfloat16 (float32 with --smoke)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--len-dist", default="fixed", choices=LEN_DISTS, help="input/output length distribution")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="uniform: +-ratio around the mean; lognormal: sigma")
    g = p.add_argument_group("engine sizing")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-prefill-chunk", type=int, default=None, help="default: the mode's")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--memory-fraction", type=float, default=0.5)
    g.add_argument("--seq-buckets", default=None, help="throughput/serving: e.g. 64 (default: powers of 2)")
    g.add_argument("--token-buckets", default=None, help="throughput/serving: e.g. 2048")
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="throughput/serving: N engine replicas, one per device (serving: the child "
                        "server's --data-parallel-size; default 1)")
    for mode_args in (_throughput, _serving_mode, _scaling, _sweep):
        mode_args(p)


def _throughput(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("throughput")
    g.add_argument("--num-requests", type=int, default=256)
    g.add_argument("--input-len", type=int, default=512)
    g.add_argument("--output-len", type=int, default=128)


def _serving_mode(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving")
    g.add_argument("--server", default=None,
                   help="HOST:PORT of a running server, or http://HOST:PORT with --backend openai "
                        "(default: start `hybrid-jax serve` as a child process with this command's model and "
                        "engine flags, stopped at the end)")
    g.add_argument("--backend", default="grpc", choices=["grpc", "openai"],
                   help="grpc: the Generate RPC; openai: streamed /v1/completions with token-id prompts, "
                        "against this server's --http-port or any OpenAI-compatible one (default grpc)")
    g.add_argument("--served-model-name", default=None,
                   help="openai: the model id to send (default: the first of GET /v1/models)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="openai: vocabulary of the random prompts when /v1/models does not report it")
    g.add_argument("--api-key", default=None, help="openai: sent as 'Authorization: Bearer KEY'")
    g.add_argument("--in-process", action="store_true",
                   help="run the server inside this process instead (smoke tests only: client and "
                        "server share one Python process, which inflates latencies many times)")
    g.add_argument("--server-start-timeout", type=float, default=1800.0,
                   help="seconds the child server may take to load and compile (default 1800)")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson arrivals (default inf: all at once)")
    g.add_argument("--concurrency", "--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no limit; --max-concurrency: vLLM's name)")
    g.add_argument("--duration", type=float, default=600.0, help="send nothing after this many seconds")
    g.add_argument("--request-timeout", type=float, default=600.0, help="deadline of each request (s)")


def _scaling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scaling")
    g.add_argument("--models", default="native-1b-parallel,native-1b-full-attention",
                   help="presets; NAME:full-attention is NAME with global attention and no SSM")
    g.add_argument("--contexts", default="1k,2k,4k,16k,32k,128k,512k,1020k")
    g.add_argument("--batches", default="1,64")
    g.add_argument("--decode-steps", type=int, default=16, help="timed steps per point")
    g.add_argument("--warmup-steps", type=int, default=3)
    g.add_argument("--max-prefill-s", type=float, default=60.0, help="skip contexts predicted slower")
    g.add_argument("--time-budget", type=float, default=0.0,
                   help="start no point after this many s (0: none)")
    g.add_argument("--fit-contexts", default="32k,128k")
    g.add_argument("--shared-prefix", type=int, default=0,
                   help="prompts share their first N tokens, served once and then from the prefix "
                        "cache (prefix caching on); each keeps at least its largest window of its own "
                        "tokens, so its memory is that of any sequence at the context. Makes large "
                        "batches at long context affordable to prefill. Models with global attention "
                        "keep distinct prompts (all their pages are in the window)")


def _sweep(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sweep")
    g.add_argument("--windows", default="512,2048,4096")
    g.add_argument("--state-sizes", default="64,128,256")
    g.add_argument("--sweep-batch", type=int, default=16, help="sequences decoding together")
    g.add_argument("--short-factor", type=float, default=0.5, help="short prompt = factor * window")
    g.add_argument("--long-factor", type=float, default=4.0, help="long prompt = factor * window")
    g.add_argument("--sweep-steps", type=int, default=8, help="timed decode steps per cell")


BENCH_EPILOG = """examples (docs/benchmarks.md has the measured results):
  hybrid-jax bench throughput --smoke --out /tmp/b          # any mode: tiny preset, seconds on a CPU
  hybrid-jax bench throughput --model native-1b-parallel --num-requests 256 --input-len 512 \\
      --output-len 128 --len-dist uniform --range-ratio 0.5
  # starts `hybrid-jax serve` with these flags as a child process, measures it, stops it
  hybrid-jax bench serving --model native-1b-parallel --request-rate 16 --num-requests 400
  hybrid-jax serve --model native-1b-parallel --dtype bfloat16 --port 50051 &
  hybrid-jax bench serving --server localhost:50051 --request-rate 8 --num-requests 200 --duration 120
  hybrid-jax bench serving --server localhost:50051 --concurrency 32 --num-requests 200
  hybrid-jax serve --model native-1b-parallel --dtype bfloat16 --port 50051 --http-port 8000 &
  hybrid-jax bench serving --backend openai --server http://localhost:8000 --request-rate 16 \
      --num-requests 400 --input-len 512 --output-len 128 --len-dist uniform --range-ratio 0.5
  hybrid-jax bench scaling --models native-1b-parallel,native-1b-full-attention --batches 1,64 \\
      --contexts 1k,4k,16k,128k,1020k --memory-fraction 0.9 --profile /tmp/trace
  hybrid-jax bench sweep --windows 512,2048 --state-sizes 64,128 --sweep-batch 16
"""
