"""Shared pieces of `hybrid-jax bench`: request lengths, percentile summaries, results files.

Every mode writes `OUT/MODE.json` (the figures, the batch and lengths actually run, the
command, device and date) and `OUT/MODE.png`. This module knows nothing of the engine.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.entrypoints.bench.args import LEN_DISTS


@dataclass(frozen=True)
class LengthDist:
    """Token counts around `mean`: fixed, uniform in mean*(1 +- ratio), or lognormal (median mean,
    sigma ratio) clipped to [1, 4 * mean]."""

    mean: int
    dist: str = "fixed"
    ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.mean < 1:
            raise ValueError(f"mean={self.mean} must be >= 1")
        if self.dist not in LEN_DISTS:
            raise ValueError(f"dist={self.dist!r} must be one of {LEN_DISTS}")
        if not 0.0 <= self.ratio < (1.0 if self.dist == "uniform" else 10.0):
            raise ValueError(f"ratio={self.ratio} out of range for dist={self.dist!r}")

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        if self.dist == "fixed" or self.ratio == 0.0:
            return [self.mean] * n
        if self.dist == "uniform":
            lo = max(1, math.floor(self.mean * (1 - self.ratio)))
            hi = max(lo, math.ceil(self.mean * (1 + self.ratio)))
            return rng.integers(lo, hi + 1, n).tolist()
        x = rng.lognormal(math.log(self.mean), self.ratio, n)
        return np.clip(np.rint(x), 1, 4 * self.mean).astype(int).tolist()


def random_prompts(lengths: list[int], vocab_size: int, rng: np.random.Generator,
                   low: int = 3) -> list[list[int]]:
    """Random token ids in [low, vocab) (skipping the usual pad/BOS/EOS ids at the bottom)."""
    low = min(low, vocab_size - 1)
    return [rng.integers(low, vocab_size, n).tolist() for n in lengths]


def summarize(values: list[float], scale: float = 1.0) -> dict[str, float | int]:
    """mean, p50, p90, p99 (and count) of `values` times `scale`; NaN-free: empty -> count 0 only."""
    if not values:
        return {"count": 0}
    x = np.asarray(values, dtype=np.float64) * scale
    return {"count": int(x.size), "mean": float(x.mean()), "p50": float(np.percentile(x, 50)),
            "p90": float(np.percentile(x, 90)), "p99": float(np.percentile(x, 99))}


def environment() -> dict[str, str]:
    """Device, versions, date and the command line: what every results file states."""
    import jax

    dev = jax.devices()[0]
    return {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform,
            "jax": jax.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "command": _command()}


def _command() -> str:
    if not sys.argv:
        return ""
    prog = Path(sys.argv[0]).name
    prog = "python -m serving.entrypoints.bench" if prog == "__main__.py" else prog
    return " ".join([prog, *sys.argv[1:]])


def write_json(out: Path, mode: str, data: dict) -> Path:
    """Write OUT/MODE.json atomically (a crash mid-run leaves the last complete file)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{mode}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
    tmp.replace(path)
    return path


def emit(out: str | None, row: dict) -> None:
    """Print one figure as a JSON line (floats rounded) and append it, unrounded, to `out`."""
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def _jsonable(x: object) -> object:
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def parse_ints(text: str, name: str) -> tuple[int, ...]:
    """'1024,4k,1M' -> (1024, 4096, 1048576); ValueError naming the option."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = {"k": 1024, "m": 1024 * 1024}.get(part[-1:], 1)
        digits = part[:-1] if mult > 1 else part
        if not digits.isdigit() or int(digits) < 1:
            raise ValueError(f"{name}={text!r}: {part!r} is not a positive integer "
                             "(k and M suffixes allowed)")
        out.append(int(digits) * mult)
    return tuple(out)
