"""The serving fronts' host cost: how much a front slows the engine loop under streaming load.

    PYTHONPATH=. python benchmarks/front_overhead.py [--streams 32] [--host-releases 20]
        [--seconds 8] [--repeats 3]

Starts a `GenerationServer` with both fronts (gRPC and OpenAI HTTP) in a child process
over a *fake* engine whose step costs a fixed amount: `--host-ms` of Python work (holds
the GIL, as the real engine's scheduling, packing and detokenizing do; with
`--host-releases N` it lets the GIL go N times in between, as the real engine does at
every JAX call) and then `--device-ms` of waiting with the GIL released (as the real
engine waits for the device). Every step gives each running request one token. The
load generator runs in this process (gRPC: one grpc.aio loop; HTTP: a thread per
stream): `--streams` concurrent streaming requests (long `max_tokens`, EOS ignored,
closed loop: a finished one is replaced at once) through one front at a time for
`--seconds`, alternating fronts per repeat. From the server's Prometheus endpoint
(`hybrid_jax_engine_step_seconds`) it reports, per front: the mean step interval (wall
time over steps taken), the mean engine step (what `EngineCore` times around
`engine.step()`; minus the fixed device wait, that is the host time a step took, its
fixed Python work stretched by whatever else wanted the GIL; split into the Python work
and the wait as `step_host_ms` and `step_wait_ms`), output tokens/s, and
CPU time per streamed token of the front's own threads, of the whole server process
(from /proc: Linux only) and of the load generator. On a machine with few cores the
load generator's CPU competes with the server's, so the step interval there mixes the
front's cost with its client's; the CPU times per token separate them.

With no front overhead, the step interval is host-ms + device-ms (plus the loop's own
bookkeeping), whichever front serves. Whatever it costs beyond that is the front's
host cost landing on the engine thread (GIL hand-offs, wake-ups, message building).
This is a host-cost figure: valid on a CPU as such (no accelerator is involved), but the
machine's other load adds noise, so it repeats and reports the spread. The GPU
counterpart is benchmarks/http_vs_grpc.sh (a real model, Poisson arrivals). Figures:
docs/benchmarks.md, "Serving under load".
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

# -- the server side (child process) -------------------------------------------------------


class _Seq:
    __slots__ = ("rid", "prompt", "max_tokens", "out")

    def __init__(self, rid: str, prompt: int, max_tokens: int):
        self.rid, self.prompt, self.max_tokens, self.out = rid, prompt, max_tokens, 0

    @property
    def num_output_tokens(self) -> int:
        return self.out

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt


class FakeEngine:
    """What `EngineCore` and the fronts use of `LLMEngine`, with a step of fixed cost.

    A step: `host_iters` iterations of Python arithmetic (GIL held; calibrated to
    `host_ms` on an idle interpreter) in `host_releases + 1` pieces with the GIL let go
    between them (the real engine lets it go at every JAX call; each time, another thread
    may take it, and the engine waits to get it back), then `time.sleep(device_ms)`
    (GIL released).
    Every running request (at most max_num_seqs, first come first served) gets one token.
    """

    def __init__(self, *, max_num_seqs: int, host_ms: float, device_ms: float, host_releases: int = 0,
                 vocab: int = 1000):
        from serving.engine.engine_config import EngineConfig

        self.max_num_seqs, self.device_s, self.vocab = max_num_seqs, device_ms / 1e3, vocab
        self.host_releases = host_releases
        self.host_iters = _calibrate(host_ms / 1e3)
        self._seqs: dict[str, _Seq] = {}
        self._ids = 0
        self.host_s = self.wait_s = 0.0
        sched = SimpleNamespace(max_model_len=1 << 20, max_num_seqs=max_num_seqs, page_size=16, groups=[],
                                prefix_caching=False)
        self.plan = SimpleNamespace(scheduler=sched, kv_bytes=0, slot_bytes=0)
        self.model_config = SimpleNamespace(vocab_size=vocab, architecture="fake", layers=[],
                                            eos_token_ids=[], bos_token_id=None, mamba2=None, mamba1=None,
                                            rglru=None)
        self.config = EngineConfig()
        self.tokenizer = None
        self.weight_bytes_by_dtype: dict[str, int] = {}
        self.quantization, self.kv_cache_dtype, self.last_fault = None, "float32", None
        self.scheduler = SimpleNamespace(stats=self._sched_stats, get=self._seqs.get)

    def _sched_stats(self):
        return SimpleNamespace(num_waiting=max(0, len(self._seqs) - self.max_num_seqs))

    def add_request(self, prompt=None, params=None, *, prompt_token_ids=None, request_id=None) -> str:
        rid = request_id or f"fake-{self._ids}"
        self._ids += 1
        if rid in self._seqs:
            raise ValueError(f"request_id {rid!r} is already live")
        self._seqs[rid] = _Seq(rid, len(prompt_token_ids or [0]), params.max_tokens)
        return rid

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def background_ready(self) -> bool:
        return False

    def abort(self, request_id: str) -> bool:
        return self._seqs.pop(request_id, None) is not None

    def step(self):
        from serving.engine.outputs import RequestDelta

        x, t0 = 0, time.perf_counter()
        chunk = self.host_iters // (self.host_releases + 1)
        for _ in range(self.host_releases + 1):
            for i in range(chunk):  # the step's host work: holds the GIL
                x = (x * 31 + i) % 1000003
            if self.host_releases:
                time.sleep(0)  # a call that lets the GIL go (as every JAX dispatch does)
        t1 = time.perf_counter()
        time.sleep(self.device_s)  # the device: GIL released
        t2 = time.perf_counter()
        self.host_s += t1 - t0  # the Python work, stretched when the thread loses the GIL or a core
        self.wait_s += t2 - t1  # the wait, stretched when the GIL is not free as the wait ends
        out = []
        for seq in list(self._seqs.values())[:self.max_num_seqs]:
            seq.out += 1
            done = seq.out >= seq.max_tokens
            out.append(RequestDelta(seq.rid, [(seq.out * 7 + x) % self.vocab], "a", None, done,
                                    "length" if done else None, seq.prompt, seq.out))
            if done:
                del self._seqs[seq.rid]
        return out

    def stats(self) -> dict:
        running = min(len(self._seqs), self.max_num_seqs)
        return {"num_running": running, "num_waiting": len(self._seqs) - running, "slots_in_use": running,
                "slots_total": self.max_num_seqs, "pages_in_use": {}, "pages_total": {}}


def _calibrate(seconds: float) -> int:
    """Iterations of the step's loop that take `seconds` (the fastest of 20 tries: the
    machine's other load only ever slows a try down)."""
    n, best = 20000, float("inf")
    for _ in range(20):
        x, t0 = 0, time.perf_counter()
        for i in range(n):
            x = (x * 31 + i) % 1000003
        best = min(best, time.perf_counter() - t0)
    return max(1, int(n * seconds / best))


