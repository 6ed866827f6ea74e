"""The OpenAI-compatible HTTP API against a live server, driven by the official `openai` client.

One server for the module (the session's native-tiny engine, behind an API key), with
a model directory built here: the byte-level tokenizer of native-tiny plus a
tokenizer_config.json whose chat template reads a kwarg (`enable_thinking`, as Qwen3's
does). References are independent: the Python API (`LLM.generate`) on the same
engine before the server starts, and transformers' `apply_chat_template` on the same
directory.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import shutil
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path

import openai
import pytest

from serving.entrypoints.grpc.server import GenerationServer
from serving.entrypoints.llm import LLM
from serving.entrypoints.openai.api_server import OpenAIConfig
from serving.sample.sampling_params import SamplingParams
from tests.serving.server_helpers import wait_for

KEY = "test-key"
MODEL = "tiny-chat"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
            "{% if greeting is defined %}{{ greeting }}{% endif %}{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
PROMPT = "The cat"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-chat")
    with resources.as_file(resources.files("configs") / "tokenizers" / "byte-level.json") as f:
        shutil.copy(f, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "chat_template": TEMPLATE}))
    return d


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def refs(server_engine, hf_tokenizer):
    """Python-API outputs on the same engine, computed before the server's core steps it."""
    llm = LLM.from_engine(server_engine)
    chat_ids = list(hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, enable_thinking=False,
                                                     greeting="Hello")["input_ids"])
    text = llm.generate([PROMPT], GREEDY)[0]
    ban = text.token_ids[0]  # the greedy first token, biased away below
    return {"text": text, "ban": ban,
            "bias": llm.generate([PROMPT], dataclasses.replace(GREEDY, logit_bias={ban: -100.0}))[0],
            "logprobs": llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0],
            "chat": llm.generate(prompt_token_ids=[chat_ids], sampling_params=GREEDY)[0],
            "chat_ids": chat_ids}


@pytest.fixture(scope="module")
def served(server_engine, model_dir, refs, tmp_path_factory):
    config = OpenAIConfig(port=0, model_name=MODEL, model_dir=str(model_dir),
                          default_chat_template_kwargs={"enable_thinking": True, "greeting": "Hello"},
                          profile_dir=str(tmp_path_factory.mktemp("profile")))
    server = GenerationServer(server_engine, model_name=MODEL, port=0, api_key=KEY, http=config).start()
    try:
        yield server
    finally:
        server.shutdown(grace_s=0)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key=KEY, max_retries=0)


