"""Memory-indexer labels from the model itself (FlashMemory's golden chunks), and their file.

A sequence runs through the model as it is served (the training forward with the indexer's top-k
and its FP4 QK round trip). At each position t, in each V4 CSA layer, the layer's native indexer
scores the entries (chunks) visible at t, `(t + 1) // ratio` of them; of its top-k (the model's
`index_topk`) the softmax over those k alone is taken, and the layer picks the highest-scoring of
them until their probability reaches `top_p` (0.6; the entry that crosses it is picked too, so
a layer always picks one when any chunk is visible). A chunk's vote at t is the number of CSA
layers that pick it there. Only visible chunks are candidates: a chunk completed after t is never
a label of t (FlashMemory's released data lets later chunks in).

What training reads (`window_targets`): the chunks with at least `vote` votes at any position of
t .. t + window − 1 (FlashMemory's 64-token window, one recall cycle), limited to the chunks
visible at t, because t is where the recall for that window is decided.

File (`save_labels`, `load_labels`; safetensors, `format` "hybridkv-memory-labels/1"):
    input_ids           [S] int32     the sequence (position 0 first)
    label_pointers      [S + 1] int64 CSR over positions: row t is label_indices[p[t]:p[t+1]]
    label_indices       [nnz] int32   chunk ids with at least one vote at t, ascending
    label_votes         [nnz] uint8   their votes (1 .. number of CSA layers)
    x.L                 [S, dim] bf16 CSA layer L's attention input (what a memory indexer reads)
    keys.L              [n, d] bf16   layer L's native indexer keys as cached: rotated, Hadamard'd,
                                      FP4 values with their scales, so exact in bf16
metadata (strings): format, layers ("1,3,5"), ratio, topk, top_p, model (the model directory's
name), source (what generated the sequence).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridkv.errors import TrainingError
from hybridkv.ops.indexer_topk.reference import index_scores

FORMAT = "hybridkv-memory-labels/1"
TOP_P = 0.6
WINDOW = 64


@dataclass
class DocumentLabels:
    input_ids: torch.Tensor          # [S]
    pointers: torch.Tensor           # [S + 1]
    indices: torch.Tensor            # [nnz]
    votes: torch.Tensor              # [nnz]
    x: dict[int, torch.Tensor]       # CSA layer -> [S, dim]
    keys: dict[int, torch.Tensor]    # CSA layer -> [n, d]
    ratio: int
    topk: int
    top_p: float
    meta: dict

    @property
    def layers(self) -> list[int]:
        return sorted(self.keys)

    def visible(self, t: int) -> int:
        return (t + 1) // self.ratio

    def row(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ids with a vote at t and their votes."""
        a, b = int(self.pointers[t]), int(self.pointers[t + 1])
        return self.indices[a:b], self.votes[a:b]


def layer_picks(scores: torch.Tensor, visible: torch.Tensor, topk: int, top_p: float = TOP_P) -> torch.Tensor:
    """scores [T, N] of one layer, visible [T] -> bool [T, N]: the chunks that layer picks at each
    query (top-k of the visible chunks, softmax over those k, the top-p prefix with its crossing
    entry). A query that sees no chunk picks none."""
    t, n = scores.shape
    picks = torch.zeros(t, n + 1, dtype=torch.bool, device=scores.device)   # column n: a dump
    k = min(topk, n)
    if k == 0:
        return picks[:, :n]
    cols = torch.arange(n, device=scores.device)
    masked = scores.float().masked_fill(cols.view(1, -1) >= visible.view(-1, 1), float("-inf"))
    val, idx = masked.topk(k, dim=-1)                                        # sorted, best first
    live = torch.isfinite(val)
    p = val.softmax(-1).nan_to_num(0.0)                                      # a row with none live: 0
    before = p.cumsum(-1) - p                                                # mass of the better ones
    keep = live & (before < top_p)
    picks.scatter_(1, torch.where(keep, idx, n), True)
    return picks[:, :n]


