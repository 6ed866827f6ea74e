"""The reference workload (issue 44), reproducible by one command: a 35B-A3B Qwen3.5 hybrid
served tensor-parallel with prefix caching over the OpenAI API, driven by `hybrid-jax
bench serving`, and its table printed beside vLLM's published figures for the same
workload on two GPUs.

1. `hybrid-jax serve --model qwen3.5-35b-a3b` (random weights from the preset, MTP module
   included; `--quantization fp8` as the published checkpoint is FP8) with
   `--tensor-parallel-size 2 --enable-prefix-caching --max-num-seqs 64 --http-port`,
   started as a child (serving/entrypoints/bench/server_process.py) and stopped at the end;
   `--speculative-tokens 2` adds `--speculative-method mtp --num-speculative-tokens 2`.
2. `hybrid-jax bench serving --backend openai --server http://... --max-concurrency 16
   --num-requests 512 --input-len 4400 --output-len 512 --len-dist uniform
   --range-ratio 0.1` (vLLM's random dataset: lengths uniform within +-10%; ignore_eos).
3. The server's /metrics for speculation's acceptance, then the table: ours beside
   vLLM's, written to OUT/reference.json too.

Random weights accept almost no drafted token, so with speculation the figures show the
verification's cost, not its speed-up. Every setting is a flag, for shortened runs:

  PYTHONPATH=. python benchmarks/reference_workload.py --out ref_out
  PYTHONPATH=. python benchmarks/reference_workload.py --num-requests 64 --out ref_short

A CPU dry run of the whole path (two CPU devices, the shrunk preset; docs/benchmarks.md):

  XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. python benchmarks/reference_workload.py \
      --model qwen3.5-moe-tiny --num-requests 8 --max-concurrency 4 --input-len 96 --output-len 16 \
      --max-model-len 256 --max-num-batched-tokens 128 --max-num-seqs 8 --memory-fraction 0.1 \
      --speculative-tokens 2 --out ref_cpu
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# vLLM's published figures for this workload on two GPUs (issue 44); None: not published.
VLLM = {"output_tok_s": 2300.0, "total_tok_s": 22228.0, "ttft_ms.p50": 84.0, "ttft_ms.p99": 996.0,
        "tpot_ms.p50": 6.61, "tpot_ms.p99": 7.95, "itl_ms.p50": 15.8, "itl_ms.p99": 38.9,
        "spec_mean_accepted_length": 2.57}

ROWS = [("Successful requests", "completed"), ("Failed requests", "failed"),
        ("Benchmark duration (s)", "duration_s"), ("Request throughput (req/s)", "request_throughput"),
        ("Output token throughput (tok/s)", "output_tok_s"),
        ("Peak output token throughput (tok/s)", "peak_output_tok_s"),
        ("Total token throughput (tok/s)", "total_tok_s")]
LATENCIES = [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")]
SPEC = [("Spec. acceptance rate", "spec_acceptance_rate"),
        ("Spec. mean accepted length (tokens/step)", "spec_mean_accepted_length")]


def _get(res: dict, key: str):
    v = res
    for part in key.split("."):
        if not isinstance(v, dict) or part not in v:
            return None
        v = v[part]
    return v


def table(res: dict) -> list[tuple[str, object, object]]:
    """(row name, ours, vLLM's) for the reference table, from `bench serving`'s result
    plus the speculation gauges (absent: the rows are left out)."""
    rows = [(name, _get(res, key), VLLM.get(key)) for name, key in ROWS]
    for name, key in LATENCIES:
        for stat, label in (("mean", "mean"), ("p50", "median"), ("p99", "p99")):
            rows.append((f"{name} {label} (ms)", _get(res, f"{key}.{stat}"), VLLM.get(f"{key}.{stat}")))
    rows += [(name, res[key], VLLM.get(key)) for name, key in SPEC if res.get(key) is not None]
    return rows


def format_table(rows: list[tuple[str, object, object]]) -> str:
    def cell(v) -> str:
        if v is None:
            return "-"
        return f"{v:,.2f}" if isinstance(v, float) else f"{v:,}"
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'hybrid-jax':>12}  {'vLLM':>10}"]
    lines += [f"{name:<{width}}  {cell(ours):>12}  {cell(theirs):>10}" for name, ours, theirs in rows]
    return "\n".join(lines)


def serve_command(a: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "serving.entrypoints.cli", "serve", "--model", a.model,
           "--dtype", "bfloat16", "--tensor-parallel-size", str(a.tp), "--enable-prefix-caching",
           "--max-num-seqs", str(a.max_num_seqs),
           "--max-model-len", str(a.max_model_len), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
           "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--http-port", "0",
           "--max-waiting", str(max(128, a.num_requests)), "--shutdown-grace", "0",
           "--memory-fraction", str(a.memory_fraction)]
    if a.quantization != "none":
        cmd += ["--quantization", a.quantization]
    if a.speculative_tokens:
        cmd += ["--speculative-method", "mtp", "--num-speculative-tokens", str(a.speculative_tokens)]
    if not a.background_compile:  # steady state: every executable in before the first request
        cmd += ["--no-background-compile"]
    return cmd + a.serve_args


def bench_command(a: argparse.Namespace, http_port: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "serving.entrypoints.cli", "bench", "serving", "--backend", "openai",
            "--server", f"http://127.0.0.1:{http_port}", "--max-concurrency", str(a.max_concurrency),
            "--num-requests", str(a.num_requests), "--input-len", str(a.input_len),
            "--output-len", str(a.output_len), "--len-dist", "uniform", "--range-ratio", str(a.range_ratio),
            "--request-timeout", "1800", "--duration", "36000", "--out", str(out)]


def spec_gauges(metrics_port: int) -> dict[str, float]:
    """Speculation's acceptance gauges from the server's /metrics (empty without speculation)."""
    from serving.entrypoints.bench.serving_mode import _scrape

    out = {}
    for fam in _scrape(metrics_port):
        for name in ("spec_acceptance_rate", "spec_mean_accepted_length"):
            if fam.name == f"hybrid_jax_{name}" and fam.samples:
                out[name] = float(fam.samples[0].value)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3.5-35b-a3b")
    p.add_argument("--tp", type=int, default=2, help="--tensor-parallel-size")
    p.add_argument("--quantization", default="fp8", choices=["fp8", "none"])
    p.add_argument("--speculative-tokens", type=int, default=0, help="MTP drafted tokens (0: off)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--memory-fraction", type=float, default=0.9)
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=4400)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--range-ratio", type=float, default=0.1)
    p.add_argument("--background-compile", action="store_true",
                   help="serve while the largest executables still compile (the server's default; "
                        "off here: on 2 x H200 the run overlapped them and TPOT was 24 ms, not 18)")
    p.add_argument("--start-timeout", type=float, default=3600.0, help="seconds to load and compile")
    p.add_argument("--out", default="reference_out")
    p.add_argument("serve_args", nargs="*", help="after --: more `hybrid-jax serve` flags")
    a = p.parse_args()
    from serving.entrypoints.bench.server_process import ServerProcess

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    server = ServerProcess(serve_command(a), out / "server.log", start_timeout_s=a.start_timeout)
    started = time.perf_counter() - t0
    try:
        import subprocess

        subprocess.run(bench_command(a, server.http_port, out), check=True)
        gauges = spec_gauges(server.metrics_port) if a.speculative_tokens else {}
    finally:
        server.stop()
    res = json.loads((out / "serving.json").read_text()) | gauges
    rows = table(res)
    print(f"\n{a.model} tp={a.tp} quantization={a.quantization} speculative_tokens={a.speculative_tokens} "
          f"requests={a.num_requests} concurrency={a.max_concurrency} input~{a.input_len} "
          f"output={a.output_len} (server started in {started:.0f} s)")
    print(format_table(rows))
    (out / "reference.json").write_text(json.dumps(
        {"settings": vars(a), "server_start_s": started, "serve_command": serve_command(a),
         "table": rows, "device": res.get("device"), "date": time.strftime("%Y-%m-%d")}, indent=1))


if __name__ == "__main__":
    main()
