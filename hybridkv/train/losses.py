"""Training losses and the MoE balance mechanism.

- LM loss: next-token cross entropy over every token, plus an answer loss over the supervised
  tokens (the task completions) that the recipe weights up, and their teacher-forced exact match;
- answer-end loss: the completion's closing tokens (the period after the value, then EOS) once more,
  for a model that copies a value but does not stop after it; their teacher-forced accuracy is
  logged whatever the weight;
- MTP loss: the MTP block at row t predicts token t + 2 (a chained pass of it, t + 3);
- indexer KL: the DSA signal, mean over the CSA layers' terms the forward left;
- aux-loss-free balance: after each step every non-hash gate's selection bias moves by ±rate
  towards the mean load (DeepSeek-V3/V4); hash layers have no bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridkv.train.forward import TrainOutput


@dataclass
class LossWeights:
    answer: float = 1.0      # extra weight of the supervised (answer) tokens' loss
    answer_end: float = 0.0  # extra weight of the completion's closing tokens (period, EOS)
    mtp: float = 0.3
    indexer_kl: float = 1.0


CLOSING_TOKENS = 2   # every completion ends with "." and EOS (`training_example`)


def closing_targets(supervised: torch.Tensor) -> torch.Tensor:
    """[B, S] -> [B, S]: the last `CLOSING_TOKENS` supervised tokens of each row."""
    from_end = supervised.flip(-1).cumsum(-1).flip(-1)
    return supervised & (from_end <= CLOSING_TOKENS)


def _ce_rows(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, reduction="none")


def compute_losses(model, ids: torch.Tensor, supervised: torch.Tensor, out: TrainOutput,
                   weights: LossWeights) -> tuple[torch.Tensor, dict[str, float]]:
    """ids, supervised [B, S]; supervised[b, t] marks token t as part of an answer. Returns the total
    loss and the scalars to log."""
    b, s = ids.shape
    logits = model.logits(out.stream).view(b, s, -1)
    ce = _ce_rows(logits[:, :-1].reshape(b * (s - 1), -1), ids[:, 1:].reshape(-1)).view(b, s - 1)
    sup = supervised[:, 1:].float()
    lm = ce.mean()
    n_sup = sup.sum().clamp(min=1)
    answer = (ce * sup).sum() / n_sup
    closing = closing_targets(supervised)[:, 1:].float()
    n_closing = closing.sum().clamp(min=1)
    end = (ce * closing).sum() / n_closing
    total = lm + weights.answer * answer + weights.answer_end * end
    with torch.no_grad():
        right = logits[:, :-1].argmax(-1) == ids[:, 1:]
        hit = right | ~supervised[:, 1:]
        has = supervised[:, 1:].any(-1)
        exact = (hit.all(-1) & has).sum() / has.sum().clamp(min=1)
        end_acc = (right.float() * closing).sum() / n_closing
    logs = {"lm": float(lm.detach()), "answer": float(answer.detach()), "answer_exact": float(exact),
            "answer_end": float(end.detach()), "answer_end_acc": float(end_acc)}
    for depth, h in enumerate(out.mtp_streams):
        ahead = 2 + depth
        if s <= ahead:
            continue
        # a chained pass (`mtp_chain`) reads the last block's head, as the engine's chain does
        mlog = model.mtp_logits(h, min(depth, len(model.mtp) - 1)).view(b, s, -1)[:, :-ahead]
        mtp = _ce_rows(mlog.reshape(-1, mlog.shape[-1]), ids[:, ahead:].reshape(-1)).mean()
        total = total + weights.mtp * mtp
        logs[f"mtp{depth}"] = float(mtp.detach())
    if out.aux.indexer_kl:
        kl = torch.stack(list(out.aux.indexer_kl.values())).mean()
        total = total + weights.indexer_kl * kl
        logs["indexer_kl"] = float(kl.detach())
    logs["loss"] = float(total.detach())
    return total, logs


@torch.no_grad()
def update_gate_biases(model, counts: dict[int, torch.Tensor], rate: float,
                       layers: list | None = None) -> dict[str, float]:
    """bias_e += rate · sign(mean load − load_e) on every biased gate (of `layers`, default every
    layer and MTP block); returns load statistics (max/mean expert load, averaged over them) for the
    log."""
    layers = list(model.layers) + list(model.mtp) if layers is None else layers
    imbalance = []
    for layer in layers:
        c = counts.get(layer.layer_id)
        if c is None:
            continue
        load = c.float()
        imbalance.append(float(load.max() / load.mean().clamp(min=1e-9)))
        bias = layer.ffn.gate.bias
        if bias is not None:
            bias.add_(rate * torch.sign(load.mean() - load))
    return {"expert_max_over_mean": sum(imbalance) / max(1, len(imbalance))}
