"""The LLM engine: requests in, deltas out; one step = schedule, run, update.

Owns the scheduler (host bookkeeping), the runner (device arrays and the compiled
step) and per-request text state (incremental detokenizer, stop strings, logprobs).
Requests are validated here, at the boundary, with ValueErrors that name the field;
a bad request never reaches the scheduler, so it cannot harm the others.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import jax
import numpy as np

from hybrid_jax import tensor_parallel as tp
from hybrid_jax.fusion import shared_stack_bytes
from hybrid_jax.kv_quant import calibrate_kv_scales, kv_dtype
from hybrid_jax.loading import DTYPES, LoadedModel, load_model
from hybrid_jax.quantization import fp8_linears
from serving.core.schedule import PENDING, Schedule, flatten
from serving.core.scheduler import Scheduler
from serving.core.sequence import FinishReason, Sequence, SequenceStatus
from serving.core.verify_step import SpecPlan
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.engine_config import EngineConfig, PoolPlan, plan_pools
from serving.engine.faults import EngineFatal, FaultIsolator
from serving.engine.memory import device_free_bytes
from serving.engine.outputs import RequestDelta
from serving.engine.startup import (  # noqa: F401  (freeze_heap: imported from here by the CLI)
    compile_progress,
    describe_bytes,
    freeze_heap,
    load_for_engine,
    make_runner,
    use_compilation_cache,
)
from serving.runner.buckets import decode_row_floor
from serving.runner.runner import Pending, StepResult
from serving.sample.sampling import SUPPRESS_WIDTH, SamplingArrays
from serving.sample.sampling_params import SamplingParams, outside_vocab
from serving.sample.sampling_rows import (
    Request,
    SamplingRows,
    constant_row,
    needs_full,
    uses_filters,
    uses_penalties,
)
from serving.spec_decode.speculative import NgramDrafter, SpecCounters

log = logging.getLogger(__name__)
FINISHED = SequenceStatus.FINISHED


class _Launched:
    """A dispatched step: its schedule and the runner's handle on its results."""

    __slots__ = ("schedule", "pending", "_rows")

    def __init__(self, schedule: Schedule, pending: Pending) -> None:
        self.schedule, self.pending, self._rows = schedule, pending, None

    @property
    def rows(self) -> dict[str, int]:
        """Request id -> row in the step (made when first needed: logprobs, a feed)."""
        if self._rows is None:
            self._rows = {q.request_id: i for i, q in enumerate(self.schedule.seqs)}
        return self._rows


