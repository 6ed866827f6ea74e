"""The `hybrid-jax` argument parser: subcommands, flags, help texts and examples.

`build_parser` builds it for every command, `--help` included, so this module imports
neither JAX nor gRPC nor the engine: defaults that live there (EngineConfig's, the
server's health threshold) are written out here, and tests check that they match.
What each subcommand then does is serving/entrypoints/cli_commands.py.
"""

from __future__ import annotations

import argparse

from configs import DEFAULT_MODEL, switches

EPILOG = """examples:
  hybrid-jax presets
  hybrid-jax generate "def fibonacci(n):"           # the shipped default model
  echo "import os" | hybrid-jax generate --temperature 0.8 --top-p 0.95 --seed 1
  hybrid-jax generate --model native-tiny "Hello"   # a preset: random weights, noise
  hybrid-jax generate --model ./my-hf-model --max-tokens 64 --dtype bfloat16 "Once upon"

  # a server on :50051 with metrics on :9464, sized small for a CPU
  hybrid-jax serve --model native-tiny --port 50051 --max-num-seqs 4 \\
      --max-num-batched-tokens 32 --max-model-len 256
  hybrid-jax client --server localhost:50051 --max-tokens 32 "Hello"
  hybrid-jax client --server localhost:50051 --temperature 0.8 --top-p 0.9 --seed 1 "Hi"
  hybrid-jax client --server localhost:50051 --info          # model facts as JSON
  curl -s localhost:9464/metrics | grep hybrid_jax_
  # the OpenAI API beside gRPC (off unless --http-port is given)
  hybrid-jax serve --model ./my-hf-chat-model --http-port 8000 --served-model-name chat
  curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
      -d '{"model": "chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}'

run `hybrid-jax COMMAND --help` for each command's options.
"""

SERVE_EPILOG = """Before health reports SERVING, one internal request runs through the engine; if it
fails, the start fails (one error line, exit 1). Health turns NOT_SERVING after
--unhealthy-after consecutive requests failed in the engine, SERVING again when one
succeeds. The server stops on SIGTERM or Ctrl-C: health turns NOT_SERVING, new requests get
UNAVAILABLE, requests in flight get --shutdown-grace seconds to finish, the rest are
aborted (UNAVAILABLE), and the process exits 0. Logs are JSON lines on stderr.

example (CPU-sized):
  hybrid-jax serve --model native-tiny --port 50051 --metrics-port 9464 \\
      --max-num-seqs 4 --max-num-batched-tokens 32 --max-model-len 256 --max-waiting 64
"""

GENERATE_EPILOG = """The prompt is printed, then its continuation as it streams. Sampled by default
(temperature 0.6, top-p 0.9, repetition penalty 1.2, seed 0: the same text on every run);
--temperature 0 is greedy, --repetition-penalty 1 turns the penalty off. Presets
(`hybrid-jax presets`) have random weights: their output is noise.

examples:
  hybrid-jax generate "def fibonacci(n):"           # the shipped default model
  echo "import os" | hybrid-jax generate --temperature 0.8 --top-p 0.95 --seed 1
  hybrid-jax generate --max-tokens 128 --temperature 0 "class Stack:"
  hybrid-jax generate --model ./my-hf-model --max-tokens 64 --dtype bfloat16 "Once upon"
  hybrid-jax generate --model native-tiny "Hello"   # a preset: random weights, noise
"""

PRESETS_EPILOG = """Presets are model shapes (configs/models/*.json) with random weights: use one with
--model to try the engine or measure speed; its output is noise, not text.

example:
  hybrid-jax presets
  hybrid-jax generate --model native-tiny --max-tokens 8 "Hello"
"""

CLIENT_EPILOG = """examples:
  hybrid-jax client --server localhost:50051 "Hello"
  hybrid-jax client --server localhost:50051 --max-tokens 64 --temperature 0.7 --seed 3 "Hi"
  hybrid-jax client --server localhost:50051 --stop "." --usage "Tell me"
  hybrid-jax client --server localhost:50051 --info
The prompt is printed, then the continuation as it streams; errors exit 1 with the
gRPC status (e.g. INVALID_ARGUMENT naming the field).
"""