def _raw(served, method: str, path: str, body=None, headers=None) -> tuple[int, bytes]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", served.http_port, timeout=60)
    conn.request(method, path, body=data, headers={"Authorization": f"Bearer {KEY}",
                                                   "Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, resp.read()
    conn.close()
    return out


def _error(served, path: str, body) -> tuple[int, dict]:
    status, raw = _raw(served, "POST", path, body)
    return status, json.loads(raw)["error"]


def _idle(served) -> None:
    wait_for(lambda: served.core.num_live() == 0, what="every request to finish")
    stats = served.core.stats()
    assert stats["slots_in_use"] == 0 and sum(stats["pages_in_use"].values()) == 0


def test_models_and_health(served, client):
    cards = client.models.list().data
    assert [c.id for c in cards] == [MODEL]
    assert cards[0].max_model_len == 128
    with urllib.request.urlopen(f"http://127.0.0.1:{served.http_port}/health") as r:  # no key needed
        assert r.status == 200
    served._serving = False  # what shutdown and a fatal engine fault set
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{served.http_port}/health")
        assert err.value.code == 503
    finally:
        served._serving = True


def test_completion_greedy_equals_python_api(client, refs):
    want = refs["text"]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)  # the BOS included, as the Python API
    assert got.usage.completion_tokens == 12 and got.usage.total_tokens == len(want.prompt_token_ids) + 12
    by_ids = client.completions.create(model=MODEL, prompt=want.prompt_token_ids, max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == want.text


def test_profile_routes_trace_and_log_steps_without_changing_output(served, client, refs):
    assert _raw(served, "POST", "/stop_profile")[0] == 409  # none running
    status, body = _raw(served, "POST", "/start_profile")
    assert status == 200 and json.loads(body)["profiling"] is True
    assert _raw(served, "POST", "/start_profile")[0] == 409  # one at a time
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == refs["text"].text
    status, body = _raw(served, "POST", "/stop_profile")
    info = json.loads(body)
    assert status == 200 and info["steps"] >= 11
    steps = [json.loads(line) for line in Path(info["step_log"]).read_text().splitlines()]
    assert len(steps) == info["steps"] and {"t_s", "seqs", "decodes", "tokens"} <= set(steps[0])
    assert steps[0]["tokens"] > 1 and steps[-1]["decodes"] == 1  # the prefill, then decodes
    assert any(Path(info["trace_dir"]).rglob("*.xplane.pb"))
    # the engine's methods are its own again
    assert "dispatch" not in vars(served.core.engine.runner) and "step" not in vars(served.core.engine)


def test_streamed_completion_matches_and_ends_with_done(served, client, refs):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == refs["text"].text
    content = [c for c in chunks if c.choices]
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    status, raw = _raw(served, "POST", "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                                          "stream": True})
    events = [e for e in raw.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    # return_token_ids (vLLM's extension): every token gets a chunk carrying its id
    extra = {"ignore_eos": True, "return_token_ids": True}
    ids = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                         stream=True, extra_body=extra))
    want = refs["text"]
    assert [t for c in ids for t in c.choices[0].token_ids] == list(want.token_ids)
    assert ids[0].choices[0].prompt_token_ids == list(want.prompt_token_ids)
    assert all(c.choices[0].prompt_token_ids is None for c in ids[1:])
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert whole.choices[0].token_ids == list(want.token_ids)


def test_n_choices_seed_and_echo(client):
    # native-tiny's random weights are peaked (gaps of ~20 nats): a high temperature makes
    # sampling choose, so that seeds show
    kw = dict(model=MODEL, prompt=["ab", "cd"], max_tokens=8, temperature=60.0, seed=7, n=2, logprobs=0)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    texts = [c.logprobs.tokens for c in first.choices]
    assert texts == [c.logprobs.tokens for c in again.choices]  # the seed repeats them
    assert texts[0] != texts[1] and texts[2] != texts[3]  # the choices of one prompt differ
    single = client.completions.create(model=MODEL, prompt="ab", max_tokens=8, temperature=60.0, seed=7,
                                       logprobs=0)
    assert single.choices[0].logprobs.tokens == texts[0]  # choice 0 has the request's seed
    assert first.usage.prompt_tokens == 3 + 3  # each prompt once (BOS + 2 bytes), not once per choice
    assert first.usage.completion_tokens == sum(len(t) for t in texts)
    echo = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt="ab", max_tokens=3, temperature=0)
    assert echo.choices[0].text == "ab" + plain.choices[0].text


def test_logprobs_match_the_python_api(client, refs):
    want = refs["logprobs"]
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == got.choices[0].text
    for tok, value, top, entry in zip(want.token_ids, lp.token_logprobs, lp.top_logprobs, want.logprobs,
                                      strict=True):
        assert value == pytest.approx(entry[tok], abs=1e-5)
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the sampled token is the best
        assert 3 <= len(top) <= 4
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 3
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
               for t in content)


def test_stop_strings_and_stop_token_ids(client, refs):
    text, ids = refs["text"].text, refs["text"].token_ids
    assert len(text) == len(ids)  # one byte, one character per token here
    cut = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # a token seen first at i
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    stop=[text[cut]])
    assert got.choices[0].text == text[:cut] and got.choices[0].finish_reason == "stop"
    stop_id = ids[cut]
    by_id = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"stop_token_ids": [stop_id]})
    assert by_id.choices[0].finish_reason == "stop" and by_id.usage.completion_tokens == cut + 1


def test_chat_renders_as_transformers_and_equals_python_api(client, refs, hf_tokenizer):
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert got.usage.prompt_tokens == len(refs["chat_ids"])
    assert got.choices[0].message.content == refs["chat"].text
    assert got.choices[0].message.role == "assistant" and got.choices[0].finish_reason == "length"
    # the server default (enable_thinking true) renders without <think></think>, as transformers does
    default = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
    thinking = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                                enable_thinking=True, greeting="Hello")
    assert "<think>" not in thinking
    assert default.usage.prompt_tokens == len(hf_tokenizer(thinking, add_special_tokens=False)["input_ids"])
    assert default.usage.prompt_tokens == len(refs["chat_ids"]) - len("<think></think>")
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == refs["chat"].text
    assert [c for c in streamed if c.choices][-1].choices[0].finish_reason == "length"
    assert streamed[-1].usage.prompt_tokens == len(refs["chat_ids"])
    assert streamed[-1].usage.completion_tokens == 12
    def prompt_tokens(content) -> int:
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=1, temperature=0).usage.prompt_tokens

    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]
    assert prompt_tokens(parts) == prompt_tokens("Say\nhi") == prompt_tokens("Sayhi") + 1  # joined by "\n"


