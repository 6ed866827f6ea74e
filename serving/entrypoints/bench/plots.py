"""PNG summaries of the benchmark results (matplotlib, headless Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path, title: str) -> None:
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def throughput(res: dict, path: Path) -> None:
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.hist([res["input_lens"], res["output_lens"]], bins=20, label=["input", "output"])
    a.set_xlabel("tokens")
    a.set_ylabel("requests")
    a.legend()
    names = ["output tok/s", "total tok/s", "requests/s"]
    vals = [res["output_tok_s"], res["total_tok_s"], res["requests_per_s"]]
    b.bar(names, vals)
    for i, v in enumerate(vals):
        b.text(i, v, f"{v:,.1f}", ha="center", va="bottom", fontsize=8)
    _save(fig, path, f"throughput: {res['model']} {res['dtype']}, {res['num_requests']} requests, "
                     f"max_num_seqs {res['max_num_seqs']} ({res['device']})")


def serving(res: dict, records: list, path: Path) -> None:
    ok = [r for r in records if r.ok]
    series = {
        "TTFT (ms)": [1e3 * (r.token_times[0] - r.sent) for r in ok if r.token_times],
        "TPOT (ms)": [1e3 * (r.token_times[-1] - r.token_times[0]) / (r.output_tokens - 1)
                      for r in ok if r.output_tokens > 1 and len(r.token_times) > 1],
        "ITL (ms)": [1e3 * (b - a) for r in ok
                     for a, b in zip(r.token_times, r.token_times[1:], strict=False)],
        "E2E (ms)": [1e3 * (r.end - r.sent) for r in ok],
    }
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.5))
    for ax, (name, xs) in zip(axes, series.items(), strict=True):
        if xs:
            ax.hist(xs, bins=30)
        ax.set_xlabel(name)
    axes[0].set_ylabel("count")
    rate = res["request_rate"] or "inf"
    _save(fig, path, f"serving: {res['model']}, {res['completed']}/{res['sent']} ok, rate {rate}, "
                     f"concurrency {res['concurrency'] or '-'}, failures {res['failures_by_code']}")


def scaling(res: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    groups: dict[tuple[str, int], list[dict]] = {}
    for p in res["points"]:
        groups.setdefault((p["model"], p["batch"]), []).append(p)
    for (model, batch), pts in groups.items():
        x = [p["context"] for p in pts]
        line, = axes[0].plot(x, [p["step_ms_median"] for p in pts], "o-", label=f"{model} b={batch}")
        axes[0].plot(x, [p["floor_ms"] for p in pts], "--", color=line.get_color(), alpha=0.5)
        axes[1].plot(x, [p["decode_tok_s"] for p in pts], "o-", label=f"{model} b={batch}")
        axes[2].plot(x, [(p["kv_in_use_bytes"] + p["state_in_use_bytes"]) / 2**30 for p in pts], "o-",
                     label=f"{model} b={batch}")
    for ax, label in zip(axes[:3], ["decode step ms (dashed: byte floor)", "decode tokens/s",
                                    "KV + state in use (GiB)"], strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=7)
    fits = res["fit"]
    x = range(len(fits))
    axes[3].bar([i - 0.2 for i in x], [f["engine_plan_max_batch"] or 0 for f in fits], 0.4,
                label="engine plan")
    axes[3].bar([i + 0.2 for i in x], [f["decode_pages_max_batch"] for f in fits], 0.4,
                label="decode pages only")
    axes[3].set_xticks(list(x), [f"{f['model']}\n{_tokens(f['context'])}" for f in fits], fontsize=6)
    axes[3].set_yscale("log")
    axes[3].set_ylabel("largest batch that fits")
    axes[3].legend(fontsize=7)
    bw = res["copy_bandwidth_Bps"] / 1e12
    _save(fig, path, f"scaling ({res['device']}, {res['dtype']}, copy {bw:.2f} TB/s)")


def sweep(res: dict, path: Path) -> None:
    cells = res["cells"]
    labels = [f"W{c['window']} N{c['state_size']}\n{c['prompt']}" for c in cells]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar(labels, [c["decode_tok_s"] for c in cells])
    axes[0].set_ylabel("decode tokens/s")
    axes[1].bar(labels, [c["prefill_tok_s"] for c in cells])
    axes[1].set_ylabel("prefill tokens/s")
    axes[2].bar(labels, [c["kv_in_use_bytes"] / 2**20 for c in cells], label="KV in use")
    axes[2].bar(labels, [c["state_in_use_bytes"] / 2**20 for c in cells],
                bottom=[c["kv_in_use_bytes"] / 2**20 for c in cells], label="state in use")
    axes[2].set_ylabel("MiB")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=6)
    _save(fig, path, f"sweep: {res['model']} variants, batch {res['batch']} ({res['device']}); "
                     f"KV pages = pure-SWA need: {res['all_pages_match']}")
