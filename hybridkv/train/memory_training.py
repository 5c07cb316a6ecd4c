"""Training and validating a memory indexer on labels from its model (`hybridkv train-memory-indexer`).

Data: long documents from the task generators (the needle families over generated filler and over
the training half of the real prose; seeds far from the evaluation's), each followed by its
reference completion (what the model decodes when it is right), labelled by `memory_labels.label_sequence`
and cached as label files. Documents are split into a training and a validation part.

A training sample is one (document, query position t) with at least one window target: the
positives are the window targets of t (chunks with ≥ `vote` votes in t .. t + `window` − 1, 64 by
default as the recall interval, that exist at t), at most 512; the negatives are 3× as many chunks
drawn uniformly from the other visible chunks,
plus as many hard negatives (the highest-scoring other chunks under the current weights). Loss:
binary cross-entropy on every target layer's logits. Query positions: every `stride`-th one and
the document's last 128 (where the question and the answer are).

Validation, on held-out documents at every `stride`-th position: micro F1 of (prob > 0.5) against
the window targets (max over target layers), and recall under the serving policy
(`hybridkv.memory.policies.FlashMemory`): the share of window targets in the blocks a recall would make resident,
next to the resident share of the visible chunks. Each position is scored from its own row, as the
decode-time recalls are; the engine's first recall, at the prefill's end, averages the prompt's last
32 rows (`FlashMemory.query_rows`), which the label files (no prompt length) cannot place. The same policy is scored with the native indexer's
own logits (probability = sigmoid of the logit; a reference, uncalibrated), with recency at the
same budget, and with the labels themselves (the oracle).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridkv.errors import TrainingError
from hybridkv.memory.indexer import MemoryIndexer
from hybridkv.memory.policies import FlashMemory, complete_blocks_kept
from hybridkv.train.memory_labels import (TOP_P, WINDOW, DocumentLabels, label_sequence, labels_top_p, load_labels,
                                          save_labels, window_targets)

DOC_TASKS = ("passkey", "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue",
             "niah_multiquery", "passkey_realtext", "niah_single_1_realtext", "niah_multikey_1_realtext")
DOC_SEED = 9_000_000          # evaluation prompts use seeds below 10^8 of the form seed·10^5 + i; the pools differ too
POOL_SEED = 77


@dataclass
class MemoryTrainConfig:
    docs: int = 48
    val_docs: int = 8
    lengths: tuple[int, ...] = (8192,)   # document i has lengths[i % len(lengths)] prompt tokens
    vote: int = 2
    top_p: float = TOP_P              # a layer picks the top-p of its top-k softmax (labels are made with it)
    window: int = WINDOW              # positives: picked at any of the next `window` positions
    stride: int = 16
    steps: int = 600
    batch_positions: int = 64
    lr: float = 1e-3
    neg_ratio: int = 3
    max_positives: int = 512
    block_chunks: int = 32            # chunks per KV block (128 tokens / ratio 4): the recall unit
    budget: float = 0.15              # the policy's resident share of the complete blocks (`flashmemory-B`)
    seed: int = 0
    extra: dict = field(default_factory=dict)


def document_length(cfg: MemoryTrainConfig, i: int) -> int:
    """Prompt tokens of document i: the lengths take turns, so training and validation both hold each."""
    return cfg.lengths[i % len(cfg.lengths)]


class Documents:
    """The documents, deterministic in their index: document i is task DOC_TASKS[i % len] with seed
    DOC_SEED + i at `length` prompt tokens, followed by its reference completion."""

    def __init__(self, model_dir: str | Path):
        from hybridkv.tasks.generators import Pools
        from hybridkv.tasks.tokenizer import TaskTokenizer

        self.pools = Pools(TaskTokenizer.load(model_dir), seed=POOL_SEED, prose_split="train")

    def get(self, i: int, length: int) -> tuple[str, list[int]]:
        from hybridkv.tasks.generators import make_sample

        task = DOC_TASKS[i % len(DOC_TASKS)]
        s = make_sample(task, DOC_SEED + i, self.pools, length)
        return task, s.prompt + s.completion


def build_labels(model, model_dir: str | Path, out_dir: Path, cfg: MemoryTrainConfig, echo=print,
                 indices: range | None = None) -> list[Path]:
    """Label files for the training and validation documents (or the documents `indices`), reusing
    those already in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    docs, paths = None, []
    total = cfg.docs + cfg.val_docs
    for i in (range(total) if indices is None else indices):
        length = document_length(cfg, i)
        path = out_dir / f"doc{i:05d}-{length}.safetensors"
        paths.append(path)
        if path.exists():
            made = labels_top_p(path)
            if made != cfg.top_p:
                raise TrainingError(f"{path} holds labels made with top-p {made}, not {cfg.top_p}: "
                                    f"give --labels another directory")
            continue
        docs = docs or Documents(model_dir)
        task, ids = docs.get(i, length)
        t0 = time.perf_counter()
        save_labels(label_sequence(model, ids, cfg.top_p,
                                   meta={"model": Path(model_dir).name, "source": f"{task} seed {DOC_SEED + i}"}),
                    path)
        echo(f"labelled document {i + 1}/{total} ({task}, {len(ids)} tokens) in {time.perf_counter() - t0:.1f}s")
    return paths


