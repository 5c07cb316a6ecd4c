"""DeepSeek-V4.1 beyond the golden outputs: what each layer owns, the release checkpoint names,
KV bytes against kv-calc, ragged batches, the gate, and the real-size plan."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridkv.cache.layout import kv_layout
from hybridkv.config import ModelConfig
from hybridkv.demo import kv_accounting
from hybridkv.errors import CheckpointError, ConfigError
from hybridkv.model import ContiguousKV, ForwardBatch, Transformer
from hybridkv.model.moe import Gate
from hybridkv.presets import get_preset
from hybridkv.weights import load_model, save_checkpoint


@pytest.fixture(scope="module")
def tiny(fixtures):
    return load_model(fixtures / "v41-tiny")


def _prefill(model, ids, chunks, kv=None):
    kv = kv or ContiguousKV(model.config)
    pos, out = 0, []
    with torch.no_grad():
        for n in chunks:
            out.append(model.logits(model(ids[pos:pos + n], ForwardBatch.build([(kv, pos, n)]))))
            pos += n
    return torch.cat(out), kv


def test_measured_bytes_match_formula(tiny):
    """Entries held after a run, priced in the v41 layout, equal kv-calc's per-token figure times
    the tokens; only the Full layers hold compressed KV and keys; window and compressor state
    equal kv-calc's fixed part."""
    model, cfg = tiny
    n = 300  # a multiple of every ratio, so every entry is whole
    _, kv = _prefill(model, torch.arange(n) % cfg.vocab_size, [128, 101, 71])
    rows = {kind: (entries, held, priced) for kind, entries, held, priced in kv_accounting(kv)}
    lay = kv_layout(cfg, "v41")
    assert set(lay.per_token) == {"global KV", "indexer keys"}
    for kind in lay.per_token:
        assert rows[kind][2] == pytest.approx(lay.per_token[kind] * n)
    assert rows["global KV"][0] == n // 2 + n          # layer 2 (ratio 2) and layer 6 (ratio 1)
    # head_dim 128: 64 B of E2M1 + 8 e4m3 scales; index_head_dim 64: 32 B + 2 ue8m0; window 128 + 4
    assert lay.per_token == {"global KV": 72 * (1 / 2 + 1), "indexer keys": 34 * (1 / 2 + 1)}
    assert rows["window"][2] == lay.fixed["window"] == 10 * 128 * 132
    assert rows["compressor state"][1] == lay.fixed["compressor state"] == 2 * 4 * 2 * cfg.head_dim
    for layer_id, layer in enumerate(kv.layers):
        owns = cfg.layer_kind(layer_id) == "full"
        assert layer.kinds == (("kv", "index") if owns else ()), layer_id
        assert bool(layer.states) == (owns and cfg.layer_ratio(layer_id) > 1), layer_id
    assert rows["global KV"][1] == (n // 2 + n) * cfg.head_dim * 4  # float32 storage in this run


def test_ragged_batch_equals_requests_alone(tiny):
    """Requests of different lengths at different positions in one flat batch: the cross-layer
    top-k and candidate pool are per request (a request with no complete group yet included)."""
    model, cfg = tiny
    gen = torch.Generator().manual_seed(3)
    plans = [[1], [1, 1, 1], [20, 17], [64, 64, 3], [100, 100, 61]]
    prompts = [torch.randint(2, cfg.vocab_size, (sum(p),), generator=gen) for p in plans]
    alone = [_prefill(model, p, c)[0] for p, c in zip(prompts, plans)]
    kvs = [ContiguousKV(cfg) for _ in prompts]
    done = [0] * len(plans)
    got = [[] for _ in plans]
    with torch.no_grad():
        for step in range(3):
            items, ids = [], []
            for r, plan in enumerate(plans):
                if step < len(plan):
                    items.append((r, (kvs[r], done[r], plan[step])))
                    ids.append(prompts[r][done[r]:done[r] + plan[step]])
                    done[r] += plan[step]
            batch = ForwardBatch.build([it for _, it in items])
            logits = model.logits(model(torch.cat(ids), batch))
            for (r, _), seg in zip(items, batch.segments):
                got[r].append(logits[seg.rows])
    for r in range(len(plans)):
        mine = torch.cat(got[r])
        err = (mine - alone[r]).pow(2).mean().sqrt() / alone[r].pow(2).mean().sqrt()
        assert err < 1e-4, (r, float(err))
        assert torch.equal(mine.argmax(-1), alone[r].argmax(-1))


def test_checkpoint_names_follow_the_layer_modes(tiny):
    model, cfg = tiny
    sd = model.state_dict()
    assert not [k for k in sd if "hc_head" in k or k.startswith("mtp.")]
    assert "layers.2.attn.compressor.wgate.weight" in sd and "layers.2.attn.compressor.ape" not in sd
    assert "layers.6.attn.compressor.wkv.weight" in sd and "layers.6.attn.compressor.wgate.weight" not in sd
    for full in (2, 6):
        assert {f"layers.{full}.attn.indexer.{n}.weight" for n in ("wq_b", "wk", "k_norm", "weights_proj")} <= set(sd)
    assert [k for k in sd if k.startswith("layers.8.attn.indexer.")] == [
        "layers.8.attn.indexer.wq_b.weight", "layers.8.attn.indexer.weights_proj.weight"]
    for reuse in (3, 7, 9):
        assert not [k for k in sd if k.startswith(f"layers.{reuse}.attn.") and ("indexer" in k or "compressor" in k)]
    assert "layers.5.ffn.gate.bias" in sd and "layers.5.ffn.gate.bias_vl" not in sd


def _copy(fixtures, tmp_path, name="v41-tiny"):
    dst = tmp_path / name
    shutil.copytree(fixtures / name, dst)
    (dst / "golden.safetensors").unlink()
    return dst


def _edit(path, fn):
    sd = load_file(path / "model.safetensors")
    fn(sd)
    save_file(sd, path / "model.safetensors")


def test_mode_mismatch_errors(fixtures, tmp_path):
    """A checkpoint whose layer modes differ from the config's plan is refused, naming the tensors."""
    d = _copy(fixtures, tmp_path)

    def reindex_with_keys(sd):
        sd["layers.8.attn.indexer.wk.weight"] = sd["layers.6.attn.indexer.wk.weight"].clone()
        sd.pop("layers.6.attn.indexer.k_norm.weight")
    _edit(d, reindex_with_keys)
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert "missing tensor(s): layers.6.attn.indexer.k_norm.weight" in str(e.value)
    assert "unexpected tensor(s) not used by this config: layers.8.attn.indexer.wk.weight" in str(e.value)


def test_release_dtypes_and_round_trip(fixtures, tmp_path):
    """bf16 compressor/indexer weights (the release's dtype) load; save + load keeps the logits."""
    d = _copy(fixtures, tmp_path, "v41-tiny-fp8")

    def to_bf16(sd):
        for k in ("layers.2.attn.compressor.wkv.weight", "layers.6.attn.indexer.wk.weight",
                  "layers.8.attn.indexer.weights_proj.weight"):
            sd[k] = sd[k].bfloat16()
    _edit(d, to_bf16)
    model, cfg = load_model(d)
    assert model.layers[2].attn.compressor.wkv.weight.dtype == torch.float32
    out = tmp_path / "saved"
    save_checkpoint(model, cfg, out)
    again, cfg2 = load_model(out)
    assert cfg2 == cfg and cfg2.family == "v4.1"
    ids = torch.arange(2, 140)
    assert torch.equal(_prefill(model, ids, [138])[0], _prefill(again, ids, [138])[0])


def test_multimodal_gate_has_vl_bias(fixtures):
    d = json.loads((fixtures / "v41-tiny" / "config.json").read_text())
    cfg = ModelConfig.from_dict({**d, "vision_config": {"num_hidden_layers": 2}})
    with torch.device("meta"):
        sd = Transformer(cfg).state_dict()
    assert "layers.2.ffn.gate.bias_vl" in sd and "layers.2.ffn.gate.bias" in sd
    with pytest.raises(ConfigError, match="Engram memory layers are not implemented"):
        Transformer(ModelConfig.from_dict({**d, "engram_layer_ids": [1]}))


def test_gate_temperature_and_normalisation(tiny):
    """V4.1's gate: logits / gate_temp, sqrt-softplus scores, selection by score + bias, weights
    from the unbiased scores normalised to 1 (times routed_scaling_factor)."""
    _, cfg = tiny
    gate = Gate(cfg.replace(gate_temp=2.0), 3)
    with torch.no_grad():
        gate.weight.copy_(torch.randn_like(gate.weight))
        gate.bias.copy_(torch.tensor([0, 0, 0, 5.0, 0, 0, 0, 0]))
    x = torch.randn(5, cfg.hidden_size)
    w, ids = gate(x, None)
    scores = torch.nn.functional.softplus(x @ gate.weight.T / 2.0).sqrt()
    assert (ids == 3).any(-1).all()  # the bias forces expert 3 into every selection
    expect = scores.gather(1, ids)
    assert torch.allclose(w, expect / expect.sum(-1, keepdim=True) * cfg.routed_scaling_factor)


def test_meta_instantiation_real_plan():
    cfg = get_preset("v4.1-flash")
    with torch.device("meta"):
        model = Transformer(cfg, dtype=torch.bfloat16)
    sd = model.state_dict()
    assert len(model.layers) == 40 and len(model.mtp) == 0
    assert sd["layers.20.attn.compressor.wkv.weight"].shape == (512, 5120)
    assert "layers.20.attn.compressor.wgate.weight" not in sd and "layers.14.attn.compressor.wgate.weight" in sd
    assert sd["layers.24.attn.indexer.wq_b.weight"].shape == (32 * 128, 1280)
    assert sd["layers.24.attn.indexer.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert sd["layers.24.attn.indexer.wq_b.scale"].shape == (32 * 128 // 32, 1280 // 32)
    assert "layers.24.attn.indexer.wk.weight" not in sd and sd["layers.20.attn.indexer.wk.weight"].shape == (128, 512)
    assert not [k for k in sd if k.startswith("layers.21.attn.") and ("indexer" in k or "compressor" in k)]
    assert sd["layers.3.ffn.experts.0.w1.weight"].shape == (2304, 5120 // 2)
    assert sum(model.layers[i].attn.compressor is not None for i in range(40)) == 4