def _sub(sub, name: str, help: str, epilog: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help, epilog=epilog,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(_subparser=p)  # error messages name this subcommand's flags (cli_support)
    return p


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF dir, native dir, preset name or HF repo id org/name (default: 'default', "
                        "the shipped hybrid trained on Python source; docs/training.md). Presets "
                        "(`hybrid-jax presets`) have random weights: their output is noise, not text")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the weights and activations (default float32; bfloat16 halves "
                        "weight and KV memory and is the fast choice on a GPU)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: quantize the decoder Linear weights block-wise (128 x 128, e4m3) at "
                        "load; FP8 checkpoints load FP8 without it (docs/engine.md)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: K/V pages in e4m3 with scales calibrated at start-up (a quarter of "
                        "f32's bytes, half of bf16's: more pages in the same memory); auto: --dtype")
    p.add_argument("--kv-scale", default="head", choices=["head", "tensor"],
                   help="FP8 KV scales per layer and KV head (default) or per layer (docs/engine.md)")
    p.add_argument("--weights-seed", type=int, default=0,
                   help="seed for a preset's random weights (default 0)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model by heads over N local devices (default 1; "
                        "docs/tensor_parallel.md)")


# `generate`'s sampling defaults: sampled, with a repetition penalty (greedy decoding of the
# small default model falls into loops: 45% of its lines repeat an earlier one, 1% sampled
# at these defaults; benchmarks/code_eval.py, docs/training.md), with a fixed seed so the
# README's command prints the same text on every run. --temperature 0 gives greedy
# decoding, --repetition-penalty 1 turns the penalty off.
GENERATE_DEFAULTS = {"max_tokens": 64, "temperature": 0.6, "top_p": 0.9, "top_k": -1,
                     "repetition_penalty": 1.2, "seed": 0}


UNHEALTHY_AFTER = 3  # serving.entrypoints.grpc.server.UNHEALTHY_AFTER, written out for --help without JAX

# EngineConfig's defaults, written out so that `--help` needs no JAX import
# (tests/serving/test_server_cli.py checks that they match).
# The sizing settings are None: chosen for the device at start (engine_config.device_sizing).
ENGINE_DEFAULTS = {"max_num_seqs": None, "max_num_batched_tokens": None, "max_prefill_chunk": None,
                   "page_size": 16, "memory_fraction": None, "prefix_state_stride": 256,
                   "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                   "speculative_disable_by_batch_size": 16, "num_scheduler_steps": 1,
                   "multi_step_max_seqs": 8}


def _engine_args(p: argparse.ArgumentParser) -> None:
    d = ENGINE_DEFAULTS
    g = p.add_argument_group(
        "engine sizing (more sequences and tokens = more compiled buckets; defaults by device: "
        "32 / 512 / 256 / 0.5 on a CPU, 256 / 8192 / 2048 / 0.5 on a GPU with >= 40 GiB, "
        "128 / 4096 / 2048 / 0.5 on a smaller one; the server logs what it chose)")
    g.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                   help="sequences running at once (default: by device)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"],
                   help="tokens per engine step (default: by device)")
    g.add_argument("--max-prefill-chunk", type=int, default=d["max_prefill_chunk"],
                   help="prompt tokens of one sequence per step (default: by device)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens per request (default: the model's, capped at 8192)")
    g.add_argument("--page-size", type=int, default=d["page_size"],
                   help=f"tokens per KV page (default {d['page_size']})")
    g.add_argument("--memory-fraction", type=float, default=d["memory_fraction"],
                   help="of free device memory for KV pages and states (default: by device)")
    g.add_argument("--seq-buckets", default=None, metavar="N,N,...",
                   help="sequence counts to compile step shapes for (default: x2 from 8 up to "
                        "--max-num-seqs; a GPU's prefill shapes x4 from 16); fewer buckets: faster "
                        "start-up, more padding (serving/runner/buckets.make_buckets)")
    g.add_argument("--token-buckets", default=None, metavar="N,N,...",
                   help="token counts to compile prefill step shapes for (default: x4 from 64, from "
                        "256 on a GPU, up to --max-num-batched-tokens)")
    g.add_argument("--admission-interval-steps", type=int, default=1, metavar="N",
                   help="while sequences run, admit waiting prompts every N-th step only, so that "
                        "prompts arriving close together share one prefill step (default 1: every step)")
    g.add_argument("--no-background-compile", action="store_true",
                   help="compile every step executable before serving (default on a GPU: steps over "
                        "64 sequences or 1024 tokens compile in the background while smaller ones serve)")
    g.add_argument("--ssm-state-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="recurrent state dtype (bfloat16 halves state traffic; default float32)")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="do not overlap host bookkeeping with the next device step (debugging)")
    pc = p.add_argument_group("prefix caching (docs/engine.md)")
    pc.add_argument("--enable-prefix-caching", action="store_true",
                    help="reuse the KV pages and recurrent states of prompt prefixes seen before")
    pc.add_argument("--prefix-state-stride", type=int, default=d["prefix_state_stride"],
                    help="tokens between recurrent-state checkpoints, a multiple of --page-size "
                         f"(default {d['prefix_state_stride']})")
    pc.add_argument("--prefix-state-checkpoints", type=int, default=None,
                    help="state checkpoints kept on the device, each the size of one sequence's "
                         "recurrent state (default: 2 x max-num-seqs, at least 16)")
    _spec_args(p)


def _spec_args(p: argparse.ArgumentParser) -> None:
    d = ENGINE_DEFAULTS
    sd = p.add_argument_group("speculative decoding (docs/engine.md)")
    sd.add_argument("--speculative-method", choices=["ngram", "draft", "mtp"], default=None,
                    help="draft tokens by prompt lookup (ngram), a draft model or the model's own "
                         "multi-token-prediction head (mtp: mtp.* weights), verify them in one step")
    sd.add_argument("--num-speculative-tokens", type=int, default=d["num_speculative_tokens"],
                    help=f"drafted tokens per sequence and step, 1..8 "
                         f"(default {d['num_speculative_tokens']})")
    sd.add_argument("--speculative-model", default=None,
                    help="the draft model (path or preset) for --speculative-method draft")
    sd.add_argument("--prompt-lookup-min", type=int, default=d["prompt_lookup_min"],
                    help=f"shortest n-gram matched by ngram (default {d['prompt_lookup_min']})")
    sd.add_argument("--prompt-lookup-max", type=int, default=d["prompt_lookup_max"],
                    help=f"longest n-gram matched by ngram (default {d['prompt_lookup_max']})")
    sd.add_argument("--speculative-disable-by-batch-size", type=int,
                    default=d["speculative_disable_by_batch_size"],
                    help="no speculation in a step with more running sequences than this "
                         f"(default {d['speculative_disable_by_batch_size']}; 0 = never off)")
    ms = p.add_argument_group("multi-step decoding (docs/engine.md)")
    ms.add_argument("--num-scheduler-steps", type=int, default=d["num_scheduler_steps"],
                    help="decode steps per executable call while few sequences run, all decoding: "
                         "the host's per-step cost is paid once per that many tokens, which "
                         f"arrive in runs (default {d['num_scheduler_steps']}: off)")
    ms.add_argument("--multi-step-max-seqs", type=int, default=d["multi_step_max_seqs"],
                    help="multi-step decoding only while at most this many sequences run "
                         f"(default {d['multi_step_max_seqs']})")


def build_parser() -> argparse.ArgumentParser:
    """The `hybrid-jax` parser (`train` is only listed: hybrid_jax.train parses its arguments)."""
    p = argparse.ArgumentParser(prog="hybrid-jax", epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Serve and run hybrid SSM + sliding-window models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = _sub(sub, "generate", "generate a continuation of a prompt in this process (streams)",
               GENERATE_EPILOG)
    gen.add_argument("prompt", nargs="?", help="prompt text (default: read from stdin)")
    _model_args(gen)
    gen.add_argument("--max-tokens", type=int, default=GENERATE_DEFAULTS["max_tokens"],
                     help=f"tokens to generate (default {GENERATE_DEFAULTS['max_tokens']})")
    gen.add_argument("--temperature", type=float, default=GENERATE_DEFAULTS["temperature"],
                     help=f"0 = greedy (default {GENERATE_DEFAULTS['temperature']})")
    gen.add_argument("--top-p", type=float, default=GENERATE_DEFAULTS["top_p"],
                     help=f"nucleus mass in (0, 1] (default {GENERATE_DEFAULTS['top_p']})")
    gen.add_argument("--top-k", type=int, default=GENERATE_DEFAULTS["top_k"],
                     help=f"keep the k most likely tokens, -1 = off (default {GENERATE_DEFAULTS['top_k']})")
    gen.add_argument("--repetition-penalty", type=float, default=GENERATE_DEFAULTS["repetition_penalty"],
                     help="> 0; divides the logits of tokens already seen, 1 = off "
                          f"(default {GENERATE_DEFAULTS['repetition_penalty']})")
    gen.add_argument("--seed", type=int, default=GENERATE_DEFAULTS["seed"],
                     help=f"sampling seed, for reproducible output (default {GENERATE_DEFAULTS['seed']})")
    _spec_args(gen)

    serve = _sub(sub, "serve", "serve a model over gRPC, with Prometheus metrics", SERVE_EPILOG)
    _model_args(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address for gRPC, HTTP and metrics (default 127.0.0.1; 0.0.0.0 or [::] "
                            "to expose)")
    serve.add_argument("--port", type=int, default=50051, help="gRPC port (default 50051; 0 = any free)")
    serve.add_argument("--metrics-port", type=int, default=9464,
                       help="Prometheus /metrics HTTP port (default 9464; -1 = off)")
    _http_args(serve)
    serve.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                       help="N engine replicas, each on its own group of --tensor-parallel-size "
                            "devices, behind this server; requests go to the least loaded (default 1; "
                            "docs/serving.md)")
    serve.add_argument("--max-waiting", type=int, default=128,
                       help="requests allowed to wait for a slot, per replica; beyond: RESOURCE_EXHAUSTED "
                            "(default 128)")
    serve.add_argument("--shutdown-grace", type=float, default=30.0,
                       help="seconds in-flight requests get after SIGTERM (default 30)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--unhealthy-after", type=int, default=UNHEALTHY_AFTER, metavar="N",
                       help="health turns NOT_SERVING after N consecutive requests failed in the "
                            f"engine, SERVING again when one succeeds (default {UNHEALTHY_AFTER}; 0 = never)")
    sec = serve.add_argument_group("security and limits")
    sec.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain (+ --tls-key): "
                     "gRPC, and HTTPS on --http-port")
    sec.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    sec.add_argument("--api-key", default=switches.api_key(),
                     help="require 'authorization: Bearer KEY' on every gRPC call and HTTP request but "
                          "health checks and HTTP /metrics "
                          "(default: $HYBRID_JAX_API_KEY; prefer it to the flag, which ps shows)")
    sec.add_argument("--max-request-bytes", type=int, default=None,
                     help="largest request message (default 1 MiB + 8 bytes per max-model-len token)")
    _engine_args(serve)

    client = _sub(sub, "client", "stream a prompt's continuation from a running server", CLIENT_EPILOG)
    add_client_args(client)
    _sub(sub, "presets", "list the model presets (random weights)", PRESETS_EPILOG)
    # `train` is parsed by hybrid_jax.train (main() hands it the arguments), which imports
    # JAX; listed here for `hybrid-jax --help`.
    _sub(sub, "train", "train a model on .py/text files (run `hybrid-jax train --help`)", "")
    from serving.entrypoints.bench import args as bench_args

    bench_args.add_args(_sub(sub, "bench", "benchmarks that write OUT/MODE.json and OUT/MODE.png",
                             bench_args.BENCH_EPILOG))
    return p


def _http_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("OpenAI-compatible HTTP API (docs/serving.md)")
    g.add_argument("--http-port", type=int, default=None,
                   help="serve /v1/completions, /v1/chat/completions, /v1/models and /health on this "
                        "port beside gRPC (default: off; 8000 is the usual port, 0 = any free)")
    g.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models and GetModelInfo report "
                        "(default: the --model value)")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file for /v1/chat/completions (default: the model "
                        "directory's chat_template.jinja or tokenizer_config.json's chat_template)")
    g.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help="variables every chat template rendering sees unless a request's "
                        "chat_template_kwargs sets them, e.g. '{\"enable_thinking\": false}'")
    g.add_argument("--profile-dir", default=None, metavar="DIR",
                   help="enable POST /start_profile and /stop_profile: a jax.profiler trace of the "
                        "running server and a per-step log (DIR/steps-N.jsonl) between the two")