def test_error_bodies_name_the_field(served, client):
    cases = [("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
             ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
             ("/v1/completions", {"model": MODEL, "prompt": "x", "bogus": 1}, 400, "bogus"),
             ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
             ("/v1/completions", {"model": MODEL, "prompt": [5, 999999]}, 400, "prompt"),
             ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
             ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
             ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model"),
             ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                       "max_completion_tokens": 500}, 400, "max_completion_tokens"),
             ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
              400, "messages[0].role"),
             ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages")]
    for path, body, status, param in cases:
        got_status, err = _error(served, path, body)
        assert (got_status, err["param"]) == (status, param), (body, err)
        assert err["message"] and err["type"] and err["code"] == status
    status, raw = _raw(served, "POST", "/v1/completions", b"{not json")
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, raw = _raw(served, "POST", "/v1/completions", b"x" * (served.limits.max_request_bytes + 1))
    assert status == 413
    assert _raw(served, "GET", "/v1/nothing")[0] == 404
    status, raw = _raw(served, "GET", "/v1/completions")
    assert status == 405 and json.loads(raw)["error"]["code"] == 405
    with pytest.raises(openai.BadRequestError) as err:  # the SDK sees the same body
        client.completions.create(model=MODEL, prompt="x", presence_penalty=3)
    assert err.value.body["param"] == "presence_penalty"


def test_logit_bias_equals_python_api_and_is_checked(served, client, refs):
    want, ban = refs["bias"], refs["ban"]
    assert want.token_ids[0] != ban and ban not in want.token_ids  # -100: never sampled
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    logit_bias={str(ban): -100}, extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})  # its slot's bias is gone
    assert plain.choices[0].text == refs["text"].text
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=4,
                                          temperature=0, logit_bias={"68": 100})
    assert chat.choices[0].message.content == "AAAA"  # byte-level tokenizer: id 68 is "A"
    for bias in ({"x": 1}, {"5": 101}, {"5": -100.5}, {"999999": 1}, {"-3": 1},
                 {str(i): 1 for i in range(301)}):
        status, err = _error(served, "/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": bias})
        assert (status, err["param"]) == (400, "logit_bias"), (bias, err)
    _idle(served)


def test_no_template_queue_full_and_api_key(served, client):
    front = served.http.front
    template, front.chat_template = front.chat_template, None
    try:
        status, err = _error(served, "/v1/chat/completions", {"messages": MESSAGES})
        assert status == 400 and "no chat template" in err["message"]
    finally:
        front.chat_template = template
    limit, served.core.max_waiting = served.core.max_waiting, 0
    try:
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    finally:
        served.core.max_waiting = limit
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        status, raw = _raw(served, "GET", "/v1/models", headers=headers)
        assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=2)
    _idle(served)


def test_disconnect_while_waiting_for_a_whole_answer_frees_the_slot(served):
    finished = served.metrics.requests
    aborted, lengths = finished.labels("abort")._value.get(), finished.labels("length")._value.get()
    conn = http.client.HTTPConnection("127.0.0.1", served.http_port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "ignore_eos": True}),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    wait_for(lambda: served.core.stats()["slots_in_use"] == 1, what="the request to run")
    conn.sock.close()  # gone before the answer
    conn.close()
    wait_for(lambda: served.core.num_live() == 0, timeout=10, what="the request to be aborted")
    assert served.core.stats()["slots_in_use"] == 0
    assert finished.labels("abort")._value.get() == aborted + 1
    assert finished.labels("length")._value.get() == lengths


def test_disconnect_mid_stream_frees_the_slot(served):
    finished = served.metrics.requests
    aborted, lengths = finished.labels("abort")._value.get(), finished.labels("length")._value.get()
    conn = http.client.HTTPConnection("127.0.0.1", served.http_port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 110, "ignore_eos": True, "stream": True}),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read(6) == b"data: "  # the stream runs
    assert served.core.stats()["slots_in_use"] == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    wait_for(lambda: served.core.num_live() == 0, timeout=10, what="the request to be aborted")
    stats = served.core.stats()
    assert stats["slots_in_use"] == 0 and sum(stats["pages_in_use"].values()) == 0
    # aborted by the disconnect, not run to its length
    assert finished.labels("abort")._value.get() == aborted + 1
    assert finished.labels("length")._value.get() == lengths


