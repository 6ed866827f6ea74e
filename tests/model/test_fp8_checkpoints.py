"""FP8 checkpoints (the Hub's fine-grained FP8 format) load and compute like the
dequantized model.

Tiny random transformers models are saved, then quantized block-wise by an independent
numpy implementation (tests/model/fp8_checkpoints.py): Mistral with f32 scales and an MLP
width (80) that is not a multiple of the block (32: edge blocks), Falcon-H1 with bf16
scales, edge blocks in its Mamba2 in_proj and one module in modules_to_not_convert.
transformers running the dequantized weights is the reference: logits within the
parity tests' 1e-4 (relative to the largest logit), the engine's greedy tokens equal to
its argmax wherever the top-1/top-2 gap exceeds 1e-3. Unsupported configs and
inconsistent files are refused naming the field or the tensor.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

from hybrid_jax.checkpoints import CheckpointError, load_hf  # noqa: E402
from hybrid_jax.checkpoints.fp8 import fp8_format  # noqa: E402
from hybrid_jax.fusion import fuse_projections  # noqa: E402
from hybrid_jax.layers.fp8 import dequantize  # noqa: E402
from hybrid_jax.layers.linear import Linear  # noqa: E402
from hybrid_jax.loading import load_model  # noqa: E402
from serving.engine.engine_config import EngineConfig  # noqa: E402
from serving.engine.llm_engine import LLMEngine  # noqa: E402
from serving.entrypoints.llm import LLM  # noqa: E402
from serving.sample.sampling_params import SamplingParams  # noqa: E402
from tests.model.fp8_checkpoints import dequantize_np, quantize_experts, quantize_np, write_fp8  # noqa: E402
from tests.model.hf_models import falcon_h1_config, mistral_config, randomize_  # noqa: E402

BLOCK = 32
SEQ = 40
GAP = 1e-3
NOT_CONVERTED = "model.layers.1.mamba.out_proj"


def _build(make_config, cls, out_dir, *, scale_dtype: str, not_convert: tuple[str, ...] = ()):
    cfg = make_config()
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(cfg).eval()
    randomize_(model, seed=0)
    model.save_pretrained(out_dir)
    quantized = write_fp8(model, out_dir, block=BLOCK, scale_dtype=scale_dtype, not_convert=not_convert)
    return model, quantized


def _falcon_config():
    # Input multipliers equal and output multipliers 1: the engine fuses the projections.
    cfg = falcon_h1_config()
    cfg.attention_in_multiplier = cfg.ssm_in_multiplier = 1.0
    cfg.attention_out_multiplier = cfg.ssm_out_multiplier = 1.0
    return cfg


def _mistral_config():
    cfg = mistral_config()
    cfg.intermediate_size = 80  # gate/up rows and down columns end in a 16-wide edge block
    return cfg


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8_mistral")
    model, quantized = _build(_mistral_config, T.MistralForCausalLM, path, scale_dtype="float32")
    return path, model, quantized


@pytest.fixture(scope="module")
def falcon(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8_falcon")
    model, quantized = _build(_falcon_config, T.FalconH1ForCausalLM, path, scale_dtype="bfloat16",
                              not_convert=(NOT_CONVERTED,))
    return path, model, quantized


def _linears(model) -> dict[str, Linear]:
    return {".".join(map(str, p)): m for p, m in nnx.iter_graph(model) if isinstance(m, Linear)}


def _logit_error(hf_model, model, vocab: int) -> float:
    ids = np.random.default_rng(1).integers(0, vocab, (2, SEQ))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(jax.jit(lambda x: model(x))(jnp.asarray(ids, jnp.int32)))
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("which", ["mistral", "falcon"])
def test_fp8_checkpoint_logits_match_dequantized_transformers(which, request):
    path, hf_model, quantized = request.getfixturevalue(which)
    model, cfg = load_hf(path, dtype=jnp.float32)
    lins = _linears(model)
    fp8 = {n for n, lin in lins.items() if lin.quantized}
    assert len(fp8) == len(quantized) > 0
    for name, lin in lins.items():  # FP8 in memory where the file is FP8, f32 elsewhere
        want = jnp.float8_e4m3fn if name in fp8 else jnp.float32
        assert lin.kernel[...].dtype == want, name
    if which == "falcon":
        out_proj = model.layers[1].mamba.out_proj
        assert not out_proj.quantized and out_proj.kernel[...].dtype == jnp.float32
        assert model.layers[0].mamba.out_proj.scale[...].dtype == jnp.bfloat16
        assert model.lm_head.kernel[...].dtype == jnp.float32
    err = _logit_error(hf_model, model, cfg.vocab_size)
    assert err <= 1e-4, f"{which}: max relative logit error {err:.2e}"


def test_dequantize_matches_numpy_with_edge_blocks():
    w = np.random.default_rng(0).normal(size=(70, 45)).astype(np.float32)  # 3 x 2 blocks of 32
    for scale_dtype in ("float32", "bfloat16"):
        q, scale = quantize_np(w, BLOCK, scale_dtype)
        s = jnp.asarray(scale, jnp.bfloat16 if scale_dtype == "bfloat16" else jnp.float32)
        ours = dequantize(jnp.asarray(q), s, BLOCK, jnp.float32)
        np.testing.assert_array_equal(np.asarray(ours), dequantize_np(q, scale, BLOCK))
        assert np.abs(dequantize_np(q, scale, BLOCK) - w).max() <= np.abs(w).max() / 16


def test_engine_greedy_equals_dequantized_transformers_argmax(mistral):
    path, hf_model, quantized = mistral
    eng = LLMEngine(load_model(str(path)), EngineConfig(
        max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=7, page_size=8, token_buckets=(32,),
        max_model_len=64), show_progress=False)
    # The engine's fused copy joins the FP8 q/k/v (whole blocks) with their scales; gate and
    # up (80 rows: an edge block) stay apart, transposed with their scales.
    prompts = [[int(t) for t in np.random.default_rng(s).integers(0, 128, n)] for s, n in ((2, 3), (3, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = LLM.from_engine(eng).generate(prompt_token_ids=prompts, sampling_params=params)
    compared = 0
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].numpy()
        for i, (row, tok) in enumerate(zip(logits, out.token_ids, strict=True)):
            top2 = np.sort(row)[-2:]
            if top2[1] - top2[0] > GAP:
                compared += 1
                assert tok == int(np.argmax(row)), f"token {i}: engine {tok} != {int(np.argmax(row))}"
    assert compared >= 10
    # stats() reports the bytes held: FP8 kernels one byte per element (+ alignment padding)
    held = eng.stats()["weight_bytes_by_dtype"]
    fp8_elements = sum(lin.kernel[...].size for lin in _linears(load_hf(path)[0]).values() if lin.quantized)
    assert set(held) == {"float8_e4m3fn", "float32"} and eng.stats()["quantization"] == "fp8"
    assert fp8_elements <= held["float8_e4m3fn"] < fp8_elements + 128 * len(quantized)


def test_fused_fp8_projections_equal_the_separate_ones(falcon):
    """fuse_projections joins Falcon-H1's FP8 q/k/v/in_proj (in_proj's 196 rows end in an
    edge block) and o_proj/out_proj with their scales; layer 1's out_proj is unquantized
    (modules_to_not_convert), so its out-projections stay apart."""
    model = load_hf(falcon[0])[0]
    fused = fuse_projections(model)
    first, second = fused.layers[0], fused.layers[1]
    assert first.fused_in.quantized and first.fused_out.quantized
    assert second.fused_in.quantized and second.fused_out is None
    layer = model.layers[0]
    a, m = layer.attention, layer.mamba
    u = jnp.asarray(np.random.default_rng(0).normal(size=(5, model.cfg.hidden_size)), jnp.float32)
    separate = jnp.concatenate([a.q_proj(u), a.k_proj(u), a.v_proj(u), m.in_proj(u)], axis=-1)
    np.testing.assert_allclose(first.fused_in(u), separate, rtol=1e-5, atol=1e-5)
    width = a.o_proj.kernel.shape[0]
    y = jnp.asarray(np.random.default_rng(1).normal(size=(5, width + m.out_proj.kernel.shape[0])),
                    jnp.float32)
    np.testing.assert_allclose(first.fused_out(y), a.o_proj(y[:, :width]) + m.out_proj(y[:, width:]),
                               rtol=1e-5, atol=1e-5)


def test_fp8_checkpoint_with_quantization_fp8_loads_as_stored(falcon):
    """quantization="fp8" of an FP8 checkpoint: the checkpoint's own choice stands (its
    block of 32, its not-converted out_proj in the load dtype), nothing is re-quantized."""
    path = str(falcon[0])
    stored, asked = (load_model(path, quantization=q).model for q in (None, "fp8"))
    a, b = (nnx.to_flat_state(nnx.state(m)) for m in (stored, asked))
    assert [p for p, _ in a] == [p for p, _ in b]
    for (p, x), (_, y) in zip(a, b, strict=True):
        assert x.get_value().dtype == y.get_value().dtype, p
        np.testing.assert_array_equal(np.asarray(x.get_value(), np.float32),
                                      np.asarray(y.get_value(), np.float32))
    lins = _linears(asked)
    assert not lins["layers.1.mamba.out_proj"].quantized
    assert lins["layers.0.mamba.out_proj"].quantized and lins["layers.0.mamba.out_proj"].block == BLOCK


def test_unsupported_quantization_configs_are_refused_by_field():
    good = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]}
    assert fp8_format({"quantization_config": good}).block == 128
    for field, bad in (("quant_method", "gptq"), ("fmt", "e5m2"), ("activation_scheme", "static"),
                       ("weight_block_size", [128, 64]), ("weight_block_size", None)):
        with pytest.raises(ValueError, match=field):
            fp8_format({"quantization_config": good | {field: bad}})


def test_inconsistent_fp8_files_are_refused_naming_the_tensor(mistral, tmp_path):
    from safetensors.torch import load_file, save_file

    path = mistral[0]
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_bytes((path / f).read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight_scale_inv"]
    tensors["model.layers.1.mlp.up_proj.weight_scale_inv"] = torch.ones(2, 2)  # wants [3, 2]
    save_file(tensors, tmp_path / "model.safetensors")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["model.layers.2.self_attn.q_proj"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as err:
        load_hf(tmp_path)
    assert err.value.missing == ["model.layers.0.mlp.up_proj.weight_scale_inv"]
    text = "\n".join(err.value.misshaped)
    assert "model.layers.1.mlp.up_proj.weight_scale_inv (2, 2) (expected (3, 2)" in text
    assert "modules_to_not_convert names model.layers.2.self_attn.q_proj" in text
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_hf(tmp_path)


def test_e4m3_round_trip_is_ml_dtypes():
    """The numpy reference quantizes with ml_dtypes' e4m3 rounding, as jnp does."""
    x = np.linspace(-448, 448, 997, dtype=np.float32)
    np.testing.assert_array_equal(np.asarray(jnp.asarray(x).astype(jnp.float8_e4m3fn)).view(np.uint8),
                                  x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def test_fp8_mtp_head_loads_like_the_trunk(tmp_path):
    """Qwen/Qwen3.5-35B-A3B-FP8's layout: the multimodal Qwen3.5-MoE with its MTP head
    (`mtp.*`, tests/serving/qwen_mtp_helpers.py), the head's Linears FP8 like the trunk's
    (bf16 scales; experts one Linear each), one head module in modules_to_not_convert.
    Blocks of 48: hidden 64 ends in a 16-wide edge block, the expert width 32 is one edge
    block. The FP8 weights stay FP8, the experts stacked into e4m3 [e, ...] with their bf16
    block scales (gate and up halves on their own grids); trunk and head logits equal the
    dequantized torch models' (1e-4); a missing head scale and an FP8 head tensor in a
    not-converted module are refused naming the tensor."""
    from safetensors.torch import load_file, save_file

    from tests.serving.qwen_mtp_helpers import build_with_mtp, text_model

    hf_model, head = build_with_mtp("qwen3_5_moe_vlm", tmp_path, seed=0)
    kept = "mtp.layers.0.self_attn.o_proj"
    extra = {f"mtp.{n.replace('layer.', 'layers.0.', 1)}.weight": m.weight
             for n, m in head.named_modules() if isinstance(m, torch.nn.Linear)}
    block = 48
    quantized = write_fp8(hf_model, tmp_path, block=block, scale_dtype="bfloat16", not_convert=(kept,),
                          extra=extra)
    assert {"mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= set(quantized)
    # The experts too, one Linear each (trunk and head): stacked FP8 at load.
    params = dict(hf_model.named_parameters()) | {f"mtp.{n.replace('layer.', 'layers.0.', 1)}": p
                                                  for n, p in head.named_parameters()}
    assert quantize_experts(tmp_path, params, block=block, scale_dtype="bfloat16") == 3 * 4 * 5
    model, cfg = load_hf(tmp_path, dtype=jnp.float32)
    head_fp8 = {n for n, lin in _linears(model.mtp).items() if lin.quantized}
    # every quantized head Linear but the shared expert's gate (a plain parameter: dequantized)
    assert len(head_fp8) == sum(n.startswith("mtp.") for n in quantized) - 1 > 0
    assert model.mtp.fc.quantized and model.mtp.fc.scale[...].dtype == jnp.bfloat16
    assert not model.mtp.layers[0].attention.o_proj.quantized
    assert model.layers[0].gdn.in_proj_qkv.quantized
    e, d, f = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    for moe in [layer.moe for layer in model.layers] + [model.mtp.layers[0].moe]:
        assert moe.quantized and moe.block == block
        assert moe.gate_up[...].dtype == moe.down[...].dtype == jnp.float8_e4m3fn
        assert moe.gate_up[...].shape == (e, d, 2 * f) and moe.down[...].shape == (e, f, d)
        # [e, ceil(64/48), 2 halves x ceil(32/48)] and [e, ceil(32/48), ceil(64/48)], bf16 as stored
        assert moe.gate_up_scale[...].shape == (e, 2, 2) and moe.down_scale[...].shape == (e, 1, 2)
        assert moe.gate_up_scale[...].dtype == moe.down_scale[...].dtype == jnp.bfloat16
        assert moe.router[...].dtype == moe.shared_gate[...].dtype == jnp.float32  # dequantized (tiny)

    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, SEQ))
    tm = text_model(hf_model)
    with torch.no_grad():
        h = tm(input_ids=torch.tensor(ids)).last_hidden_state
        ref = hf_model.lm_head(torch.cat([h[:, :-1], head(tm, torch.tensor(ids[:, 1:]), h[:, :-1])])).numpy()
    x = jnp.asarray(ids, jnp.int32)

    @jax.jit
    def logits(x):  # the trunk's at each position, then the head's
        hidden = model.final_norm(model.hidden(x))[:, :-1]
        g = model.mtp(model.embed_tokens(x)[:, 1:], hidden, jnp.arange(SEQ - 1)[None])
        return model.head(jnp.concatenate([hidden, g]))

    ours = np.asarray(logits(x))
    for what, a, b in (("trunk", ours[0], ref[0]), ("head", ours[1], ref[1])):
        err = np.abs(a - b).max() / np.abs(b).max()
        assert err <= 1e-4, f"{what}: max relative logit error {err:.2e}"

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["mtp.fc.weight_scale_inv"]
    q, _ = quantize_np(tensors[kept + ".weight"].numpy(), block, "bfloat16")
    tensors[kept + ".weight"] = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_hf(tmp_path)
    assert err.value.missing == ["mtp.fc.weight_scale_inv"]
    assert f"modules_to_not_convert names {kept}" in "\n".join(err.value.misshaped)
