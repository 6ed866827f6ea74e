"""The `hybrid-jax` command line.

`hybrid-jax generate --model MODEL "prompt"` streams a continuation to the terminal.
MODEL is a Hugging Face directory, a native (orbax) directory or a preset name
(`hybrid-jax presets` lists them; presets have random weights until trained).
Decoding currently runs the reference full-sequence forward (hybrid_jax.generate);
the continuous-batching engine takes over as it lands.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

EPILOG = """examples:
  hybrid-jax presets
  hybrid-jax generate --model native-tiny "Hello"
  hybrid-jax generate --model ./my-hf-model --max-tokens 64 --dtype bfloat16 "Once upon"
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybrid-jax",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve and run hybrid SSM + sliding-window models.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="generate a continuation of a prompt (streams)",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument(
        "--model", default="native-tiny", help="HF dir, native dir or preset name (default: native-tiny)"
    )
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    gen.add_argument("--seed", type=int, default=0, help="seed for preset weights")
    sub.add_parser("presets", help="list the model presets")
    return p


def _generate(args: argparse.Namespace) -> int:
    from hybrid_jax.generate import greedy_steps
    from hybrid_jax.loading import load_model

    if args.max_tokens < 1:
        print(f"error: --max-tokens={args.max_tokens} must be >= 1", file=sys.stderr)
        return 2
    lm = load_model(args.model, dtype=args.dtype, seed=args.seed)
    if lm.tokenizer is None:
        print(f"error: {args.model} has no tokenizer.json", file=sys.stderr)
        return 2
    prompt = lm.tokenizer.encode(args.prompt, add_bos=True)
    print(args.prompt, end="", flush=True)
    out: list[int] = []
    shown = ""
    for tok, _ in greedy_steps(lm.model, prompt, args.max_tokens, eos_ids=lm.config.eos_token_ids):
        out.append(tok)
        text = lm.tokenizer.decode(out)
        if not text.endswith("\ufffd"):  # hold back a split multi-byte character
            print(text[len(shown) :], end="", flush=True)
            shown = text
    print(lm.tokenizer.decode(out)[len(shown) :])  # whatever was held back at the end
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "presets":
        from hybrid_jax.presets import preset_names

        print("\n".join(preset_names()))
        return 0
    return _generate(args)


if __name__ == "__main__":
    sys.exit(main())
