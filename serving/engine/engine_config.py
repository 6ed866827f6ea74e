"""Engine settings and pool sizing from a memory budget.

`EngineConfig` is what a user sets (vLLM-like names). `plan_pools` turns it and a
model into concrete page and slot counts: from explicit numbers when given, else from
a fraction of device memory after the weights. A configuration that cannot hold one
sequence of max_model_len is refused with a message that says what to change;
max_num_seqs larger than the slots that fit is lowered with a warning.
This module knows nothing of requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from hybrid_jax.cache import cache_bytes
from hybrid_jax.config import ModelConfig
from hybrid_jax.kv_quant import check_kv_cache_dtype, kv_dtype
from hybrid_jax.quantization import check_quantization
from hybrid_jax.tensor_parallel import local_config
from serving.core.block_table import decode_page_bound, ring_width
from serving.core.scheduler_config import AttentionGroup, SchedulerConfig
from serving.sample.penalties import init_token_stats

log = logging.getLogger(__name__)
CPU_MEMORY_BYTES = 4 << 30  # budget base when the device reports no memory (CPU)
MAX_SCHEDULER_STEPS = 64
# The sizing settings that default by device (None in EngineConfig until the engine starts).
SIZING = ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "memory_fraction")
CPU_SIZING = {"max_num_seqs": 32, "max_num_batched_tokens": 512, "max_prefill_chunk": 256,
              "memory_fraction": 0.5}


def device_sizing(platform: str, device_bytes: int | None) -> dict[str, int | float]:
    """Default sizing for a device: small on a CPU (tests, development); on a GPU, as
    vLLM sizes its server: many sequences, large prefill budgets, most of the memory.

    A GPU with at least 40 GiB for the process (an H100 / H200 / A100-80G) runs 256
    sequences and 8192-token steps; a smaller one 128 and 4096. One prompt takes at
    most 2048 tokens of a step, so a long prompt never holds the decodes sharing its
    steps for a full 8192-token step. The memory plan lowers max_num_seqs further
    when the model's pages and states do not fit (`plan_pools`).

    memory_fraction stays at 0.5 of what is free after the weights: the rest holds the
    step's temporaries, which grow with the step's tokens (native-1b-parallel, H100,
    8192-token buckets: with 0.9, XLA needed 73.5 GiB against a 55.4 GiB limit)."""
    if platform != "gpu":
        return dict(CPU_SIZING)
    big = device_bytes is None or device_bytes >= 40 << 30
    return {"max_num_seqs": 256 if big else 128, "max_num_batched_tokens": 8192 if big else 4096,
            "max_prefill_chunk": 2048, "memory_fraction": 0.5}


@dataclass(frozen=True)
class EngineConfig:
    # Sizing: None picks a default for the device when the engine starts (`device_sizing`:
    # 32 / 512 / 256 / 0.5 on a CPU, 256 / 8192 / 2048 / 0.5 on an 80 GB GPU).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_prefill_chunk: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 8192
    page_size: int = 16
    num_pages: int | None = None  # per window group, incl. the dummy page; None: from memory
    num_slots: int | None = None  # incl. the dummy slot; None: max_num_seqs + 1
    memory_fraction: float | None = None  # of device memory after weights, for pages + slots
    dtype: str = "float32"
    # "fp8": the decoder Linears quantized block-wise (128 x 128, e4m3) at load
    # (hybrid_jax/quantization.py); FP8 checkpoints load FP8 whatever this says.
    quantization: str | None = None
    # "fp8": K/V pages in float8_e4m3fn (half the bytes of bf16: twice the pages for the same
    # memory) with static scales calibrated at start-up (hybrid_jax/kv_quant.py), one per
    # layer and KV head (kv_scale "head") or per layer ("tensor"); "auto": `dtype`.
    kv_cache_dtype: str = "auto"
    kv_scale: str = "head"
    # Persistent XLA compilation cache, so a restart skips most of the start-up compile.
    # Used only when the process has not configured one itself; None disables.
    compilation_cache_dir: str | None = "~/.cache/hybrid-jax/xla"
    # Shape-bucket ladders (sequences per step, tokens per step); None: powers of two up
    # to max_num_seqs / max_num_batched_tokens. Fewer buckets: faster start-up, more padding.
    seq_buckets: tuple[int, ...] | None = None
    token_buckets: tuple[int, ...] | None = None
    # Recurrent (SSM / RG-LRU) state dtype, as vLLM's mamba_ssm_cache_dtype: float32, or
    # bfloat16 to halve the state traffic that dominates large-batch decode.
    ssm_state_dtype: str = "float32"
    # Overlap host and device: dispatch step N+1 before step N's tokens reach the host
    # (fed on device), and do step N's bookkeeping while N+1 runs. Outputs are identical.
    async_scheduling: bool = True
    # Prefix caching (docs/engine.md): KV pages are content-addressed and recurrent layers
    # resume from state checkpoints taken every `prefix_state_stride` tokens (a multiple of
    # page_size) and at the end of every prompt. `prefix_state_checkpoints` is the size of
    # the checkpoint pool (each holds every recurrent state of one position: the bytes of
    # one state slot); None: 2 * max_num_seqs, at least 16. The pool comes out of the
    # memory budget before the pages and slots.
    enable_prefix_caching: bool = False
    prefix_state_stride: int = 256
    prefix_state_checkpoints: int | None = None
    # Speculative decoding (docs/engine.md): None, "ngram" (prompt lookup: the tokens that
    # followed an earlier occurrence of the last prompt_lookup_max..min tokens) or
    # "draft" (a smaller model with the same vocabulary, `speculative_model`: a path or a
    # preset) or "mtp" (the model's own multi-token-prediction head, `mtp.*` tensors:
    # serving/spec_decode/mtp.py). Each decoding sequence verifies num_speculative_tokens (k, 1..8) drafts per
    # step. Speculation is off for a step when more than speculative_disable_by_batch_size
    # sequences run (None: never off): verification costs k + 1 tokens of compute per
    # sequence, a loss once the step is compute-bound. It runs the synchronous loop.
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    speculative_model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    speculative_disable_by_batch_size: int | None = 16
    # Tensor parallelism (docs/tensor_parallel.md): parameters, KV pages and states split
    # by heads over the first N local devices; pools are planned per device.
    tensor_parallel_size: int = 1
    # Which local devices this engine runs on: [device_offset, device_offset +
    # tensor_parallel_size). A data-parallel replica's group (serving/engine/data_parallel.py).
    device_offset: int = 0
    # Data parallelism (docs/serving.md): N engine replicas, each on its own group of
    # tensor_parallel_size devices, behind one server. An engine itself is one replica
    # (LLMEngine refuses more): `data_parallel.build_engines` builds them.
    data_parallel_size: int = 1
    # Multi-step decoding (docs/engine.md), as vLLM's num_scheduler_steps: while at most
    # multi_step_max_seqs sequences run and all of them decode (no penalties, no top-n
    # logprobs, no min_tokens pending), one executable call runs num_scheduler_steps
    # decode steps (a loop on the device, each step's samples fed to the next), so the
    # host's per-step cost (scheduling, the transfer, launching the step's graph,
    # bookkeeping) is paid once per num_scheduler_steps tokens. Tokens then arrive in
    # runs of that many; outputs are identical. 1: off.
    num_scheduler_steps: int = 1
    multi_step_max_seqs: int = 8
    # Start serving before the largest executables are compiled (None: on GPUs): steps of
    # more than 64 sequences or 1024 tokens compile on a background thread while the
    # engine serves within those limits (a chunk is cut by the step's token budget as
    # under load: outputs unchanged), then the limits lift. Not with speculation or
    # multi-step decoding. Executables the store holds load before serving either way.
    compile_in_background: bool | None = None
    # While sequences run, admit waiting prompts only every N-th step (1: every step), so
    # that prompts arriving within N steps share one mixed step (serving/core/scheduler.py;
    # docs/benchmarks.md, "Serving under load", has the measured trade). Outputs unchanged.
    admission_interval_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "page_size",
                     "tensor_parallel_size", "data_parallel_size", "admission_interval_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.device_offset < 0:
            raise ValueError(f"device_offset={self.device_offset} must be >= 0")
        if self.tensor_parallel_size > 1 and self.speculative_method == "draft":
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} with speculative_method="
                             "'draft': the draft model's runner does not run tensor-parallel yet; "
                             "use speculative_method 'ngram' or 'mtp', or tensor_parallel_size=1")
        if self.memory_fraction is not None and not 0.0 < self.memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction={self.memory_fraction} must be in (0, 1]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 2")
        check_quantization(self.quantization)
        check_kv_cache_dtype(self.kv_cache_dtype, self.kv_scale)
        if self.ssm_state_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"ssm_state_dtype={self.ssm_state_dtype!r} must be 'float32' or 'bfloat16'")
        if self.prefix_state_stride < self.page_size or self.prefix_state_stride % self.page_size:
            raise ValueError(f"prefix_state_stride={self.prefix_state_stride} must be a positive "
                             f"multiple of page_size={self.page_size}")
        if self.prefix_state_checkpoints is not None and self.prefix_state_checkpoints < 1:
            raise ValueError(f"prefix_state_checkpoints={self.prefix_state_checkpoints} must be >= 1")
        self._check_speculative()
        self._check_multi_step()
        for name in ("seq_buckets", "token_buckets"):
            sizes = getattr(self, name)
            if sizes is not None and (not sizes or min(sizes) < 1):
                raise ValueError(f"{name}={sizes} must be a non-empty tuple of sizes >= 1")


    def _check_speculative(self) -> None:
        from serving.spec_decode.speculative import MAX_SPECULATIVE_TOKENS, METHODS

        method = self.speculative_method
        if method not in METHODS:
            raise ValueError(f"speculative_method={method!r} must be one of {METHODS}")
        if method is None:
            if self.speculative_model is not None:
                raise ValueError(f"speculative_model={self.speculative_model!r} needs "
                                 "speculative_method='draft'")
            return
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={k} must be in 1..{MAX_SPECULATIVE_TOKENS}")
        if self.max_prefill_chunk is not None and k + 1 > self.max_prefill_chunk:
            raise ValueError(f"num_speculative_tokens={k}: a verification computes k + 1 tokens per "
                             f"sequence, more than max_prefill_chunk={self.max_prefill_chunk}")
        if method == "draft" and not self.speculative_model:
            raise ValueError("speculative_model: speculative_method='draft' needs a draft model "
                             "(a path or a preset name)")
        if method in ("ngram", "mtp") and self.speculative_model is not None:
            raise ValueError(f"speculative_model={self.speculative_model!r} is only used with "
                             "speculative_method='draft'")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max="
                             f"{self.prompt_lookup_max}: need 1 <= min <= max")
        limit = self.speculative_disable_by_batch_size
        if limit is not None and limit < 1:
            raise ValueError(f"speculative_disable_by_batch_size={limit} must be >= 1 (or None)")

    def _check_multi_step(self) -> None:
        k = self.num_scheduler_steps
        if not 1 <= k <= MAX_SCHEDULER_STEPS:
            raise ValueError(f"num_scheduler_steps={k} must be in 1..{MAX_SCHEDULER_STEPS}")
        if k == 1:
            return
        if self.multi_step_max_seqs < 1:
            raise ValueError(f"multi_step_max_seqs={self.multi_step_max_seqs} must be >= 1")
        if self.max_prefill_chunk is not None and k > self.max_prefill_chunk:
            raise ValueError(f"num_scheduler_steps={k}: pages for that many tokens per sequence "
                             f"are reserved at once, more than max_prefill_chunk={self.max_prefill_chunk}")
        if self.speculative_method is not None:
            raise ValueError(f"num_scheduler_steps={k} with speculative_method="
                             f"{self.speculative_method!r}: use one or the other")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"num_scheduler_steps={k} with tensor_parallel_size="
                             f"{self.tensor_parallel_size}: multi-step decoding does not run "
                             "tensor-parallel yet; use num_scheduler_steps=1")

    def with_device_sizing(self, platform: str, device_bytes: int | None, *,
                           announce: bool = True) -> EngineConfig:
        """This config with every sizing setting left at None chosen for the device
        (`device_sizing`); explicit settings win. Logs one line with what it chose."""
        chosen = {k: v for k, v in device_sizing(platform, device_bytes).items() if getattr(self, k) is None}
        if not chosen:
            return self
        if announce:
                log.info("engine sizing for %s (explicit settings win): %s", platform,
                     " ".join(f"{k}={v}" for k, v in chosen.items()))
        return replace(self, **chosen)

    def store_key(self) -> str:
        """This configuration as a part of an executable store key (serving/runner/exec_store.py),
        less where the store lives."""
        # Not the device group (the store keys on the devices themselves): every replica
        # of a data-parallel server shares one configuration key.
        return repr(replace(self, compilation_cache_dir=None, compile_in_background=None,
                            admission_interval_steps=1, device_offset=0, data_parallel_size=1))

    @property
    def multi_q(self) -> int:
        """Decode steps per multi-step call, 0 when multi-step decoding is off."""
        return self.num_scheduler_steps if self.num_scheduler_steps > 1 else 0

    @property
    def spec_q(self) -> int:
        """Tokens per sequence in a verification step (k + 1), 0 when speculation is off."""
        return self.num_speculative_tokens + 1 if self.speculative_method else 0

    @property
    def spec_max_seqs(self) -> int:
        """The most running sequences a verification step takes."""
        limit = self.speculative_disable_by_batch_size
        return self.max_num_seqs if limit is None else min(limit, self.max_num_seqs)


@dataclass(frozen=True)
class PoolPlan:
    scheduler: SchedulerConfig
    page_bytes: tuple[int, ...]  # one page across its group's layers
    slot_bytes: int
    num_checkpoints: int = 0  # prefix-cache state checkpoints, incl. the dummy (0: none)
    checkpoint_bytes: int = 0  # one checkpoint: every recurrent state of one position

    @property
    def checkpoint_pool_bytes(self) -> int:
        return self.num_checkpoints * self.checkpoint_bytes

    @property
    def kv_bytes(self) -> int:
        return sum(g.num_pages * b for g, b in zip(self.scheduler.groups, self.page_bytes, strict=True))

    @property
    def state_bytes(self) -> int:
        return self.scheduler.num_slots * self.slot_bytes


def _sized(cfg: EngineConfig) -> EngineConfig:
    """`cfg` with its sizing chosen for the default backend, for callers that pass a config
    the engine has not sized (the engine sizes its own when it starts)."""
    return cfg.with_device_sizing(jax.default_backend(), None, announce=False)


def draft_bytes(draft: ModelConfig, cfg: EngineConfig, max_len: int, dtype) -> int:
    """Device bytes of the draft-model drafter's caches (serving/spec_decode/draft_model.py): per
    drafted-for sequence (at most min(speculative_disable_by_batch_size, max_num_seqs)) one
    page ring per window group wide enough for a catch-up chunk or k + 1 drafted
    positions, and two state slots (base, scratch) with their penalty statistics."""
    cfg = _sized(cfg)
    seqs = min(cfg.spec_max_seqs, cfg.max_num_seqs)
    page_bytes, slot_bytes = cache_bytes(draft, page_size=cfg.page_size, dtype=dtype,
                                         state_dtype=jnp.dtype(cfg.ssm_state_dtype))
    slot_bytes += sum(x.size * x.dtype.itemsize
                      for x in jax.eval_shape(lambda: init_token_stats(1, draft.vocab_size)))
    span = max(cfg.max_prefill_chunk, cfg.num_speculative_tokens + 1)
    pages = [ring_width(w, cfg.page_size, span, max_len) * seqs + 1 for w in draft.windows]
    return sum(n * b for n, b in zip(pages, page_bytes, strict=True)) + (2 * seqs + 1) * slot_bytes


def plan_pools(model: ModelConfig, cfg: EngineConfig, *, free_bytes: int | None,
               weight_bytes: int, dtype, draft: tuple[ModelConfig, int] | None = None,
               min_slots: int = 1) -> PoolPlan:
    """Choose page and slot counts; ValueError when one max-length sequence cannot fit.

    `min_slots` (dummy included): slots allocated even when max_num_seqs needs fewer, if
    the budget allows (the engine asks for decode_row_floor() + 1: see there why).

    With tensor parallelism every byte is per device: `free_bytes` and `weight_bytes` of
    one device, pages and states of its shard (its KV heads, its SSM heads).
    `draft`: the draft model's config and weight bytes (speculative_method="draft"):
    its weights and caches come out of the budget first.
    """
    cfg = _sized(cfg)
    max_len = cfg.max_model_len or min(model.max_position_embeddings, 8192)
    if cfg.speculative_method == "mtp" and model.mtp_num_hidden_layers:
        # The MTP head's K/V share the pages of one group (hybrid_jax/mtp_ragged.py).
        from hybrid_jax.mtp_ragged import with_mtp_layers

        model = with_mtp_layers(model)
    shard = local_config(model, cfg.tensor_parallel_size)
    page_bytes, slot_bytes = cache_bytes(shard, page_size=cfg.page_size, dtype=dtype,
                                         state_dtype=jnp.dtype(cfg.ssm_state_dtype),
                                         kv_dtype=kv_dtype(cfg.kv_cache_dtype, dtype))
    ckpts, ckpt_bytes = 0, slot_bytes
    if cfg.enable_prefix_caching and slot_bytes:  # a model without recurrent state needs none
        ckpts = (cfg.prefix_state_checkpoints or max(16, 2 * cfg.max_num_seqs)) + 1
    slot_bytes += sum(x.size * x.dtype.itemsize  # penalty statistics of one slot
                      for x in jax.eval_shape(lambda: init_token_stats(1, model.vocab_size)))
    # Pages one sequence may hold at once (the chunk in flight included), and between
    # steps or while it decodes. Only prefilling sequences hold the chunk's extra pages,
    # and a step prefills at most max_num_batched_tokens tokens in chunks of at most
    # max_prefill_chunk: the extra is reserved for that many chunks, not per sequence.
    chunk = min(cfg.max_prefill_chunk, cfg.max_num_batched_tokens)
    need = [ring_width(w, cfg.page_size, chunk, max_len) for w in model.windows]
    held = [decode_page_bound(w, cfg.page_size, max_len) for w in model.windows]
    q = max(cfg.spec_q, cfg.multi_q)
    if q:  # a verification or multi-step call holds the pages of q tokens per sequence
        held = [ring_width(w, cfg.page_size, q, max_len) for w in model.windows]
    chunks_per_step = -(-cfg.max_num_batched_tokens // chunk)
    extra = [(n - h) * chunks_per_step for n, h in zip(need, held, strict=True)]
    one_seq = sum(n * b for n, b in zip(need, page_bytes, strict=True)) + slot_bytes
    per_seq = sum(h * b for h, b in zip(held, page_bytes, strict=True)) + slot_bytes
    extra_bytes = sum(e * b for e, b in zip(extra, page_bytes, strict=True))
    max_seqs = cfg.max_num_seqs
    spare = max(0, min_slots - 1 - max_seqs)  # slots beyond max_num_seqs + 1 (never admitted)
    if cfg.num_pages is not None:
        pages = [cfg.num_pages] * len(need)
    else:
        budget = cfg.memory_fraction * ((free_bytes or CPU_MEMORY_BYTES) - weight_bytes)
        budget -= ckpts * ckpt_bytes
        # Speculative verification keeps the state after each of q positions for every
        # verified sequence until the acceptance is known (candidates, inside the step).
        spec_bytes = cfg.spec_q * cfg.spec_max_seqs * ckpt_bytes
        if spec_bytes and budget - spec_bytes < one_seq:
            raise ValueError(
                f"num_speculative_tokens={cfg.num_speculative_tokens}: verifying "
                f"{cfg.spec_max_seqs} sequences keeps {cfg.spec_q} recurrent states each "
                f"({spec_bytes / 2**20:.1f} MiB) and leaves too little for one sequence: lower "
                "num_speculative_tokens or speculative_disable_by_batch_size, or raise memory_fraction")
        budget -= spec_bytes
        if draft is not None:
            need_draft = draft[1] + draft_bytes(draft[0], cfg, max_len, dtype)
            if budget - need_draft < one_seq:
                raise ValueError(
                    f"speculative_model={cfg.speculative_model!r}: the draft model's weights and "
                    f"caches take {need_draft / 2**20:.1f} MiB and leave too little for one sequence "
                    f"({one_seq / 2**20:.1f} MiB): choose a smaller draft model, lower "
                    "max_prefill_chunk or speculative_disable_by_batch_size, or raise memory_fraction")
            budget -= need_draft
        if budget < one_seq and ckpts:
            raise ValueError(
                f"prefix_state_checkpoints={ckpts - 1} take {ckpts * ckpt_bytes / 2**20:.1f} MiB and "
                f"leave too little for one sequence ({one_seq / 2**20:.1f} MiB): lower "
                "prefix_state_checkpoints or raise memory_fraction")
        if budget < one_seq:
            raise ValueError(
                f"one sequence of max_model_len={max_len} needs {one_seq / 2**20:.1f} MiB of KV "
                f"pages and state{per_device(cfg)}, but the budget is {max(budget, 0) / 2**20:.1f} "
                f"MiB: lower max_model_len or max_prefill_chunk, or raise memory_fraction"
                f"{' or tensor_parallel_size' if cfg.tensor_parallel_size > 1 else ''}")
        # Spare slots only from memory that max_num_seqs sequences do not need.
        if spare and (budget - spare * slot_bytes - extra_bytes) // per_seq < max_seqs:
            spare = 0
        budget -= spare * slot_bytes
        fit = max(1, int((budget - extra_bytes) // per_seq))
        if fit < max_seqs:
            log.warning("max_num_seqs=%d lowered to %d: that many sequences fit the memory budget",
                        max_seqs, fit)
            max_seqs = fit
        pages = [max(h * max_seqs + e, n) + 1 for h, e, n in zip(held, extra, need, strict=True)]
    for n, p in zip(need, pages, strict=True):
        if p - 1 < n:
            raise ValueError(f"num_pages={p} cannot hold one sequence of max_model_len={max_len} "
                             f"({n} pages): raise num_pages or lower max_model_len")
    slots = cfg.num_slots or max_seqs + 1 + spare
    if slots - 1 < max_seqs:
        log.warning("max_num_seqs=%d lowered to %d: num_slots=%d", max_seqs, slots - 1, slots)
        max_seqs = slots - 1
    groups = tuple(AttentionGroup(f"w{w}" if w else "global", w, p)
                   for w, p in zip(model.windows, pages, strict=True))
    sched = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=max(cfg.max_num_batched_tokens, max_seqs),
        max_prefill_chunk=min(cfg.max_prefill_chunk, cfg.max_num_batched_tokens),
        max_model_len=max_len, page_size=cfg.page_size, num_slots=slots, groups=groups,
        prefix_caching=cfg.enable_prefix_caching, prefix_state_stride=cfg.prefix_state_stride,
        num_checkpoints=ckpts, max_checkpoint_ops=min(8, max_seqs),
        admission_interval_steps=cfg.admission_interval_steps)
    return PoolPlan(sched, page_bytes, slot_bytes, ckpts, ckpt_bytes if ckpts else 0)


def per_device(cfg: EngineConfig) -> str:
    n = cfg.tensor_parallel_size
    return f" per device (tensor_parallel_size={n})" if n > 1 else ""
