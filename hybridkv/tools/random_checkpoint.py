"""A random-weight checkpoint in the release format with a preset's real attention and cache shapes:
for benchmarks of the cache, the engine and the kernels at V4-Flash dimensions without the 280 GB
release. Layer count, vocabulary and MoE width are overridable (they do not change a token's KV).

    python -m hybridkv.tools.random_checkpoint OUT_DIR --preset v4-flash --layers 4 --vocab 1024 \\
        --experts 8 --moe-inter 512

The compress ratios keep the preset's pattern: pure-window layers first, then CSA/HCA alternating,
the MTP layer(s) window-only. Weights follow the training init (`hybridkv.train.init`); FP8
linears and FP4 experts are quantised as a trained export would be.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hybridkv.config import ModelConfig
from hybridkv.model import Transformer
from hybridkv.presets import PRESETS
from hybridkv.train.export import release_state
from hybridkv.train.init import init_weights
from hybridkv.weights import save_checkpoint


def shaped_config(preset: str, layers: int | None = None, vocab: int | None = None, experts: int | None = None,
                  moe_inter: int | None = None) -> ModelConfig:
    d = dict(PRESETS[preset])
    if layers is not None and d["model_type"] != "deepseek_v4":
        raise ValueError(f"--layers reshapes V4 presets only ({preset} names its source layers by index)")
    if layers is not None:
        ratios = list(d["compress_ratios"])
        n_all, mtp = len(ratios), d.get("num_nextn_predict_layers", 0)
        main = ratios[: n_all - mtp]
        lead = next((i for i, r in enumerate(main) if r), len(main))       # pure-window layers first
        pattern = main[lead:lead + 2] or [0]
        body = [pattern[i % len(pattern)] for i in range(max(0, layers - min(lead, layers)))]
        d["compress_ratios"] = main[:min(lead, layers)] + body + ratios[n_all - mtp:]
        d["num_hidden_layers"] = layers
        d["num_hash_layers"] = min(d.get("num_hash_layers", 0), layers)
    if vocab is not None:
        d["vocab_size"] = vocab
    if experts is not None:
        d["n_routed_experts"] = experts
        d["num_experts_per_tok"] = min(d["num_experts_per_tok"], experts)
    if moe_inter is not None:
        d["moe_intermediate_size"] = moe_inter
    return ModelConfig.from_dict(d)


@torch.no_grad()
def write_random_checkpoint(config: ModelConfig, out_dir: str | Path, seed: int = 0,
                            max_shard_bytes: int = 2 << 30) -> Path:
    float_cfg = config.to_dict()
    float_cfg.pop("quantization_config", None)
    float_cfg["expert_dtype"] = "bf16"
    model = Transformer(ModelConfig.from_dict(float_cfg), dtype=torch.float32)
    init_weights(model, seed)
    release = Transformer(config, dtype=torch.bfloat16)
    release.load_state_dict(release_state(model.state_dict(), release))
    save_checkpoint(release, config, out_dir, max_shard_bytes=max_shard_bytes)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybridkv.tools.random_checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--preset", default="v4-flash", choices=sorted(k for k in PRESETS if k != "v3.2"))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--moe-inter", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    cfg = shaped_config(a.preset, a.layers, a.vocab, a.experts, a.moe_inter)
    out = write_random_checkpoint(cfg, a.out_dir, a.seed)
    print(f"wrote {out}: {cfg.num_hidden_layers} layers, ratios {list(cfg.compress_ratios)}, "
          f"hidden {cfg.hidden_size}, head_dim {cfg.head_dim}, vocab {cfg.vocab_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
