"""`hybrid-jax bench MODE --smoke --out DIR` end to end on CPU: each mode writes DIR/MODE.json
with the batch and lengths actually run, and DIR/MODE.png; the serving load generator runs
against a real local gRPC server (and its OpenAI HTTP API) and its counts equal the server's own."""

from __future__ import annotations

import json

import pytest

from serving.entrypoints.cli import main


def _run(mode: str, tmp_path, *extra: str) -> dict:
    assert main(["bench", mode, "--smoke", "--out", str(tmp_path), *extra]) == 0
    png = tmp_path / f"{mode}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads((tmp_path / f"{mode}.json").read_text())


def test_throughput_runs_every_request_to_its_length(tmp_path):
    res = _run("throughput", tmp_path)
    assert res["num_requests"] == len(res["input_lens"]) == 6
    assert res["output_lens"] == res["output_lens_requested"]  # EOS ignored: each ran to its length
    assert res["output_tok_s"] == pytest.approx(sum(res["output_lens"]) / res["elapsed_s"])
    total = sum(res["input_lens"]) + sum(res["output_lens"])
    assert res["total_tok_s"] == pytest.approx(total / res["elapsed_s"])
    assert res["max_num_seqs"] == 4 and res["device"] and res["date"]


def test_serving_counts_exactly_the_requests_it_sent(tmp_path):
    res = _run("serving", tmp_path)  # against a `hybrid-jax serve` child process, stopped at the end
    assert res["server"] == "child process" and "note" not in res
    log = [json.loads(line) for line in (tmp_path / "serving_server.log").read_text().splitlines()
           if line.startswith("{")]
    assert [e["event"] for e in log if e.get("event", "").startswith("server.st")][-1] == "server.stopped"
    server = res["server_counted"]
    finished = sum(v for k, v in server.items() if k.startswith("finished_"))
    rejected = sum(v for k, v in server.items() if k.startswith("rejected_"))
    assert res["sent"] == res["num_requests"] == 12
    assert finished + rejected == res["sent"]
    assert server["finished_length"] == res["completed"]
    assert server["generation_tokens"] == res["output_tokens"]
    # Independently of the server: requests longer than max_model_len fail INVALID_ARGUMENT, the rest
    # complete with exactly max_tokens tokens.
    too_long = [p + m > res["max_model_len"]
                for p, m in zip(res["input_lens"], res["max_tokens"], strict=True)]
    assert 0 < sum(too_long) < len(too_long)
    assert res["failures_by_code"] == {"INVALID_ARGUMENT": sum(too_long)}
    assert [c != "OK" for c in res["codes"]] == too_long
    assert [o for o, bad in zip(res["output_lens"], too_long, strict=True) if not bad] == \
        [m for m, bad in zip(res["max_tokens"], too_long, strict=True) if not bad]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = res[key]
        assert s["count"] > 0 and s["p50"] <= s["p90"] <= s["p99"]
    assert res["ttft_ms"]["p50"] <= res["e2e_ms"]["p50"]


def test_serving_over_the_openai_api_counts_what_it_sent(tmp_path):
    res = _run("serving", tmp_path, "--backend", "openai")
    server = res["server_counted"]
    assert res["backend"] == "openai" and res["sent"] == 12
    assert sum(v for k, v in server.items() if k.startswith(("finished_", "rejected_"))) == 12
    too_long = [p + m > res["max_model_len"]
                for p, m in zip(res["input_lens"], res["max_tokens"], strict=True)]
    assert 0 < sum(too_long) < 12
    assert res["failures_by_code"] == {"HTTP_400": sum(too_long)}
    assert server["finished_length"] == res["completed"]
    assert server["generation_tokens"] == res["output_tokens"]
    assert [o for o, bad in zip(res["output_lens"], too_long, strict=True) if not bad] == \
        [m for m, bad in zip(res["max_tokens"], too_long, strict=True) if not bad]
    assert res["tpot_ms"]["count"] > 0 and res["ttft_ms"]["p50"] <= res["e2e_ms"]["p50"]


