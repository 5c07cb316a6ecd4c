"""A training run's directory as the loop writes it and the export reads it: the tokenizer built
from the recipe, the model config (trained or shipped), the portable state files, and the trained
weights.

    tokenizer.json             built once from the recipe's corpus (deterministic)
    config.json                the model config trained (experts in float)
    state.pt                   model, optimizers, progress (what --resume continues)
    state-portable.pt.NN       float32 weights and progress in parts of <= 15 MiB (a fresh machine)
"""

from __future__ import annotations

import io
from pathlib import Path

import torch

from hybridkv.config import ModelConfig
from hybridkv.errors import TrainingError
from hybridkv.train.recipes import Recipe

PORTABLE = "state-portable.pt"
PART_BYTES = 15 << 20


def prepare_tokenizer(recipe: Recipe, run_dir: Path):
    """The run's tokenizer: tokenizer.json in run_dir, built from the recipe's corpus if absent."""
    from hybridkv.tasks.generators import build_tokenizer
    from hybridkv.tasks.tokenizer import TaskTokenizer
    path = run_dir / "tokenizer.json"
    if path.exists():
        return TaskTokenizer.load(path)
    tok = build_tokenizer(recipe.vocab_size, seed=recipe.seed, n_texts=recipe.tokenizer_texts,
                          hex_chars=recipe.hex_chars)
    tok.save(run_dir)
    return tok


def model_config(recipe: Recipe, vocab_size: int, release: bool = False) -> ModelConfig:
    """The config trained (experts in float, QAT simulating FP4) or, with `release`, the one shipped
    (the recipe's expert format)."""
    d = {**recipe.model, "vocab_size": vocab_size}
    if not release:
        d["expert_dtype"] = "bf16"
    return ModelConfig.from_dict(d)


def save_portable(weights: dict[str, torch.Tensor], progress: dict, out_dir: Path) -> list[Path]:
    """Float32 weights and progress (no optimizer state), in files of at most 15 MiB: what a run
    carries to a fresh machine. Resuming from it restarts the optimizer moments. Each part is
    written beside its name and renamed into place, and parts left from a larger earlier state are
    removed, so a process killed while saving leaves the previous state (or, between two renames,
    parts that `load_portable` refuses)."""
    buf = io.BytesIO()
    torch.save({"model": {k: v.detach().cpu() for k, v in weights.items()}, "progress": progress}, buf)
    data = buf.getvalue()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [(out_dir / f"{PORTABLE}.{i // PART_BYTES:02d}", data[i:i + PART_BYTES])
             for i in range(0, len(data), PART_BYTES)]
    for path, chunk in parts:
        path.with_name(path.name + ".tmp").write_bytes(chunk)
    for path, _ in parts:
        path.with_name(path.name + ".tmp").replace(path)
    kept = {path for path, _ in parts}
    for stale in portable_parts(out_dir):
        if stale not in kept:
            stale.unlink()
    return [path for path, _ in parts]


def portable_parts(run_dir: Path) -> list[Path]:
    """The portable state's parts in run_dir, in order (not the `.tmp` files of a save under way)."""
    return sorted(p for p in run_dir.glob(f"{PORTABLE}.*") if p.suffix != ".tmp")


def load_portable(run_dir: Path, device: str = "cpu") -> dict | None:
    """What `save_portable` wrote into run_dir (None if nothing)."""
    parts = portable_parts(run_dir)
    if not parts:
        return None
    try:
        return torch.load(io.BytesIO(b"".join(p.read_bytes() for p in parts)), map_location=device,
                          weights_only=False)
    except Exception as e:   # a torch.load of a truncated or mixed byte stream fails in several ways
        raise TrainingError(f"{run_dir}: the {len(parts)} {PORTABLE}.* part(s) do not form one saved state "
                            f"({type(e).__name__}); a save was interrupted or parts of two saves are mixed: "
                            f"copy all parts of one save") from None


def load_run_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The trained weights of the run in run_dir (float32 state dict)."""
    state_path = run_dir / "state.pt"
    if state_path.exists():
        return torch.load(state_path, map_location="cpu", weights_only=False)["model"]
    state = load_portable(run_dir)
    if state is None:
        raise TrainingError(f"no state.pt or {PORTABLE}.* in {run_dir}: nothing to export "
                            f"(train the run first, or name its directory with --out)")
    return state["model"]


def mismatch(e: KeyError | RuntimeError) -> str:
    """What a failed state-dict load names first (a missing or unexpected tensor, or one of another
    shape), for an error message that says which run and recipe do not fit."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    detail = lines[1] if len(lines) > 1 and lines[0].startswith("Error(s) in loading") else lines[0] if lines else ""
    return detail[:200]