def test_a_request_the_engine_fails_gets_500_and_the_others_go_on(served, server_engine, client, refs):
    poison = server_engine.tokenizer.encode("Poison", add_bos=True)
    dispatch = server_engine.runner.dispatch

    def faulty(arrays, *args, **kwargs):  # every step holding the poisoned prompt raises
        slots = arrays.slot_ids.tolist()
        if any(r.seq.prompt_token_ids == poison and r.seq.slot in slots
               for r in list(server_engine.requests.values())):
            raise RuntimeError("injected fault")
        return dispatch(arrays, *args, **kwargs)

    server_engine.runner.dispatch = faulty
    try:
        with ThreadPoolExecutor(2) as pool:
            good = pool.submit(client.completions.create, model=MODEL, prompt=PROMPT, max_tokens=12,
                               temperature=0, extra_body={"ignore_eos": True})
            status, err = _error(served, "/v1/completions",
                                 {"model": MODEL, "prompt": "Poison", "max_tokens": 4})
            status_s, raw = _raw(served, "POST", "/v1/completions",
                                 {"model": MODEL, "prompt": "Poison", "max_tokens": 4, "stream": True})
            assert good.result(timeout=120).choices[0].text == refs["text"].text
    finally:
        server_engine.runner.dispatch = dispatch
    assert status == 500 and err["type"] == "server_error" and "failed in the engine" in err["message"]
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert status_s == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 500
    assert served.is_serving()
    _idle(served)


def test_tokenize_and_detokenize_as_the_endpoints_would_send(served, refs, hf_tokenizer):
    """vLLM's /tokenize and /detokenize: a prompt gives the ids /v1/completions sends (the
    Python API's, BOS included), messages the ids transformers' apply_chat_template gives;
    the ids detokenize to the text again (special tokens kept); bad bodies name the field."""
    def post(path, body):
        status, raw = _raw(served, "POST", path, body)
        assert status == 200, raw
        return json.loads(raw)

    want = refs["text"].prompt_token_ids
    got = post("/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    assert got["tokens"] == want and got["count"] == len(want) and got["max_model_len"] == 128
    assert got["token_strs"] == hf_tokenizer.convert_ids_to_tokens(want)
    bare = post("/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert bare["tokens"] == want[1:] and bare["token_strs"] is None
    chat = post("/tokenize", {"model": MODEL, "messages": MESSAGES,
                              "chat_template_kwargs": {"enable_thinking": False}})
    assert chat["tokens"] == refs["chat_ids"]
    no_prompt = post("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert no_prompt["tokens"] == list(hf_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=False, tokenize=True, return_dict=True, greeting="Hello",
        enable_thinking=True)["input_ids"])
    text = post("/detokenize", {"model": MODEL, "tokens": refs["chat_ids"]})["prompt"]
    assert text == hf_tokenizer.decode(refs["chat_ids"]) and text.startswith("<bos><|system|>")
    assert post("/detokenize", {"tokens": want[1:]})["prompt"] == PROMPT
    for path, body, status, param in [("/tokenize", {"prompt": PROMPT, "bogus": 1}, 400, "bogus"),
                                      ("/tokenize", {"messages": []}, 400, "messages"),
                                      ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
                                      ("/detokenize", {"tokens": [5, 10**6]}, 400, "tokens"),
                                      ("/detokenize", {"tokens": "abc"}, 400, "tokens")]:
        got_status, err = _error(served, path, body)
        assert (got_status, err["param"]) == (status, param), (body, err)
    status, raw = _raw(served, "POST", "/tokenize", b"{not json")
    assert status == 400 and "JSON" in json.loads(raw)["error"]["message"]
    wrong_key = {"Authorization": "Bearer no"}
    assert _raw(served, "POST", "/tokenize", {"prompt": "x"}, headers=wrong_key)[0] == 401


def test_model_retrieve_and_metrics_on_the_api_port(served, client):
    """OpenAI's `models.retrieve` (GET /v1/models/{id}); GET /metrics serves the same series as
    --metrics-port, without the API key (as /health), and counts what this server did."""
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model")
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("other")
    assert err.value.body["param"] == "model"
    assert _raw(served, "GET", f"/v1/models/{MODEL}", headers={"Authorization": "Bearer no"})[0] == 401
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    with urllib.request.urlopen(f"http://127.0.0.1:{served.http_port}/metrics") as r:  # no key
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    done = [line for line in text.splitlines() if line.startswith("hybrid_jax_requests_total{")]
    assert done and sum(float(line.rsplit(" ", 1)[1]) for line in done) >= 1, text[:500]