def test_scaling_reports_whole_batch_decode_and_its_floor(tmp_path):
    res = _run("scaling", tmp_path, "--profile", str(tmp_path / "trace"), "--shared-prefix", "96")
    got = {(p["model"], p["batch"], p["context"]) for p in res["points"]}
    assert got == {(m, 4, c) for m in ("native-tiny", "native-tiny:full-attention") for c in (32, 160)}
    for p in res["points"]:
        assert p["decode_steps_timed"] == 3 and p["floor_bytes"] > p["weight_bytes"] > 0
    hybrid = {p["context"]: p for p in res["points"] if p["model"] == "native-tiny"}
    full = {p["context"]: p for p in res["points"] if p["model"] != "native-tiny"}
    # Past the window (64) the hybrid's K/V stops growing; the full-attention baseline's does not.
    assert full[160]["kv_in_use_bytes"] > 2 * full[32]["kv_in_use_bytes"]
    assert hybrid[160]["floor_kv_bytes"] < full[160]["floor_kv_bytes"]
    assert {f["context"] for f in res["fit"]} == {128, 512}
    # --shared-prefix 96: at 160 the hybrid's prompts share 96 tokens served from the prefix
    # cache and keep their own last 64 (its window), so no in-window page is shared: every
    # sequence holds at least the pages a pure sliding-window model needs. Below 96 + 64
    # tokens, and for the global-attention baseline, the prompts stay distinct.
    from serving.entrypoints.bench.memory import swa_pages

    assert hybrid[160]["shared_prefix"] == 96 and hybrid[160]["prefix_cache_hit_tokens"] == 4 * 96
    assert "shared_prefix" not in hybrid[32] and not any("shared_prefix" in p for p in full.values())
    assert hybrid[160]["pages_in_use"]["w64"] >= 4 * swa_pages(64, hybrid[160]["context"], 16)
    # The trace holds the named scopes put around the engine's phases.
    assert {"engine_step", "schedule", "device_step"} <= set(res["profile"]["scopes"])
    trace = b"".join(f.read_bytes() for f in (tmp_path / "trace").rglob("*.xplane.pb"))
    assert all(name.encode() in trace for name in res["profile"]["scopes"])
    # Read back: one of each scope per timed step of the traced point (the first).
    assert (res["profile"]["model"], res["profile"]["context"]) == ("native-tiny", 32)
    counts = {k: v["count"] for k, v in res["profile"]["scope_stats"].items()}
    assert counts == dict.fromkeys(res["profile"]["scopes"], 3)


def test_sweep_pages_in_use_equal_a_pure_swa_models_need(tmp_path):
    res = _run("sweep", tmp_path)
    cells = {(c["window"], c["state_size"], c["prompt"]) for c in res["cells"]}
    assert cells == {(w, 16, k) for w in (64, 32) for k in ("short", "long")}
    assert res["all_pages_match"] and all(c["batch"] == 4 for c in res["cells"])
    long64 = next(c for c in res["cells"] if c["window"] == 64 and c["prompt"] == "long")
    assert long64["context"] == 160 and sum(long64["pages_in_use"].values()) <= 4 * (63 // 8 + 2)


def test_prefill_prediction_follows_the_measured_growth():
    from serving.entrypoints.bench.scaling import predict_prefill_s

    assert predict_prefill_s([], 1 << 20) == 0.0
    assert predict_prefill_s([(1000, 1.0)], 4000) == pytest.approx(4.0)  # one point: linear
    assert predict_prefill_s([(1000, 1.0), (2000, 4.0)], 4000) == pytest.approx(16.0)  # quadratic
    assert predict_prefill_s([(1000, 1.0), (2000, 8.0)], 4000) == pytest.approx(32.0)  # clipped at 2
    assert predict_prefill_s([(1000, 1.0), (2000, 1.5)], 4000) == pytest.approx(3.0)  # at least linear


def test_serving_keeps_at_most_concurrency_requests_in_flight(tmp_path, capsys):
    res = _run("serving", tmp_path, "--concurrency", "2", "--in-process")
    assert res["server"] == "in-process" and "smoke tests only" in res["note"]
    assert "note: --in-process" in capsys.readouterr().out  # the printed report says so
    assert res["sent"] == 12 and res["concurrency"] == 2
    spans = list(zip(res["sent_s"], res["end_s"], strict=True))
    for t, _ in spans:  # at each send, at most 2 requests (this one included) are open
        assert sum(s <= t < e for s, e in spans) <= 2


def test_poisson_arrivals_have_the_requested_rate():
    import math

    import numpy as np

    from serving.entrypoints.bench.load import LoadSpec, arrival_offsets

    gaps = np.diff(arrival_offsets(20000, 8.0, np.random.default_rng(0)), prepend=0.0)
    assert gaps.min() >= 0 and abs(gaps.mean() - 1 / 8) < 0.005 and abs(gaps.std() - 1 / 8) < 0.005
    assert not arrival_offsets(5, math.inf, np.random.default_rng(0)).any()
    with pytest.raises(ValueError, match="concurrency=0"):
        LoadSpec(concurrency=0)
    with pytest.raises(ValueError, match="rate=0"):
        LoadSpec(rate=0)


def test_serving_reports_a_child_server_that_cannot_start_in_one_line(tmp_path, capsys):
    code = main(["bench", "serving", "--smoke", "--model", "no-such-model", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "server exited with code 2 before serving" in err[-1], err
    assert "no-such-model" in err[-1]
    both = ["--in-process", "--server", "x:1"]
    assert main(["bench", "serving", "--smoke", *both, "--out", str(tmp_path)]) == 2
