"""Training step time of a recipe's model at each of its curriculum stages (forward + backward +
optimizer), with the peak memory. Prints a table.

    python benchmarks/train_throughput.py --recipe tiny-v4 --device cuda
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import date

import torch

from hybridkv.model import Transformer
from hybridkv.train.forward import TrainOptions, train_forward
from hybridkv.train.init import init_weights
from hybridkv.train.losses import compute_losses
from hybridkv.train.optim import build_optimizers
from hybridkv.train.recipes import get_recipe
from hybridkv.train.rundir import model_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipe", default="tiny-v4")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of the last stage's step")
    p.add_argument("--also", default="", help="extra sparse shapes, e.g. 32768x1,65536x1")
    a = p.parse_args()
    recipe = get_recipe(a.recipe)
    cfg = model_config(recipe, a.vocab)
    with torch.device(a.device):
        model = Transformer(cfg, dtype=torch.float32)
    init_weights(model)
    opts = build_optimizers(model, recipe.lr)
    cuda = a.device.startswith("cuda")
    name = torch.cuda.get_device_name() if cuda else platform.processor()
    print(f"{recipe.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params on {name}, "
          f"torch {torch.__version__}, {date.today()}")
    print("| seq_len | batch | indexer | QAT | s/step | tokens/s | peak GiB |")
    print("|---:|---:|---|---|---:|---:|---:|")
    from hybridkv.train.recipes import Stage
    extra = [Stage(1.0, int(x.split("x")[0]), int(x.split("x")[1]), False) for x in a.also.split(",") if x]
    seen = set()
    for st in [*recipe.stages, *extra]:
        key = (st.seq_len, st.batch, st.dense_indexer, st.qat_experts)
        if key in seen:
            continue
        seen.add(key)
        ids = torch.randint(2, a.vocab, (st.batch, st.seq_len), device=a.device)
        sup = torch.zeros_like(ids, dtype=torch.bool)
        sup[:, -8:] = True
        to = TrainOptions(dense_indexer=st.dense_indexer, qat_experts=st.qat_experts, qat_indexer=True,
                          kl_queries=recipe.kl_queries)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        def step() -> float:
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                out = train_forward(model, ids, to)
                loss, _ = compute_losses(model, ids, sup, out, recipe.loss)
            loss.backward()
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t

        times = [step() for _ in range(a.steps)]
        if a.profile and st is [*recipe.stages, *extra][-1]:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
        dt = min(times[1:]) if len(times) > 1 else times[0]
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        print(f"| {st.seq_len} | {st.batch} | {'dense' if st.dense_indexer else 'top-k'} | "
              f"{'on' if st.qat_experts else 'off'} | {dt:.3f} | {ids.numel() / dt / 1e3:.0f}K | {peak:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
