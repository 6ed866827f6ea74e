"""`hybrid-jax bench serving`: latency under load against a running `hybrid-jax serve`.

`--backend grpc` (default) drives the Generate RPC; `--backend openai` drives streamed
/v1/completions (`serving.entrypoints.bench.openai_load`), of this server's --http-port or of any
OpenAI-compatible server (vLLM, SGLang, ...), with the same prompts and arrivals.

With `--server HOST:PORT` the load goes to that server. Without it, `hybrid-jax serve`
is started as a child process with the benchmark's model and engine flags on free
localhost ports (serving/entrypoints/bench/server_process.py), and stopped at the end. With
`--in-process` (smoke tests only) the server runs in this Python process instead:
client and server then share one GIL, which inflates latencies many times (issue 38),
and the report says so. Without `--server`, the server's own request counters (its
/metrics) are recorded beside the client's. Lengths come from the model info's
vocabulary, and are not clipped: requests longer than the server's max_model_len fail
with INVALID_ARGUMENT and are counted as such.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from serving.entrypoints.bench import common, plots
from serving.entrypoints.bench.load import LoadSpec, report, run_load


def run(args: argparse.Namespace, out: Path) -> dict:
    if args.smoke:
        # lengths up to 152 + 19 tokens: some exceed max_model_len 128 and must fail INVALID_ARGUMENT
        args.num_requests, args.input_len, args.output_len = 12, 80, 10
        args.len_dist, args.range_ratio = "uniform", 0.9
    spec = LoadSpec(rate=args.request_rate, concurrency=args.concurrency, duration_s=args.duration,
                    timeout_s=args.request_timeout, seed=args.seed)
    if args.server and args.in_process:
        raise ValueError("--server and --in-process exclude each other")
    if args.data_parallel_size > 1 and (args.server or args.in_process):
        raise ValueError(f"--data-parallel-size={args.data_parallel_size} sets the child server's "
                         "replicas; it does not apply with --server or --in-process")
    if args.profile and args.in_process:
        raise ValueError("--profile traces a child server; it does not apply with --in-process")
    openai = args.backend == "openai"
    server = child = None
    if args.in_process:
        server = _local_server(args, http=openai)
    elif not args.server:
        child = _child_server(args, out, http=openai, profile=args.profile)
    elif args.profile:
        raise ValueError("--profile traces a child server: start yours with --profile-dir and "
                         "POST /start_profile, /stop_profile yourself")
    local = server if server is not None else child
    port = None if local is None else local.http_port if openai else local.port
    target = args.server or (f"http://127.0.0.1:{port}" if openai else f"127.0.0.1:{port}")
    try:
        info = _openai_info(target, args) if openai else _model_info(target)
        rng = np.random.default_rng(args.seed)
        n = args.num_requests
        ins = common.LengthDist(args.input_len, args.len_dist, args.range_ratio).sample(n, rng)
        outs = common.LengthDist(args.output_len, args.len_dist, args.range_ratio).sample(n, rng)
        prompts = common.random_prompts(ins, info.vocab_size, rng)
        if child is not None and args.profile:
            _profile(child, "start")
        if openai:
            from serving.entrypoints.bench.openai_load import Target, run_load_openai

            records, wall = run_load_openai(Target.parse(target, args.api_key), info.model, prompts, outs,
                                            spec, sampling={"temperature": 0.0})
        else:
            records, wall = run_load(target, prompts, outs, spec, sampling={"temperature": 0.0})
        if child is not None and args.profile:
            res_profile = _profile(child, "stop")
        res = {"mode": "serving", "backend": args.backend, "model": info.model, "dtype": info.dtype,
               **common.environment(),
               "server": args.server or ("in-process" if server is not None else "child process"),
               "max_num_seqs": info.max_num_seqs,
               "max_model_len": info.max_model_len,
               "request_rate": None if math.isinf(spec.rate) else spec.rate,
               "concurrency": spec.concurrency, "duration_limit_s": spec.duration_s,
               "num_requests": args.num_requests, "len_dist": args.len_dist, "range_ratio": args.range_ratio,
               "input_lens": [r.prompt_len for r in records],
               "output_lens": [r.output_tokens for r in records],
               "max_tokens": [r.max_tokens for r in records], "codes": [r.code for r in records],
               **_timeline(records),
               "wall_s": wall, **report(records, wall)}
        if server is not None:
            res["server_counted"] = server_counts(server.metrics.registry.collect())
            res["note"] = IN_PROCESS_NOTE
        elif child is not None:
            res["server_counted"] = server_counts(_scrape(child.metrics_port))
            if args.profile:
                res["profile"] = res_profile
    finally:
        if server is not None:
            server.shutdown(grace_s=0)
        if child is not None:
            child.stop()
    common.write_json(out, "serving", res)
    plots.serving(res, records, out / "serving.png")
    return res


def _timeline(records) -> dict[str, list]:
    """Per request, seconds from the first send: sent, first token (None if none), end."""
    t0 = min((r.sent for r in records), default=0.0)
    return {"sent_s": [r.sent - t0 for r in records],
            "first_token_s": [r.token_times[0] - t0 if r.token_times else None for r in records],
            "end_s": [r.end - t0 for r in records]}


IN_PROCESS_NOTE = ("--in-process: client and server shared one Python process, so latencies are "
                   "inflated many times; for smoke tests only, not figures to report")


def _max_model_len(args: argparse.Namespace) -> int:
    return args.max_model_len or 2 * (args.input_len + args.output_len)


def _child_server(args: argparse.Namespace, out: Path, http: bool = False, profile: str | None = None):
    """The child server; `profile`: with --profile-dir (and an HTTP port for its routes)."""
    from serving.entrypoints.bench.server_process import ServerProcess, serve_command

    cmd = serve_command(args, _max_model_len(args))
    if http or profile:
        cmd += ["--http-port", "0"]
    if profile:
        cmd += ["--profile-dir", str(Path(profile).resolve())]
    return ServerProcess(cmd, out / "serving_server.log", start_timeout_s=args.server_start_timeout)


def _profile(child, action: str) -> dict:
    """POST /start_profile or /stop_profile to the child server; its JSON answer."""
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{child.http_port}/{action}_profile", data=b"",
                                 method="POST")
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _scrape(metrics_port: int):
    """The metric families of a server's /metrics endpoint."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    return list(text_string_to_metric_families(body.decode()))


