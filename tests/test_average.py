"""Weight averaging of two trainings of one model (hybridkv.train.average)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv.train.average import average_models
from hybridkv.train.export import float_model
from hybridkv.weights import checkpoint_files

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "tiny-v4"


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """The model's weights: the shards its index names (not files beside them, e.g. a memory indexer)."""
    out = {}
    for f in sorted(set(checkpoint_files(model_dir).values())):
        out.update(load_file(f))
    return out


def _copy(dst: Path) -> Path:
    shutil.copytree(SHIPPED, dst, ignore=shutil.ignore_patterns("eval", "*.png", "README.md"))
    return dst


def _edit(model_dir: Path, name: str, fn) -> None:
    """Rewrite one stored tensor of model_dir in place."""
    for f in sorted(set(checkpoint_files(model_dir).values())):
        t = load_file(f)
        if name in t:
            t[name] = fn(t[name])
            save_file(t, f, metadata={"format": "pt"})
            return
    raise KeyError(name)


@pytest.fixture(scope="module")
def shipped_tensors():
    return _tensors(SHIPPED)


def _a_bf16_matrix(tensors) -> str:
    return next(k for k, t in tensors.items() if t.dtype == torch.bfloat16 and t.dim() == 2 and "embed" in k)


def test_a_model_averaged_with_itself_is_itself(tmp_path, shipped_tensors):
    """Every weight as the model computes with it is unchanged: FP4 experts dequantised and
    requantised (a block may come back with a smaller scale holding the same values), bf16 and
    float32 tensors bit-identical."""
    out = average_models(SHIPPED, SHIPPED, 0.5, tmp_path / "avg")
    got = _tensors(out)
    assert got.keys() == shipped_tensors.keys()
    for k, t in shipped_tensors.items():
        if t.dtype not in (torch.int8, torch.float8_e8m0fnu):
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    ours, theirs = float_model(out).state_dict(), float_model(SHIPPED).state_dict()
    for k, t in theirs.items():
        assert torch.equal(ours[k], t), k
    assert (out / "tokenizer.json").read_bytes() == (SHIPPED / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads((SHIPPED / "config.json").read_text())


def test_the_weight_sets_each_models_share(tmp_path, shipped_tensors):
    name = _a_bf16_matrix(shipped_tensors)
    b = _copy(tmp_path / "b")
    _edit(b, name, lambda t: t + 0.25)
    a_t, b_t = shipped_tensors[name].float(), _tensors(b)[name].float()
    for w in (0.0, 0.5, 1.0):
        got = _tensors(average_models(SHIPPED, b, w, tmp_path / f"avg{w}"))
        want = ((1.0 - w) * a_t + w * b_t).to(torch.bfloat16)
        assert torch.equal(got[name], want), w
        other = next(k for k in shipped_tensors if k != name and shipped_tensors[k].dtype == torch.bfloat16)
        assert torch.equal(got[other], shipped_tensors[other])


def test_two_models_that_are_not_one_architecture_and_tokenizer_are_refused(tmp_path, shipped_tensors):
    b = _copy(tmp_path / "b")
    cfg = json.loads((b / "config.json").read_text())
    cfg["index_topk"] = 32
    (b / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="different configs \\(index_topk\\)"):
        average_models(SHIPPED, b, 0.5, tmp_path / "out")

    c = _copy(tmp_path / "c")
    tok = json.loads((c / "tokenizer.json").read_text())
    tok["added_tokens"][0]["content"] += "x"
    (c / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="different tokenizers"):
        average_models(SHIPPED, c, 0.5, tmp_path / "out")

    d = _copy(tmp_path / "d")
    table = next(k for k, t in shipped_tensors.items() if not t.is_floating_point() and t.dim() >= 1
                 and "tid2eid" in k)
    _edit(d, table, lambda t: t.flip(0))
    with pytest.raises(ValueError, match="is not a weight to average"):
        average_models(SHIPPED, d, 0.5, tmp_path / "out")

    with pytest.raises(ValueError, match="weight must lie in"):
        average_models(SHIPPED, SHIPPED, 1.5, tmp_path / "out")
    with pytest.raises(ValueError, match="one of the models being averaged"):
        average_models(SHIPPED, d, 0.5, d)


def test_command_names_a_bad_directory_without_a_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "hybridkv.train.average", str(SHIPPED), str(tmp_path),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode != 0 and "no config.json" in r.stderr and "Traceback" not in r.stderr
