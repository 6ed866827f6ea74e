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
stderr and exit code 2; HYBRID_JAX_DEBUG=1 shows the traceback. This module parses
arguments and wires the parts; the client side imports no JAX, so `hybrid-jax client` starts fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from configs import DEFAULT_MODEL, resolve_model_name, switches
from serving.entrypoints.cli_support import add_client_args, check_bindable, prepare_model, run_user_command

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
                        "start-up, more padding (serving/runner/step_fns.make_buckets)")
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


def _spec_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """EngineConfig's speculative- and multi-step-decoding settings from the CLI flags."""
    limit = args.speculative_disable_by_batch_size
    return dict(speculative_method=args.speculative_method,
                num_speculative_tokens=args.num_speculative_tokens,
                speculative_model=args.speculative_model, prompt_lookup_min=args.prompt_lookup_min,
                prompt_lookup_max=args.prompt_lookup_max,
                speculative_disable_by_batch_size=None if limit == 0 else limit,
                num_scheduler_steps=args.num_scheduler_steps, multi_step_max_seqs=args.multi_step_max_seqs)


def _parser() -> argparse.ArgumentParser:
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
                          "health checks "
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


def _http_config(args: argparse.Namespace):
    """The HTTP front's settings from the flags (checked before the model loads), or None."""
    import json
    from pathlib import Path

    if args.http_port is None:
        for flag in ("chat_template", "default_chat_template_kwargs", "profile_dir"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --http-port")
        return None
    from serving.entrypoints.openai.api_server import OpenAIConfig

    if args.http_port < 0:
        raise ValueError(f"--http-port={args.http_port} must be >= 0 (0 = any free port)")
    kwargs = {}
    if args.default_chat_template_kwargs is not None:
        try:
            kwargs = json.loads(args.default_chat_template_kwargs)
        except json.JSONDecodeError as err:
            raise ValueError(f"--default-chat-template-kwargs: not JSON ({err})") from err
    if args.chat_template is not None and not Path(args.chat_template).is_file():
        raise FileNotFoundError(f"--chat-template {args.chat_template}: no such file")
    if args.tls_cert is not None and args.tls_key is not None:
        import ssl

        try:  # HTTPS: the same pair must load as a TLS server context
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.tls_cert, args.tls_key)
        except (OSError, ssl.SSLError) as err:
            raise ValueError(f"--tls-cert / --tls-key do not load for HTTPS: {err}") from err
    return OpenAIConfig(port=args.http_port, model_name=args.served_model_name or args.model,
                        chat_template=args.chat_template, default_chat_template_kwargs=kwargs,
                        profile_dir=args.profile_dir)


def _with_model_dir(http, model: str):
    """The HTTP settings with the model's directory (its chat template, checked now), or None."""
    if http is None:
        return None
    from serving.entrypoints.openai.api_server import model_dir_of
    from serving.entrypoints.openai.chat_template import ChatTemplate

    http.model_dir = model_dir_of(model)
    ChatTemplate.from_model_dir(http.model_dir, http.chat_template)  # a bad template fails before loading
    return http


