"""Fuzz the OpenAI HTTP front: a few hundred random and mutated bodies on every endpoint
(random bytes, wrong JSON types, extreme and wild values, unknown fields, flipped bytes
of good bodies, streamed and not), bounded in count and time. No call gets a 5xx,
every body of a refusal is OpenAI's error object, and afterwards a normal request
gives the Python API's output and the pools are back to empty."""

from __future__ import annotations

import http.client
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from serving.entrypoints.grpc.server import GenerationServer
from serving.entrypoints.llm import LLM
from serving.entrypoints.openai.api_server import OpenAIConfig
from serving.sample.sampling_params import SamplingParams
from tests.serving.server_helpers import wait_for

N_CALLS = 300
BUDGET_S = 60.0
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
GOOD = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
WILD = [0, 1, -1, 2, 16, 127, 128, 2**31 - 1, -(2**31), 2**31, 2**63, -(2**64), 0.5, -0.0, 1e308, -1e308,
        "1", "", "x" * 300, True, False, None, [], {}, [1, 2], {"a": 1}, [[]], ["a", ""], [-1, 300]]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "seed", "stop", "stop_token_ids", "n", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "ignore_eos", "min_tokens", "stream", "stream_options", "logprobs",
          "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "user", "chat_template_kwargs",
          "response_format", "unknown_field"]
SANE = {"max_tokens": [1, 3, 8], "temperature": [0.0, 0.7], "top_p": [0.5, 1.0], "top_k": [-1, 5],
        "min_p": [0.0, 0.1], "seed": [0, 5, -1], "stop": ["a", ["zz", "\n"]], "stop_token_ids": [[5], []],
        "n": [1, 2], "presence_penalty": [0.5], "frequency_penalty": [0.5], "repetition_penalty": [1.2],
        "ignore_eos": [True], "min_tokens": [0, 2], "stream": [True, False],
        "stream_options": [{"include_usage": True}], "logprobs": [2, True], "top_logprobs": [2],
        "echo": [True], "chat_template_kwargs": [{"x": 1}, {"messages": 1}],
        "logit_bias": [{"5": 2.0}, {"70": -100, "71": 0.5}, {}]}


def _text(rng: np.random.Generator) -> str:
    alphabet = ["a", "Z", " ", "\n", "\x00", "é", "中", "🙂", "<bos>", "{{", "{%", "\\", "%s"]
    return "".join(rng.choice(alphabet) for _ in range(int(rng.integers(0, 30))))


def _value(rng: np.random.Generator, field: str):
    if field in SANE and rng.random() < 0.6:
        options = SANE[field]
        return options[int(rng.integers(len(options)))]
    if field == "prompt" and rng.random() < 0.5:
        return [int(rng.integers(0, 300)) for _ in range(int(rng.integers(0, 20)))]
    if field == "messages" and rng.random() < 0.6:
        roles = ["user", "system", "assistant", "tool", ""]
        return [{"role": roles[int(rng.integers(len(roles)))], "content": _text(rng)}
                for _ in range(int(rng.integers(0, 4)))]
    return WILD[int(rng.integers(len(WILD)))] if rng.random() < 0.7 else _text(rng)


def _structured(rng: np.random.Generator) -> tuple[str, bytes]:
    chat = rng.random() < 0.5
    body = {"model": "m", "messages" if chat else "prompt": _value(rng, "messages" if chat else "prompt")}
    for field in FIELDS:
        if rng.random() < 0.2:
            body[field] = _value(rng, field)
    return ("/v1/chat/completions" if chat else "/v1/completions"), json.dumps(body).encode()


def _mutated(rng: np.random.Generator) -> tuple[str, bytes]:
    body = bytearray(json.dumps({"model": "m", "prompt": _text(rng) or "x", "max_tokens": 4, "stream": True,
                                 "stop": ["zz"], "temperature": 0.5}).encode())
    for _ in range(int(rng.integers(1, 4))):
        op, at = rng.integers(0, 3), int(rng.integers(0, len(body)))
        if op == 0:
            body[at] = int(rng.integers(0, 256))
        elif op == 1:
            del body[at:at + int(rng.integers(1, 4))]
        else:
            body[at:at] = rng.bytes(int(rng.integers(1, 4)))
    return "/v1/completions", bytes(body)


def _bodies(seed: int) -> list[tuple[str, str, bytes]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(N_CALLS):
        r = rng.random()
        if i % 20 == 19:
            out.append(("GET", str(rng.choice(["/v1/models", "/health", "/v1/x", "/"])), b""))
        elif r < 0.15:
            out.append(("POST", str(rng.choice(["/v1/completions", "/v1/chat/completions"])),
                        rng.bytes(int(rng.integers(0, 80)))))
        elif r < 0.4:
            out.append(("POST", *_mutated(rng)))
        else:
            out.append(("POST", *_structured(rng)))
    return out


@pytest.fixture(scope="module")
def served(server_engine, tmp_path_factory):
    want = LLM.from_engine(server_engine).generate(["After the fuzz"], GOOD)[0]
    template = tmp_path_factory.mktemp("fuzz") / "chat.jinja"
    template.write_text(TEMPLATE)
    config = OpenAIConfig(port=0, model_name="m", chat_template=str(template))
    server = GenerationServer(server_engine, model_name="m", port=0, http=config).start()
    try:
        yield server, want
    finally:
        server.shutdown(grace_s=0)


def _one(port: int, method: str, path: str, body: bytes, t_end: float) -> tuple[int, bytes] | None:
    if time.monotonic() > t_end:
        return None
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body or None, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _check(status: int, raw: bytes) -> str | None:
    """What is wrong with one answer, or None."""
    if status >= 500:
        return f"status {status}"
    if status >= 400:
        err = json.loads(raw).get("error", {})
        if not (err.get("message") and err.get("type") and err.get("code") == status):
            return f"error body {raw[:80]!r}"
    return None


def test_random_and_mutated_bodies_never_break_the_server(served):
    server, want = served
    t_end = time.monotonic() + BUDGET_S
    bodies = _bodies(seed=11)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda b: _one(server.http_port, *b, t_end), bodies))
    done = [(b, a) for b, a in zip(bodies, answers, strict=True) if a is not None]
    assert len(done) >= N_CALLS // 2, f"only {len(done)} calls within {BUDGET_S}s"
    bad = [(b[1], b[2][:60], problem) for b, a in done if (problem := _check(*a))]
    assert not bad, bad[:5]
    seen = {a[0] for _, a in done}
    assert {200, 400} <= seen  # the fuzz reached both sides
    status, raw = _one(server.http_port, "POST", "/v1/completions", json.dumps(
        {"model": "m", "prompt": "After the fuzz", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    ).encode(), math.inf)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == want.text
    wait_for(lambda: server.core.num_live() == 0, what="every fuzz request to finish")
    stats = server.core.stats()
    assert stats["slots_in_use"] == 0 and sum(stats["pages_in_use"].values()) == 0
    assert server.is_serving()