def votes_from_capture(captured: dict[int, dict[str, torch.Tensor]], ratio: int, topk: int,
                       top_p: float = TOP_P, tile: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training forward's `Aux.captured` (batch 1) -> CSR (pointers, indices, votes) of every
    position's chunks with at least one vote."""
    layers = sorted(captured)
    s = captured[layers[0]]["q"].shape[0]
    n = captured[layers[0]]["keys"].shape[1]
    pointers, indices, votes = [torch.zeros(1, dtype=torch.long)], [], []
    for t0 in range(0, s, tile):
        t1 = min(s, t0 + tile)
        device = captured[layers[0]]["q"].device
        visible = (torch.arange(t0, t1, device=device) + 1) // ratio
        count = torch.zeros(t1 - t0, n, dtype=torch.uint8, device=device)
        for layer in layers:
            c = captured[layer]
            scores = index_scores(c["q"][t0:t1], c["w"][t0:t1], c["keys"][0])
            count += layer_picks(scores, visible, topk, top_p).to(torch.uint8)
        count = count.cpu()
        rows, cols = torch.nonzero(count, as_tuple=True)                     # row-major: ascending
        indices.append(cols.to(torch.int32))
        votes.append(count[rows, cols])
        pointers.append(pointers[-1][-1] + torch.bincount(rows, minlength=t1 - t0).cumsum(0))
    return torch.cat(pointers), torch.cat(indices), torch.cat(votes)


@torch.no_grad()
def label_sequence(model, ids: list[int] | torch.Tensor, top_p: float = TOP_P, meta: dict | None = None) -> DocumentLabels:
    """Run `ids` through `model` (a float V4 model, `train.export.float_model`) as served and label
    every position."""
    from hybridkv.train.forward import TrainOptions, train_forward

    cfg = model.config
    if cfg.family != "v4":
        raise TrainingError(f"memory-indexer labels need a V4 model (CSA layers with their own indexer), "
                            f"not {cfg.family}")
    ids = torch.as_tensor(ids, dtype=torch.long).view(1, -1)
    device = next(model.parameters()).device
    out = train_forward(model, ids.to(device), TrainOptions(dense_indexer=False, qat_indexer=True, kl_queries=1,
                                                            capture_indexer=True))
    captured = out.aux.captured
    if not captured:
        raise TrainingError("the model has no CSA layer with an indexer: nothing to label")
    ratios = {model.layers[i].attn.ratio for i in captured}
    if len(ratios) != 1:
        raise TrainingError(f"CSA layers with different ratios {sorted(ratios)}")
    ratio = ratios.pop()
    pointers, indices, votes = votes_from_capture(captured, ratio, cfg.index_topk, top_p)
    return DocumentLabels(ids[0].cpu(), pointers, indices, votes,
                          {i: c["x"].to(torch.bfloat16).cpu() for i, c in captured.items()},
                          {i: c["keys"][0].to(torch.bfloat16).cpu() for i, c in captured.items()},
                          ratio, cfg.index_topk, top_p, dict(meta or {}))


def window_targets(labels: DocumentLabels, t: int, vote: int, window: int = WINDOW) -> torch.Tensor:
    """Chunk ids (ascending) with ≥ `vote` votes at any position of t .. t + window − 1 that are
    visible at t."""
    end = min(t + window, labels.input_ids.numel())
    a, b = int(labels.pointers[t]), int(labels.pointers[end])
    ids = labels.indices[a:b][labels.votes[a:b] >= vote].long()
    ids = ids[ids < labels.visible(t)]
    return torch.unique(ids)


def save_labels(labels: DocumentLabels, path: str | Path) -> Path:
    from safetensors.torch import save_file

    tensors = {"input_ids": labels.input_ids.to(torch.int32), "label_pointers": labels.pointers.to(torch.int64),
               "label_indices": labels.indices.to(torch.int32), "label_votes": labels.votes.to(torch.uint8)}
    for layer in labels.layers:
        tensors[f"x.{layer}"] = labels.x[layer].contiguous()
        tensors[f"keys.{layer}"] = labels.keys[layer].contiguous()
    meta = {"format": FORMAT, "layers": ",".join(map(str, labels.layers)), "ratio": str(labels.ratio),
            "topk": str(labels.topk), "top_p": repr(labels.top_p), **{k: str(v) for k, v in labels.meta.items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    return path


def _read(path: Path, tensors: bool) -> tuple[dict, dict]:
    """(metadata, tensors: all of them with `tensors`, else none) of a label file, its format checked;
    what cannot be read is a TrainingError naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = dict(f.metadata() or {})
            if meta.get("format") != FORMAT or "top_p" not in meta:
                raise TrainingError(f"{path}: not a memory-label file of format {FORMAT} "
                                    f"(format {meta.get('format')!r})")
            return meta, ({k: f.get_tensor(k) for k in f.keys()} if tensors else {})
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        if isinstance(e, TrainingError):
            raise
        raise TrainingError(f"{path}: cannot read memory labels: {type(e).__name__}: {e}") from None


def labels_top_p(path: str | Path) -> float:
    """The top-p a label file was made with, from its metadata alone (its tensors are not read)."""
    return float(_read(Path(path), tensors=False)[0]["top_p"])


def load_labels(path: str | Path) -> DocumentLabels:
    path = Path(path)
    meta, t = _read(path, tensors=True)
    try:
        layers = [int(x) for x in meta["layers"].split(",")]
    except (KeyError, ValueError) as e:
        raise TrainingError(f"{path}: cannot read memory labels: {type(e).__name__}: {e}") from None
    s = t["input_ids"].numel()
    p = t["label_pointers"]
    nnz = t["label_indices"].numel()
    if p.numel() != s + 1 or int(p[-1]) != nnz or t["label_votes"].numel() != nnz:
        raise TrainingError(f"{path}: label CSR does not match its {s} positions")
    extra = {k: v for k, v in meta.items() if k not in ("format", "layers", "ratio", "topk", "top_p")}
    return DocumentLabels(t["input_ids"].long(), p, t["label_indices"], t["label_votes"],
                          {i: t[f"x.{i}"] for i in layers}, {i: t[f"keys.{i}"] for i in layers},
                          int(meta["ratio"]), int(meta["topk"]), float(meta["top_p"]), extra)


def describe(labels: DocumentLabels, vote: int, window: int = WINDOW) -> dict:
    """Positives per position (window targets) and the share of visible chunks they are."""
    s = labels.input_ids.numel()
    pos, share = [], []
    for t in range(0, s, max(1, s // 256)):
        v = labels.visible(t)
        if v:
            n = window_targets(labels, t, vote, window).numel()
            pos.append(n)
            share.append(n / v)
    return {"positions": s, "chunks": int(labels.keys[labels.layers[0]].shape[0]),
            "mean_positives": sum(pos) / max(1, len(pos)), "mean_share": sum(share) / max(1, len(share)),
            "votes": json.dumps({int(k): int(c) for k, c in zip(*torch.unique(labels.votes, return_counts=True))})}
