"""The model runner: the only place that builds device arrays and calls the jitted step.

One pure step function - merge the NNX graph with the parameters (passed as an
argument, never baked into the HLO), run the ragged forward, sample on device - is
compiled ahead of time for every shape bucket (tokens x sequences, plus one
decode-only bucket per sequence count) at start-up. Serving calls those compiled
executables only, so it cannot recompile: a shape outside the buckets is an error.
KV pages and recurrent states are donated and updated in place. With prefix caching,
the mixed (prefill) executables also take the state checkpoint pool (donated) and a
fixed number of copy operations: checkpoints into slots before the forward (cache
hits), slots into checkpoints after it (the state at the end of a chunk). Arrays are placed
with shardings over a `jax.sharding.Mesh` (one device by default). With tensor
parallelism (a mesh of N devices, hybrid_jax/tensor_parallel.py) each device holds its
shard of the parameters (packed per device: one flat buffer per dtype, split along the
mesh), KV pages by KV head and states by head or channel; the model part of the step
runs the device-local model under `shard_map` (the kernels see local heads), and the
step stays one executable with explicit in/out shardings, so nothing is resharded
between steps. The step functions themselves and the shape buckets live in
serving/runner/step_fns.py, the tensor-parallel placement in serving/runner/sharded.py,
the list of executables to build in serving/runner/executables.py and the padding of a
step to its bucket in serving/runner/padding.py; this module holds the device state,
compiles, and dispatches.
The runner knows nothing of requests or scheduling policy.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs import switches
from hybrid_jax import tensor_parallel as tp
from hybrid_jax.cache import RaggedBatch
from hybrid_jax.fusion import fuse_projections, kernel_stacks
from hybrid_jax.kv_quant import with_kv_scales
from hybrid_jax.layers.linear import Linear, reduction_gemv
from hybrid_jax.model import CausalLM
from hybrid_jax.mtp_ragged import mtp_group
from serving.core.schedule import StepArrays
from serving.runner.buckets import (  # noqa: F401  (Bucket, make_buckets: imported from here too)
    Bucket,
    decode_row_floor,
    late_buckets,
    make_buckets,
)
from serving.runner.compile_pool import Job, compile_jobs, compile_later
from serving.runner.executables import add_executables
from serving.runner.host_pack import HostLayout, host_layout, host_put
from serving.runner.packing import pack
from serving.runner.padding import check_indices, dummy_batch, pad_batch, pad_ckpt_ops, pad_rows, q_bucket
from serving.runner.result_buffers import ResultBuffers
from serving.runner.sharded import local_shapes, place_sharded
from serving.runner.step_fns import CkptOps, Shardings, compile_options
from serving.sample.penalties import bias_row, init_token_stats, set_logit_bias
from serving.sample.sampling import SamplingArrays

log = logging.getLogger(__name__)


def fuse_projections_enabled() -> bool:
    """Fused projections (hybrid_jax/fusion.py): on unless HYBRID_JAX_FUSE_PROJECTIONS=0
    (for A/B measurements; the executable store keys on it). Tensor-parallel runners fuse
    each device's local model (serving/runner/sharded.py `fuse_local`), never the global one (a fused
    matrix's column shards would mix heads)."""
    return switches.fuse_projections()


class StepResult(NamedTuple):
    tokens: np.ndarray  # [b] int32
    logprobs: np.ndarray  # [b] f32, of the sampled token
    top_ids: np.ndarray  # [b, TOP_LOGPROBS]
    top_logprobs: np.ndarray  # [b, TOP_LOGPROBS]


class Pending(NamedTuple):
    """A dispatched step: device results on their way to the host."""

    num_seqs: int
    tokens: jax.Array  # [max_seqs] int32
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    recycle: int = 0  # the forward's own output buffers (of this many rows): reused once fetched


