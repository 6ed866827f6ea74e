"""Tiny transformers Qwen3.5 / Qwen3-Next checkpoints WITH an MTP head, and a torch
reference of that head (transformers ships no MTP module: it ignores `mtp.*`).

The head is laid out as the published checkpoints store it (and vLLM's
qwen3_next_mtp.py / qwen3_5_mtp.py read it): `mtp.fc.weight` [d, 2d] over
concat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)), one decoder layer
`mtp.layers.0.*` named as the trunk's full-attention layers (experts one Linear each, as
transformers saves them), `mtp.norm.weight`; `mtp_num_hidden_layers` in the (text) config.
The reference layer is transformers' own decoder layer class, so the head's attention
(gate, q/k norms, partial rotary), MoE and zero-centred norms are checked against it.

`agree` makes the head's drafts agree with the target often, not always (as
tests/serving/mtp_helpers.py `agreeing_head` does for the native hybrid): the target's
sub-block outputs are damped, so its next token is mostly decided by the current token's
embedding; the head reads mostly that embedding, its own layer damped but not zero.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

from tests.model import hf_models

# Sub-block outputs scaled by `damp` (the target) or DAMP_HEAD (the head's layer).
_OUTPUTS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")
DAMP_HEAD = 0.1


def text_model(hf: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (embed_tokens, layers, norm, rotary_emb) of a CausalLM or of a
    multimodal model."""
    return getattr(hf.model, "language_model", hf.model)


class TorchMTP(torch.nn.Module):
    """The MTP head in torch (vLLM's Qwen3NextMultiTokenPredictor math) over one sequence."""

    def __init__(self, hf: torch.nn.Module, gen: torch.Generator):
        super().__init__()
        tm = text_model(hf)
        d = tm.norm.weight.shape[0]
        self.attn_index = next(i for i, layer in enumerate(tm.layers) if hasattr(layer, "self_attn"))
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding = copy.deepcopy(tm.norm)
        self.pre_fc_norm_hidden = copy.deepcopy(tm.norm)
        self.norm = copy.deepcopy(tm.norm)
        self.layer = copy.deepcopy(tm.layers[self.attn_index])
        with torch.no_grad():
            for name, p in list(self.named_parameters()):
                if name.startswith("layer."):  # fresh values at the trunk's scales
                    p.add_(torch.randn(p.shape, generator=gen) * p.std().clamp(min=0.05))
                elif name.startswith("pre_fc_norm"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            self.fc.weight.copy_(torch.randn(self.fc.weight.shape, generator=gen) / math.sqrt(2 * d))

    def forward(self, tm: torch.nn.Module, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_tokens [1, t] (x_{p+1}), hidden [1, t, d] (the target's h_p after its final
        norm) -> the head's normed output g [1, t, d] (logits: the target's lm_head(g))."""
        e = self.pre_fc_norm_embedding(tm.embed_tokens(next_tokens))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        t = x.shape[1]
        pos = torch.arange(t)[None]
        mrope = "Qwen3_5" in type(tm).__name__  # M-RoPE: three equal position streams for text
        pe = tm.rotary_emb(x, pos[None].expand(3, 1, t) if mrope else pos)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        return self.norm(self.layer(x, position_embeddings=pe, attention_mask=mask, position_ids=pos))

    def tensors(self) -> dict[str, np.ndarray]:
        """The `mtp.*` tensors as a checkpoint stores them (experts one Linear each)."""
        out = {}
        for name, p in self.state_dict().items():
            x = p.detach().numpy().copy()
            name = name.replace("layer.", "layers.0.", 1) if name.startswith("layer.") else name
            if name.endswith("experts.gate_up_proj"):  # [e, 2f, d] -> gate [f, d], up [f, d] per expert
                f, stem = x.shape[1] // 2, name.removesuffix("gate_up_proj")
                for j in range(x.shape[0]):
                    out[f"mtp.{stem}{j}.gate_proj.weight"] = x[j, :f]
                    out[f"mtp.{stem}{j}.up_proj.weight"] = x[j, f:]
            elif name.endswith("experts.down_proj"):  # [e, d, f] -> [d, f] per expert
                stem = name.removesuffix("down_proj")
                for j in range(x.shape[0]):
                    out[f"mtp.{stem}{j}.down_proj.weight"] = x[j]
            else:
                out[f"mtp.{name}"] = x
        return out


@torch.no_grad()
def _damp(module: torch.nn.Module, scale: float) -> None:
    for name, p in module.named_parameters():
        if name.endswith(_OUTPUTS):
            p.mul_(scale)


@torch.no_grad()
def agree(hf: torch.nn.Module, head: TorchMTP, damp: float) -> None:
    """Damp the target's sub-blocks; make the head read mostly the embedding of x_{t+1}
    and normalise with the target's final norm (see the module docstring)."""
    _damp(text_model(hf).layers, damp)
    _damp(head.layer, DAMP_HEAD)
    d = head.fc.weight.shape[0]
    head.fc.weight[:, :d] = torch.eye(d)
    head.fc.weight[:, d:] *= 0.1  # the hidden part still counts, a little
    head.pre_fc_norm_embedding.weight.zero_()  # zero-centred: scale 1
    head.norm.weight.copy_(text_model(hf).norm.weight)


def build_with_mtp(arch: str, out_dir: Path, *, seed: int = 0, damp: float | None = None
                   ) -> tuple[torch.nn.Module, TorchMTP]:
    """A tiny random `arch` (tests/model/hf_models.py) saved with an MTP head in `out_dir`;
    returns (the transformers model, the torch reference head), both eval f32."""
    make_config, cls = (hf_models.BUILDERS | hf_models.VARIANTS)[arch]
    cfg = make_config()
    text = getattr(cfg, "text_config", cfg)
    text.mtp_num_hidden_layers = 1
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = cls(cfg).eval()
    hf_models.randomize_(hf, seed=seed)
    head = TorchMTP(hf, torch.Generator().manual_seed(seed + 100)).eval()
    if damp is not None:
        agree(hf, head, damp)
    hf.save_pretrained(out_dir)
    file = out_dir / "model.safetensors"
    save_file(load_file(file) | head.tensors(), file, metadata={"format": "pt"})
    return hf, head
