"""A random-weight checkpoint in the release format with a preset's real shapes: for benchmarks of
the cache, the engine and the kernels at V4-Flash dimensions without the 280 GB release. Layer
count, vocabulary and MoE width are overridable (they do not change a token's KV).

    python -m hybridkv.tools.random_checkpoint OUT_DIR --preset v4-flash --layers 8
    python -m hybridkv.tools.random_checkpoint OUT_DIR --preset v4-flash --layers 4 --vocab 1024 \\
        --experts 8 --moe-inter 512

The compress ratios keep the preset's pattern: pure-window layers first, then CSA/HCA alternating,
the MTP layer(s) window-only.

The checkpoint is written part by part (the embedding, each block, each MTP block, the head), one
shard per part, each tensor streamed to its shard as soon as it is made: host memory holds one
part's non-expert weights (float32, ~0.6 GB for a V4-Flash block) and one routed expert matrix,
never the model. Non-expert weights follow the training init (`hybridkv.train.init`) and FP8
linears are quantised from it with e8m0 128×128 block scales, as a trained export would be. Routed
FP4 experts are made packed: uniformly random E2M1 codes (rms 2.93) under one power-of-two scale
per tensor that gives them the init's standard deviation, so activations stay at the init's size
at any width (quantising a normal init per 32 would take an hour at 256 × 2048 × 8 layers).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from hybridkv.config import ModelConfig
from hybridkv.model import Transformer
from hybridkv.model.transformer import weight_formats
from hybridkv.model.linear import FP4_WEIGHT_BLOCK, Linear
from hybridkv.ops.quant import E2M1_VALUES, dequant_fp8_weight, quant_fp8_weight
from hybridkv.presets import PRESETS
from hybridkv.train.init import init_weights
from hybridkv.weights import INDEX_FILE, _ST_NAMES, commit_checkpoint

INIT_STD = 0.02
E2M1_UNIFORM_RMS = float(E2M1_VALUES.pow(2).mean().sqrt())   # rms of uniformly random E2M1 codes


def shaped_config(preset: str, layers: int | None = None, vocab: int | None = None, experts: int | None = None,
                  moe_inter: int | None = None) -> ModelConfig:
    d = dict(PRESETS[preset])
    if layers is not None and d["model_type"] != "deepseek_v4":
        _shape_v41(d, layers)
    elif layers is not None:
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


def _shape_v41(d: dict, layers: int) -> None:
    """A V4.1 preset at `layers` backbone layers, in place: its window-only layers first, then each
    run of one compression ratio (V4.1-Flash: 18 layers of ratio 2, then 20 of ratio 1) shortened in
    proportion, and in each run the source layers at the preset's offsets from the run's start
    (Full every 6 layers of the ratio-2 run; the ratio-1 run's first layer Full and the candidate
    source, a Reindex layer every 4 after it), as far as the shorter run reaches. At the preset's
    depth this is the preset."""
    ratios = list(d["compress_ratios"])
    mtp = d.get("num_nextn_predict_layers", 0)
    main = ratios[: len(ratios) - mtp]
    lead = next((i for i, r in enumerate(main) if r), len(main))
    if layers <= lead:
        raise ValueError(f"--layers {layers}: a V4.1 stack needs more than its {lead} window-only layers")
    runs = []                                  # (ratio, first layer, length) in the preset
    for i in range(lead, len(main)):
        if runs and main[i] == runs[-1][0]:
            runs[-1][2] += 1
        else:
            runs.append([main[i], i, 1])
    rest, total = layers - lead, len(main) - lead
    lengths = [max(1, round(n * rest / total)) for _, _, n in runs[:-1]]
    lengths.append(rest - sum(lengths))
    while lengths[-1] < 1:                      # too few layers for every run: drop the last ones
        lengths.pop()
        lengths[-1] += rest - sum(lengths)
    new_ratios, kv, index, candidate, at = [0] * lead, [], [], None, lead
    for (ratio, first, _), n in zip(runs, lengths):
        new_ratios += [ratio] * n
        for name, ids in (("kv", kv), ("index", index)):
            src = d["kv_source_layer_ids" if name == "kv" else "index_source_layer_ids"]
            ids += [at + i - first for i in src if first <= i < first + n]
        if d.get("candidate_source_layer_id") is not None and first <= d["candidate_source_layer_id"] < first + n:
            candidate = at + d["candidate_source_layer_id"] - first
        at += n
    d["compress_ratios"] = new_ratios + ratios[len(main):]
    d["num_hidden_layers"] = layers
    d["kv_source_layer_ids"], d["index_source_layer_ids"] = kv, index
    d["candidate_source_layer_id"] = candidate


class _Part(nn.Module):
    """One part of a model under the model's own parameter names (what `init_weights` reads)."""

    def __init__(self, config: ModelConfig, modules: dict[str, nn.Module], params: dict[str, nn.Parameter]):
        super().__init__()
        self.config = config
        for path, mod in modules.items():
            head, _, idx = path.partition(".")
            if idx:
                if head not in self._modules:
                    self.add_module(head, nn.ModuleDict())
                self._modules[head][idx] = mod
            else:
                self.add_module(path, mod)
        for name, p in params.items():
            self.register_parameter(name, p)