def add_client_args(p: argparse.ArgumentParser) -> None:
    """`hybrid-jax client`'s arguments (here, not in serving/entrypoints/grpc/client.py, so that building the
    CLI's parser imports no gRPC: `generate` runs whatever grpcio is installed)."""
    p.add_argument("prompt", nargs="?", help="prompt text (not needed with --info)")
    p.add_argument("--server", default="localhost:50051", help="host:port (default localhost:50051)")
    p.add_argument("--max-tokens", type=int, help="output tokens at most (server default 16)")
    p.add_argument("--temperature", type=float, help="0 = greedy (server default 1.0)")
    p.add_argument("--top-k", type=int, help="keep the k most likely tokens (-1 = off)")
    p.add_argument("--top-p", type=float, help="nucleus mass in (0, 1]")
    p.add_argument("--min-p", type=float, help="drop tokens below min_p * p(best)")
    p.add_argument("--min-tokens", type=int, help="do not stop before this many tokens")
    p.add_argument("--seed", type=int, help="per-request seed for reproducible sampling")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", dest="stop_token_ids",
                   help="stop token id (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None, help="generate past EOS")
    p.add_argument("--timeout", type=float, help="deadline in seconds (the server aborts at expiry)")
    p.add_argument("--request-id", default="", help="request id for the server logs (default: generated)")
    p.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    p.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, trusting this CA certificate")
    p.add_argument("--api-key", default=switches.api_key(),
                   help="sent as 'authorization: Bearer KEY' (default: $HYBRID_JAX_API_KEY)")
    p.add_argument("--usage", action="store_true", help="print finish reason and usage to stderr")
    p.add_argument("--info", action="store_true", help="print the server's model info as JSON and exit")
