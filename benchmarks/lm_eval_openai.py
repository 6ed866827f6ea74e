"""lm-evaluation-harness against the OpenAI HTTP API: `local-completions` and `local-chat-completions`.

Offline check (CPU, about a minute; the default): serves native-tiny in this process
with a small chat template, writes a four-question `generate_until` task to a
temporary directory, and runs it through both lm-eval models. It passes when every
request completes without an error (the score is meaningless on random weights):

    pip install "lm-eval[api]"     # not a test dependency: this is a script
    python benchmarks/lm_eval_openai.py

Against a running server (any task lm-eval knows, e.g. the reference workload's
gsm8k_cot with thinking off through the server's default template kwargs):

    hybrid-jax serve --model ./Qwen3-hybrid --http-port 8000 --served-model-name m \\
        --default-chat-template-kwargs '{"enable_thinking": false}' &
    python benchmarks/lm_eval_openai.py --server http://127.0.0.1:8000 --model-name m \\
        --tasks gsm8k_cot --chat-only --limit 200

lm-eval is given `tokenizer_backend=None` (it sends text and reads text: no tokenizer
is downloaded) and, for chat, `--apply_chat_template` so that it sends messages that
the server renders with the model's template.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

TASK = "hybrid_jax_tiny_qa"
TASK_YAML = f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{data}}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
"""
DOCS = [{"question": "2 + 2?", "answer": "4"}, {"question": "Capital of France?", "answer": "Paris"},
        {"question": "Opposite of hot?", "answer": "cold"}, {"question": "3 x 3?", "answer": "9"}]
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


def write_task(root: Path) -> Path:
    data = root / "tiny_qa.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (root / f"{TASK}.yaml").write_text(TASK_YAML.replace("{data}", str(data)))
    (root / "chat.jinja").write_text(TEMPLATE)
    return root


def local_server(template: Path):
    from serving.engine.engine_config import EngineConfig
    from serving.engine.llm_engine import LLMEngine
    from serving.entrypoints.grpc.server import GenerationServer
    from serving.entrypoints.openai.api_server import OpenAIConfig

    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=32, max_model_len=256,
                       page_size=8)
    engine = LLMEngine("native-tiny", cfg, show_progress=False)
    http = OpenAIConfig(port=0, model_name="native-tiny", chat_template=str(template))
    return GenerationServer(engine, model_name="native-tiny", port=0, http=http).start()


def evaluate(url: str, model: str, tasks: list[str], task_dir: Path, *, chat: bool, limit: int | None,
             concurrency: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    endpoint = "chat/completions" if chat else "completions"
    model_args = (f"model={model},base_url={url}/v1/{endpoint},tokenizer_backend=None,"
                  f"tokenized_requests=False,num_concurrent={concurrency},max_retries=1,timeout=600")
    return lm_eval.simple_evaluate(
        model="local-chat-completions" if chat else "local-completions", model_args=model_args, tasks=tasks,
        task_manager=TaskManager(include_path=str(task_dir)), apply_chat_template=chat, limit=limit,
        log_samples=True)


def _server_counts(server) -> dict[str, int]:
    finished = rejected = 0
    for family in server.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "hybrid_jax_requests_total":
                finished += int(sample.value)
            elif sample.name == "hybrid_jax_requests_rejected_total":
                rejected += int(sample.value)
    return {"finished": finished, "rejected": rejected}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", default=None, help="http://HOST:PORT (default: serve native-tiny here)")
    p.add_argument("--model-name", default="native-tiny", help="the served model id")
    p.add_argument("--tasks", default=TASK, help=f"comma-separated lm-eval tasks (default: {TASK}, offline)")
    p.add_argument("--limit", type=int, default=None, help="documents per task")
    p.add_argument("--concurrency", type=int, default=4, help="lm-eval's num_concurrent")
    p.add_argument("--chat-only", action="store_true", help="only local-chat-completions")
    p.add_argument("--completions-only", action="store_true", help="only local-completions")
    args = p.parse_args(argv)
    tasks = args.tasks.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        task_dir = write_task(Path(tmp))
        server = None if args.server else local_server(task_dir / "chat.jinja")
        url = args.server or f"http://127.0.0.1:{server.http_port}"
        failures, expected = [], 0
        try:
            for chat in (False, True):
                if (chat and args.completions_only) or (not chat and args.chat_only):
                    continue
                res = evaluate(url, args.model_name, tasks, task_dir, chat=chat, limit=args.limit,
                               concurrency=args.concurrency)
                name = "local-chat-completions" if chat else "local-completions"
                for task, metrics in res["results"].items():
                    print(f"{name} {task}: " + ", ".join(f"{k}={v}" for k, v in metrics.items()
                                                         if isinstance(v, int | float)))
                for task, samples in res["samples"].items():
                    expected += len(samples)
                    empty = [s["doc_id"] for s in samples if not isinstance(s["resps"][0][0], str)]
                    if not samples or empty:
                        failures.append(f"{name} {task}: {len(samples)} samples, unanswered {empty}")
            if server is not None:  # the server's own counts: every request answered, none refused
                counts = {**_server_counts(server), "expected": expected}
                print(f"server: {counts}")
                if counts["rejected"] or counts["finished"] != counts["expected"]:
                    failures.append(f"server counted {counts}")
        finally:
            if server is not None:
                server.shutdown(grace_s=0)
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
