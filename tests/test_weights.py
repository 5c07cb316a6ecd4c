"""Checkpoint loading and saving in the release format, and its error messages."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv.errors import CheckpointError, ConfigError
from hybridkv.model import ContiguousKV, ForwardBatch
from hybridkv.weights import checkpoint_files, load_model, save_checkpoint


def _copy(fixtures, tmp_path, name="v4-tiny"):
    dst = tmp_path / name
    shutil.copytree(fixtures / name, dst)
    (dst / "golden.safetensors").unlink()
    return dst


def _edit(path, fn):
    sd = load_file(path / "model.safetensors")
    fn(sd)
    save_file(sd, path / "model.safetensors")


def test_removed_tensor(fixtures, tmp_path):
    d = _copy(fixtures, tmp_path)
    _edit(d, lambda sd: sd.pop("layers.3.attn.indexer.wq_b.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): layers\.3\.attn\.indexer\.wq_b\.weight"):
        load_model(d)


def test_wrong_shape(fixtures, tmp_path):
    d = _copy(fixtures, tmp_path)
    _edit(d, lambda sd: sd.__setitem__("layers.1.attn.wkv.weight", torch.zeros(96, 127)))
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert "tensor layers.1.attn.wkv.weight: expected shape [96, 128]" in str(e.value)
    assert "found shape [96, 127] dtype F32" in str(e.value)


def test_wrong_dtype(fixtures, tmp_path):
    d = _copy(fixtures, tmp_path, "v4-tiny-fp8")

    def to_bf16(sd):
        sd["layers.0.attn.wq_a.weight"] = sd["layers.0.attn.wq_a.weight"].float().bfloat16()
    _edit(d, to_bf16)
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert "tensor layers.0.attn.wq_a.weight: expected shape [128, 256] dtype F8_E4M3, found shape [128, 256] dtype BF16" \
        in str(e.value)


def test_unexpected_tensor(fixtures, tmp_path):
    d = _copy(fixtures, tmp_path)
    _edit(d, lambda sd: sd.__setitem__("layers.9.attn.wkv.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected tensor.*layers.9.attn.wkv.weight"):
        load_model(d)


def test_config_layer_count_mismatch(fixtures, tmp_path):
    d = _copy(fixtures, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["compress_ratios"] = cfg["compress_ratios"][:-2]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="compress_ratios has 5 entries but num_hidden_layers"):
        load_model(d)


def test_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model(tmp_path)


def test_release_dtypes_accepted(fixtures, tmp_path):
    """tid2eid as I64 (release) and bf16 norms load; the values are what the file holds."""
    d = _copy(fixtures, tmp_path)

    def release_like(sd):
        sd["layers.0.ffn.gate.tid2eid"] = sd["layers.0.ffn.gate.tid2eid"].to(torch.int64)
        sd["norm.weight"] = sd["norm.weight"].bfloat16()
    _edit(d, release_like)
    model, _ = load_model(d)
    ref = load_file(fixtures / "v4-tiny" / "model.safetensors")
    assert torch.equal(model.layers[0].ffn.gate.tid2eid, ref["layers.0.ffn.gate.tid2eid"])
    assert torch.equal(model.norm.weight, ref["norm.weight"].bfloat16().float())


def _logits(model, ids):
    kv = ContiguousKV(model.config)
    with torch.no_grad():
        h = model(ids, ForwardBatch.build([(kv, 0, ids.numel())]))
        return model.logits(h[-1:])


@pytest.mark.parametrize("shard", [None, 400_000])
def test_save_load_round_trip(fixtures, tmp_path, shard):
    model, cfg = load_model(fixtures / "v4-tiny-fp8")
    out = tmp_path / "saved"
    save_checkpoint(model, cfg, out, max_shard_bytes=shard)
    if shard:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    again, cfg2 = load_model(out)
    assert cfg2 == cfg
    saved = {}
    for f in out.glob("*.safetensors"):
        saved.update(load_file(f))
    assert saved["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert saved["layers.0.ffn.experts.3.w1.weight"].dtype == torch.int8  # packed FP4
    assert saved["layers.0.ffn.gate.tid2eid"].dtype == torch.int64       # the release's I64
    assert not list(out.glob("*.tmp"))
    ids = torch.arange(2, 150)
    assert torch.equal(_logits(model, ids), _logits(again, ids))


def test_index_naming_missing_shard(fixtures, tmp_path):
    model, cfg = load_model(fixtures / "v4-tiny")
    save_checkpoint(model, cfg, tmp_path, max_shard_bytes=2_000_000)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {victim.name}, which does not exist"):
        load_model(tmp_path)


@pytest.mark.parametrize("model", ["tiny-v4", "tiny-v41"])
def test_attention_projections_load_into_one_stacked_buffer(model):
    """Loading (bf16, the release's dtypes) puts each attention layer's per-token float projections
    (V4: compressor kv/gate, indexer compressor kv/gate, indexer head weights; V4.1's Full layers:
    compressor kv (and gate), indexer head weights) in one buffer, in order, and every one of them
    holds exactly its checkpoint tensor."""
    from safetensors import safe_open

    from hybridkv.model.attention import Attention
    from hybridkv.model.linear import stacked_weight
    model_dir = Path(__file__).resolve().parents[1] / "models" / model
    model, cfg = load_model(model_dir, dtype=torch.bfloat16)
    files = checkpoint_files(model_dir)
    names = {id(p): n for n, p in model.named_parameters()}
    stacked = 0
    for attn in (m for m in model.modules() if isinstance(m, Attention)):
        proj = attn.token_projections()
        if not proj:
            continue
        # all of them, or (this model's compressors are float32, its indexer head weights bf16) all
        # but the indexer's head weights
        group = attn.stacked_projections
        assert group in (proj, proj[:-1]) and len({lin.weight.dtype for lin in group}) == 1
        w = stacked_weight(group)
        assert w is not None and w.shape[0] == sum(p.out_features for p in group)
        stacked += 1
        for lin in proj:
            name = names[id(lin.weight)]
            with safe_open(files[name], "pt") as f:
                assert torch.equal(lin.weight, f.get_tensor(name).to(lin.weight.dtype)), name
    if cfg.family == "v4.1":      # the Full layers: the others read a source layer's entries
        assert stacked == sum(1 for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == "full") > 0
    else:                         # every compressed layer of the blocks and of the MTP layers
        assert stacked == sum(1 for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
                              if cfg.layer_ratio(i))
