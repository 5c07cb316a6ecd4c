"""Is the indexer doing its job? For long task prompts, with every CSA entry visible to the main
attention (the DSA warm-up view), the recall of the indexer's top-k against the main attention's
top-k (head-summed probabilities: the indexer's training target), per CSA layer; for a V4.1
model also per Reuse layer, against the top-k of the index source it reads.

    python -m hybridkv.train.indexer_report MODEL_DIR [--length 16384] [--samples 4]

MODEL_DIR is a release-format model (FP4/FP8 weights are dequantised into a float model).
"""

from __future__ import annotations

import argparse
from pathlib import Path
import statistics

import torch

from hybridkv.errors import TrainingError, reports_errors
from hybridkv.train.export import float_model
from hybridkv.train.forward import TrainOptions, train_forward


@reports_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybridkv.train.indexer_report")
    p.add_argument("model_dir")
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--tasks", default="passkey,niah_single_2,niah_multikey_1")
    p.add_argument("--queries", type=int, default=256, help="query positions per prompt")
    a = p.parse_args(argv)
    from hybridkv.tasks.generators import Pools, make_sample
    from hybridkv.tasks.tokenizer import TaskTokenizer

    for flag, v in (("--length", a.length), ("--samples", a.samples), ("--queries", a.queries)):
        if v < 1:
            raise TrainingError(f"{flag} {v}: must be at least 1")
    if not (Path(a.model_dir) / "tokenizer.json").is_file():
        raise TrainingError(f"{a.model_dir}: no tokenizer.json (a model directory that --export wrote)")
    model = float_model(a.model_dir)
    tok = TaskTokenizer.load(a.model_dir)
    pools = Pools(tok, seed=0)
    recall: dict[int, list[float]] = {}
    for task in a.tasks.split(","):
        for i in range(a.samples):
            try:
                ids = torch.tensor([make_sample(task, 10_000 + i, pools, a.length).prompt])
            except ValueError as e:     # an unknown task, or a prompt too short for it
                raise TrainingError(f"--tasks {task} at {a.length} tokens: {e}") from None
            with torch.no_grad():
                out = train_forward(model, ids, TrainOptions(dense_indexer=True, qat_indexer=True,
                                                             kl_queries=a.queries, reuse_layers_train_indexer=True),
                                    torch.Generator().manual_seed(i))
            for layer, r in out.aux.indexer_recall.items():
                recall.setdefault(layer, []).append(r)
    k = model.config.index_topk
    print(f"indexer top-{k} recall of the main attention's top-{k}, {a.length}-token prompts "
          f"({a.tasks}, {a.samples} each, {a.queries} query positions per prompt)")
    print("| layer | kind | recall | prompts |\n|---:|---|---:|---:|")
    for layer in sorted(recall):
        print(f"| {layer} | {model.config.layer_kind(layer)} | {statistics.fmean(recall[layer]):.3f} | "
              f"{len(recall[layer])} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
