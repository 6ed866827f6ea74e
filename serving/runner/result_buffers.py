"""The device buffers that the step executables write their results into (donated).

Why: a step runs as a CUDA graph, and before each launch XLA updates every graph node
that uses a buffer whose address changed since the last call. XLA places the step's
temporaries inside its output buffers (and inside donated parameters it never reads),
so results allocated afresh each call made ~80 nodes of a decode step change, 0.3-0.7
ms of host time per call on an H100 host (docs/history/benchmarks-2026.md, seventh pass). Buffers
kept here keep their addresses:

- logits [b, vocab] f32, one buffer per row count, reused every call: the host never
  reads it, and a full sampler enqueued on it runs before the next step (stream order).
  Only the `LOGITS_KEPT` row counts used last keep theirs (a large vocabulary's logits
  are hundreds of MB at b = 256; a dropped one is made again, once);
- the plain samples (tokens [max_seqs], logprobs [b], top ids and top logprobs
  [b, TOP_LOGPROBS]): the host reads a step's samples after the next step is
  dispatched, so sets cycle through a free list. A set goes back when its step is
  fetched (`recycle`); `take` never hands out the set that holds the next call's fed
  tokens, nor a deleted one (a failed call), and makes fresh buffers when none is free
  (the draft model dispatches several steps before fetching any);
- the results of synchronous calls (verification, multi-step: fetched before the call
  returns), one set per executable, reused by the next call.

The forward writes the samples last with `write_into` (pallas_kernels/stage_copy.py),
which keeps XLA's temporaries out of those cycling buffers. This module knows nothing of
requests or scheduling.
"""

from __future__ import annotations

from collections import OrderedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from serving.runner.buckets import Bucket
from serving.runner.step_fns import TOP_LOGPROBS

FREE_SETS = 3  # sample sets kept per row count (two alternate in the overlapped loop)
LOGITS_KEPT = 4  # row counts whose logits buffer is kept (the most recently used)


class ResultBuffers:
    def __init__(self, vocab_size: int, max_seqs: int, sharding: NamedSharding):
        self.vocab_size, self.max_seqs, self.sharding = vocab_size, max_seqs, sharding
        self._logits: OrderedDict[int, jax.Array] = OrderedDict()
        self._free: dict[int, list[tuple[jax.Array, ...]]] = {}
        self._sync: dict[object, tuple[jax.Array, ...]] = {}

    # -- shapes (the executables' results: serving/runner/step_fns.py) -----------------------

    def forward_shapes(self, b: int) -> tuple:
        """(logits [b, vocab] f32, plain samples: tokens [max_seqs], logprobs [b], top ids
        and top logprobs [b, TOP_LOGPROBS]) of a forward executable of b rows."""
        def spec(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharding)

        n = TOP_LOGPROBS
        return (spec((b, self.vocab_size), jnp.float32),
                (spec((self.max_seqs,), jnp.int32), spec((b,), jnp.float32),
                 spec((b, n), jnp.int32), spec((b, n), jnp.float32)))

    def sync_shapes(self, kind: str, bucket: Bucket) -> tuple:
        """A verification call's (tokens [b, q], accepted [b]) or a multi-step call's
        (tokens [b, q], logprobs [b, q])."""
        b, q = bucket.seqs, bucket.tokens // bucket.seqs
        second = ((b,), jnp.int32) if kind == "verify" else ((b, q), jnp.float32)
        return (jax.ShapeDtypeStruct((b, q), jnp.int32, sharding=self.sharding),
                jax.ShapeDtypeStruct(*second, sharding=self.sharding))

    def zeros(self, shapes):
        return jax.device_put(jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes), self.sharding)

    # -- the forward's buffers --------------------------------------------------------

    def take(self, b: int, fed: jax.Array) -> tuple:
        """(logits, samples) buffers for a forward call of b rows, to donate into it;
        `fed` is the call's last_tokens input (never donated with it)."""
        logits = self._logits.get(b)
        if logits is None or logits.is_deleted():
            logits = self.zeros(self.forward_shapes(b)[0])
        free = self._free.get(b, [])
        for i, samples in enumerate(free):
            if samples[0] is not fed and not any(x.is_deleted() for x in samples):
                del free[i]
                return logits, samples
        return logits, self.zeros(self.forward_shapes(b)[1])

    def keep_logits(self, b: int, logits: jax.Array) -> None:
        """The call's logits result (in the donated buffer): the next call's buffer."""
        self._logits[b] = logits
        self._logits.move_to_end(b)
        while len(self._logits) > LOGITS_KEPT:
            self._logits.popitem(last=False)

    def recycle(self, b: int, samples: tuple) -> None:
        """A set of samples the host is done with (fetched, or never to be read)."""
        free = self._free.setdefault(b, [])
        if len(free) < FREE_SETS:
            free.append(tuple(samples))

    # -- synchronous calls ------------------------------------------------------------

    def take_sync(self, kind: str, bucket: Bucket) -> tuple:
        outs = self._sync.pop((kind, bucket), None)
        if outs is None or any(x.is_deleted() for x in outs):
            outs = self.zeros(self.sync_shapes(kind, bucket))
        return outs

    def keep_sync(self, kind: str, bucket: Bucket, outs: tuple) -> None:
        """A synchronous call's results, to be fetched before the next call donates them."""
        self._sync[(kind, bucket)] = tuple(outs)
