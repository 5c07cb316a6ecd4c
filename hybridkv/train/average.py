"""Weight averaging of two trained models of one architecture and tokenizer (a continued model and
the model it continued): every float weight is `(1 - weight) * A + weight * B`, taken on the float
model (FP4 experts and FP8 linears dequantised), then written in the release format again, the
experts requantised to FP4 as an export would.

    python -m hybridkv.train.average A_DIR B_DIR --weight 0.5 --out OUT_DIR

A continuation trained for one skill often gives up some of another its base had; the average of
the two can keep some of each (model soups, WiSE-FT). Integer tensors (the hash-routing tables)
hold no weights to average: they must be equal.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from hybridkv.errors import TrainingError, reports_errors
from hybridkv.train.export import SHARD_BYTES, float_model, release_state


@torch.no_grad()
def average_models(a_dir: str | Path, b_dir: str | Path, weight: float, out_dir: str | Path) -> Path:
    """Write `(1 - weight) * A + weight * B` to out_dir in A's release format (config, shards,
    tokenizer). Raises TrainingError when the two are not the same architecture and tokenizer."""
    from hybridkv.config import ModelConfig
    from hybridkv.model import Transformer
    from hybridkv.weights import save_checkpoint
    a_dir, b_dir, out_dir = Path(a_dir), Path(b_dir), Path(out_dir)
    if not 0.0 <= weight <= 1.0:
        raise TrainingError(f"weight must lie in [0, 1], got {weight}")
    if out_dir.resolve() in (a_dir.resolve(), b_dir.resolve()):
        raise TrainingError(f"--out {out_dir} is one of the models being averaged")
    # compared as read, so that two spellings of one config (an export from before a format change) agree
    config = ModelConfig.from_json(a_dir)
    ca, cb = config.to_dict(), ModelConfig.from_json(b_dir).to_dict()
    if ca != cb:
        diff = sorted(k for k in {**ca, **cb} if ca.get(k) != cb.get(k))
        raise TrainingError(f"{a_dir} and {b_dir} have different configs ({', '.join(diff)}): not one architecture")
    for d in (a_dir, b_dir):
        if not (d / "tokenizer.json").is_file():
            raise TrainingError(f"{d}: no tokenizer.json")
    if (a_dir / "tokenizer.json").read_bytes() != (b_dir / "tokenizer.json").read_bytes():
        raise TrainingError(f"{a_dir} and {b_dir} have different tokenizers: their token ids do not mean the same")
    sa, sb = float_model(a_dir).state_dict(), float_model(b_dir).state_dict()
    mixed = {}
    for name, ta in sa.items():
        tb = sb[name]
        if ta.is_floating_point():
            mixed[name] = ((1.0 - weight) * ta.float() + weight * tb.float()).to(ta.dtype)
        elif torch.equal(ta, tb):
            mixed[name] = ta
        else:
            raise TrainingError(f"{name} differs between {a_dir} and {b_dir} and is not a weight to average "
                                f"({ta.dtype}): these are not two trainings of one model")
    release = Transformer(config, dtype=torch.bfloat16)
    release.load_state_dict(release_state(mixed, release))
    save_checkpoint(release, config, out_dir, max_shard_bytes=SHARD_BYTES)
    shutil.copy(a_dir / "tokenizer.json", out_dir / "tokenizer.json")
    return out_dir


@reports_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybridkv.train.average", description=__doc__.split("\n\n")[0])
    p.add_argument("a_dir")
    p.add_argument("b_dir")
    p.add_argument("--weight", type=float, default=0.5, help="B's share (0 gives A, 1 gives B)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    for d in (a.a_dir, a.b_dir):
        if not (Path(d) / "config.json").is_file():
            raise TrainingError(f"{d}: no config.json (a model directory in the release format)")
    out = average_models(a.a_dir, a.b_dir, a.weight, a.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
