"""The load generator's OpenAI transport: streamed /v1/completions against any compatible server.

`hybrid-jax bench serving --backend openai --server http://HOST:PORT` sends each
prompt as token ids (vLLM, SGLang and this project's server take them) with
`max_tokens`, `ignore_eos: true`, `stream: true`, `stream_options.include_usage` and
`return_token_ids: true` (vLLM's extension: every chunk carries its token ids, so a token
whose text is not decodable yet, as most of a random-weight preset's are, still counts),
and times it as the gRPC transport does: TTFT at the first chunk with text or token ids,
one token time per such chunk (ITL), the output token count from the final usage chunk
(chunks with text when a server sends no usage). A failure is counted
as `HTTP_<status>` (or the error event's code when a stream fails midway). The model
id and max_model_len come from GET /v1/models; the vocabulary size for the random
prompts from its `vocab_size` field (this server's) or `--vocab-size`. Plain
`http.client`, one connection per request, in the shared arrival loop's threads.
This module imports no JAX and knows nothing of the engine.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from serving.entrypoints.bench.load import LoadSpec, Record, drive


@dataclass(frozen=True)
class Target:
    host: str
    port: int
    prefix: str  # the path before /v1, usually ""
    api_key: str | None = None

    @classmethod
    def parse(cls, url: str, api_key: str | None = None) -> Target:
        """`http://host:port[/prefix]` or `host:port`."""
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--server {url!r}: give http://HOST:PORT (https is not supported here)")
        prefix = parts.path.rstrip("/").removesuffix("/v1")
        return cls(parts.hostname, parts.port or 80, prefix, api_key)

    def request(self, method: str, path: str, body: dict | None = None,
                timeout: float = 60.0) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body)
        conn.request(method, self.prefix + path, body=data, headers=headers)
        return conn, conn.getresponse()


@dataclass(frozen=True)
class ServedModel:
    model: str
    max_model_len: int | None
    vocab_size: int | None


def served_model(target: Target, model: str | None = None) -> ServedModel:
    """The model `target` serves (the first of /v1/models unless `model` names one)."""
    conn, resp = target.request("GET", "/v1/models")
    try:
        if resp.status != 200:
            raise OSError(f"GET /v1/models answered {resp.status}: {resp.read()[:200]!r}")
        cards = json.loads(resp.read())["data"]
    finally:
        conn.close()
    card = next((c for c in cards if c["id"] == model), None) if model else (cards[0] if cards else None)
    if card is None:
        raise ValueError(f"the server does not serve {model!r}; it serves {[c['id'] for c in cards]}")
    return ServedModel(card["id"], card.get("max_model_len"), card.get("vocab_size"))


def run_load_openai(target: Target, model: str, prompts: list[list[int]], max_tokens: list[int],
                    spec: LoadSpec, sampling: dict | None = None) -> tuple[list[Record], float]:
    """Send the requests as streamed completions; the records of those SENT and the wall time."""

    def send(prompt: list[int], n: int, rec: Record) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True, **(sampling or {})}
        conn, resp = target.request("POST", "/v1/completions", body, timeout=spec.timeout_s)
        try:
            if resp.status != 200:
                rec.code = f"HTTP_{resp.status}"
                return
            _read_stream(resp, rec)
        finally:
            conn.close()

    return drive(send, prompts, max_tokens, spec)


def _read_stream(resp: http.client.HTTPResponse, rec: Record) -> None:
    chunks, usage = 0, None
    while line := resp.readline():
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            rec.code = f"HTTP_{event['error'].get('code', 'error')}"
            return
        if any(c.get("text") or c.get("token_ids") for c in event.get("choices") or ()):
            rec.token_times.append(time.perf_counter())
            chunks += 1
        usage = event.get("usage") or usage
    rec.output_tokens = usage["completion_tokens"] if usage else chunks
