"""What each `hybrid-jax` subcommand does, once serving/entrypoints/cli_args.py has parsed
its flags: `generate` in this process, `serve` (one engine or --data-parallel-size
replicas behind the gRPC and HTTP fronts), and the hand-off of `client`, `presets` and
`bench` to their modules.

Everything a user can get wrong (flags, files, ports, devices) is checked before the
weights load and the engine compiles. JAX, gRPC and the engine are imported inside the
runners, so importing this module stays cheap.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from configs import resolve_model_name
from serving.entrypoints.cli_support import check_bindable, prepare_model


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed subcommand (`train` never comes here: cli.main hands it over)."""
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


def spec_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """EngineConfig's speculative- and multi-step-decoding settings from the CLI flags."""
    limit = args.speculative_disable_by_batch_size
    return dict(speculative_method=args.speculative_method,
                num_speculative_tokens=args.num_speculative_tokens,
                speculative_model=args.speculative_model, prompt_lookup_min=args.prompt_lookup_min,
                prompt_lookup_max=args.prompt_lookup_max,
                speculative_disable_by_batch_size=None if limit == 0 else limit,
                num_scheduler_steps=args.num_scheduler_steps, multi_step_max_seqs=args.multi_step_max_seqs)


def http_config(args: argparse.Namespace):
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
                       tensor_parallel_size=args.tensor_parallel_size, **spec_kwargs(args))
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
    http = http_config(args)
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
                       **spec_kwargs(args))
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
