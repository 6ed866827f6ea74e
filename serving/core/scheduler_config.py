"""The scheduler's configuration: batch limits, page geometry and attention groups.

Plain data that validates itself. It knows nothing of model weights or device
memory: whoever sizes the pools from a memory budget (the engine) builds one
of these. `num_pages` and `num_slots` are device-array sizes and include the
dummy index 0, so each pool hands out `size - 1` indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from serving.core.block_table import decode_page_bound, ring_width


class AttentionGroup(NamedTuple):
    """Layers that share a window, and therefore a page pool.

    window: a query at q attends keys q - window < k <= q; None = global attention.
    num_pages: size of the group's page axis, including the dummy page 0.
    """

    name: str
    window: int | None
    num_pages: int


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one engine step and the page/slot geometry.

    max_num_seqs: running sequences at most (b per step <= this).
    max_num_batched_tokens: token budget per step (t <= this); must be >=
      max_num_seqs so that every running decode fits in every step.
    max_prefill_chunk: most tokens of one sequence's prefill per step (C).
    max_model_len: prompt + max_tokens of any request is at most this.
    page_size: tokens per KV page (s), shared by all groups.
    num_slots: recurrent-state slots including the dummy slot 0.
    groups: attention groups; empty for a pure-SSM model. Plain 3-tuples
      (name, window, num_pages) are accepted.
    prefix_caching: content-addressed pages and state checkpoints (serving/core/prefix_cache.py).
    prefix_state_stride: tokens between state checkpoints, a multiple of page_size.
    num_checkpoints: size of the state checkpoint pool including the dummy index 0;
      0 when the model has no recurrent state (attention groups alone resume a hit).
    max_checkpoint_ops: checkpoint restores (and, separately, saves) per step at most.
    admission_interval_steps: while sequences run, waiting ones are admitted only in a step
      at least this many steps after the last admission (1: every step), so that prompts
      arriving close together share one mixed step; admission timing never changes outputs.
    admission_batch: ... or when this many wait (coalescing has enough to share a step);
      None: as many prompts as one step's budget takes in full chunks, at least 2.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_chunk: int
    max_model_len: int
    page_size: int
    num_slots: int
    groups: tuple[AttentionGroup, ...] = ()
    prefix_caching: bool = False
    prefix_state_stride: int = 256
    num_checkpoints: int = 0
    max_checkpoint_ops: int = 8
    admission_interval_steps: int = 1
    admission_batch: int | None = None

    def __post_init__(self) -> None:
        _check_int("admission_interval_steps", self.admission_interval_steps, 1)
        if self.admission_batch is None:
            object.__setattr__(self, "admission_batch",
                               max(2, self.max_num_batched_tokens // self.max_prefill_chunk))
        _check_int("admission_batch", self.admission_batch, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_prefill_chunk", self.max_prefill_chunk, 1)
        _check_int("max_model_len", self.max_model_len, 1)
        _check_int("page_size", self.page_size, 1)
        _check_int("num_slots", self.num_slots, 2)
        max_num_seqs, max_num_batched_tokens = self.max_num_seqs, self.max_num_batched_tokens
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"{max_num_batched_tokens=} must be >= {max_num_seqs=}")
        max_prefill_chunk = self.max_prefill_chunk
        if max_prefill_chunk > max_num_batched_tokens:
            raise ValueError(f"{max_prefill_chunk=} must be <= {max_num_batched_tokens=}")
        if self.prefix_caching:
            _check_int("max_checkpoint_ops", self.max_checkpoint_ops, 1)
            if self.num_checkpoints != 0:
                _check_int("num_checkpoints", self.num_checkpoints, 2)
            stride, page_size = self.prefix_state_stride, self.page_size
            _check_int("prefix_state_stride", stride, page_size)
            if stride % page_size:
                raise ValueError(f"prefix_state_stride={stride} must be a multiple of {page_size=}")
        groups = tuple(self._check_group(g) for g in self.groups)
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        object.__setattr__(self, "groups", groups)

    def _check_group(self, group: object) -> AttentionGroup:
        if not isinstance(group, tuple | list) or len(group) != 3:
            raise ValueError(f"group {group!r} must be (name, window | None, num_pages)")
        g = AttentionGroup(*group)
        if not isinstance(g.name, str) or not g.name:
            raise ValueError(f"group name {g.name!r} must be a non-empty str")
        if g.window is not None:
            _check_int(f"groups[{g.name!r}].window", g.window, 1)
        _check_int(f"groups[{g.name!r}].num_pages", g.num_pages, 2)
        # A sequence alone must always be able to decode, or it would preempt
        # itself forever; prefill chunks shrink to the pages that are free.
        need = decode_page_bound(g.window, self.page_size, self.max_model_len)
        if g.num_pages - 1 < need:
            raise ValueError(
                f"group {g.name!r}: num_pages={g.num_pages} cannot hold one sequence of "
                f"max_model_len={self.max_model_len}: it needs {need} pages plus the dummy "
                f"(num_pages >= {need + 1}); raise num_pages or lower max_model_len"
            )
        return g

    @property
    def ring_widths(self) -> tuple[int, ...]:
        """T per group: the width of the device page table (see block_table)."""
        return tuple(
            ring_width(g.window, self.page_size, self.max_prefill_chunk, self.max_model_len)
            for g in self.groups
        )