def _generate(args: argparse.Namespace) -> int:
    from hybrid_jax.loading import load_model
    from serving.engine.engine_config import EngineConfig
    from serving.engine.llm_engine import LLMEngine
    from serving.entrypoints.llm import LLM
    from serving.sample.sampling_params import SamplingParams

    if args.max_tokens < 1:
        print(f"error: --max-tokens={args.max_tokens} must be >= 1", file=sys.stderr)
        return 2
    # Everything the user typed is checked before the weights load and the engine compiles.
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              repetition_penalty=args.repetition_penalty, seed=args.seed,
                              max_tokens=args.max_tokens)
    text = _prompt_text(args.prompt)
    host = _sharded_loading(args.tensor_parallel_size)
    lm = load_model(prepare_model(resolve_model_name(args.model), needs_tokenizer=True, announce=_to_stderr),
                    device=host,
                    dtype=args.dtype, seed=args.weights_seed, quantization=args.quantization)
    if lm.tokenizer is None:
        print(f"error: {args.model} has no tokenizer.json", file=sys.stderr)
        return 2
    prompt = lm.tokenizer.encode(text, add_bos=True)
    # One sequence: few buckets to compile, and room for exactly this prompt + output.
    chunk = min(64, max(16, len(prompt)))
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=chunk, max_prefill_chunk=chunk,
                       max_model_len=len(prompt) + args.max_tokens, dtype=args.dtype,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                       kv_scale=args.kv_scale,
                       tensor_parallel_size=args.tensor_parallel_size, **_spec_kwargs(args))
    llm = LLM.from_engine(LLMEngine(lm, cfg))
    print(text, end="", flush=True)
    for delta in llm.stream(prompt_token_ids=prompt, sampling_params=sampling):
        print(delta.text, end="", flush=True)
    print()
    return 0


def _sharded_loading(n: int):
    """With --tensor-parallel-size N > 1: refuse too few devices before loading anything,
    and load on the host (each device then receives only its shard)."""
    from hybrid_jax import tensor_parallel as tp

    tp.make_mesh(n)
    return tp.host_device() if n > 1 else None


def _prompt_text(prompt: str | None) -> str:
    """The prompt argument, or stdin when none is given (a terminal is not waited on)."""
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise ValueError("no prompt: give one as an argument or pipe it on stdin")
        prompt = sys.stdin.read()
    if not prompt:
        raise ValueError("the prompt is empty")
    return prompt


def _serve(args: argparse.Namespace) -> int:
    from serving.entrypoints.grpc.security import tls_credentials
    from serving.entrypoints.request_log import log_event, setup_logging

    setup_logging(args.log_level)
    # Everything a user can get wrong is checked before the weights load and compile.
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    tls = tls_credentials(args.tls_cert, args.tls_key) if args.tls_cert else None
    check_bindable(args.host, args.port, "--port")
    if args.metrics_port >= 0:
        check_bindable(args.host, args.metrics_port, "--metrics-port")
    if args.http_port is not None and args.http_port >= 0:
        check_bindable(args.host, args.http_port, "--http-port")
    limits = _request_limits(args)
    if args.unhealthy_after < 0:
        raise ValueError(f"--unhealthy-after={args.unhealthy_after} must be >= 0")
    _ints(args.seq_buckets, "--seq-buckets"), _ints(args.token_buckets, "--token-buckets")  # checked early
    http = _http_config(args)
    _check_devices(args)  # before a model is fetched or loaded
    model = prepare_model(resolve_model_name(args.model), needs_tokenizer=False,
                          announce=lambda msg: log_event("server.loading", message=msg),
                          warn=lambda msg: log_event("server.model", logging.WARNING, message=msg))
    return _serve_model(args, model, tls, limits, _with_model_dir(http, model))


def _request_limits(args: argparse.Namespace):
    from serving.entrypoints.validation import RequestLimits

    if args.max_request_bytes is None:
        return None
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes={args.max_request_bytes} must be >= 1")
    return RequestLimits(max_request_bytes=args.max_request_bytes)


