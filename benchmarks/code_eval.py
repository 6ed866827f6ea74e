"""Does a model write Python? Parse share and repetition of its continuations, held-out bits per byte.

1. Generation (the public `LLM` API): every signature of `benchmarks/code_eval_signatures.txt`
   (written for this benchmark, not taken from a corpus) is continued greedily and sampled
   (`--temperature`, `--top-p`, `--repetition-penalty`, one seed per prompt), `--max-tokens` each.
   - **parses**: the continuation is cut at the end of the definition: the first non-empty
     line that starts at or left of the signature's column (i.e. the next top-level
     statement). If the token budget ended inside the definition (no such line, and no
     end-of-text), its last line, which may be cut mid-way, is dropped. Then
     `ast.parse(signature + body)` must succeed. A body that is only the signature fails.
   - **repeated lines**: over the whole continuation (not cut), the share of its lines
     holding a letter or digit that equal (stripped) an earlier line of the same
     continuation. Lines of brackets or quotes only (`)`, `\"\"\"`) are not counted.
2. Held-out loss (`--held-out corpus.json`): the files the corpus.json lists as held out
   (found under `--root NAME=DIR`; `python3.*` is this Python's standard library and other
   names are looked up under the site-packages directory), packed as training packs them
   (`<bos> text <eos>`, rows of `--seq-len` + 1 tokens), scored by the model's forward:
   nats per token and bits per byte (the UTF-8 bytes the target tokens stand for), so models
   with different tokenizers are compared on the same text.

  PYTHONPATH=. python benchmarks/code_eval.py --model default --out /tmp/eval.json
  PYTHONPATH=. python benchmarks/code_eval.py --model runs/x/model --no-generate \\
      --held-out configs/default_model/corpus.json
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
SIGNATURES = HERE / "code_eval_signatures.txt"


def read_signatures(path: Path = SIGNATURES) -> list[str]:
    lines = path.read_text().splitlines()
    return [s for s in lines if s.strip() and not s.lstrip().startswith("#")]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def definition_body(signature: str, continuation: str, finished: bool) -> str:
    """The continuation up to the end of the definition (see the module docstring)."""
    col = _indent(signature)
    lines = continuation.split("\n")
    # lines[0] continues the signature's own line (usually empty)
    for i, line in enumerate(lines[1:], start=1):
        if line.strip() and _indent(line) <= col:
            return "\n".join(lines[:i])
    return "\n".join(lines if finished else lines[:-1])


def parses(signature: str, continuation: str, finished: bool) -> bool:
    body = definition_body(signature, continuation, finished)
    try:
        ast.parse(signature + body + "\n")
    except (SyntaxError, ValueError):
        return False
    return True


def repeated_lines(continuation: str) -> tuple[int, int]:
    """(repeated, counted) lines of one continuation."""
    seen, rep, n = set(), 0, 0
    for line in continuation.split("\n"):
        s = line.strip()
        if not re.search(r"\w", s):
            continue
        n += 1
        rep += s in seen
        seen.add(s)
    return rep, n


def generate(model: str, sigs: list[str], args) -> dict:
    from serving.entrypoints.llm import LLM
    from serving.sample.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, show_progress=False)
    out = {"load_s": time.perf_counter() - t0}
    modes = {}
    for rp in args.repetition_penalty:
        tag = "" if rp == 1.0 else f"_rp{rp:g}"
        modes["greedy" + tag] = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                repetition_penalty=rp)] * len(sigs)
        modes["sampled" + tag] = [SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                                 repetition_penalty=rp, max_tokens=args.max_tokens,
                                                 seed=args.seed_base + i) for i in range(len(sigs))]
    for mode, params in modes.items():
        t0 = time.perf_counter()
        res = llm.generate(sigs, params)
        rows, ok, rep, n = [], 0, 0, 0
        for sig, r in zip(sigs, res, strict=True):
            text, reason = r.text, r.finish_reason
            p = parses(sig, text, reason == "stop")
            a, b = repeated_lines(text)
            ok, rep, n = ok + p, rep + a, n + b
            rows.append({"signature": sig, "continuation": text, "finish_reason": reason, "parses": p,
                         "repeated_lines": a, "lines": b})
        out[mode] = {"parse_share": ok / len(sigs), "parsed": ok, "prompts": len(sigs),
                     "repeated_line_share": rep / max(n, 1), "seconds": time.perf_counter() - t0,
                     "samples": rows}
    return out


def _resolve(name: str, roots: dict[str, Path]) -> Path | None:
    from hybrid_jax.train.corpus import stdlib_dir

    root, _, rest = name.partition("/")
    if root in roots:
        base = roots[root]
    elif root.startswith("python3"):
        base = stdlib_dir()
    else:
        import numpy
        base = Path(numpy.__file__).parent.parent / root
    p = base / rest
    return p if p.is_file() else None


def held_out_loss(model: str, manifest: Path, roots: dict[str, Path], seq_len: int, batch: int,
                  dtype: str = "float32", quantization: str | None = None) -> dict:
    """Nats per token and bits per byte of `model` (loaded in `dtype`, `quantization` at load)
    over the held-out files of `manifest` (module doc, 2)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hybrid_jax.loading import load_model
    from hybrid_jax.train.data import PAD, Document, encode_docs, pack
    from hybrid_jax.train.dataset import token_bytes

    names = json.loads(manifest.read_text())["held_out_files"]
    docs, missing = [], []
    for name in names:
        p = _resolve(name, roots)
        if p is None:
            missing.append(name)
            continue
        try:
            docs.append(Document(name, p.read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            missing.append(name)
    if not docs:
        raise ValueError(f"held_out={str(manifest)!r}: none of its {len(names)} files is here")
    lm = load_model(model, dtype=dtype, quantization=quantization)
    rows = pack(encode_docs(lm.tokenizer, docs), seq_len, pad_tail=True)
    tb = token_bytes(lm.tokenizer)

    @jax.jit
    def score(ids):
        logp = jax.nn.log_softmax(lm.model(ids[:, :-1]).astype(jnp.float32), axis=-1)
        tgt = ids[:, 1:]
        nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
        return jnp.where(tgt != PAD, nll, 0.0).sum(), (tgt != PAD).sum()

    nats = count = 0.0
    pad = -len(rows) % batch
    rows_p = np.concatenate([rows, np.zeros((pad, rows.shape[1]), np.int32)])
    for i in range(0, len(rows_p), batch):
        a, b = jax.device_get(score(jnp.asarray(rows_p[i:i + batch])))
        nats, count = nats + float(a), count + float(b)
    nbytes = int(tb[rows[:, 1:]].sum())
    text_bytes = sum(len(d.text.encode()) for d in docs)
    return {"files": len(docs), "missing": missing, "tokens": int(count), "bytes": nbytes,
            "text_bytes": text_bytes, "loss": nats / count, "bits_per_byte": nats / math.log(2) / nbytes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--signatures", type=Path, default=SIGNATURES)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--repetition-penalty", type=float, nargs="+", default=[1.0],
                   help="for both greedy and sampled runs; several values: each is run, their "
                        "results named greedy_rpX / sampled_rpX (default 1: off)")
    p.add_argument("--seed-base", type=int, default=0,
                   help="prompt i is sampled with seed seed_base + i (default 0)")
    p.add_argument("--no-generate", action="store_true")
    p.add_argument("--held-out", type=Path, help="a corpus.json whose held_out_files are scored")
    p.add_argument("--root", action="append", default=[], metavar="NAME=DIR",
                   help="where the held-out files of root NAME live (default: stdlib / site-packages)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", type=Path, help="write the full results (every continuation) here")
    args = p.parse_args(argv)
    res: dict = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                 "top_p": args.top_p, "repetition_penalty": args.repetition_penalty}
    if not args.no_generate:
        res |= generate(args.model, read_signatures(args.signatures), args)
    if args.held_out is not None:
        roots = dict(r.split("=", 1) for r in args.root)
        res["held_out"] = held_out_loss(args.model, args.held_out, {k: Path(v) for k, v in roots.items()},
                                        args.seq_len, args.batch)
    summary = {k: ({i: j for i, j in v.items() if i != "samples"} if isinstance(v, dict) else v)
               for k, v in res.items()}
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
