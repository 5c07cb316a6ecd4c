"""FlashMemory's memory indexer: a wider Lightning-Indexer-style scorer that predicts which chunks
(CSA entries) the next recall window of decoding will need, from one query position.

Per target CSA layer L, from that layer's attention input x and the query's position:

    q = Hadamard(RoPE(wq_b(RMSNorm(wq_a(x)))))      [heads, d]   (RoPE on the last dims, as native)
    w = weights_proj(x) · d^-1/2 · heads^-1/2          [heads]
    logit(chunk j) = Σ_h w_h · ReLU(q_h · k_j) + bias   k_j: layer L's native indexer key, as cached

and the probability is sigmoid(logit); several target layers are combined by their max (any layer
above 0.5 keeps a chunk). The keys are not learned: they are the native indexer's keys, which the
serving cache holds anyway. Warm start (`from_native`): the first `q_lora_rank` ranks and the
first `index_n_heads` heads copy the layer's attention `wq_a`/`q_norm` and indexer `wq_b`/
`weights_proj`, the other heads' weights start at zero, so the initial logits are the native
indexer's (up to the RMSNorm's wider rank, rescaled) plus the bias. The scalar bias calibrates the
0.5 threshold (FlashMemory shifted its logits by hand).

File: `memory_indexer.safetensors` beside the model, tensors `L.<layer>.<name>` and metadata
`format` "hybridkv-memory-indexer/1", `config` (JSON of `MemoryIndexerConfig`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from hybridkv.errors import ConfigError
from hybridkv.ops.hadamard import hadamard_transform
from hybridkv.ops.rope import apply_rope, rope_freqs

FORMAT = "hybridkv-memory-indexer/1"
FILENAME = "memory_indexer.safetensors"


@dataclass
class MemoryIndexerConfig:
    layers: list[int]              # target CSA layers (transformer layer ids)
    dim: int                       # the model's hidden size
    rank: int                      # query low rank (native: q_lora_rank)
    heads: int                     # native: index_n_heads
    head_dim: int                  # = the native indexer keys' width
    rope_dim: int                  # RoPE'd trailing dims of each head
    native_rank: int
    native_heads: int
    eps: float = 1e-6
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.layers:
            raise ConfigError("a memory indexer needs at least one target layer")
        if self.rank < self.native_rank or self.heads < self.native_heads:
            raise ConfigError(f"memory indexer rank {self.rank} / heads {self.heads} below the native "
                              f"indexer's {self.native_rank} / {self.native_heads}: it starts from it")


class LayerScorer(nn.Module):
    def __init__(self, c: MemoryIndexerConfig):
        super().__init__()
        self.c = c
        self.wq_a = nn.Linear(c.dim, c.rank, bias=False)
        self.q_norm = nn.Parameter(torch.ones(c.rank))
        self.wq_b = nn.Linear(c.rank, c.heads * c.head_dim, bias=False)
        self.weights_proj = nn.Linear(c.dim, c.heads, bias=False)
        self.bias = nn.Parameter(torch.zeros(()))
        self.scale = c.head_dim ** -0.5 * c.heads ** -0.5

    def queries(self, x: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim], freqs [T, rope/2] -> q [T, heads, d], w [T, heads] (float32)."""
        a = self.wq_a(x.float())
        a = a * torch.rsqrt(a.square().mean(-1, keepdim=True) + self.c.eps) * self.q_norm
        q = self.wq_b(a).unflatten(-1, (self.c.heads, self.c.head_dim))
        q = hadamard_transform(apply_rope(q, freqs))
        return q, self.weights_proj(x.float()) * self.scale

    def logits(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [T, H, d], w [T, H], keys [N, d] -> [T, N]."""
        s = torch.einsum("thd,nd->thn", q, keys.float()).relu()
        return (s * w.unsqueeze(-1)).sum(1) + self.bias


class MemoryIndexer(nn.Module):
    def __init__(self, config: MemoryIndexerConfig, inv_freq: torch.Tensor):
        super().__init__()
        self.config = config
        self.scorers = nn.ModuleDict({str(layer): LayerScorer(config) for layer in config.layers})
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)

    def layer_logits(self, layer: int, x: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """One target layer's logits [T, N] for queries x [T, dim] at `positions` over keys [N, d]."""
        sc = self.scorers[str(layer)]
        q, w = sc.queries(x, rope_freqs(positions.to(self.inv_freq.device), self.inv_freq))
        return sc.logits(q, w, keys)

    def probabilities(self, xs: dict[int, torch.Tensor], positions: torch.Tensor,
                      keys: dict[int, torch.Tensor]) -> torch.Tensor:
        """The serving score: max over target layers of sigmoid(logits), [T, N]."""
        return torch.stack([self.layer_logits(layer, xs[layer], positions, keys[layer]).sigmoid()
                            for layer in self.config.layers]).amax(0)

    def paged_probabilities(self, xs: dict[int, torch.Tensor], positions: torch.Tensor, batch,
                            pools: dict[int, torch.Tensor], ratio: int, fmt: str, max_visible: int) -> torch.Tensor:
        """The serving score of one query row per request of a paged batch, over the keys where the
        store holds them (`pools[layer]`, in `fmt`; `hybridkv.ops.indexer_topk.paged_scores`: one
        launch per target layer for every request on CUDA): [R, max_visible], 0 beyond a request's
        visible chunks. xs[layer] [R, dim], positions [R]."""
        from hybridkv.ops.indexer_topk import paged_scores
        out = None
        freqs = rope_freqs(positions.to(self.inv_freq.device), self.inv_freq)
        for layer in self.config.layers:
            sc = self.scorers[str(layer)]
            q, w = sc.queries(xs[layer], freqs)
            p = (paged_scores(q, w, batch, pools[layer], ratio, fmt, self.config.head_dim, max_visible)
                 + sc.bias).sigmoid()                       # −inf beyond the visible chunks: 0
            out = p if out is None else torch.maximum(out, p)
        return out

    # ----- building, saving, loading -----

    @classmethod
    def from_native(cls, model, layers: list[int] | None = None, heads: int | None = None, rank: int | None = None,
                    seed: int = 0) -> "MemoryIndexer":
        """Warm-started from a V4 model's (float) native indexers at `layers` (default: every CSA
        layer), with `heads` (default 2× native) and `rank` (default 2× the q rank)."""
        cfg = model.config
        csa = [i for i, block in enumerate(model.layers) if getattr(block.attn, "indexer", None) is not None]
        layers = sorted(layers if layers is not None else csa)
        bad = [layer for layer in layers if layer not in csa]
        if bad:
            raise ConfigError(f"memory indexer layers {bad} are not CSA layers with an indexer (those are {csa})")
        c = MemoryIndexerConfig(layers, cfg.hidden_size, rank or 2 * cfg.q_lora_rank, heads or 2 * cfg.index_n_heads,
                                cfg.index_head_dim, cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.index_n_heads,
                                eps=model.layers[layers[0]].attn.q_norm.eps)
        mi = cls(c, model.layers[layers[0]].attn.inv_freq)
        gen = torch.Generator().manual_seed(seed)
        r, h, d = c.native_rank, c.native_heads, c.head_dim
        with torch.no_grad():
            for layer in layers:
                attn, sc = model.layers[layer].attn, mi.scorers[str(layer)]
                ind = attn.indexer
                wq_a = attn.wq_a.dense_weight().float()
                sc.wq_a.weight.normal_(0.0, float(wq_a.std()), generator=gen)
                sc.wq_a.weight[:r] = wq_a
                # the RMSNorm spans `rank` dims: with the new dims small (a tenth of the native ones'
                # spread), the native dims keep their native normalisation when their weights are
                # scaled by sqrt(native_rank / rank)
                sc.wq_a.weight[r:] *= 0.1
                sc.q_norm.fill_(1.0)
                sc.q_norm[:r] = attn.q_norm.weight.float() * (r / c.rank) ** 0.5
                wq_b = ind.wq_b.dense_weight().float().view(h, d, r)
                full = torch.zeros(c.heads, d, c.rank)
                full.normal_(0.0, float(wq_b.std()), generator=gen)
                full[:h, :, :r] = wq_b
                full[:h, :, r:] = 0.0
                sc.wq_b.weight.copy_(full.view(c.heads * d, c.rank))
                wp = torch.zeros(c.heads, c.dim)
                # native head weights are scaled by its own d^-1/2 h^-1/2; keep its scores unchanged
                wp[:h] = ind.weights_proj.dense_weight().float() * (ind.weight_scale / sc.scale)
                sc.weights_proj.weight.copy_(wp)
        return mi

    @classmethod
    def random(cls, config, layers: list[int] | None = None, seed: int = 0) -> "MemoryIndexer":
        """An untrained memory indexer of `from_native`'s default shape for a V4 checkpoint's
        `config` (no weights read): its scores are arbitrary, so `flashmemory-B` recalls B of the
        blocks whatever it finds. For measuring what recall costs (benchmarks/flashmemory.py)."""
        from hybridkv.model.attention import layer_inv_freq

        csa = [i for i in range(config.num_hidden_layers) if config.layer_kind(i) == "csa"]
        layers = sorted(layers if layers is not None else csa)
        if not layers or not set(layers) <= set(csa):
            raise ConfigError(f"memory indexer layers {layers} are not CSA layers (those are {csa})")
        c = MemoryIndexerConfig(layers, config.hidden_size, 2 * config.q_lora_rank, 2 * config.index_n_heads,
                                config.index_head_dim, config.qk_rope_head_dim, config.q_lora_rank,
                                config.index_n_heads, eps=config.rms_norm_eps)
        with torch.random.fork_rng(devices=[]):     # nn.Linear's init draws from the global generator
            torch.manual_seed(seed)
            return cls(c, layer_inv_freq(config, config.compress_ratios[layers[0]]))

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        tensors = {f"L.{k}.{name}": p.detach().float().contiguous().cpu()
                   for k, sc in self.scorers.items() for name, p in sc.named_parameters()}
        tensors["inv_freq"] = self.inv_freq.cpu()
        path = Path(path)
        if path.is_dir():
            path = path / FILENAME
        save_file(tensors, str(path), metadata={"format": FORMAT, "config": json.dumps(asdict(self.config))})
        return path

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> "MemoryIndexer":
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if path.is_dir():
            path = path / FILENAME
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise ConfigError(f"{path}: not a memory indexer of format {FORMAT} (format {meta.get('format')!r})")
                config = MemoryIndexerConfig(**json.loads(meta["config"]))
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{path}: cannot read a memory indexer: {type(e).__name__}: {e}") from None
        mi = cls(config, tensors.pop("inv_freq"))
        missing = mi.load_state_dict({k.replace("L.", "scorers.", 1): v for k, v in tensors.items()}, strict=False)
        if missing.missing_keys or missing.unexpected_keys:
            raise ConfigError(f"{path}: memory indexer tensors do not match its config "
                              f"(missing {missing.missing_keys[:3]}, unexpected {missing.unexpected_keys[:3]})")
        return mi.to(device)
