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
serving/runner/step_fns.py; this module holds the device state, compiles, and dispatches.
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
from hybrid_jax.cache import RaggedBatch, init_caches, states_of
from hybrid_jax.fusion import fuse_projections, kernel_stacks
from hybrid_jax.kv_quant import with_kv_scales
from hybrid_jax.layers.linear import Linear, reduction_gemv
from hybrid_jax.model import CausalLM
from hybrid_jax.mtp_ragged import mtp_group, mtp_init_caches
from serving.core.schedule import PENDING, StepArrays
from serving.runner.compile_pool import Job, compile_jobs, compile_later
from serving.runner.host_pack import HostLayout, host_layout, host_put
from serving.runner.packing import pack, pack_host, plan_layout
from serving.runner.result_buffers import ResultBuffers
from serving.runner.step_fns import (  # noqa: F401  (Bucket, make_buckets: imported from here too)
    TOP_LOGPROBS,
    Bucket,
    CkptOps,
    Shardings,
    _forward_fn,
    _mtp_fn,
    _multi_fn,
    _sampler_fn,
    _verify_fn,
    compile_options,
    decode_row_floor,
    make_buckets,
)
from serving.sample.penalties import init_token_stats
from serving.sample.sampling import SamplingArrays

log = logging.getLogger(__name__)