def _local_server(args: argparse.Namespace, http: bool = False):
    from serving.entrypoints.bench.engine_setup import build_engine, load, smoke_buckets
    from serving.entrypoints.grpc.server import GenerationServer
    from serving.entrypoints.openai.api_server import OpenAIConfig

    lm, _ = load(args.model, args.dtype, args.seed)
    engine = build_engine(lm, args, max_model_len=_max_model_len(args), **smoke_buckets(args))
    return GenerationServer(engine, model_name=args.model, host="127.0.0.1", port=0, metrics_port=None,
                            max_waiting=max(128, args.num_requests),
                            http=OpenAIConfig(port=0, model_name=args.model) if http else None).start()


def _model_info(target: str):
    from serving.entrypoints.grpc.client import GenerationClient

    with GenerationClient(target) as c:
        return c.model_info(timeout=60)


def _openai_info(target: str, args: argparse.Namespace) -> SimpleNamespace:
    """What the load needs from an OpenAI-compatible server (GetModelInfo's fields it can give)."""
    from serving.entrypoints.bench.openai_load import Target, served_model

    served = served_model(Target.parse(target, args.api_key), args.served_model_name)
    vocab = args.vocab_size or served.vocab_size
    if vocab is None:
        raise ValueError(f"{target} does not report its vocabulary size; give --vocab-size")
    return SimpleNamespace(model=served.model, vocab_size=vocab, max_model_len=served.max_model_len,
                           dtype=None, max_num_seqs=None)


def server_counts(families) -> dict[str, int]:
    """The server's own counters (its metric families): finished requests by reason,
    rejected by code, tokens streamed."""
    labels = {"hybrid_jax_requests": ("finished", "finish_reason"),
              "hybrid_jax_requests_rejected": ("rejected", "code")}
    out: dict[str, int] = {}
    for fam in families:
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            if fam.name in labels:
                prefix, key = labels[fam.name]
                out[f"{prefix}_{s.labels[key]}"] = int(s.value)
            elif fam.name == "hybrid_jax_generation_tokens":
                out["generation_tokens"] = int(s.value)
    return out
