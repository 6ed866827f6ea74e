"""TrainConfig: the optimisation and data settings of one run, frozen and self-validating.

The model's shape is a ModelConfig (a preset or a JSON file); this holds everything
else. Errors name the setting (`batch_size=12 must be a multiple of grad_accum=5`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

COMPUTE_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32  # sequences per optimizer step, over all devices and micro-steps
    grad_accum: int = 1  # micro-steps per optimizer step
    seq_len: int = 512
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    compute_dtype: str = "bfloat16"  # master weights and optimizer state stay f32
    seed: int = 0
    vocab_size: int = 4096  # of the BPE tokenizer trained when none is given
    eval_fraction: float = 0.02  # of the files, held out
    eval_every: int = 200
    eval_rows: int = 64  # held-out rows per evaluation (at most)
    ckpt_every: int = 200
    log_every: int = 10

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "seq_len", "eval_every", "eval_rows",
                     "ckpt_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("lr", "clip_norm"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.warmup_steps < 0 or self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")
        if not (0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0):
            raise ValueError(f"b1={self.b1}, b2={self.b2} must be in [0, 1)")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r} must be one of {COMPUTE_DTYPES}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size={self.batch_size} must be a multiple of "
                             f"grad_accum={self.grad_accum}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={self.eval_fraction} must be in [0, 1)")

    @property
    def micro_batch(self) -> int:
        return self.batch_size // self.grad_accum

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def check_devices(self, num_devices: int) -> None:
        """The micro-batch is split over devices (data parallel): it must divide evenly."""
        if self.micro_batch % num_devices:
            raise ValueError(f"batch_size={self.batch_size} / grad_accum={self.grad_accum} = "
                             f"{self.micro_batch} sequences per micro-step must be a multiple of "
                             f"the {num_devices} devices")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