def _serve_model(args: argparse.Namespace, model: str, tls, limits, http) -> int:
    from hybrid_jax.loading import load_model
    from serving.engine.engine_config import EngineConfig
    from serving.engine.engine_core import SelfTestFailed
    from serving.engine.llm_engine import LLMEngine, freeze_heap
    from serving.entrypoints.grpc.server import EXIT_ENGINE_FAILED, GenerationServer

    cfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_prefill_chunk=args.max_prefill_chunk, max_model_len=args.max_model_len,
                       page_size=args.page_size, memory_fraction=args.memory_fraction, dtype=args.dtype,
                       quantization=args.quantization, ssm_state_dtype=args.ssm_state_dtype,
                       kv_cache_dtype=args.kv_cache_dtype, kv_scale=args.kv_scale,
                       async_scheduling=not args.no_async_scheduling,
                       enable_prefix_caching=args.enable_prefix_caching,
                       prefix_state_stride=args.prefix_state_stride,
                       prefix_state_checkpoints=args.prefix_state_checkpoints,
                       tensor_parallel_size=args.tensor_parallel_size,
                       data_parallel_size=args.data_parallel_size, seq_buckets=_ints(args.seq_buckets,
                       "--seq-buckets"), token_buckets=_ints(args.token_buckets, "--token-buckets"),
                       admission_interval_steps=args.admission_interval_steps,
                       compile_in_background=False if args.no_background_compile else None,
                       **_spec_kwargs(args))
    if cfg.data_parallel_size > 1:
        engine = _replicas(args, model, cfg)
    else:
        host = _sharded_loading(args.tensor_parallel_size)
        engine = LLMEngine(load_model(model, dtype=args.dtype, seed=args.weights_seed, device=host,
                                      quantization=args.quantization), cfg)
    freeze_heap()  # one engine for the process's life: no full GC walks of the start-up heap
    server = GenerationServer(engine, model_name=args.served_model_name or args.model, host=args.host,
                              port=args.port,
                              metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                              max_waiting=args.max_waiting, limits=limits, tls=tls,
                              api_key=args.api_key, unhealthy_after=args.unhealthy_after, http=http)
    try:
        server.start()  # the self-test request runs first: a broken engine never reports SERVING
    except SelfTestFailed as err:
        print(f"hybrid-jax serve: error: {err}", file=sys.stderr, flush=True)
        return EXIT_ENGINE_FAILED
    code = server.run_until_signal(grace_s=args.shutdown_grace)
    if code:  # the engine cannot recover: leave now, even if a thread is wedged
        logging.shutdown()
        os._exit(code)
    return code


def _check_devices(args: argparse.Namespace) -> None:
    """Refuse more devices than the host has (--tensor-parallel-size, --data-parallel-size)."""
    from hybrid_jax import tensor_parallel as tp
    from serving.engine.data_parallel import check_devices
    from serving.engine.engine_config import EngineConfig

    tp.make_mesh(args.tensor_parallel_size)
    check_devices(EngineConfig(tensor_parallel_size=args.tensor_parallel_size,
                               data_parallel_size=args.data_parallel_size))


def _replicas(args: argparse.Namespace, model: str, cfg) -> list:
    """--data-parallel-size N: N engines, each loading the weights onto its own device group
    (the host when tensor-parallel); too few devices is refused before anything loads
    (`build_engines` checks)."""
    import jax

    from hybrid_jax import tensor_parallel as tp
    from hybrid_jax.loading import load_model
    from serving.engine.data_parallel import build_engines

    def load(rc):
        device = tp.host_device() if rc.tensor_parallel_size > 1 else jax.local_devices()[rc.device_offset]
        return load_model(model, dtype=args.dtype, seed=args.weights_seed, device=device,
                          quantization=args.quantization)

    return build_engines(load, cfg)


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    """A comma-separated list of positive ints (None stays None)."""
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}={text!r} must be comma-separated integers, e.g. 1,4,16") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag}={text!r} must list integers >= 1")
    return values


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; a user error is one line on stderr and exit code 2 (cli_support)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:
        from hybrid_jax.train.__main__ import main as train_main

        return train_main(argv[1:], prog="hybrid-jax train")
    return run_user_command(_dispatch, _parser().parse_args(argv))


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "presets":
        from hybrid_jax.presets import preset_names

        print("\n".join(preset_names()))
        return 0
    if args.command == "bench":
        from serving.entrypoints.bench import main as bench_main

        return bench_main(args)
    if args.command == "client":
        from serving.entrypoints.grpc.client import run_client

        return run_client(args)
    if args.command == "serve":
        return _serve(args)
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
