"""GPU kernels for hybrid-jax, each beside a pure-JAX reference with the same signature.

`backend.resolve_impl` is the single switch between `pallas`, `interpret` and
`reference`. This package knows nothing of models, configs or scheduling: ops
take plain arrays (paged K/V, per-slot states, ragged offsets) and return arrays.
"""

from pallas_kernels.backend import IMPLS, Impl, default_impl, resolve_impl
from pallas_kernels.conv1d import (
    conv1d_decode,
    conv1d_decode_reference,
    conv1d_ragged,
    conv1d_ragged_reference,
)
from pallas_kernels.decode_glue import (
    DecodeParts,
    add_rms_norm,
    add_rms_norm_reference,
    mixer_merge,
    mixer_merge_reference,
)
from pallas_kernels.gated_delta import (
    gated_delta_ragged,
    gated_delta_ragged_reference,
    gated_delta_step,
    gated_delta_step_reference,
)
from pallas_kernels.gated_delta_chunked import gated_delta_ragged_chunked
from pallas_kernels.index_offsets import offset_indices, offset_indices_reference
from pallas_kernels.linear_scan import (
    linear_scan_decode,
    linear_scan_decode_reference,
    linear_scan_ragged,
    linear_scan_ragged_reference,
)
from pallas_kernels.mamba_step import mamba2_step, mamba2_step_fits, mamba2_step_reference
from pallas_kernels.mla_decode import mla_decode, mla_decode_fits, mla_decode_reference
from pallas_kernels.paged_attention import (
    decode_fused_fits,
    paged_attention_decode,
    paged_attention_decode_fused,
    paged_attention_prefill,
    write_kv,
)
from pallas_kernels.paged_attention_ref import (
    paged_attention_decode_reference,
    paged_attention_prefill_reference,
)
from pallas_kernels.parallel_decode import attention_ssm_decode
from pallas_kernels.selective_scan import (
    selective_scan_ragged,
    selective_scan_ragged_reference,
    selective_scan_step,
    selective_scan_step_reference,
)
from pallas_kernels.ssd import ssd_ragged, ssd_ragged_reference
from pallas_kernels.ssm_decode import ssm_decode, ssm_decode_packed, ssm_decode_reference

__all__ = [
    "offset_indices",
    "offset_indices_reference",
    "DecodeParts",
    "IMPLS",
    "Impl",
    "add_rms_norm",
    "add_rms_norm_reference",
    "attention_ssm_decode",
    "conv1d_decode",
    "conv1d_decode_reference",
    "conv1d_ragged",
    "conv1d_ragged_reference",
    "default_impl",
    "gated_delta_ragged",
    "gated_delta_ragged_chunked",
    "gated_delta_ragged_reference",
    "gated_delta_step",
    "gated_delta_step_reference",
    "linear_scan_decode",
    "linear_scan_decode_reference",
    "linear_scan_ragged",
    "linear_scan_ragged_reference",
    "mamba2_step",
    "mamba2_step_fits",
    "mamba2_step_reference",
    "mla_decode",
    "mla_decode_fits",
    "mla_decode_reference",
    "mixer_merge",
    "mixer_merge_reference",
    "paged_attention_decode",
    "paged_attention_decode_fused",
    "paged_attention_decode_reference",
    "paged_attention_prefill",
    "paged_attention_prefill_reference",
    "resolve_impl",
    "selective_scan_ragged",
    "selective_scan_ragged_reference",
    "selective_scan_step",
    "selective_scan_step_reference",
    "ssd_ragged",
    "ssd_ragged_reference",
    "ssm_decode",
    "ssm_decode_packed",
    "ssm_decode_reference",
    "decode_fused_fits",
    "write_kv",
]