def fuse_projections_enabled() -> bool:
    """Fused projections (hybrid_jax/fusion.py): on unless HYBRID_JAX_FUSE_PROJECTIONS=0
    (for A/B measurements; the executable store keys on it). Tensor-parallel runners fuse
    each device's local model (`Runner._fuse_local`), never the global one (a fused
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
        local = tp.local_config(self.cfg, n)
        cache_shapes = jax.eval_shape(lambda: init_caches(
            local, num_pages=num_pages, page_size=page_size, num_slots=num_slots, dtype=model.dtype,
            state_dtype=state_dtype, kv_dtype=kv_dtype))
        fp8_kv = any(kv.k_scale is not None for kv in cache_shapes.kv)
        if fp8_kv != (kv_scales is not None):
            raise ValueError("FP8 KV pages (kv_dtype float8_e4m3fn) need their kv_scales "
                             "(hybrid_jax/kv_quant.py), and only they take them")
        ckpt_shapes = jax.eval_shape(lambda: states_of(init_caches(
            local, num_pages=(1,) * len(num_pages), page_size=page_size,
            num_slots=max(num_checkpoints, 1), dtype=model.dtype, state_dtype=state_dtype))) \
            if ckpt_ops else None
        # speculative_method="mtp": the MTP head's K/V (pages of the group it shares,
        # hybrid_jax/mtp_ragged.py) and the target steps' hidden states for the MTP step.
        self.mtp_k, self.dtype = mtp_k, model.dtype
        mtp_shapes = jax.eval_shape(lambda: mtp_init_caches(  # one device's (split like the caches)
            local, num_pages=num_pages[mtp_group(self.cfg)], page_size=page_size,
            dtype=model.dtype)) if mtp_k else None
        self.mtp_shardings = None
        self.hidden: tuple[Bucket, jax.Array] | None = None  # the last target step's (bucket, [t, d])
        self.mtp_caches = None
        # HYBRID_JAX_SHARDED_RUNNER=1 runs the tensor-parallel path (packed shards, shard_map,
        # explicit shardings) on a one-device mesh: the TP step checked on one GPU.
        # FP8 Linears' block sizes (static in the graph; keyed by the executable store)
        self.fp8_blocks = tuple((".".join(map(str, p)), m.block) for p, m in nnx.iter_graph(model)
                                if isinstance(m, Linear) and m.quantized)
        if n == 1 and not switches.sharded_runner():
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
            self.ckpts = zeros(ckpt_shapes) if ckpt_ops else None
            self.mtp_caches = zeros(mtp_shapes) if mtp_k else None
        else:
            self._place_sharded(model, cache_shapes, ckpt_shapes, mtp_shapes)
            if kv_scales is not None:  # each device's pages get the scales of their KV heads
                self.caches = with_kv_scales(self.caches, tp.shard_kv_scales(self.cfg, kv_scales, n))
        self.stats = jax.device_put(init_token_stats(num_slots, self.cfg.vocab_size), self.replicated)
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
        self.max_seqs = max(b.seqs for b in self.buckets)
        self.last_tokens = self._no_tokens()
        self.compiled: dict[Bucket, Callable] = {}
        self.samplers: dict[int, Callable] = {}  # the full sampler, by sequence count
        self._host_layouts()
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
        if mtp_k:
            g = mtp_group(self.cfg)
            for bk in [*self.buckets, *self.verify_buckets]:
                batch, _ = self._dummy(bk)
                batch = batch._replace(page_tables=(batch.page_tables[g],),
                                       slot_mappings=(batch.slot_mappings[g],))
                self.mtp_layouts[bk] = host_layout((batch, np.full(bk.tokens, -1, np.int32)))
        # The buffers the executables write their results into (serving/runner/result_buffers.py).
        self.results = ResultBuffers(self.cfg.vocab_size, self.max_seqs, self.replicated)

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

    def _place_sharded(self, model: CausalLM, cache_shapes, ckpt_shapes, mtp_shapes=None) -> None:
        """Tensor parallelism: each device's parameter shard, packed on the host and put on
        that device only; caches, checkpoints and the MTP head's K/V created sharded (by
        head / channel)."""
        n, mesh = self.mesh.size, self.mesh
        tp.check_weights_shardable(model, n)
        fp8 = tp.fp8_layout(model)  # FP8 kernels and their block scales split together
        local = tp.local_abstract_model(self.cfg, n, model.dtype, fp8)
        local_graph, local_state = nnx.split(local)
        state = nnx.state(model)
        per_device = []
        for d, dev in enumerate(mesh.devices.flat):
            leaves = tp.shard_params(self.cfg, state, n, d, local_state, fp8)
            if fuse_projections_enabled():
                leaves = self._fuse_local(local_graph, local_state, leaves)
            else:
                self.graphdef, self.layout = local_graph, plan_layout(local_state)
            bufs = pack_host(self.layout, leaves)
            per_device.append([jax.device_put(b, dev) for b in bufs])
            del leaves, bufs
        split = NamedSharding(mesh, PartitionSpec(tp.AXIS))
        self.params = tuple(
            jax.make_array_from_single_device_arrays((n * size,), split, [bufs[i] for bufs in per_device])
            for i, size in enumerate(self.layout.sizes))

        def sharded_zeros(shapes):
            axes = tp.cache_axes(shapes)
            def one(x, axis):
                shape = tuple(s * n if i == axis else s for i, s in enumerate(x.shape))
                spec = PartitionSpec(*([None] * axis), tp.AXIS)
                return jnp.zeros(shape, x.dtype, device=NamedSharding(mesh, spec))
            return jax.tree.map(one, shapes, axes)

        self.caches = sharded_zeros(cache_shapes)
        self.ckpts = sharded_zeros(ckpt_shapes) if ckpt_shapes is not None else None
        sharding = lambda tree: None if tree is None else jax.tree.map(lambda x: x.sharding, tree)
        if mtp_shapes is not None:
            self.mtp_caches = sharded_zeros(mtp_shapes)
            self.mtp_shardings = sharding(self.mtp_caches)
        self.shardings = Shardings(mesh, split, sharding(self.caches), sharding(self.ckpts))

    def _fuse_local(self, local_graph, local_state, leaves: list[np.ndarray]) -> list[np.ndarray]:
        """One device's local model fused as the single-device path fuses the whole model
        (hybrid_jax/fusion.py: fused input / output projections, transposed kernels, the
        stacks the decode kernels read in place), built on the host; sets the fused
        graphdef and layout (the same for every device) -> the fused leaves."""
        with jax.default_device(tp.host_device()):
            shard = nnx.merge(local_graph, jax.tree.unflatten(jax.tree.structure(local_state), leaves))
            fused = fuse_projections(shard)
            self.graphdef, fused_state = nnx.split(fused)
            self.transposed = True
            stacks = kernel_stacks(fused)
            self.layout = plan_layout(fused_state, own=lambda x: tuple(x.shape) in stacks)
            return [np.asarray(x) for x in jax.tree.leaves(fused_state)]

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
        the store holds them (`self.deferred`; `startup["deferred"]` counts them). Until
        they are in, steps must stay within those limits (the engine lowers the
        scheduler's: see LLMEngine).
        """
        from serving.runner.exec_store import default_store, describe_args

        opts = (compile_options() if jax.default_backend() == "gpu" else {}) or None
        rep = self.replicated if self.shardings is not None else None
        store = default_store(list(self.mesh.devices.flat))
        model_key = (config_key, repr(self.cfg), repr(self.fp8_blocks), str(self.layout.dtypes),
                     repr(self.layout.leaves), str(self.layout.treedef), repr(self.shardings),
                     repr(sorted((opts or {}).items())))
        # (key, what to lower: a function of nothing, store key)
        todo: list[Job] = []

        def add(key, fn: Callable, args: tuple, desc: tuple) -> None:
            skey = store.key(model_key, desc, describe_args(args)) if store is not None else None
            todo.append((key, lambda: fn.lower(*args), skey, args))

        for bucket in self.buckets:
            host = self.host_layouts[bucket]
            ckpt = bool(self.ckpt_ops) and not bucket.decode
            hidden = bool(self.mtp_k)
            fwd = _forward_fn(self.graphdef, self.layout, bucket.decode, host, ckpt, self.shardings,
                              max_seqs=self.max_seqs, hidden=hidden)
            extra = (self.ckpts,) if ckpt else ()
            buf = jax.ShapeDtypeStruct((host.size,), jnp.int32)
            outs = self.results.forward_shapes(bucket.seqs)
            add(bucket, fwd, (self.params, self.caches, self.stats, buf, self.last_tokens, *extra, outs),
                # max_seqs: the samples' padding; hidden: the MTP step's variant
                ("forward", bucket, ckpt, self.max_seqs, repr(host), hidden))
        for bucket in self.verify_buckets:
            host = self.verify_layouts[bucket]
            buf = jax.ShapeDtypeStruct((host.size,), jnp.int32)
            outs = self.results.sync_shapes("verify", bucket)
            for filters in (False, True):
                fn = _verify_fn(self.graphdef, self.layout, self.spec_q, host, filters, bool(self.mtp_k),
                                self.shardings)
                add((bucket, filters), fn, (self.params, self.caches, buf, outs),
                    ("verify", bucket, filters, self.spec_q, repr(host), bool(self.mtp_k)))
        for bucket, host in self.mtp_layouts.items():
            buf = jax.ShapeDtypeStruct((host.size,), jnp.int32)
            hid = jax.ShapeDtypeStruct((bucket.tokens, self.cfg.hidden_size), self.dtype)
            add(("mtp", bucket), _mtp_fn(self.graphdef, self.layout, self.mtp_k, host, bucket.decode,
                                         self.shardings, self.mtp_shardings),
                (self.params, self.mtp_caches, hid, buf, self.last_tokens),
                ("mtp", bucket, self.mtp_k, repr(host)))
        for bucket in self.multi_buckets:
            host = self.multi_layouts[bucket]
            buf = jax.ShapeDtypeStruct((host.size,), jnp.int32)
            outs = self.results.sync_shapes("multi", bucket)
            for filters in (False, True):
                fn = _multi_fn(self.graphdef, self.layout, self.multi_q, host, filters)
                add(("multi", bucket, filters), fn, (self.params, self.caches, self.stats, buf, outs),
                    ("multi", bucket, filters, self.multi_q, repr(host)))
        for b in sorted({bk.seqs for bk in self.buckets}):
            logits = jax.ShapeDtypeStruct((b, self.cfg.vocab_size), jnp.float32, sharding=rep)
            host = self.sampler_layouts[b]
            buf = jax.ShapeDtypeStruct((host.size,), jnp.int32)
            # The plain sampler runs inside each forward executable (`_forward_fn`).
            add(b, _sampler_fn(self.max_seqs, host, rep), (logits, self.stats, buf),
                ("sampler", b, self.max_seqs, repr(host)))
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
                return key.seqs > defer[0] or key.tokens > defer[1]
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
        feed = np.full(t, -1, np.int32) if feed is None else _pad_rows(feed.astype(np.int32), t, -1)
        samp = SamplingArrays(*(_pad_rows(np.asarray(x), bs) for x in sampling))
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
        bucket = _q_bucket(self.verify_buckets, self.spec_q, arrays, "verification step")
        bs = bucket.seqs
        samp = SamplingArrays(*(_pad_rows(np.asarray(x), bs) for x in sampling))
        tree = (self._pad(arrays, bucket), _pad_rows(num_drafts.astype(np.int32), bs), samp)
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
        batch = batch._replace(tokens=_pad_rows(np.maximum(tokens, 0).astype(np.int32), t),
                               page_tables=(batch.page_tables[g],), slot_mappings=(batch.slot_mappings[g],),
                               last_token=_pad_rows(last.astype(np.int32), bs))
        feed = np.full(t, -1, np.int32) if feed is None else _pad_rows(feed.astype(np.int32), t, -1)
        buf = self._host_put(self.mtp_layouts[bucket].pack((batch, feed)))
        self.mtp_caches, drafts = self.mtp_steps[bucket](self.params, self.mtp_caches, hidden, buf,
                                                         self.last_tokens)
        drafts.copy_to_host_async()
        return drafts

    def multi(self, arrays: StepArrays, sampling: SamplingArrays, *,
              filters: bool) -> tuple[np.ndarray, np.ndarray]:
        """Run a multi-step decode call and wait: (tokens [b, q], logprobs [b, q]).

        Every sequence of `arrays` has multi_q tokens: its last sampled token, then
        placeholders for the q - 1 tokens the loop samples (see `_multi_fn`).
        `filters`: some row uses top-k / top-p / min-p.
        """
        b = len(arrays.slot_ids)
        bucket = _q_bucket(self.multi_buckets, self.multi_q, arrays, "multi-step call")
        samp = SamplingArrays(*(_pad_rows(np.asarray(x), bucket.seqs) for x in sampling))
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

    def _check_indices(self, a: StepArrays) -> None:
        """Every index is checked on the host: on device, JAX clamps out-of-range silently."""
        _within("token_ids", a.token_ids, self.cfg.vocab_size, lo=PENDING)
        _within("slot_ids", a.slot_ids, self.num_slots)
        for g, n in enumerate(self.num_pages):
            _within(f"page_tables[{g}]", a.page_tables[g], n)
            _within(f"slot_mappings[{g}]", a.slot_mappings[g], n * self.page_size)

    def _ops(self, a: StepArrays | None) -> CkptOps:
        """A step's checkpoint copies padded to `ckpt_ops` rows (dummy slot and checkpoint 0)."""
        k = self.ckpt_ops
        if a is None:
            return CkptOps(*(np.zeros(k, np.int32) for _ in range(4)))
        rows = (a.restore_ckpt, a.restore_slot, a.save_slot, a.save_ckpt)
        hi = (max(self.num_checkpoints, 1), self.num_slots, self.num_slots, max(self.num_checkpoints, 1))
        for name, x, h in zip(CkptOps._fields, rows, hi, strict=True):
            _within(name, x, h)
        return CkptOps(*(_pad_rows(x.astype(np.int32), k) for x in rows))

    def _pad(self, a: StepArrays, bucket: Bucket) -> RaggedBatch:
        self._check_indices(a)
        t, bs = bucket.tokens, bucket.seqs
        b = len(a.slot_ids)
        cu = np.concatenate([a.cu_seqlens, np.full(bs - b, a.cu_seqlens[-1], np.int32)])
        return RaggedBatch(
            tokens=_pad_rows(np.maximum(a.token_ids, 0), t), positions=_pad_rows(a.positions, t),
            cu_seqlens=cu, lengths=_pad_rows(a.seq_lens, bs), slot_ids=_pad_rows(a.slot_ids, bs),
            has_initial=_pad_rows(a.has_initial, bs),
            page_tables=tuple(_pad_rows(p, bs) for p in a.page_tables),
            slot_mappings=tuple(_pad_rows(m, t) for m in a.slot_mappings),
            last_token=_pad_rows(a.logits_indices, bs))

    def _dummy(self, bucket: Bucket) -> tuple[RaggedBatch, SamplingArrays]:
        t, b = bucket.tokens, bucket.seqs
        z = lambda n: np.zeros(n, np.int32)
        batch = RaggedBatch(z(t), z(t), z(b + 1), z(b), z(b), np.zeros(b, bool),
                            tuple(np.zeros((b, w), np.int32) for w in self.ring_widths),
                            tuple(z(t) for _ in self.ring_widths), z(b))
        return batch, SamplingArrays.from_rows([{}] * b)