def _parts(model: Transformer) -> list[tuple[str, dict[str, nn.Module], dict[str, nn.Parameter]]]:
    """(shard label, submodules by path, top-level parameters) in file order."""
    parts = [("embed", {"embed": model.embed}, {})]
    parts += [(f"layer{i}", {f"layers.{i}": m}, {}) for i, m in enumerate(model.layers)]
    parts += [(f"mtp{i}", {f"mtp.{i}": m}, {}) for i, m in enumerate(model.mtp)]
    top = {n: p for n, p in model.named_parameters(recurse=False)}
    parts.append(("head", {"norm": model.norm, "head": model.head}, top))
    return parts


def _is_packed_expert(mod: nn.Module) -> bool:
    return isinstance(mod, Linear) and mod.fmt == "fp4"


def _materialize(module: nn.Module) -> None:
    """Allocate `module`'s meta tensors on the CPU except those of FP4 linears (made packed later);
    float tensors start as NaN and integer ones as -1, so a tensor the init misses is caught."""
    if _is_packed_expert(module):
        return
    module.to_empty(device="cpu", recurse=False)
    for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        t.data.fill_(float("nan") if t.is_floating_point() else -1)
    for child in module.children():
        _materialize(child)


def _seed(seed: int, label: str) -> int:
    return zlib.crc32(label.encode()) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF)


def _fp4_std(name: str, config: ModelConfig) -> float:
    out_scale = 1 / math.sqrt(2 * (config.num_hidden_layers + config.num_nextn_predict_layers))
    return INIT_STD * (out_scale if name.endswith(".w2.weight") else 1.0)


def _packed_fp4(shape: tuple[int, ...], rng: np.random.Generator) -> torch.Tensor:
    n = math.prod(shape)
    raw = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]
    return torch.from_numpy(raw.reshape(shape)).view(torch.int8)


def _fp4_scale(shape: tuple[int, ...], std: float) -> torch.Tensor:
    s = 2.0 ** round(math.log2(std / E2M1_UNIFORM_RMS))
    return torch.full(shape, s, dtype=torch.float32).to(torch.float8_e8m0fnu)


Producer = Callable[[], torch.Tensor]
# float32 model parameters the release stores in bf16: the head, the compressors' projections, the
# RMSNorm weights (the hc_* mixes, attention sinks and compressor position biases stay float32)
RELEASE_BF16 = re.compile(r"(^head\.weight|compressor\.(wkv|wgate)\.weight|norm\.weight)$")
# bf16 weights the release ships in FP8 and its conversion dequantises (the reference's convert.py):
# their values are FP8 values times power-of-two 128×128 block scales
RELEASE_FP8_WIDENED = re.compile(r"attn\.wo_a\.weight$")


