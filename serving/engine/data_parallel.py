"""Data parallelism: N engine replicas, each on its own device group, behind one server.

For a model that fits one device (or one tensor-parallel group) whose traffic does not:
`build_engines` builds `data_parallel_size` `LLMEngine`s, replica i on local devices
[i * tp, (i + 1) * tp) (`EngineConfig.device_offset`), each loading its weights onto its
own devices; `DataParallelCore` runs one `EngineCore` (its own loop thread) per replica
and offers the servers EngineCore's interface:

- `submit` routes a request to the replica with the fewest live requests (requests
  being submitted to it count; ties go to the lowest index). A replica whose waiting
  queue is full passes the request on to the next least loaded; `QueueFull` only
  when every replica's is full. Request ids are unique across the replicas.
- `abort` finds the request's replica; `stats` sums the replicas' counters (the keys keep
  their meaning: the whole server; per-device keys such as `weight_bytes` are one
  replica's, rates are recomputed from the sums) and lists each replica's own under
  "replicas", each with `requests_submitted` (requests routed to it since start-up).
- Health: the server is healthy (SERVING) only while every replica is: *degraded* while
  any replica is degraded (EngineCore's consecutive-failure rule, per replica), and an
  unrecoverable fault in any replica is fatal for the server (`on_fatal` runs once, new
  requests are refused; the server then stops every replica).

The replicas are threads of one process: their host work (scheduling, detokenization,
the fronts) shares one GIL, so host-bound serving scales less than the devices do.
This module knows nothing of gRPC or HTTP.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import jax

from hybrid_jax.loading import LoadedModel
from serving.engine.engine_config import EngineConfig
from serving.engine.engine_core import EngineCore, EngineStopped, QueueFull, RequestStream, SelfTestFailed
from serving.engine.llm_engine import LLMEngine
from serving.sample.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# stats() keys that describe one device (or one replica's setting), not a server-wide count.
PER_DEVICE = ("weight_bytes", "weight_bytes_by_dtype", "quantization", "kv_cache_dtype")


def check_devices(cfg: EngineConfig, num_devices: int | None = None) -> None:
    """ValueError naming data_parallel_size when the replicas need more local devices
    than the host has (before anything loads)."""
    dp, tp_size, offset = cfg.data_parallel_size, cfg.tensor_parallel_size, cfg.device_offset
    have = len(jax.local_devices()) if num_devices is None else num_devices
    need = offset + dp * tp_size
    if need > have:
        raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp_size} needs {need} devices"
                         f"{f' from device_offset={offset}' if offset else ''}, but this host has "
                         f"{have}: lower data_parallel_size")


def replica_configs(cfg: EngineConfig) -> list[EngineConfig]:
    """One config per replica: replica i on devices [offset + i * tp, offset + (i + 1) * tp),
    each one engine (data_parallel_size 1)."""
    check_devices(cfg)
    n = cfg.tensor_parallel_size
    return [replace(cfg, device_offset=cfg.device_offset + i * n, data_parallel_size=1)
            for i in range(cfg.data_parallel_size)]


def build_engines(model: str | LoadedModel | Callable[[EngineConfig], str | LoadedModel],
                  cfg: EngineConfig, **engine_kwargs) -> list[LLMEngine]:
    """`data_parallel_size` engines, one per device group. `model`: a name or path (each
    replica loads it onto its own devices), a LoadedModel (shared; each runner copies the
    parameters to its devices), or a function of the replica's config returning either
    (a caller that loads with its own settings, e.g. the CLI's weight seed)."""
    engines = []
    for i, rc in enumerate(replica_configs(cfg)):
        log.info("data-parallel replica %d of %d on devices %d..%d", i + 1, cfg.data_parallel_size,
                 rc.device_offset, rc.device_offset + rc.tensor_parallel_size - 1)
        engines.append(LLMEngine(model(rc) if callable(model) else model, rc, **engine_kwargs))
    return engines


def make_core(engines: LLMEngine | list[LLMEngine], **core_kwargs) -> EngineCore | DataParallelCore:
    """The plain EngineCore for one engine, a DataParallelCore for several."""
    if isinstance(engines, LLMEngine):
        return EngineCore(engines, **core_kwargs)
    if len(engines) == 1:
        return EngineCore(engines[0], **core_kwargs)
    return DataParallelCore(engines, **core_kwargs)


class DataParallelCore:
    """EngineCore's interface over one EngineCore per replica (module doc for the rules)."""

    def __init__(self, engines: list[LLMEngine], **core_kwargs):
        if len(engines) < 2:
            raise ValueError(f"data_parallel_size={len(engines)}: a DataParallelCore needs >= 2 engines")
        self.replicas = [EngineCore(e, **core_kwargs) for e in engines]
        self.engine = engines[0]  # what the fronts read (tokenizer, model config, limits): the same for all
        self.max_waiting = core_kwargs.get("max_waiting")
        self.on_step: list = []
        self.on_health: list = []
        self.on_fatal: list = []
        self.fatal_error: BaseException | None = None
        self._accepting = True
        self._route = threading.Lock()  # guards _pending (held for microseconds, never over a step)
        self._pending = [0] * len(self.replicas)  # submits under way per replica
        self._submitted = [0] * len(self.replicas)  # requests accepted per replica (stats)
        self._health = threading.Lock()
        self._ok = True  # the aggregate health last announced
        self._ids = itertools.count()
        for i, r in enumerate(self.replicas):
            r.on_step.append(self._stepped)
            r.on_health.append(self._replica_health)
            r.on_fatal.append(lambda err, i=i: self._replica_fatal(i, err))

    # -- life cycle --------------------------------------------------------------------

    def self_test(self) -> None:
        """Every replica's start-up request (EngineCore.self_test); the first failure raises,
        naming the replica."""
        for i, r in enumerate(self.replicas):
            try:
                r.self_test()
            except SelfTestFailed as err:
                raise SelfTestFailed(f"data-parallel replica {i}: {err}") from err

    def start(self) -> DataParallelCore:
        for r in self.replicas:
            r.start()
        return self

    def stop_accepting(self) -> None:
        self._accepting = False
        for r in self.replicas:
            r.stop_accepting()

    def num_live(self) -> int:
        return sum(r.num_live() for r in self.replicas)

    def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop accepting everywhere; live requests run for up to `grace_s`; stop every replica."""
        self.stop_accepting()
        deadline = time.monotonic() + grace_s
        while self.num_live() and time.monotonic() < deadline:
            time.sleep(0.01)
        for r in self.replicas:
            r.shutdown(0.0)

    # -- health ------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False once any replica hit an unrecoverable fault."""
        return self.fatal_error is None and all(r.healthy for r in self.replicas)

    @property
    def degraded(self) -> bool:
        return any(r.degraded for r in self.replicas)

    @property
    def consecutive_failures(self) -> int:
        return max(r.consecutive_failures for r in self.replicas)

    def _replica_health(self, ok: bool) -> None:
        """A replica's health changed (on its loop thread, its lock held: no calls into the
        replicas' locked methods). Announce the server's when it changes."""
        with self._health:
            now = not self.degraded
            if now == self._ok:
                return
            self._ok = now
            for cb in self.on_health:
                cb(now)

    def _replica_fatal(self, index: int, err: BaseException) -> None:
        """Replica `index` cannot go on: the server cannot either. Refuse new requests and tell
        the owner once (it stops the other replicas; not here: this runs on the failed
        replica's thread with its lock held, and another replica may be failing too)."""
        with self._health:
            first = self.fatal_error is None
            if first:
                self.fatal_error = err
                self._accepting = False
        if not first:
            return
        log.error("data-parallel replica %d failed: the server stops", index)
        for cb in self.on_fatal:
            try:
                cb(err)
            except Exception:
                log.exception("on_fatal callback failed")

    def _stepped(self, deltas, seconds: float) -> None:
        for cb in self.on_step:
            cb(deltas, seconds)

    # -- requests ------------------------------------------------------------------------

    def submit(self, prompt: str | None = None, params: SamplingParams | None = None, *,
               prompt_token_ids: list[int] | None = None,
               request_id: str | None = None) -> RequestStream:
        """Validate and queue on the least loaded replica (EngineCore.submit's errors)."""
        if not self._accepting:
            raise EngineStopped("the engine is shutting down")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if any(r.holds(request_id) for r in self.replicas):
            raise ValueError(f"request_id={request_id!r} is already in use")
        tried: set[int] = set()
        while True:
            i = self._choose(tried)
            try:
                stream = self.replicas[i].submit(prompt, params, prompt_token_ids=prompt_token_ids,
                                                 request_id=request_id)
                with self._route:
                    self._submitted[i] += 1
                return stream
            except QueueFull:
                tried.add(i)
                if len(tried) == len(self.replicas):
                    raise QueueFull(f"every replica's waiting queue is full (limit {self.max_waiting} "
                                    "each)") from None
            finally:
                with self._route:
                    self._pending[i] -= 1

    def _choose(self, skip: set[int]) -> int:
        """The replica with the fewest live + being-submitted requests (lowest index on ties),
        counted in as being submitted to."""
        with self._route:
            i = min((i for i in range(len(self.replicas)) if i not in skip),
                    key=lambda i: (self.replicas[i].load + self._pending[i], i))
            self._pending[i] += 1
            return i

    def abort(self, request_id: str) -> bool:
        """Abort a live request on whichever replica holds it; False if none does."""
        for r in self.replicas:
            if r.holds(request_id):
                return r.abort(request_id)
        return False

    def stats(self) -> dict[str, object]:
        per = [r.stats() | {"requests_submitted": n}
               for r, n in zip(self.replicas, self._submitted, strict=True)]
        out = merge_stats(per)
        out["data_parallel_size"] = len(per)
        out["replicas"] = per
        return out


def merge_stats(per: list[dict[str, object]]) -> dict[str, object]:
    """Replicas' `LLMEngine.stats()` as one server's: counts summed (dicts per key), per-device
    keys from the first replica, rates recomputed from the summed counts."""
    out: dict[str, object] = {}
    for key, first in per[0].items():
        values = [s[key] for s in per]
        if key in PER_DEVICE or not isinstance(first, int | float | dict) or isinstance(first, bool):
            out[key] = first
        elif isinstance(first, dict):
            out[key] = {k: sum(v[k] for v in values) for k in first}
        else:
            out[key] = sum(values)
    if "prefix_cache_hit_rate" in out:
        q = out["prefix_cache_query_tokens"]
        out["prefix_cache_hit_rate"] = out["prefix_cache_hit_tokens"] / q if q else 0.0
    if "spec_acceptance_rate" in out:
        p = out["spec_proposed_tokens"]
        out["spec_acceptance_rate"] = out["spec_accepted_tokens"] / p if p else 0.0
        # No exact sums for these: each replica's, weighted by its verification steps.
        steps = [s["spec_verify_steps"] for s in per]
        total = sum(steps)
        w = [n / total if total else 1 / len(per) for n in steps]
        out["spec_mean_accepted_length"] = sum(x * s["spec_mean_accepted_length"]
                                               for x, s in zip(w, per, strict=True))
        out["spec_acceptance_per_position"] = [
            sum(x * s["spec_acceptance_per_position"][j] for x, s in zip(w, per, strict=True))
            for j in range(len(per[0]["spec_acceptance_per_position"]))]
    return out