class ModelRunner:
    """Holds parameters and caches on the mesh; dispatches one padded step per call."""

    def __init__(self, model: CausalLM, *, num_pages: tuple[int, ...], page_size: int,
                 num_slots: int, ring_widths: tuple[int, ...], max_num_seqs: int,
                 max_num_batched_tokens: int, mesh: Mesh | None = None,
                 seq_sizes: tuple[int, ...] | None = None,
                 token_sizes: tuple[int, ...] | None = None,
                 state_dtype: jnp.dtype = jnp.float32, num_checkpoints: int = 0,
                 ckpt_ops: int = 0, spec_q: int = 0, spec_max_seqs: int = 0,
                 multi_q: int = 0, multi_max_seqs: int = 0, kv_dtype: jnp.dtype | None = None,
                 kv_scales: tuple[tuple[np.ndarray, np.ndarray], ...] | None = None, mtp_k: int = 0):
        self.cfg = model.cfg
        self.mesh = mesh or Mesh(np.asarray(jax.devices()[:1]), (tp.AXIS,))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.shardings: Shardings | None = None
        self.transposed = False
        self._host_put = host_put(self.replicated)  # the step's inputs to the device
        n = self.mesh.size
        # Prefix caching: `ckpt_ops` copies per mixed step into / out of a pool of
        # `num_checkpoints` state checkpoints (0 for a model without recurrent state).
        self.ckpt_ops, self.num_checkpoints = ckpt_ops, num_checkpoints
        self.ckpts = None
        cache_shapes, ckpt_shapes, mtp_shapes = local_shapes(
            self.cfg, n, num_pages=num_pages, page_size=page_size, num_slots=num_slots,
            dtype=model.dtype, state_dtype=state_dtype, kv_dtype=kv_dtype,
            num_checkpoints=num_checkpoints if ckpt_ops else None, mtp=bool(mtp_k))
        if any(kv.k_scale is not None for kv in cache_shapes.kv) != (kv_scales is not None):
            raise ValueError("FP8 KV pages (kv_dtype float8_e4m3fn) need their kv_scales "
                             "(hybrid_jax/kv_quant.py), and only they take them")
        # speculative_method="mtp": the MTP head's K/V (pages of the group it shares,
        # hybrid_jax/mtp_ragged.py) and the target steps' hidden states for the MTP step.
        self.mtp_k, self.dtype = mtp_k, model.dtype
        self.mtp_shardings = None
        self.hidden: tuple[Bucket, jax.Array] | None = None  # the last target step's (bucket, [t, d])
        self.mtp_caches = None
        # FP8 Linears' block sizes (static in the graph; keyed by the executable store)
        self.fp8_blocks = tuple((".".join(map(str, p)), m.block) for p, m in nnx.iter_graph(model)
                                if isinstance(m, Linear) and m.quantized)
        # HYBRID_JAX_SHARDED_RUNNER=1 runs the tensor-parallel path (packed shards, shard_map,
        # explicit shardings) on a one-device mesh: the TP step checked on one GPU.
        if n == 1 and not switches.sharded_runner():
            self._place_single(model, cache_shapes, ckpt_shapes, mtp_shapes, kv_scales)
        else:
            placed = place_sharded(model, self.mesh, cache_shapes, ckpt_shapes, mtp_shapes,
                                   fuse=fuse_projections_enabled())
            (self.graphdef, self.layout, self.transposed, self.params, self.caches, self.ckpts,
             self.mtp_caches, self.mtp_shardings, self.shardings) = placed
            if kv_scales is not None:  # each device's pages get the scales of their KV heads
                self.caches = with_kv_scales(self.caches, tp.shard_kv_scales(self.cfg, kv_scales, n))
        self.stats = jax.device_put(init_token_stats(num_slots, self.cfg.vocab_size), self.replicated)
        # Which request's logit bias each slot's row holds (absent: none); `sync_logit_bias`.
        self.slot_bias: dict[int, tuple] = {}
        # compiled now (ahead of time: a jitted call compiled again after the engine's first
        # steps in a CPU test), not while serving
        self._set_bias = jax.jit(set_logit_bias, donate_argnums=0, in_shardings=self.replicated,
                                 out_shardings=self.replicated).lower(
            self.stats, np.int32(0), *bias_row(())).compile()
        self.ring_widths = ring_widths
        self.page_size = page_size
        self.num_pages, self.num_slots = num_pages, num_slots
        # A lone sequence decodes in a one-row bucket where its projections are reductions
        # at 95-102% of copy bandwidth (the fused copy's transposed Linears on a GPU:
        # hybrid_jax/layers/linear.py), against 67-90% for cuBLAS's padded 8-row GEMMs.
        self.single_row = self.shardings is None and self.transposed and reduction_gemv()
        self.buckets = make_buckets(max_num_seqs, max_num_batched_tokens, seq_sizes=seq_sizes,
                                    token_sizes=token_sizes, min_decode_rows=decode_row_floor(),
                                    single_row_decode=self.single_row,
                                    coarse_mixed=jax.default_backend() == "gpu")
        # padding-only rungs, compiled with the deferred executables (`late_buckets`)
        self.late = late_buckets(self.buckets, jax.default_backend() == "gpu" and token_sizes is None)
        self.max_seqs = max(b.seqs for b in self.buckets)
        self.last_tokens = self._no_tokens()
        self.compiled: dict[Bucket, Callable] = {}
        self.samplers: dict[int, Callable] = {}  # the full sampler, by sequence count
        self._host_layouts()
        self._extra_buckets(spec_q, spec_max_seqs, multi_q, multi_max_seqs)
        # The buffers the executables write their results into (serving/runner/result_buffers.py).
        self.results = ResultBuffers(self.cfg.vocab_size, self.max_seqs, self.replicated)

    def _place_single(self, model: CausalLM, cache_shapes, ckpt_shapes, mtp_shapes, kv_scales) -> None:
        """One device: the model (fused) packed, caches, checkpoints and MTP K/V allocated whole."""
        if fuse_projections_enabled():  # one GEMM per shared input (hybrid_jax/fusion.py)
            model = fuse_projections(model)
            self.transposed = True  # its layers' Linears held [out, in], fused or not
        stacks = kernel_stacks(model)
        self.graphdef, params = nnx.split(model)
        del model  # a fused copy's concatenated weights go once packed
        # One flat buffer per dtype (serving/runner/packing.py: hundreds of arguments cost ms per call),
        # but one each for the stacks a Pallas kernel reads whole (a slice would be copied).
        self.layout, self.params = pack(jax.device_put(params, self.replicated),
                                        own=lambda x: tuple(x.shape) in stacks)
        del params
        gc.collect()  # the fused copy's concatenations, before the pools are allocated
        zeros = lambda tree: jax.device_put(
            jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree), self.replicated)
        self.caches = zeros(cache_shapes)
        if kv_scales is not None:
            self.caches = with_kv_scales(self.caches, kv_scales)
        self.ckpts = zeros(ckpt_shapes) if self.ckpt_ops else None
        self.mtp_caches = zeros(mtp_shapes) if self.mtp_k else None

    def _extra_buckets(self, spec_q: int, spec_max_seqs: int, multi_q: int, multi_max_seqs: int) -> None:
        """The verification, multi-step and MTP buckets and their host layouts."""
        # Speculative decoding: verification buckets of b sequences x spec_q tokens, for
        # the decode ladder's sizes up to spec_max_seqs (speculation is off above it),
        # each compiled with and without the sampling filters.
        self.spec_q = spec_q
        self.verify_buckets: list[Bucket] = []
        self.verify_layouts: dict[Bucket, HostLayout] = {}
        self.verifiers: dict[tuple[Bucket, bool], Callable] = {}
        if spec_q:
            self.verify_buckets = self._q_buckets(spec_q, spec_max_seqs)
            for bk in self.verify_buckets:
                batch, sampling = self._dummy(bk)
                self.verify_layouts[bk] = host_layout((batch, np.zeros(bk.seqs, np.int32), sampling))
        # Multi-step decoding: buckets of b sequences x multi_q tokens (the pages and
        # positions of multi_q decode steps), for the decode ladder's sizes up to
        # multi_max_seqs.
        if multi_q and self.shardings is not None:
            raise ValueError("multi-step decoding does not run tensor-parallel yet "
                             "(tensor_parallel_size > 1 or HYBRID_JAX_SHARDED_RUNNER=1)")
        self.multi_q = multi_q
        # A multi-step call's forwards have b rows each: a lone sequence's are one-row
        # reductions too when the runner has the one-row decode bucket.
        self.multi_buckets = self._q_buckets(multi_q, multi_max_seqs, self.single_row) if multi_q else []
        self.multi_layouts: dict[Bucket, HostLayout] = {}
        for bk in self.multi_buckets:
            batch, sampling = self._dummy(bk)
            self.multi_layouts[bk] = host_layout((sampling, batch))
        self.multisteps: dict[tuple[Bucket, bool], Callable] = {}
        self.mtp_layouts: dict[Bucket, HostLayout] = {}
        self.mtp_steps: dict[Bucket, Callable] = {}
        if self.mtp_k:
            g = mtp_group(self.cfg)
            for bk in [*self.buckets, *self.verify_buckets]:
                batch, _ = self._dummy(bk)
                batch = batch._replace(page_tables=(batch.page_tables[g],),
                                       slot_mappings=(batch.slot_mappings[g],))
                self.mtp_layouts[bk] = host_layout((batch, np.full(bk.tokens, -1, np.int32)))

    def _q_buckets(self, q: int, max_seqs: int, single_row: bool = False) -> list[Bucket]:
        """Buckets of b sequences x q tokens: the decode ladder's sizes up to max_seqs (the
        one-row decode bucket only if `single_row`: a verification forward has b x q rows)."""
        limit = min(max_seqs, self.max_seqs)
        floor = 1 if single_row else decode_row_floor()
        sizes = sorted({*(b.seqs for b in self.buckets if b.decode and floor <= b.seqs < limit), limit})
        return [Bucket(b * q, b, False, True) for b in sizes]

    def _host_tree(self, bucket: Bucket, batch: RaggedBatch, sampling: SamplingArrays,
                   feed: np.ndarray, ops: CkptOps | None) -> tuple:
        """A step's host inputs, in buffer order: the sampler's fields first."""
        tree = (sampling, batch.slot_ids, batch, feed)
        return tree + (ops,) if bool(self.ckpt_ops) and not bucket.decode else tree

    def _host_layouts(self) -> None:
        """One host-buffer layout per bucket, padded to one size per sequence count."""
        layouts: dict[Bucket, HostLayout] = {}
        for bucket in self.buckets:
            batch, sampling = self._dummy(bucket)
            feed = np.full(bucket.tokens, -1, np.int32)
            layouts[bucket] = host_layout(self._host_tree(bucket, batch, sampling, feed, self._ops(None)))
        size: dict[int, int] = {}
        for bk, lay in layouts.items():
            size[bk.seqs] = max(size.get(bk.seqs, 0), lay.size)
        self.host_layouts = {bk: lay.padded(size[bk.seqs]) for bk, lay in layouts.items()}
        self.sampler_layouts: dict[int, HostLayout] = {}
        for b in size:
            sampling = SamplingArrays.from_rows([{}] * b)
            self.sampler_layouts[b] = host_layout((sampling, np.zeros(b, np.int32))).padded(size[b])

    @property
    def param_bytes_per_device(self) -> int:
        """Bytes of parameters each device holds (its packed shard)."""
        return sum(x.addressable_shards[0].data.nbytes for x in self.params)

    def param_bytes_by_dtype(self) -> dict[str, int]:
        """Bytes of parameters each device holds per dtype (its packed buffers, alignment
        padding included): FP8 weights count one byte per element."""
        out: dict[str, int] = {}
        for name, size in zip(self.layout.dtypes, self.layout.sizes, strict=True):
            out[name] = out.get(name, 0) + size * jnp.dtype(name).itemsize
        return out

    def compile_all(self, progress: Callable[[int, int, Bucket], None] | None = None,
                    workers: int | None = None, config_key: str = "",
                    defer: tuple[int, int] | None = None) -> None:
        """Compile every bucket ahead of serving (the only compilations the runner does).

        Executables found in the executable store (serving/runner/exec_store.py, beside the
        persistent compilation cache) are loaded without tracing; the others are lowered
        and compiled in parallel, then stored (serving/runner/compile_pool.py). `self.startup`
        records the seconds spent loading, lowering and compiling. `config_key` names the
        engine configuration the executables serve (a part of their store key).

        `defer` (seqs, tokens): the step executables with more sequences or tokens than
        these, and the samplers of more sequences, are left for `compile_deferred` unless
        the store holds them (`self.deferred`; `startup["deferred"]` counts them), and so
        are the GPU ladder's padding-only rungs (`self.late`). Until they are in, steps
        must stay within those limits (the engine lowers the scheduler's: see LLMEngine).
        """
        from serving.runner.exec_store import default_store, describe_args

        opts = (compile_options() if jax.default_backend() == "gpu" else {}) or None
        store = default_store(list(self.mesh.devices.flat))
        model_key = (config_key, repr(self.cfg), repr(self.fp8_blocks), str(self.layout.dtypes),
                     repr(self.layout.leaves), str(self.layout.treedef), repr(self.shardings),
                     repr(sorted((opts or {}).items())))
        # (key, what to lower: a function of nothing, store key)
        todo: list[Job] = []

        def add(key, fn: Callable, args: tuple, desc: tuple) -> None:
            skey = store.key(model_key, desc, describe_args(args)) if store is not None else None
            todo.append((key, lambda: fn.lower(*args), skey, args))

        add_executables(self, add)
        n = len(todo)
        built = 0

        def finish(key, exe) -> None:
            nonlocal built
            self._install(key, exe)
            built += 1
            if progress is not None:
                progress(built, n, key)

        def later(key) -> bool:
            if isinstance(key, Bucket):
                return key.seqs > defer[0] or key.tokens > defer[1] or key in self.late
            return isinstance(key, int) and key > defer[0]

        self.deferred: list[Job] = []
        self._compile_opts, self._store = opts, store
        self.startup = compile_jobs(todo, opts=opts, store=store, done=finish, workers=workers,
                                    defer=later if defer is not None else None, deferred=self.deferred)

    def _install(self, key, exe) -> None:
        if isinstance(key, Bucket):
            self.compiled[key] = exe
        elif isinstance(key, int):
            self.samplers[key] = exe
        elif key[0] == "multi":
            self.multisteps[key[1:]] = exe
        elif key[0] == "mtp":
            self.mtp_steps[key[1]] = exe
        else:
            self.verifiers[key] = exe

    def compile_deferred(self, done: Callable[[dict | Exception], None]) -> None:
        """Build `self.deferred` on a background thread (serving/runner/compile_pool.py);
        `done` gets {key: executable} (for `install_deferred`, on the engine's thread) or
        the exception."""
        compile_later(self.deferred, opts=self._compile_opts, store=self._store, done=done)

    def install_deferred(self, built: dict, warm: bool) -> None:
        """Make the deferred executables callable; `warm`: run the new step executables
        once first (`warmup`: only with no step in flight, since it resets `last_tokens`)."""
        for key, exe in built.items():
            self._install(key, exe)
        self.deferred = []
        if warm:
            self.warmup([k for k in built if isinstance(k, Bucket)])

    def sync_logit_bias(self, slot_ids, biases) -> None:
        """Before a step that runs the full sampler: every row's slot gets its request's
        logit bias (`SamplingParams.logit_bias`, () for none) where the slot's row holds
        another's. One small update per changed slot, ordered before the step by `stats`."""
        for slot, bias in zip(slot_ids, biases, strict=True):
            slot = int(slot)
            if self.slot_bias.get(slot, ()) != bias:
                ids, values = bias_row(bias)
                self.stats = self._set_bias(self.stats, np.int32(slot), ids, values)
                self.slot_bias[slot] = bias

    def pick(self, arrays: StepArrays) -> Bucket:
        b, t = len(arrays.slot_ids), len(arrays.token_ids)
        decode = arrays.num_decodes == b
        for bucket in self.buckets:
            if (bucket.decode == decode and bucket.seqs >= b and bucket.tokens >= t
                    and bucket in self.compiled):  # a deferred one is not, until it arrives
                return bucket
        raise ValueError(f"no bucket holds {t} tokens x {b} sequences (decode={decode})")

    def dispatch(self, arrays: StepArrays, sampling: SamplingArrays, feed: np.ndarray | None = None,
                 *, full: bool = True) -> Pending:
        """Pad to a bucket and enqueue the step (caches donated); returns without waiting.

        `feed` [t]: for each token, the row of the previous dispatched step whose sample it
        is (-1: the token id in `arrays` is real). The results start copying to the host.
        """
        bucket = self.pick(arrays)
        t, bs = bucket.tokens, bucket.seqs
        batch = self._pad(arrays, bucket)
        feed = np.full(t, -1, np.int32) if feed is None else pad_rows(feed.astype(np.int32), t, -1)
        samp = SamplingArrays(*(pad_rows(np.asarray(x), bs) for x in sampling))
        ckpt = bool(self.ckpt_ops) and not bucket.decode
        if not ckpt and (arrays.restore_slot.size or arrays.save_slot.size):
            raise ValueError("checkpoint copies in a step without them (decode or caching off)")
        tree = self._host_tree(bucket, batch, samp, feed, self._ops(arrays) if ckpt else None)
        return self._launch(bucket, tree, len(arrays.slot_ids), full)

    def _no_tokens(self) -> jax.Array:
        """`last_tokens` before any step has sampled (nothing is fed from it yet)."""
        return jax.device_put(np.zeros(self.max_seqs, np.int32), self.replicated)

    def warmup(self, buckets: list[Bucket] | None = None) -> None:
        """Run every step executable and full sampler once, on an all-padding batch, and wait.

        A GPU executable's first run pays one-time costs (its CUDA graph captured, kernels
        loaded), which a request would otherwise pay (H100, 16 req/s: the first requests'
        TTFT was 155-176 ms against a 17.5 ms median; the cause is inferred, the warm-up's
        own effect was not measured apart).
        Every row of the batch is padding: it reads and writes only the dummy page 0 and
        slot 0, so no sequence's state changes.
        """
        pending = []
        for bucket in self.buckets if buckets is None else buckets:
            if bucket not in self.compiled:  # deferred: warmed when it arrives, if idle
                continue
            batch, sampling = self._dummy(bucket)
            feed = np.full(bucket.tokens, -1, np.int32)
            tree = self._host_tree(bucket, batch, sampling, feed, self._ops(None))
            pending.append(self._launch(bucket, tree, 0, full=True))
        for p in pending:
            self.fetch(p)
        self.last_tokens = self._no_tokens()

    def _launch(self, bucket: Bucket, tree: tuple, num_seqs: int, full: bool) -> Pending:
        """Enqueue `bucket`'s executable on a padded step's host inputs (caches donated)."""
        bs = bucket.seqs
        ckpt = bool(self.ckpt_ops) and not bucket.decode
        # One transfer for every host input of the step (serving/runner/host_pack.py).
        buf = self._host_put(self.host_layouts[bucket].pack(tree))
        args = (self.params, self.caches, self.stats, buf, self.last_tokens)
        exe, outs = self.compiled[bucket], self.results.take(bs, self.last_tokens)
        if ckpt:
            self.caches, self.stats, logits, plain, self.ckpts, *hidden = exe(*args, self.ckpts, outs)
        else:
            self.caches, self.stats, logits, plain, *hidden = exe(*args, outs)
        if hidden:
            self.hidden = (bucket, hidden[0])
        self.results.keep_logits(bs, logits)
        if full:
            out = self.samplers[bs](logits, self.stats, buf)
            self.results.recycle(bs, plain)
        else:
            out = plain
        self.last_tokens = out[0]
        for x in out if full else out[:2]:
            x.copy_to_host_async()
        return Pending(num_seqs, *out, recycle=0 if full else bs)

    def verify(self, arrays: StepArrays, sampling: SamplingArrays, num_drafts: np.ndarray, *,
               filters: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Run a verification step and wait: (tokens [b, q], accepted drafts [b]).

        Every sequence of `arrays` has spec_q tokens (its last token, then drafts).
        Padded rows have zero length for attention (the ragged convention) and run the
        recurrent path on their padded tokens in the dummy slot 0.
        """
        b = len(arrays.slot_ids)
        bucket = q_bucket(self.verify_buckets, self.spec_q, arrays, "verification step")
        bs = bucket.seqs
        samp = SamplingArrays(*(pad_rows(np.asarray(x), bs) for x in sampling))
        tree = (self._pad(arrays, bucket), pad_rows(num_drafts.astype(np.int32), bs), samp)
        buf = self._host_put(self.verify_layouts[bucket].pack(tree))
        outs = self.results.take_sync("verify", bucket)
        self.caches, out, accepted, *hidden = self.verifiers[(bucket, filters)](self.params, self.caches,
                                                                                 buf, outs)
        if hidden:
            self.hidden = (bucket, hidden[0])
        self.results.keep_sync("verify", bucket, (out, accepted))
        out, accepted = jax.device_get((out, accepted))
        return out[:b], accepted[:b]

    def mtp_dispatch(self, arrays: StepArrays, tokens: np.ndarray, feed: np.ndarray | None,
                     last: np.ndarray) -> jax.Array:
        """Enqueue the MTP step after the last target step (its bucket and hidden states):
        `arrays` that step's, `tokens` [t] its tokens shifted by one (x_{p+1} for position
        p), `feed` [t] (>= 0: the token is that row of the step's samples), `last` [b] each
        row's last valid token. Returns the drafts [b, k] on the device (copying to the host)."""
        bucket, hidden = self.hidden
        g = mtp_group(self.cfg)
        batch = self._pad(arrays, bucket)
        t, bs = bucket.tokens, bucket.seqs
        batch = batch._replace(tokens=pad_rows(np.maximum(tokens, 0).astype(np.int32), t),
                               page_tables=(batch.page_tables[g],), slot_mappings=(batch.slot_mappings[g],),
                               last_token=pad_rows(last.astype(np.int32), bs))
        feed = np.full(t, -1, np.int32) if feed is None else pad_rows(feed.astype(np.int32), t, -1)
        buf = self._host_put(self.mtp_layouts[bucket].pack((batch, feed)))
        self.mtp_caches, drafts = self.mtp_steps[bucket](self.params, self.mtp_caches, hidden, buf,
                                                         self.last_tokens)
        drafts.copy_to_host_async()
        return drafts

    def multi(self, arrays: StepArrays, sampling: SamplingArrays, *,
              filters: bool) -> tuple[np.ndarray, np.ndarray]:
        """Run a multi-step decode call and wait: (tokens [b, q], logprobs [b, q]).

        Every sequence of `arrays` has multi_q tokens: its last sampled token, then
        placeholders for the q - 1 tokens the loop samples (see step_fns.py `_multi_fn`).
        `filters`: some row uses top-k / top-p / min-p.
        """
        b = len(arrays.slot_ids)
        bucket = q_bucket(self.multi_buckets, self.multi_q, arrays, "multi-step call")
        samp = SamplingArrays(*(pad_rows(np.asarray(x), bucket.seqs) for x in sampling))
        buf = self._host_put(self.multi_layouts[bucket].pack((samp, self._pad(arrays, bucket))))
        exe = self.multisteps[(bucket, filters)]
        outs = self.results.take_sync("multi", bucket)
        self.caches, self.stats, out, lps = exe(self.params, self.caches, self.stats, buf, outs)
        self.results.keep_sync("multi", bucket, (out, lps))
        out, lps = jax.device_get((out, lps))
        return out[:b], lps[:b]

    def fetch(self, p: Pending) -> StepResult:
        """Wait for a dispatched step's results on the host. The step's device arrays may be
        reused by a later dispatch once this returns (serving/runner/result_buffers.py): read them
        only here."""
        b = p.num_seqs
        if p.recycle:  # the plain sampler's: no top-n logprobs (zeros), not worth a transfer
            tokens, lps = jax.device_get((p.tokens, p.logprobs))
            top_ids = np.zeros(p.top_ids.shape, p.top_ids.dtype)
            top_lps = np.zeros(p.top_logprobs.shape, p.top_logprobs.dtype)
            self.results.recycle(p.recycle, (p.tokens, p.logprobs, p.top_ids, p.top_logprobs))
        else:
            tokens, lps, top_ids, top_lps = jax.device_get(
                (p.tokens, p.logprobs, p.top_ids, p.top_logprobs))
        return StepResult(tokens[:b], lps[:b], top_ids[:b], top_lps[:b])

    def run(self, arrays: StepArrays, sampling: SamplingArrays, feed: np.ndarray | None = None,
            *, full: bool = True) -> StepResult:
        """Dispatch and wait (the synchronous step)."""
        return self.fetch(self.dispatch(arrays, sampling, feed, full=full))

    def state_lost(self) -> bool:
        """Whether the donated device state (caches, statistics) is gone, e.g. a step died mid-call."""
        try:
            return any(x.is_deleted() for x in jax.tree.leaves((self.caches, self.stats, self.ckpts,
                                                                self.mtp_caches)))
        except Exception:  # the device itself is unusable
            return True

    def _ops(self, a: StepArrays | None) -> CkptOps:
        """A step's checkpoint copies padded to `ckpt_ops` rows (dummy slot and checkpoint 0)."""
        return pad_ckpt_ops(a, self.ckpt_ops, num_checkpoints=self.num_checkpoints, num_slots=self.num_slots)

    def _pad(self, a: StepArrays, bucket: Bucket) -> RaggedBatch:
        check_indices(a, vocab_size=self.cfg.vocab_size, num_slots=self.num_slots,
                      num_pages=self.num_pages, page_size=self.page_size)
        return pad_batch(a, bucket)

    def _dummy(self, bucket: Bucket) -> tuple[RaggedBatch, SamplingArrays]:
        return dummy_batch(bucket, self.ring_widths)