def _part_tensors(config: ModelConfig, float_part: _Part, release_part: _Part,
                  seed: int, label: str) -> Iterator[tuple[str, torch.dtype, tuple[int, ...], Producer]]:
    """(name, dtype, shape, make) of each release tensor of one part; `make` builds it on call."""
    float_state = float_part.state_dict()
    modules = dict(release_part.named_modules())
    rng = np.random.Generator(np.random.SFC64(_seed(seed, label)))
    done: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def fp8(owner: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        if owner not in done:                       # weight and scale come from one quantisation
            done.clear()
            done[owner] = quant_fp8_weight(float_state[f"{owner}.weight"], block)
        return done[owner]

    for name, target in release_part.state_dict(keep_vars=True).items():
        owner, _, leaf = name.rpartition(".")
        mod = modules.get(owner)
        dtype, shape = target.dtype, tuple(target.shape)
        if name.endswith("tid2eid"):
            dtype = torch.int64
        elif dtype == torch.float32 and RELEASE_BF16.search(name):
            dtype = torch.bfloat16
        if isinstance(mod, Linear) and mod.fmt == "fp4":
            std = _fp4_std(f"{owner}.weight", config)
            make = (lambda s=shape: _packed_fp4(s, rng)) if leaf == "weight" else \
                (lambda s=shape, sd=std: _fp4_scale(s, sd))
        elif isinstance(mod, Linear) and mod.fmt == "fp8":
            make = (lambda o=owner, b=mod.block, i=int(leaf == "scale"): fp8(o, b)[i])
        elif RELEASE_FP8_WIDENED.search(name) and dtype == torch.bfloat16:
            make = (lambda t=float_state[name]: dequant_fp8_weight(*quant_fp8_weight(t, (128, 128)), (128, 128),
                                                                   torch.bfloat16))
        else:
            make = (lambda t=float_state[name], d=dtype: t.to(d))
        yield name, dtype, shape, make


def _write_shard(path: Path, tensors: list[tuple[str, torch.dtype, tuple[int, ...], Producer]]) -> int:
    """A safetensors file written one tensor at a time (the header is known from shapes alone).
    Returns its data bytes."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, _ in tensors:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, dtype, shape, make in tensors:
            t = make().contiguous()
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise AssertionError(f"{name}: made {t.dtype} {tuple(t.shape)}, declared {dtype} {shape}")
            if t.is_floating_point() and t.dtype.itemsize > 1 and not bool(torch.isfinite(t).all()):
                raise AssertionError(f"{name}: the init left non-finite values")
            f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return offset


def _models(config: ModelConfig) -> tuple[Transformer, Transformer]:
    """(float32 training-init model, release-format model) of `config`, both on the meta device."""
    float_cfg = config.to_dict()
    float_cfg.pop("quantization_config", None)
    float_cfg["expert_dtype"] = "fp4" if weight_formats(config)[1] == "fp4" else "bf16"
    with torch.device("meta"):
        return (Transformer(ModelConfig.from_dict(float_cfg), dtype=torch.float32),
                Transformer(config, dtype=torch.bfloat16))


@torch.no_grad()
def _write_part(config: ModelConfig, out_dir: Path, seed: int, i: int,
                models: tuple[Transformer, Transformer] | None = None) -> tuple[Path, Path, list[str], int]:
    """Write part `i` under a temporary name: (temporary path, final path, its tensor names, its
    data bytes). A part's bytes depend on (seed, part label) alone, so parts can be written in any
    order, by any process."""
    float_model, release = models or _models(config)
    float_parts, release_parts = _parts(float_model), _parts(release)
    (label, fmods, fparams), (_, rmods, rparams) = float_parts[i], release_parts[i]
    fpart = _Part(float_model.config, fmods, fparams)
    _materialize(fpart)
    init_weights(fpart, _seed(seed, label) & 0x7FFFFFFF)
    fname = f"model-{i + 1:05d}-of-{len(release_parts):05d}.safetensors"
    tensors = list(_part_tensors(config, fpart, _Part(config, rmods, rparams), seed, label))
    tmp = out_dir / (fname + ".tmp")
    size = _write_shard(tmp, tensors)
    for mod in fmods.values():
        mod.to_empty(device="meta")             # the part's float weights are done with
    return tmp, out_dir / fname, [name for name, *_ in tensors], size


def _write_part_job(args: tuple) -> tuple[Path, Path, list[str], int]:
    torch.set_num_threads(1)
    return _write_part(*args)


def write_random_checkpoint(config: ModelConfig, out_dir: str | Path, seed: int = 0,
                            progress: Callable[[str], None] | None = None, jobs: int = 1) -> Path:
    """Write `config.json` and one shard per part of a random-weight model in `config`'s release
    format, with an index. Shards are written under temporary names and renamed at the end. `jobs`
    processes write parts side by side (the bytes are the same for any `jobs`); each holds one
    part's float weights."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    models = _models(config)
    labels = [label for label, *_ in _parts(models[1])]
    if jobs > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(min(jobs, len(labels)), mp_context=mp.get_context("spawn")) as pool:
            results = []
            for r, label in zip(pool.map(_write_part_job, [(config, out_dir, seed, i) for i in range(len(labels))]),
                                labels):
                results.append(r)
                if progress:
                    progress(label)
    else:
        results = []
        for i, label in enumerate(labels):
            results.append(_write_part(config, out_dir, seed, i, models))
            if progress:
                progress(label)
    weight_map = {name: final.name for _, final, names, _ in results for name in names}
    commit_checkpoint(out_dir, config, [(tmp, final) for tmp, final, _, _ in results], weight_map,
                      sum(size for *_, size in results))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybridkv.tools.random_checkpoint")
    p.add_argument("out_dir")
    p.add_argument("--preset", default="v4-flash", choices=sorted(k for k in PRESETS if k != "v3.2"))
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--moe-inter", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="processes writing parts side by side")
    a = p.parse_args(argv)
    cfg = shaped_config(a.preset, a.layers, a.vocab, a.experts, a.moe_inter)
    from tqdm import tqdm
    bar = tqdm(total=cfg.num_hidden_layers + cfg.num_nextn_predict_layers + 2, desc="parts", unit="part")
    out = write_random_checkpoint(cfg, a.out_dir, a.seed, progress=lambda _: bar.update(), jobs=a.jobs)
    bar.close()
    size = json.loads((out / INDEX_FILE).read_text())["metadata"]["total_size"]
    print(f"wrote {out}: {size / 1e9:.2f} GB, {cfg.num_hidden_layers} layers, ratios {list(cfg.compress_ratios)}, "
          f"hidden {cfg.hidden_size}, {cfg.n_routed_experts} experts x {cfg.moe_intermediate_size}, "
          f"head_dim {cfg.head_dim}, vocab {cfg.vocab_size}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