def query_positions(labels: DocumentLabels, stride: int, tail: int = 128) -> list[int]:
    s = labels.input_ids.numel()
    pos = set(range(stride - 1, s, stride)) | set(range(max(0, s - tail), s))
    return sorted(t for t in pos if labels.visible(t) > 0)


class _Docs:
    def __init__(self, paths: list[Path], device):
        self.labels = [load_labels(p) for p in paths]
        self.device = device
        self._keys = [{layer: d.keys[layer].to(device).float() for layer in d.layers} for d in self.labels]

    def keys(self, i: int) -> dict[int, torch.Tensor]:
        return self._keys[i]


def _loss_for(mi: MemoryIndexer, d: DocumentLabels, keys: dict, positions: list[int], cfg: MemoryTrainConfig,
              gen: random.Random, device) -> torch.Tensor | None:
    pos_t = torch.tensor(positions, device=device)
    n = keys[mi.config.layers[0]].shape[0]
    targets = [window_targets(d, t, cfg.vote, cfg.window) for t in positions]
    rows, cols, ys = [], [], []
    with torch.no_grad():
        score = torch.stack([mi.layer_logits(L, d.x[L][pos_t.cpu()].to(device), pos_t, keys[L]) for L in mi.config.layers]).amax(0)
    for r, (t, tg) in enumerate(zip(positions, targets)):
        vis = d.visible(t)
        if tg.numel() == 0:
            continue
        if tg.numel() > cfg.max_positives:
            tg = tg[torch.randperm(tg.numel(), generator=torch.Generator().manual_seed(gen.randrange(1 << 30)))
                    [:cfg.max_positives]]
        is_pos = torch.zeros(vis, dtype=torch.bool)
        is_pos[tg] = True
        others = torch.nonzero(~is_pos).flatten()
        if others.numel():
            k = min(others.numel(), cfg.neg_ratio * tg.numel())
            uniform = others[torch.randperm(others.numel(), generator=torch.Generator().manual_seed(gen.randrange(1 << 30)))[:k]]
            s = score[r, :vis].cpu().masked_fill(is_pos, -math.inf)
            hard = s.topk(min(tg.numel(), others.numel())).indices
            neg = torch.unique(torch.cat([uniform, hard]))
        else:
            neg = others
        c = torch.cat([tg, neg])
        rows.append(torch.full((c.numel(),), r))
        cols.append(c)
        ys.append(torch.cat([torch.ones(tg.numel()), torch.zeros(neg.numel())]))
    if not rows:
        return None
    rows, cols, ys = torch.cat(rows).to(device), torch.cat(cols).to(device), torch.cat(ys).to(device)
    loss = 0.0
    for L in mi.config.layers:
        logits = mi.layer_logits(L, d.x[L][pos_t.cpu()].to(device), pos_t, keys[L])[rows, cols]
        loss = loss + torch.nn.functional.binary_cross_entropy_with_logits(logits, ys)
    return loss / len(mi.config.layers)