def serve(args: argparse.Namespace) -> None:
    from serving.entrypoints.grpc.server import GenerationServer
    from serving.entrypoints.openai.api_server import OpenAIConfig

    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    engine = FakeEngine(max_num_seqs=args.streams, host_ms=args.host_ms, device_ms=args.device_ms,
                        host_releases=args.host_releases)
    server = GenerationServer(engine, model_name="fake", port=0, metrics_port=0, self_test=False,
                              http=OpenAIConfig(port=0, model_name="fake")).start()
    print(json.dumps({"grpc": server.port, "http": server.http_port, "metrics": server.metrics_port}),
          flush=True)
    for _ in sys.stdin:  # each line asks for the CPU times; until the parent closes our stdin
        got = {**thread_cpu(), "fake_host": engine.host_s, "fake_wait": engine.wait_s}
        print(json.dumps(got), flush=True)
    server.shutdown(grace_s=0)


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, by role: the engine
    loop, each front's threads (its event loop, its pool; before grpc.aio, the gRPC pool
    threads), and the rest (threads that Python did not start, e.g. gRPC's poller)."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {"engine": 0.0, "grpc": 0.0, "http": 0.0, "other": 0.0}  # seconds
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        name = names.get(int(tid), "")
        role = ("engine" if name == "engine-core" else "grpc" if name.startswith("grpc")
                else "http" if name.startswith("http") else "other")
        out[role] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


# -- the load generator (this process) -----------------------------------------------------


def _grpc_streams(port: int, max_tokens: int, stop: threading.Event, counts: list[int]) -> None:
    """Every gRPC stream on one asyncio loop (this thread): a grpc.aio client costs the load
    generator much less CPU per message than a sync stream per thread, which matters when
    client and server share a few cores."""
    import asyncio

    import grpc.aio

    from serving.entrypoints.grpc.client import make_request
    from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc

    async def one(stub, i: int) -> None:
        while not stop.is_set():
            req = make_request([1, 2, 3, 4], max_tokens=max_tokens, ignore_eos=True)
            call = stub.Generate(req, timeout=600)
            async for msg in call:
                counts[i] += len(msg.token_ids)
                if stop.is_set():
                    call.cancel()
                    break

    async def main() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.GenerationStub(ch)
            await asyncio.gather(*(one(stub, i) for i in range(len(counts))))

    asyncio.run(main())


def _http_worker(port: int, max_tokens: int, stop: threading.Event, counts: list[int], i: int) -> None:
    body = json.dumps({"model": "fake", "prompt": [1, 2, 3, 4], "max_tokens": max_tokens, "ignore_eos": True,
                       "stream": True})
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        for line in resp:
            if line.startswith(b"data: {"):
                counts[i] += 1  # one chunk per token
            if stop.is_set():
                break
        conn.close()


def _steps(metrics_port: int) -> tuple[float, float]:
    """(sum, count) of hybrid_jax_engine_step_seconds."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    got = {}
    for line in body.splitlines():
        for key in ("hybrid_jax_engine_step_seconds_sum", "hybrid_jax_engine_step_seconds_count"):
            if line.startswith(key + " "):
                got[key] = float(line.split()[1])
    return got["hybrid_jax_engine_step_seconds_sum"], got["hybrid_jax_engine_step_seconds_count"]


def run_once(front: str, ports: dict, args: argparse.Namespace, cpu) -> dict:
    stop = threading.Event()
    counts = [0] * args.streams
    if front == "grpc":
        threads = [threading.Thread(target=_grpc_streams, args=(ports[front], args.max_tokens, stop, counts),
                                    daemon=True)]
    else:  # plain http.client, a thread per stream: cheap enough per chunk
        threads = [threading.Thread(target=_http_worker, daemon=True,
                                    args=(ports[front], args.max_tokens, stop, counts, i))
                   for i in range(args.streams)]
    for t in threads:
        t.start()
    time.sleep(args.warmup)  # every stream open and streaming
    s0, c0, n0, t0, u0 = *_steps(ports["metrics"]), sum(counts), time.monotonic(), cpu()
    k0 = _own_cpu()
    time.sleep(args.seconds)
    s1, c1, n1, t1, u1 = *_steps(ports["metrics"]), sum(counts), time.monotonic(), cpu()
    k1 = _own_cpu()
    stop.set()
    for t in threads:
        t.join(timeout=30)
    time.sleep(0.5)  # the cancelled streams leave the engine
    steps = c1 - c0
    return {"front": front, "steps": int(steps), "step_interval_ms": 1e3 * (t1 - t0) / steps,
            "engine_step_ms": 1e3 * (s1 - s0) / steps,
            "host_ms_per_step": 1e3 * (s1 - s0) / steps - args.device_ms,
            "tokens_per_s": (n1 - n0) / (t1 - t0), "tokens_per_step": (n1 - n0) / steps,
            "front_cpu_us_per_token": 1e6 * (u1[front] - u0[front]) / max(1, n1 - n0),
            "step_host_ms": 1e3 * (u1.pop("fake_host") - u0.pop("fake_host")) / steps,
            "step_wait_ms": 1e3 * (u1.pop("fake_wait") - u0.pop("fake_wait")) / steps,
            "server_cpu_us_per_token": 1e6 * (sum(u1.values()) - sum(u0.values())) / max(1, n1 - n0),
            "client_cpu_us_per_token": 1e6 * (k1 - k0) / max(1, n1 - n0)}


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=32, help="concurrent streams (= the engine's batch)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured time per front and repeat")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=100000)
    p.add_argument("--host-ms", type=float, default=1.0, help="the fake step's Python work (GIL held)")
    p.add_argument("--device-ms", type=float, default=2.0, help="the fake step's wait (GIL released)")
    p.add_argument("--host-releases", type=int, default=0,
                   help="times the fake step's Python work lets the GIL go (as JAX calls do)")
    p.add_argument("--fronts", default="grpc,http")
    p.add_argument("--switch-interval-ms", type=float, default=0.0,
                   help="the server process's sys.setswitchinterval (0: Python's default, 5 ms)")
    p.add_argument("--out", help="write the runs as JSON lines here")
    p.add_argument("--_serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._serve:
        return serve(args)
    cmd = [sys.executable, __file__, "--_serve", "--streams", str(args.streams),
           "--host-ms", str(args.host_ms), "--device-ms", str(args.device_ms),
           "--switch-interval-ms", str(args.switch_interval_ms), "--host-releases", str(args.host_releases)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    runs = []

    def cpu() -> dict[str, float]:
        child.stdin.write("\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())

    try:
        ports = json.loads(child.stdout.readline())
        for rep in range(args.repeats):
            fronts = args.fronts.split(",")
            for front in fronts if rep % 2 == 0 else fronts[::-1]:
                r = run_once(front, ports, args, cpu)
                r["repeat"] = rep
                runs.append(r)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}),
                      flush=True)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    print(f"\n{args.streams} streams, fake step {args.host_ms} ms host (GIL let go {args.host_releases} "
          f"times) + {args.device_ms} ms device, "
          f"{args.repeats} x {args.seconds:g} s per front; median [min-max]")
    for front in args.fronts.split(","):
        mine = [r for r in runs if r["front"] == front]
        cells = []
        for key in ("step_interval_ms", "engine_step_ms", "host_ms_per_step", "step_host_ms", "step_wait_ms",
                    "tokens_per_s",
                    "front_cpu_us_per_token", "server_cpu_us_per_token", "client_cpu_us_per_token"):
            vals = [r[key] for r in mine]
            cells.append(f"{key} {statistics.median(vals):.3g} [{min(vals):.3g}-{max(vals):.3g}]")
        print(f"{front:>5}: " + ", ".join(cells))
    if args.out:
        with open(args.out, "w") as f:
            for r in runs:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
