"""Export a training run as a model directory in the release format: config.json, sharded
safetensors (bf16 matrices; routed experts packed FP4 with e8m0 scales when the recipe ships FP4
experts, which QAT trained them for; float32 where the release keeps float32), tokenizer.json."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from hybridkv.errors import TrainingError
from hybridkv.model import Transformer
from hybridkv.model.linear import Linear
from hybridkv.train.qat import quantize_fp4_weight_for_export
from hybridkv.train.recipes import Recipe
from hybridkv.train.rundir import load_run_weights, mismatch, model_config, prepare_tokenizer
from hybridkv.weights import save_checkpoint

SHARD_BYTES = 15 << 20


def float_model(model_dir: str | Path) -> Transformer:
    """A release-format model as a float model the training forward can run and train (FP8/FP4
    linears dequantised, no activation quantisation): the inverse of `release_state`."""
    from hybridkv.weights import load_model
    return _float_of(*load_model(model_dir))


def _float_of(release: Transformer, cfg) -> Transformer:
    """`float_model` of a release model already loaded (float32)."""
    from hybridkv.config import ModelConfig
    d = cfg.to_dict()
    d.pop("quantization_config", None)
    d["expert_dtype"] = "bf16"
    model = Transformer(ModelConfig.from_dict(d), dtype=torch.float32)
    modules = dict(release.named_modules())
    released = release.state_dict()
    state = {}
    for name, t in model.state_dict().items():
        owner, _, leaf = name.rpartition(".")
        src = modules.get(owner)
        state[name] = (src.dense_weight().float() if isinstance(src, Linear) and leaf == "weight"
                       else released[name].to(t.dtype))
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def _frozen_from(base: Path, trains: str, trained: dict[str, torch.Tensor],
                 state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's tensors outside `trains`*, as its files hold them; a TrainingError where the
    run's float values of one differ from the base's (a run of another base, or one that trained it)."""
    from hybridkv.weights import load_model
    if not (base / "config.json").is_file():
        raise TrainingError(f"--init-from {base}: not a model directory (no config.json)")
    release, cfg = load_model(base)                 # packed tensors as stored; bf16 ones widened exactly
    held = release.state_dict()
    floats = _float_of(release, cfg).state_dict()
    kept = {}
    for name in state:
        if name.startswith(trains):
            continue
        if name not in held or held[name].shape != state[name].shape:
            raise TrainingError(f"--init-from {base}: no {name} of shape {tuple(state[name].shape)} there")
        kept[name] = held[name]
    changed = [n for n, t in trained.items() if not n.startswith(trains) and n in floats
               and not torch.equal(t.float(), floats[n].float())]
    if changed:
        raise TrainingError(f"the run changed {len(changed)} tensors outside {trains}* (e.g. {changed[0]}) from "
                            f"--init-from {base}: it did not continue that model")
    return kept


@torch.no_grad()
def release_state(float_state: dict[str, torch.Tensor], release: Transformer) -> dict[str, torch.Tensor]:
    """The state dict of `release` (a model of the release config) from a float model's weights:
    FP8 linears quantised with e8m0 block scales, FP4 experts packed (exactly what QAT simulated),
    everything else cast to the release dtype."""
    from hybridkv.ops.quant import quant_fp8_weight
    modules = dict(release.named_modules())
    state = {}
    for name, target in release.state_dict(keep_vars=True).items():
        owner, _, leaf = name.rpartition(".")
        mod = modules.get(owner)
        if isinstance(mod, Linear) and mod.fmt in ("fp4", "fp8"):
            if leaf == "weight":
                w = float_state[f"{owner}.weight"].float()
                packed, scale = (quantize_fp4_weight_for_export(w) if mod.fmt == "fp4"
                                 else quant_fp8_weight(w, mod.block))
                state[f"{owner}.weight"], state[f"{owner}.scale"] = packed, scale
            continue
        state[name] = float_state[name].to(target.dtype)
    return state


@torch.no_grad()
def export_model(recipe: Recipe, run_dir: str | Path, out_dir: str | Path, base: str | Path | None = None) -> Path:
    """The run in run_dir as a release-format model in out_dir. A recipe that trains one part only
    (`Recipe.trains`) needs `base`, the model it continued: every tensor outside that part is written
    as the base holds it, byte for byte (an FP4 block re-packed from the same values may choose
    another power-of-two scale), after checking that the run left those tensors' values as they
    were."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if recipe.trains is not None and base is None:
        raise TrainingError(f"recipe {recipe.name!r} trains {recipe.trains}* only: pass --init-from, the model it "
                            f"continued, whose other tensors the export keeps byte for byte")
    trained = load_run_weights(run_dir)
    tok = prepare_tokenizer(recipe, run_dir)
    config = model_config(recipe, tok.vocab_size, release=True)
    release = Transformer(config, dtype=torch.bfloat16)
    try:
        state = release_state(trained, release)
        if recipe.trains is not None:
            state.update(_frozen_from(Path(base), recipe.trains, trained, state))
        release.load_state_dict(state)
    except (KeyError, RuntimeError) as e:   # a missing tensor, or one of another shape
        raise TrainingError(f"the run in {run_dir} does not hold a {recipe.name!r} model (its weights do not fit "
                            f"that recipe's: {mismatch(e)}); export it with the recipe it was "
                            f"trained with") from None
    save_checkpoint(release, config, out_dir, max_shard_bytes=SHARD_BYTES)
    shutil.copy(run_dir / "tokenizer.json", out_dir / "tokenizer.json")
    return out_dir