class LLMEngine:
    def __init__(self, model: str | LoadedModel, config: EngineConfig | None = None, *,
                 seed: int = 0, show_progress: bool = True):
        config = config or EngineConfig()
        if config.data_parallel_size > 1:  # not silently one replica of N
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: an LLMEngine is one replica; "
                             "build the replicas with serving.engine.data_parallel.build_engines "
                             "(`hybrid-jax serve --data-parallel-size N`)")
        # Devices [device_offset, device_offset + n): refused before loading if the host
        # has too few. Sizing, memory planning, loading and the runner all use this group,
        # and start-up's eager work (loading, fusion, calibration) runs on its first device:
        # a model loaded there is uncommitted, and would otherwise move to device 0 when used.
        mesh = tp.make_mesh(config.tensor_parallel_size, config.device_offset)
        with jax.default_device(mesh.devices.flat[0]):
            self._start(model, config, mesh, seed, show_progress)

    def _start(self, model: str | LoadedModel, config: EngineConfig, mesh, seed: int,
               show_progress: bool) -> None:
        n = config.tensor_parallel_size
        dev = mesh.devices.flat[0]
        self.config = config.with_device_sizing(dev.platform, (dev.memory_stats() or {}).get("bytes_limit"))
        use_compilation_cache(self.config.compilation_cache_dir)
        lm = load_for_engine(model, self.config, n, device=dev)
        self.model_config, self.tokenizer = lm.config, lm.tokenizer
        if self.config.speculative_method == "mtp" and getattr(lm.model, "mtp", None) is None:
            name = model if isinstance(model, str) else lm.source
            raise ValueError(f"speculative_method='mtp': model {name!r} has no multi-token-prediction "
                             "head (no mtp.* weights, mtp_num_hidden_layers=0); use another "
                             "speculative_method or a checkpoint that ships its MTP weights")
        # What the runner's parameters add to the device while the loaded model is held: at
        # TP = 1 every parameter but the expert stacks already there (packed as they are).
        weights = (sum(x.nbytes for x in jax.tree.leaves(lm.model)) - shared_stack_bytes(lm.model, dev)
                   if n == 1 else
                   tp.param_bytes_per_device(lm.config, n, lm.model.dtype, tp.fp8_layout(lm.model)))
        self._draft_lm = None
        if self.config.speculative_method == "draft":  # loaded first: planned with the pools
            self._draft_lm = load_model(self.config.speculative_model, dtype=self.config.dtype, device=dev)
        draft = None if self._draft_lm is None else (
            self._draft_lm.config, sum(x.nbytes for x in jax.tree.leaves(self._draft_lm.model)))
        free = [device_free_bytes(d) for d in mesh.devices.flat]
        self.plan: PoolPlan = plan_pools(
            lm.config, self.config, free_bytes=None if None in free else min(free),
            weight_bytes=weights, dtype=DTYPES[self.config.dtype], draft=draft,
            min_slots=decode_row_floor() + 1)
        sc = self.plan.scheduler
        self.scheduler = Scheduler(sc, eos_token_ids=lm.config.eos_token_ids)
        multi_seqs = min(self.config.multi_step_max_seqs, sc.max_num_seqs)  # the plan may lower max_num_seqs
        # FP8 KV: static per-layer scales from one calibration prefill (hybrid_jax/kv_quant.py)
        kv_scales = (calibrate_kv_scales(lm.model, self.config.kv_scale)
                     if self.config.kv_cache_dtype == "fp8" else None)
        self.runner = make_runner(lm, self.config, sc, mesh, multi_seqs, kv_scales)
        self._spec = self._spec_plan(lm)
        # Multi-step decoding rides on the scheduler's verification steps: q tokens per
        # sequence with pages reserved, the q - 1 after the first sampled on the device.
        self._multi = None if not self.config.multi_q else SpecPlan(
            self.config.multi_q, multi_seqs, self._multi_eligible, lambda work: [[0] * n for _, n in work])
        self.multi_calls = 0  # multi-step executable calls (stats: multi_step_calls)
        self._deferred: dict | Exception | None = None  # set by the background compile's thread
        self.deferred_ready_s: float | None = None  # when the deferred executables went in
        limits = self._startup_limits()
        self.runner.compile_all(compile_progress if show_progress else None,
                                config_key=self.config.store_key(), defer=limits)
        if self.runner.deferred:
            self._t_deferred = time.perf_counter()
            self.scheduler.set_limits(*limits)
            log.info("serving with at most %d sequences and %d tokens per step while %d larger "
                     "executables compile in the background", *limits, len(self.runner.deferred))
            self.runner.compile_deferred(self._deferred_arrived)
        if jax.default_backend() == "gpu":  # first runs' one-time costs before any request
            self.runner.warmup()
        if self.drafter is not None and hasattr(self.drafter, "compile_all"):
            self.drafter.compile_all()
        self.requests: dict[str, Request] = {}
        self._inflight: deque[_Launched] = deque()  # dispatched steps not yet resolved
        self._sampling_rows = SamplingRows()
        # Late-bound: the runner (and tests' fakes of it) may be swapped after construction.
        self._faults = FaultIsolator(self.scheduler, state_lost=lambda: self.runner.state_lost(),
                                     fail=lambda rid: self.fail(rid))
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(seed)
        self.weight_bytes_by_dtype = self.runner.param_bytes_by_dtype()
        self.quantization = "fp8" if fp8_linears(lm.model) else None
        self.kv_cache_dtype = str(kv_dtype(self.config.kv_cache_dtype, lm.model.dtype))
        log.info("engine ready: %d slots, pages %s, KV %.1f MiB (%s), state %.1f MiB, weights %.1f MiB (%s)",
                 sc.num_slots - 1, [g.num_pages - 1 for g in sc.groups],
                 self.plan.kv_bytes / 2**20, self.kv_cache_dtype, self.plan.state_bytes / 2**20,
                 sum(self.weight_bytes_by_dtype.values()) / 2**20, describe_bytes(self.weight_bytes_by_dtype))

    # Steps of at most this many sequences and tokens serve from start-up on GPUs; the
    # larger executables compile in the background (`compile_in_background`).
    STARTUP_SEQS, STARTUP_TOKENS = 64, 1024

    def _startup_limits(self) -> tuple[int, int] | None:
        """(sequences, tokens) the engine serves within until its larger executables are
        compiled, or None when everything compiles before serving. The limits are rungs of
        the bucket ladders (the sequence count one of both the decode and the mixed ones),
        so every step within them has its bucket among the executables compiled first (a
        padding-only rung may come later, `ModelRunner.late`: a larger one serves meanwhile)."""
        cfg = self.config
        on = cfg.compile_in_background
        if on is None:
            on = jax.default_backend() == "gpu"
        if not on or cfg.speculative_method or cfg.multi_q:
            return None
        buckets = self.runner.buckets
        mixed_tokens = {b.tokens for b in buckets if not b.decode}
        tokens = max((t for t in mixed_tokens if t <= self.STARTUP_TOKENS), default=None)
        if tokens is None:
            return None
        decode_seqs = {b.seqs for b in buckets if b.decode}
        mixed_seqs = {b.seqs for b in buckets if not b.decode and b.tokens == tokens}
        seqs = max((b for b in decode_seqs & mixed_seqs if b <= min(self.STARTUP_SEQS, tokens)), default=None)
        if seqs is None or all(b.seqs <= seqs and b.tokens <= tokens and b not in self.runner.late
                               for b in buckets):
            return None
        return seqs, tokens

    def _deferred_arrived(self, built: dict | Exception) -> None:
        """The background compile's end (called on its thread): the engine loop installs it."""
        self._deferred = built

    def background_ready(self) -> bool:
        """The background compile has ended and `install_background` has its result."""
        return self._deferred is not None

    def install_background(self) -> None:
        """On the engine's thread: make the background compile's executables callable and
        lift the start-up limits (warming them up first when no step is in flight); if it
        failed, log it and keep serving within the limits."""
        built, self._deferred = self._deferred, None
        if isinstance(built, Exception):
            log.error("background compilation failed (%s: %s); serving on within %d sequences and "
                      "%d tokens per step", type(built).__name__, built,
                      self.scheduler.max_num_seqs, self.scheduler.max_num_batched_tokens)
            self.deferred_ready_s = float("nan")
            return
        self.runner.install_deferred(built, warm=not self._inflight)
        self.scheduler.set_limits()
        self.deferred_ready_s = time.perf_counter() - self._t_deferred
        log.info("%d background executables in after %.1f s: full limits (%d sequences, %d tokens "
                 "per step)", len(built), self.deferred_ready_s, self.scheduler.max_num_seqs,
                 self.scheduler.max_num_batched_tokens)

    def _spec_plan(self, lm: LoadedModel) -> SpecPlan | None:
        """The drafter and the scheduler's speculation offer (None: speculation off)."""
        cfg = self.config
        self.drafter = None
        self.spec_counters = SpecCounters(cfg.num_speculative_tokens) if cfg.speculative_method else None
        if cfg.speculative_method is None:
            return None
        if cfg.speculative_method == "ngram":
            self.drafter = NgramDrafter(cfg.num_speculative_tokens, cfg.prompt_lookup_min,
                                        cfg.prompt_lookup_max)
        elif cfg.speculative_method == "mtp":
            from serving.spec_decode.mtp import MTPDrafter

            self.drafter = MTPDrafter(self.runner, cfg.num_speculative_tokens)
        else:
            from serving.spec_decode.draft_model import DraftModelDrafter

            self.drafter = DraftModelDrafter(cfg, lm, self.plan, self._draft_lm, mesh=self.runner.mesh)
            self._draft_lm = None  # its runner holds the packed weights; drop the unpacked ones
        return SpecPlan(cfg.spec_q, min(cfg.spec_max_seqs, self.plan.scheduler.max_num_seqs),
                        self._spec_eligible, self._propose)

    def _spec_eligible(self, seq: Sequence) -> bool:
        """Verification samples with temperature, top-k, top-p and min-p: no penalties, no
        logit bias, no logprobs, no EOS suppression (min_tokens) pending."""
        req, p = self.requests.get(seq.request_id), seq.params
        return (req is not None and not uses_penalties(p) and p.logprobs is None
                and not p.logit_bias and seq.num_output_tokens >= p.min_tokens)

    def _multi_eligible(self, seq: Sequence) -> bool:
        """Multi-step rows sample without penalties, logit bias or top-n logprobs
        (temperature, seed, top-k / top-p / min-p and the sampled token's logprob are kept)
        and have no EOS suppression (min_tokens) pending."""
        p = seq.params
        return (seq.request_id in self.requests and not uses_penalties(p) and not p.logprobs
                and not p.logit_bias and seq.num_output_tokens >= p.min_tokens)

    def _propose(self, work: list[tuple[Sequence, int]]) -> list[list[int]]:
        t0 = time.perf_counter()
        if hasattr(self.drafter, "propose_batch"):  # a draft model: one batch for all
            out = self.drafter.propose_batch([(s.request_id, s.token_ids, n) for s, n in work])
        else:
            out = [self.drafter.propose(s.token_ids, n) if n > 0 else [] for s, n in work]
        self.spec_counters.draft_time_s += time.perf_counter() - t0
        return out

    # -- requests ----------------------------------------------------------------

    def add_request(self, prompt: str | None = None, params: SamplingParams | None = None, *,
                    prompt_token_ids: list[int] | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; returns its id. ValueError names the bad field."""
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt, prompt_token_ids)
        self._check_params(params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request_id={rid!r} is already in use")
        seq = Sequence(rid, ids, params)
        self.scheduler.add(seq)  # ValueError when prompt + max_tokens > max_model_len
        detok = (IncrementalDetokenizer(self.tokenizer, ids, params.stop)
                 if self.tokenizer is not None else None)
        # Any int is a valid seed: the sampling seed is seed mod 2**32 (documented on SamplingParams).
        seed = params.seed % 2**32 if params.seed is not None else int(self._seeds.integers(2**32))
        eos = () if params.ignore_eos else self.model_config.eos_token_ids
        ban = list(dict.fromkeys((*eos, *params.stop_token_ids)))
        row = constant_row(params, seed, seq.num_prompt_tokens, self.model_config.vocab_size)
        self.requests[rid] = Request(seq, detok, ban, needs_full(params), row)
        return rid

    def _prompt_ids(self, prompt: str | None, ids: list[int] | None) -> list[int]:
        if (prompt is None) == (ids is None):
            raise ValueError("give exactly one of prompt or prompt_token_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            ids = self.tokenizer.encode(prompt, add_bos=True)
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("prompt_token_ids: the prompt is empty")
        if (bad := outside_vocab(ids, self.model_config.vocab_size)) is not None:
            raise ValueError(f"prompt_token_ids: {bad}")
        return ids

    def _check_params(self, p: SamplingParams) -> None:
        if p.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer; use stop_token_ids")
        p.check_vocab(self.model_config.vocab_size)
        if p.min_tokens and len(set(p.stop_token_ids) | set(self.model_config.eos_token_ids)) \
                > SUPPRESS_WIDTH:
            raise ValueError(f"stop_token_ids: at most {SUPPRESS_WIDTH} stop + EOS ids with min_tokens")

    def abort(self, request_id: str) -> bool:
        """Abort a request now (pages and slot freed at once). False if it is not live."""
        self.requests.pop(request_id, None)
        return self.scheduler.abort(request_id) is not None

    @property
    def last_fault(self) -> str | None:
        """The exception of the last step that failed (one line), None if none has."""
        return self._faults.last_error

    def fail(self, request_id: str) -> RequestDelta | None:
        """Finish a live request with finish_reason "error" (a fault pinned on it)."""
        req = self.requests.pop(request_id, None)
        seq = self.scheduler.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, FinishReason.ERROR)
        log.error("request %s failed in the engine (finish_reason=error)", request_id)
        return RequestDelta(request_id, [], req.detok.flush() if req and req.detok else "", None,
                            True, FinishReason.ERROR.value, seq.num_prompt_tokens,
                            seq.num_output_tokens)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict[str, object]:
        """Memory and pool usage: the weight bytes each device holds (in total and by
        dtype: FP8 weights count one byte; `quantization` "fp8" when any are FP8), the K/V
        pages' dtype (`kv_cache_dtype`: "float8_e4m3fn" with kv_cache_dtype="fp8"), KV and
        state bytes reserved, pages and slots in use.

        `pages_in_use` counts pages held by sequences; with prefix caching,
        `pages_cached` counts idle cached pages (free to evict) and the `prefix_*` keys
        report hits (`prefix_cache_hit_tokens`: prompt tokens not recomputed,
        cumulative), the hit rate in tokens, checkpoint pool usage and evictions.
        """
        s = self.scheduler.stats()
        out = {"weight_bytes": sum(self.weight_bytes_by_dtype.values()),
               "weight_bytes_by_dtype": dict(self.weight_bytes_by_dtype),
               "quantization": self.quantization,
               "kv_cache_dtype": self.kv_cache_dtype,
               "kv_bytes": self.plan.kv_bytes, "state_bytes": self.plan.state_bytes,
               "pages_in_use": s.pages_in_use, "pages_total": s.pages_total,
               "slots_in_use": s.slots_in_use, "slots_total": s.slots_total,
               "num_running": s.num_running, "num_waiting": s.num_waiting,
               "num_preemptions": s.num_preemptions}
        if self.config.enable_prefix_caching:
            out |= {"pages_cached": s.pages_cached, **s.prefix,
                    "prefix_state_checkpoint_bytes": self.plan.checkpoint_pool_bytes}
        if self.spec_counters is not None:
            out |= self.spec_counters.stats()
        if self._multi is not None:
            out["multi_step_calls"] = self.multi_calls
        return out

    # -- one step ----------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """Schedule and dispatch the next step, then resolve the previous one.

        Every request takes the plain overlapped step (`_plain_step`). Speculation
        (`_spec_step`) and multi-step decoding (`_multi_step`) take over when the
        scheduler can give them the step; both first resolve what is in flight, since
        they need every last token on the host.
        """
        if self._deferred is not None:
            self.install_background()
        if self._spec is not None:
            if self._spec_takes_step():
                return self._drain() + self._spec_step()
            self.spec_counters.plain_steps += 1  # more sequences than speculation serves
        if self._multi is not None and self.scheduler.verify_ready(self._multi):
            deltas = self._drain()
            schedule = self.scheduler.schedule(self._multi)
            if schedule.is_verify:
                return deltas + self._multi_step(schedule)
            return deltas + self._plain_step(schedule)
        return self._plain_step(self.scheduler.schedule())

    def _plain_step(self, schedule: Schedule) -> list[RequestDelta]:
        """Dispatch `schedule`, then resolve every step in flight but it.

        With async_scheduling the step dispatched here runs on the device while this
        call turns the previous step's tokens into deltas (its result is returned by the
        next call); without it, the step is resolved before returning. Same outputs.
        """
        deltas: list[RequestDelta] = []
        launched = None
        if not schedule.is_empty:
            try:
                launched = self._dispatch(schedule)
            except Exception as err:
                deltas += self._faults.failed(schedule, err)
            else:
                self._faults.succeeded(schedule)
                self._inflight.append(launched)
        keep = 1 if launched is not None and self.config.async_scheduling else 0
        while len(self._inflight) > keep:
            deltas += self._resolve(self._inflight.popleft())
        return deltas

    def _drain(self) -> list[RequestDelta]:
        """Resolve every step in flight."""
        deltas: list[RequestDelta] = []
        while self._inflight:
            deltas += self._resolve(self._inflight.popleft())
        return deltas

    def _spec_takes_step(self) -> bool:
        """Speculation serves at most `speculative_disable_by_batch_size` sequences; past
        that (with async scheduling) the ordinary overlapped step runs instead."""
        return not (self.config.async_scheduling and len(self.scheduler.running) > self._spec.max_seqs)

    def _multi_step(self, schedule: Schedule) -> list[RequestDelta]:
        """Run a multi-step call (synchronous) and turn its token runs into deltas."""
        try:
            arrays = flatten(schedule)
            sampling, _ = self._sampling(schedule)
            filters = any(uses_filters(e.seq.params) for e in schedule.entries)
            out, lps = self.runner.multi(arrays, sampling, filters=filters)
        except Exception as err:
            return self._faults.failed(schedule, err)
        self._faults.succeeded(schedule)
        self.multi_calls += 1
        n = [e.num_drafts + 1 for e in schedule.entries]  # a row's tokens within max_tokens
        outputs = self.scheduler.update(schedule, [out[i, :k].tolist() for i, k in enumerate(n)])
        rows = {e.seq.request_id: i for i, e in enumerate(schedule.entries)}
        return [self._delta(o.seq, o.new_token_ids, None, 0,
                            lps=lps[rows[o.seq.request_id], :len(o.new_token_ids)].tolist())
                for o in outputs]

    def _spec_step(self) -> list[RequestDelta]:
        """A step with speculation on and at most `speculative_disable_by_batch_size`
        sequences running: synchronous (the drafts need the last token on the host); a
        verification step when the scheduler allows it, else a plain one. With more
        sequences running, `step` takes the ordinary overlapped path instead."""
        if self.drafter is not None and hasattr(self.drafter, "sync"):
            self.drafter.sync(self.scheduler)
        schedule = self.scheduler.schedule(self._spec)
        if schedule.is_empty:
            return []
        if not schedule.is_verify:
            self.spec_counters.plain_steps += 1
            try:
                launched = self._dispatch(schedule)
            except Exception as err:
                return self._faults.failed(schedule, err)
            self._faults.succeeded(schedule)
            return self._resolve(launched)
        t0 = time.perf_counter()
        try:
            arrays = flatten(schedule)
            sampling, _ = self._sampling(schedule)
            drafts = np.array([e.num_drafts for e in schedule.entries], np.int32)
            filters = any(uses_filters(e.seq.params) for e in schedule.entries)
            out, accepted = self.runner.verify(arrays, sampling, drafts, filters=filters)
            if hasattr(self.drafter, "after_verify"):  # the MTP head drafts the next step's tokens
                self.drafter.after_verify(schedule, arrays, out, accepted)
        except Exception as err:
            return self._faults.failed(schedule, err)
        self._faults.succeeded(schedule)
        c = self.spec_counters
        c.verify_time_s += time.perf_counter() - t0
        c.verify_steps += 1
        tokens = [out[i, :a + 1].tolist() for i, a in enumerate(accepted.tolist())]
        for e, a in zip(schedule.entries, accepted.tolist(), strict=True):
            c.record(e.num_drafts, a)
        outputs = self.scheduler.update(schedule, tokens)
        return [self._delta(o.seq, o.new_token_ids, None, 0) for o in outputs]

    def _dispatch(self, schedule: Schedule) -> _Launched:
        arrays = flatten(schedule)
        sampling, full = self._sampling(schedule)
        if full:  # the full sampler reads every row's slot's logit bias
            self.runner.sync_logit_bias(arrays.slot_ids, [s.params.logit_bias for s in schedule.seqs])
        pending = self.runner.dispatch(arrays, sampling, self._feed(schedule, arrays), full=full)
        if hasattr(self.drafter, "after_step"):  # the MTP head: its K/V and the next drafts
            self.drafter.after_step(schedule, arrays)
        return _Launched(schedule, pending)

    def _feed(self, schedule: Schedule, arrays) -> np.ndarray | None:
        """For each PENDING token, the row of the last dispatched step that samples it.

        That step is the newest in flight: its samples are the runner's `last_tokens`.
        """
        where = np.flatnonzero(arrays.token_ids == PENDING)
        if not where.size:
            return None
        feed = np.full(len(arrays.token_ids), -1, np.int32)
        last = self._inflight[-1].schedule
        if (schedule.block is not None and last.block is not None
                and schedule.block.seqs == last.block.seqs):
            feed[where] = where  # the same decode batch again: row i follows row i
            return feed
        seqs = schedule.seqs
        rows = self._inflight[-1].rows
        entry = np.searchsorted(arrays.cu_seqlens[1:], where, side="right")
        for i, e in zip(where.tolist(), entry.tolist(), strict=True):
            feed[i] = rows[seqs[e].request_id]
        return feed

    def _resolve(self, launched: _Launched) -> list[RequestDelta]:
        try:
            result = self.runner.fetch(launched.pending)
        except Exception as err:  # the device failed while running the step
            raise EngineFatal(f"fetching a step's results failed: {err}") from err
        outputs = self.scheduler.update(launched.schedule, result.tokens.tolist())
        reqs = [self.requests[o.seq.request_id] for o in outputs]
        # Every request's new token detokenized in one call (see IncrementalDetokenizer.add_batch).
        one = [i for i, (o, r) in enumerate(zip(outputs, reqs, strict=True))
               if r.detok is not None and len(o.new_token_ids) <= 1]
        texts = dict(zip(one, IncrementalDetokenizer.add_batch(
            [(reqs[i].detok, outputs[i].new_token_ids) for i in one]), strict=True))
        # The row of a request's sample in `result`: for its logprobs only.
        return [self._delta(o.seq, o.new_token_ids, result,
                            launched.rows[o.seq.request_id] if o.seq.params.logprobs is not None else 0,
                            texts.get(i), req=r)
                for i, (o, r) in enumerate(zip(outputs, reqs, strict=True))]

    def _sampling(self, schedule: Schedule) -> tuple[SamplingArrays, bool]:
        """Per-row sampling arrays, and whether any row needs the full sampler
        (serving/sample/sampling_rows.py)."""
        seqs = tuple(schedule.seqs)
        if schedule.block is not None:
            step = schedule.block.out_index
        else:
            step = np.fromiter((e.out_index for e in schedule.entries), np.int32, count=len(seqs))
        return self._sampling_rows.arrays(seqs, self.requests, step)

    @staticmethod
    def _add_run(seq: Sequence, detok: IncrementalDetokenizer, tokens: list[int]) -> tuple[str, list[int]]:
        """Detokenize several tokens one by one; at a stop string, drop the tokens after it
        (from the sequence too), as decoding them one per step would have."""
        text = ""
        for i, tok in enumerate(tokens):
            text += detok.add([tok])
            if detok.stopped_on is not None:
                extra = len(tokens) - i - 1
                if extra and not seq.is_finished:
                    del seq.token_ids[-extra:]
                return text, tokens[:i + 1]
        return text, tokens

    def _delta(self, seq: Sequence, tokens: list[int], result: StepResult | None, row: int,
               text: str | None = None, lps: list[float] | None = None,
               req: Request | None = None) -> RequestDelta:
        """`text`: the tokens already detokenized (by `_resolve`'s batch), if they were;
        `lps`: the sampled tokens' logprobs of a multi-token run (else from `result`);
        `req`: the sequence's request, when the caller has it."""
        if req is None:
            req = self.requests[seq.request_id]
        detok = req.detok
        if detok is None:
            text = ""
        else:
            if text is None and len(tokens) > 1:  # a verification run may hold a stop string
                text, tokens = self._add_run(seq, detok, tokens)
            elif text is None:
                text = detok.add(tokens)
            if detok.stopped_on is not None and seq.status is not FINISHED:
                self.scheduler.finish(seq, FinishReason.STOP, detok.stopped_on)
        finished = seq.status is FINISHED
        if finished and detok is not None:
            text += detok.flush()
        logprobs = None
        n = seq.params.logprobs
        if n is not None and lps is not None:  # a multi-step run (no top-n)
            logprobs = [{int(t): float(v)} for t, v in zip(tokens, lps, strict=False)]
        elif n is not None:
            entry = {int(result.tokens[row]): float(result.logprobs[row])}
            entry |= {int(i): float(v) for i, v in zip(result.top_ids[row, :n],
                                                       result.top_logprobs[row, :n], strict=True)}
            logprobs = [entry]
        reason = None
        if finished:
            self.requests.pop(seq.request_id, None)
            reason = seq.finish_reason.value if seq.finish_reason is not None else None
        return RequestDelta(seq.request_id, tokens, text, logprobs, finished, reason,
                            seq.num_prompt_tokens, seq.num_output_tokens)