@torch.no_grad()
def validate(score_fn, docs: _Docs, cfg: MemoryTrainConfig, max_positions: int = 64,
             only: set[int] | None = None) -> dict:
    """score_fn(doc index, positions tensor) -> probabilities [T, N]. Micro F1 at 0.5 and recall
    under the flashmemory policy, with the resident share; recency at the same budget beside it;
    both recalls also over the positions whose budget keeps a complete block (`_where_kept`: a
    document's first positions hold many targets and, at a share of their few blocks, none).
    `only`: the documents to score (default: all)."""
    policy, newest = FlashMemory(cfg.budget), FlashMemory(cfg.budget, tail_share=1.0)
    tp = fp = fn = 0
    hit = total = res = vis_sum = rec_hit = 0
    kept_hit = kept_rec_hit = kept_total = 0
    for i, d in enumerate(docs.labels):
        if only is not None and i not in only:
            continue
        positions = query_positions(d, cfg.stride)
        step = max(1, len(positions) // max_positions)
        positions = positions[::step][:max_positions] + [p for p in positions[-4:]]
        probs = score_fn(i, torch.tensor(positions)).cpu()
        for r, t in enumerate(positions):
            vis = d.visible(t)
            tg = torch.zeros(vis, dtype=torch.bool)
            tg[window_targets(d, t, cfg.vote, cfg.window)] = True
            pred = probs[r, :vis] > 0.5
            tp += int((pred & tg).sum())
            fp += int((pred & ~tg).sum())
            fn += int((~pred & tg).sum())
            keep = policy.chunks(probs[r], vis, cfg.block_chunks)
            recency = newest.chunks(torch.zeros(vis), vis, cfg.block_chunks)
            hit += int((keep & tg).sum())
            rec_hit += int((recency & tg).sum())
            total += int(tg.sum())
            if complete_blocks_kept(cfg.budget, vis // cfg.block_chunks):
                kept_hit += int((keep & tg).sum())
                kept_rec_hit += int((recency & tg).sum())
                kept_total += int(tg.sum())
            res += int(keep.sum())
            vis_sum += vis
    f1 = 2 * tp / max(1, 2 * tp + fp + fn)
    return {"f1": round(f1, 4), "precision": round(tp / max(1, tp + fp), 4), "recall_at_0.5": round(tp / max(1, tp + fn), 4),
            "policy_recall": round(hit / max(1, total), 4), "recency_recall": round(rec_hit / max(1, total), 4),
            "resident_share": round(res / max(1, vis_sum), 4),
            # None where no position's budget keeps a complete block
            "policy_recall_where_kept": round(kept_hit / kept_total, 4) if kept_total else None,
            "recency_recall_where_kept": round(kept_rec_hit / kept_total, 4) if kept_total else None}


def memory_indexer_probs(mi: MemoryIndexer, docs: _Docs, device):
    """score_fn for `validate`: the memory indexer's probabilities."""
    def f(i, pos):
        d = docs.labels[i]
        return mi.probabilities({L: d.x[L][pos].to(device) for L in mi.config.layers}, pos.to(device), docs.keys(i))
    return f


def native_probs(model, layers: list[int], docs: _Docs, device):
    """score_fn for `validate`: the sigmoid of the native indexers' logits at `layers`, their max."""
    from hybridkv.ops.hadamard import rope_hadamard_fp4
    from hybridkv.ops.indexer_topk.reference import index_scores
    from hybridkv.ops.rope import rope_freqs

    native = {L: model.layers[L].attn for L in layers}

    def f(i, pos):
        d, out = docs.labels[i], []
        for L, attn in native.items():
            x = d.x[L][pos].to(device).float()
            qr = attn.q_norm(attn.wq_a(x))
            q = rope_hadamard_fp4(attn.indexer.wq_b(qr).unflatten(-1, (attn.indexer.n_heads, attn.indexer.head_dim)),
                                  rope_freqs(pos.to(device), attn.inv_freq))
            out.append(index_scores(q, attn.indexer.head_weights(x), docs.keys(i)[L]).sigmoid())
        return torch.stack(out).amax(0)
    return f


def oracle_probs(docs: _Docs, cfg: MemoryTrainConfig):
    """score_fn for `validate`: the labels themselves."""
    def f(i, pos):
        d = docs.labels[i]
        n = d.keys[d.layers[0]].shape[0]
        p = torch.zeros(len(pos), n)
        for r, t in enumerate(pos.tolist()):
            p[r, window_targets(d, t, cfg.vote, cfg.window)] = 1.0
        return p
    return f


def validate_by_length(model, mi: MemoryIndexer, docs: _Docs, cfg: MemoryTrainConfig, device) -> dict:
    """`validate` of the native indexer and the memory indexer over the validation documents of
    each length (documents `cfg.docs` on)."""
    out = {}
    for length in cfg.lengths:
        ids = {j for j in range(len(docs.labels)) if document_length(cfg, cfg.docs + j) == length}
        out[length] = {"native": validate(native_probs(model, mi.config.layers, docs, device), docs, cfg, only=ids),
                       "trained": validate(memory_indexer_probs(mi, docs, device), docs, cfg, only=ids)}
    return out


def train_memory_indexer(model_dir: str | Path, out: str | Path, cfg: MemoryTrainConfig, label_dir: str | Path,
                         device: str = "cpu", layers: list[int] | None = None, echo=print) -> dict:
    """Label (or reuse labels), train, validate, save. Returns the report (also written beside the
    weights as `memory_indexer.json`)."""
    from hybridkv.train.export import float_model

    torch.manual_seed(cfg.seed)
    model = float_model(model_dir).to(device).eval()
    paths = build_labels(model, model_dir, Path(label_dir), cfg, echo)
    train_docs, val_docs = _Docs(paths[:cfg.docs], device), _Docs(paths[cfg.docs:], device)
    if not train_docs.labels or not val_docs.labels:
        raise TrainingError("train-memory-indexer needs at least one training and one validation document")
    mi = MemoryIndexer.from_native(model, layers).to(device)
    report = {"config": {k: v for k, v in cfg.__dict__.items() if k != "extra"}, "layers": mi.config.layers,
              "heads": mi.config.heads, "rank": mi.config.rank}
    _measure_before(report, model, mi, val_docs, cfg, device)
    echo(f"native indexer: {report['native']}\noracle labels:  {report['oracle']}\nwarm start:     {report['init']}")
    opt = torch.optim.AdamW(mi.parameters(), lr=cfg.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
    gen = random.Random(cfg.seed)
    samples = [(i, query_positions(d, cfg.stride)) for i, d in enumerate(train_docs.labels)]
    t0, losses = time.perf_counter(), []
    for step in range(cfg.steps):
        i, positions = samples[gen.randrange(len(samples))]
        pick = sorted(gen.sample(positions, min(cfg.batch_positions, len(positions))))
        loss = _loss_for(mi, train_docs.labels[i], train_docs.keys(i), pick, cfg, gen, device)
        if loss is None:
            continue
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mi.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if (step + 1) % max(1, cfg.steps // 10) == 0:
            echo(f"step {step + 1}/{cfg.steps}  loss {sum(losses[-20:]) / len(losses[-20:]):.4f}  "
                 f"{time.perf_counter() - t0:.0f}s")
    _measure_trained(report, model, mi, val_docs, cfg, device, echo)
    report["train_seconds"] = round(time.perf_counter() - t0, 1)
    report["final_loss"] = round(sum(losses[-20:]) / max(1, len(losses[-20:])), 4)
    echo(f"trained:        {report['trained']}")
    out = Path(out)
    path = mi.save(out)
    path.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    report["path"] = str(path)
    return report


def _measure_before(report: dict, model, init: MemoryIndexer, val_docs: _Docs, cfg: MemoryTrainConfig,
                    device) -> None:
    """The report's baselines on the validation documents under the serving policy: the native
    indexers, the labels themselves and the warm-started memory indexer `init`."""
    report["policy"] = str(FlashMemory(cfg.budget))
    report["native"] = validate(native_probs(model, init.config.layers, val_docs, device), val_docs, cfg)
    report["oracle"] = validate(oracle_probs(val_docs, cfg), val_docs, cfg)
    report["init"] = validate(memory_indexer_probs(init, val_docs, device), val_docs, cfg)


def _measure_trained(report: dict, model, mi: MemoryIndexer, val_docs: _Docs, cfg: MemoryTrainConfig, device,
                     echo) -> None:
    """The trained memory indexer's measures in the report, and by document length where there are
    several lengths."""
    report["trained"] = validate(memory_indexer_probs(mi, val_docs, device), val_docs, cfg)
    if len(cfg.lengths) > 1:
        report["by_length"] = validate_by_length(model, mi, val_docs, cfg, device)
        for length, measures in report["by_length"].items():
            echo(f"at {length} tokens: {measures}")


def revalidate_memory_indexer(model_dir: str | Path, weights: str | Path, label_dir: str | Path, device: str = "cpu",
                              echo=print) -> dict:
    """Measure a trained memory indexer again, on the validation documents its report names, under
    the serving policy as it is now (after a change of the policy's ranking or budget): labels only
    those documents (reusing label files), and rewrites the report's measures beside the weights,
    keeping its training figures. Returns the report."""
    from hybridkv.memory.indexer import FILENAME
    from hybridkv.train.export import float_model

    weights = Path(weights)
    if weights.is_dir():
        weights = weights / FILENAME
    report_path = weights.with_suffix(".json")
    try:
        report = json.loads(report_path.read_text())
        config = {**report["config"], "lengths": tuple(report["config"]["lengths"])}
        cfg = MemoryTrainConfig(**config)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TrainingError(f"{report_path}: no training report to take the validation documents from "
                            f"({type(e).__name__}: {e})") from None
    mi = MemoryIndexer.load(weights, device)
    model = float_model(model_dir).to(device).eval()
    paths = build_labels(model, model_dir, Path(label_dir), cfg, echo,
                         indices=range(cfg.docs, cfg.docs + cfg.val_docs))
    val_docs = _Docs(paths, device)
    init = MemoryIndexer.from_native(model, mi.config.layers, heads=mi.config.heads, rank=mi.config.rank).to(device)
    _measure_before(report, model, init, val_docs, cfg, device)
    _measure_trained(report, model, mi, val_docs, cfg, device, echo)
    echo(f"under {report['policy']}: native {report['native']}\ntrained {report['trained']}")
    # the report replaced whole or not at all: an interrupted write leaves the former one
    partial = report_path.with_suffix(".json.partial")
    partial.write_text(json.dumps(report, indent=1) + "\n")
    partial.replace(report_path)
    return report
