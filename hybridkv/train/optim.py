"""Optimizers for training: Muon with DeepSeek-V4's hybrid Newton–Schulz, the Muon/AdamW parameter
split (one declarative table), and the learning-rate schedules.

Muon takes the hidden matrices (2-D, or 3-D stacks of experts [E, out, in], orthogonalised per
expert); AdamW takes embeddings, the head, norms, biases, sinks, compressor position embeddings and
the mHC static parameters. Update rule per matrix (Moonlight / V4):
    buf ← lerp(buf, g, 1 − μ);  u = lerp(g, buf, μ) (Nesterov) or buf
    O = NS(u) · update_rms · sqrt(max(rows, cols))      (so that RMS(O) ≈ update_rms)
    p ← p · (1 − lr · wd) − lr · O
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

NSSchedule = Sequence[tuple[float, float, float]]

QUINTIC = (3.4445, -4.7750, 2.0315)
# Eight steep quintic steps, then two steps of (2, −1.5, 0.5), which pin the singular values at 1.
V4_SCHEDULE: tuple[tuple[float, float, float], ...] = (QUINTIC,) * 8 + ((2.0, -1.5, 0.5),) * 2


def newton_schulz(G: torch.Tensor, schedule: NSSchedule, eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonalisation U·Vᵀ of a matrix [m, n] or a batch [B, m, n], one iteration
    X ← aX + (bA + cA²)X with A = XXᵀ per (a, b, c) in `schedule`. Each matrix is Frobenius-normalised
    first and handled as its wide orientation. Computes in bfloat16 on CUDA and float32 elsewhere;
    returns the compute dtype."""
    if G.ndim not in (2, 3):
        raise ValueError(f"newton_schulz takes a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    X = G.to(torch.bfloat16 if G.is_cuda else torch.float32)
    if X.ndim == 2:
        X = X.unsqueeze(0)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for a, b, c in schedule:
        A = X @ X.mT
        X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
    if tall:
        X = X.mT
    return X.reshape(G.shape)


class Muon(torch.optim.Optimizer):
    """Muon for matrices of two or more dims (the last two are [out, in]; leading dims are independent
    matrices, e.g. stacked experts). Parameters of one group with equal shape, dtype and device share one
    batched Newton–Schulz call. State: one momentum buffer per parameter."""

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.1, update_rms: float = 0.18, schedule: NSSchedule = V4_SCHEDULE,
                 eps: float = 1e-7):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0:
            raise ValueError(f"invalid Muon hyper-parameters lr={lr}, momentum={momentum}, wd={weight_decay}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        update_rms=update_rms, schedule=tuple(tuple(s) for s in schedule), eps=eps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim < 2:
                    raise ValueError(f"Muon takes matrices (ndim >= 2), got a parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            buckets: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                u = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                buckets[(tuple(p.shape), p.dtype, p.device)].append((p, u))
            for (shape, _, _), items in buckets.items():
                rows, cols = shape[-2:]
                stack = torch.stack([u for _, u in items]).reshape(-1, rows, cols)
                ortho = newton_schulz(stack, group["schedule"], group["eps"]).reshape(len(items), *shape)
                scale = group["update_rms"] * math.sqrt(max(rows, cols))
                for (p, _), o in zip(items, ortho.unbind(0)):
                    p.mul_(1 - lr * wd)
                    p.add_(o.to(p.dtype), alpha=-lr * scale)
        return loss


@dataclass(frozen=True)
class Rule:
    """One row of the parameter table: parameters whose name matches `match` (a regex, searched) or for
    which `match(name, param)` is true go to `optim` ("muon" or "adamw") with lr × `lr_mult` and weight
    decay `weight_decay` (None: the optimizer's default)."""

    label: str
    match: str | Callable[[str, torch.Tensor], bool]
    optim: str
    lr_mult: float = 1.0
    weight_decay: float | None = None

    def matches(self, name: str, p: torch.Tensor) -> bool:
        return bool(re.search(self.match, name)) if isinstance(self.match, str) else self.match(name, p)


# First matching rule wins.
PARAM_TABLE: tuple[Rule, ...] = (
    Rule("embed", r"(^|\.)embed\.weight$", "adamw"),
    Rule("head", r"(^|\.)head\.weight$", "adamw"),
    Rule("norm", r"norm[^.]*\.weight$", "adamw", weight_decay=0.0),
    Rule("bias", r"(^|\.)bias(_vl)?$", "adamw", weight_decay=0.0),
    Rule("attn_sink", r"(^|\.)attn_sink$", "adamw", weight_decay=0.0),
    Rule("ape", r"(^|\.)ape$", "adamw", weight_decay=0.0),
    Rule("mhc", r"(^|\.)hc_[^.]*$", "adamw", weight_decay=0.0),
    Rule("scalar", lambda name, p: p.ndim < 2, "adamw", weight_decay=0.0),
    Rule("matrix", lambda name, p: p.ndim >= 2, "muon"),
)


def _trainable(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    return ((n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point())


def param_groups(model: nn.Module, lr: float, table: Sequence[Rule] = PARAM_TABLE,
                 adamw_lr: float | None = None) -> tuple[list[dict], list[dict]]:
    """Split the trainable float parameters into (muon_groups, adamw_groups), one group per table rule
    that matches something. Each group carries `names`, `rule`, `optim`, `lr_mult` and `peak_lr` = `lr`
    (the base lr of its optimizer, `adamw_lr` defaulting to `lr`, × lr_mult), so a loop can set
    `group["lr"] = group["peak_lr"] * factor`. Raises if a parameter matches no rule."""
    bases = {"muon": lr, "adamw": lr if adamw_lr is None else adamw_lr}
    by_rule: dict[int, dict] = {}
    for name, p in _trainable(model):
        i = next((i for i, rule in enumerate(table) if rule.matches(name, p)), None)
        if i is None:
            raise ValueError(f"parameter {name!r} {tuple(p.shape)} matches no rule of the parameter table")
        rule = table[i]
        if rule.optim not in bases:
            raise ValueError(f"rule {rule.label!r}: unknown optimizer {rule.optim!r} (muon or adamw)")
        if i not in by_rule:
            peak = bases[rule.optim] * rule.lr_mult
            by_rule[i] = dict(params=[], names=[], rule=rule.label, optim=rule.optim, lr_mult=rule.lr_mult,
                              peak_lr=peak, lr=peak)
            if rule.weight_decay is not None:
                by_rule[i]["weight_decay"] = rule.weight_decay
        by_rule[i]["params"].append(p)
        by_rule[i]["names"].append(name)
    groups = [by_rule[i] for i in sorted(by_rule)]
    return [g for g in groups if g["optim"] == "muon"], [g for g in groups if g["optim"] == "adamw"]


def build_optimizers(model: nn.Module, lr: float, adamw_lr: float | None = None,
                     betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1,
                     table: Sequence[Rule] = PARAM_TABLE) -> list[torch.optim.Optimizer]:
    """[Muon, AdamW] over the table's split (an optimizer with no parameters is left out)."""
    muon_groups, adamw_groups = param_groups(model, lr, table, adamw_lr)
    optimizers: list[torch.optim.Optimizer] = []
    if muon_groups:
        optimizers.append(Muon(muon_groups, lr=lr, weight_decay=weight_decay))
    if adamw_groups:
        optimizers.append(torch.optim.AdamW(adamw_groups, lr=lr if adamw_lr is None else adamw_lr, betas=betas,
                                            weight_decay=weight_decay))
    return optimizers


def describe_groups(muon_groups: Sequence[dict], adamw_groups: Sequence[dict]) -> str:
    """One line per parameter: name, optimizer, rule, lr multiplier, weight decay (- = default)."""
    rows = [(name, g["optim"], g["rule"], g["lr_mult"], g.get("weight_decay", "-"))
            for g in (*muon_groups, *adamw_groups) for name in g["names"]]
    width = max((len(r[0]) for r in rows), default=0)
    return "\n".join(f"{n:<{width}}  {o:<5}  {rule:<9}  lr x{m:g}  wd {wd}" for n, o, rule, m, wd in rows)


def lr_schedule(step: int, total: int, warmup: int, peak: float, final_frac: float = 0.1, kind: str = "wsd",
                decay_frac: float = 0.2) -> float:
    """Learning rate at `step` (0-based) of `total`: linear warmup to `peak` over `warmup` steps, then
    "wsd" (flat, then linear decay to peak·final_frac over the last `decay_frac` of training) or
    "cosine" (cosine decay to peak·final_frac at step `total`)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    final = peak * final_frac
    if kind == "wsd":
        decay = max(1, round(total * decay_frac))
        t = min(1.0, max(0.0, (step - (total - decay)) / decay))
        return peak - (peak - final) * t
    if kind == "cosine":
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return final + (peak - final) * 0.5 * (1 + math.cos(math.pi * t))
    raise ValueError(f"unknown lr schedule {kind!r} (wsd or cosine)")
