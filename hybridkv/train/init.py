"""Initial weights for training a V4-architecture model from scratch (the release format has no
init: checkpoints are loaded). Small normal matrices, unit norms, zero sinks and position biases,
mHC mixes that start close to the identity, and a random token → experts table for hash layers."""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridkv.model.linear import Linear


def _hc_base(base: torch.Tensor, hc: int, with_comb: bool) -> None:
    """pre ≈ 1/hc (σ(logit(1/hc))), post = 1 (2σ(0)), comb ≈ identity (diagonal logits +4)."""
    base.zero_()
    base[:hc] = math.log(1 / (hc - 1)) if hc > 1 else 0.0
    if with_comb:
        base[2 * hc:] = (torch.eye(hc) * 4.0).flatten()


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    cfg = model.config
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out_scale = 1 / math.sqrt(2 * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers))

    def normal_(t: torch.Tensor, s: float) -> None:
        t.copy_(torch.randn(t.shape, generator=gen) * s)

    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.fmt == "float":
            residual_out = name.endswith(("attn.wo_b", ".w2"))
            normal_(mod.weight, std * (out_scale if residual_out else 1.0))
        elif isinstance(mod, (nn.Embedding, nn.Linear)):
            normal_(mod.weight, std)
    hc = cfg.hc_mult
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "weight" and "norm" in name.rsplit(".", 2)[-2]:
            p.fill_(1.0)
        elif leaf in ("attn_sink", "ape", "bias"):
            p.zero_()
        elif leaf.endswith("_fn") and leaf.startswith("hc_"):
            normal_(p, std)
        elif leaf.endswith("_scale") and leaf.startswith("hc_"):
            p.fill_(1.0)
        elif leaf.endswith("_base") and leaf.startswith("hc_"):
            _hc_base(p, hc, with_comb=not leaf.startswith("hc_head"))
        elif leaf == "weight" and name.endswith("gate.weight"):
            normal_(p, std)
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            e = cfg.n_routed_experts
            buf.copy_(torch.rand(buf.shape[0], e, generator=gen).argsort(-1)[:, : buf.shape[1]].to(buf.dtype))