def _within(name: str, x: np.ndarray, hi: int, lo: int = 0) -> None:
    if x.size and not (x.min() >= lo and x.max() < hi):
        raise AssertionError(f"{name} outside [{lo}, {hi}): {x.min()}..{x.max()}")


def _q_bucket(buckets: list[Bucket], q: int, arrays: StepArrays, what: str) -> Bucket:
    """The smallest bucket of q tokens per sequence that holds the step's sequences."""
    b = len(arrays.slot_ids)
    bucket = next((bk for bk in buckets if bk.seqs >= b), None)
    if bucket is None:
        raise ValueError(f"no {what} bucket holds {b} sequences")
    if not np.all(arrays.query_lens == q):
        raise ValueError(f"a {what} needs {q} tokens per sequence")
    return bucket


def _pad_rows(x: np.ndarray, n: int, fill: int = 0) -> np.ndarray:
    """Pad the leading axis to n rows (zeros = dummy slot/page 0, greedy, empty)."""
    if len(x) > n:
        raise ValueError(f"{len(x)} rows do not fit a bucket of {n}")
    if len(x) == n:  # a full bucket: nothing to add (the caller packs it, a copy)
        return x
    return np.concatenate([x, np.full((n - len(x), *x.shape[1:]), fill, x.dtype)])
