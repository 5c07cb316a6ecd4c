"""Random-weight checkpoints with a preset's real shapes load as release-format models and serve."""

import pytest
import torch

from hybridkv.engine import LLM, SamplingParams
from hybridkv.tools.random_checkpoint import shaped_config, write_random_checkpoint
from hybridkv.weights import load_model


def test_shaped_config_keeps_the_pattern():
    c = shaped_config("v4-flash", layers=4, vocab=1024, experts=8, moe_inter=256)
    assert list(c.compress_ratios) == [0, 0, 4, 128, 0]
    assert (c.head_dim, c.hidden_size, c.index_topk, c.vocab_size) == (512, 4096, 512, 1024)


def test_a_shorter_v41_stack_keeps_every_layer_mode():
    """V4.1-Flash at fewer layers: its runs of ratio 2 and 1 shortened in proportion, the source
    layers at the preset's offsets in each run; at the preset's depth, the preset itself."""
    from hybridkv.presets import PRESETS
    full = shaped_config("v4.1-flash", layers=40)
    d = PRESETS["v4.1-flash"]
    assert list(full.compress_ratios) == d["compress_ratios"]
    assert (list(full.kv_source_layer_ids), list(full.index_source_layer_ids), full.candidate_source_layer_id) == \
        (d["kv_source_layer_ids"], d["index_source_layer_ids"], d["candidate_source_layer_id"])
    c = shaped_config("v4.1-flash", layers=20, vocab=1024, experts=8, moe_inter=256)
    assert list(c.compress_ratios) == [0, 0] + [2] * 9 + [1] * 9 + [0, 0, 0]
    kinds = [c.layer_kind(i) for i in range(20)]
    assert kinds.count("full") == 3 and kinds.count("reindex") == 2 and kinds.count("reuse") == 13
    assert c.candidate_source_layer_id == 11 and c.uses_candidates(15) and not c.uses_candidates(8)
    four = shaped_config("v4.1-flash", layers=4)        # one layer of each ratio: both Full
    assert [four.layer_kind(i) for i in range(4)] == ["swa", "swa", "full", "full"]
    with pytest.raises(ValueError, match="window-only"):
        shaped_config("v4.1-flash", layers=2)


def test_random_fp8_checkpoint_loads_and_serves(tmp_path):
    """v4-tiny-fp8's shapes: FP8 linears with e8m0 scales and packed FP4 experts, served in the fp8
    KV layout."""
    cfg = shaped_config("v4-tiny-fp8")
    write_random_checkpoint(cfg, tmp_path / "m")
    model, loaded = load_model(tmp_path / "m")
    assert loaded.quantized and loaded.to_dict()["expert_dtype"] == "fp4"
    assert model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    llm = LLM(tmp_path / "m", num_blocks=16, max_num_seqs=2, kv_format="fp8")
    out = llm.generate([list(range(2, 300))], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.error is None and len(out.output_ids) == 4


def test_written_part_by_part_in_release_dtypes(tmp_path):
    """One shard per part plus an index; FP8 linears with e8m0 block scales, experts packed FP4 with
    the init's spread, every non-expert tensor set by the init (the tool fails on a NaN left over)."""
    import json

    from safetensors import safe_open

    cfg = shaped_config("v4-tiny-fp8", experts=4)
    write_random_checkpoint(cfg, tmp_path / "m", seed=3)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers + 2
    layer_shard = index["weight_map"]["layers.1.ffn.experts.0.w1.weight"]
    assert {f for n, f in index["weight_map"].items() if n.startswith("layers.1.")} == {layer_shard}
    model, _ = load_model(tmp_path / "m")
    w1 = model.layers[1].ffn.experts[2].w1
    assert w1.weight.dtype == torch.int8 and w1.scale.dtype == torch.float8_e8m0fnu
    std = w1.dense_weight().std().item()
    assert 0.01 < std < 0.04, std
    wq = model.layers[0].attn.wq_a
    assert wq.scale.shape == (-(-wq.out_features // 128), -(-wq.in_features // 128))
    assert 0.015 < wq.dense_weight().std().item() < 0.025
    with safe_open(tmp_path / "m" / layer_shard, "pt") as f:
        assert f.get_slice("layers.1.ffn.experts.0.w1.weight").get_dtype() == "I8"
    # the same seed writes the same bytes; another seed other weights
    write_random_checkpoint(cfg, tmp_path / "again", seed=3)
    write_random_checkpoint(cfg, tmp_path / "other", seed=4)
    same, _ = load_model(tmp_path / "again")
    other, _ = load_model(tmp_path / "other")
    assert torch.equal(same.layers[1].ffn.experts[2].w1.weight, w1.weight)
    assert not torch.equal(other.layers[1].ffn.experts[2].w1.weight, w1.weight)
    assert torch.equal(same.embed.weight, model.embed.weight)


def test_parts_written_by_several_processes_are_the_same_bytes(tmp_path):
    """`jobs` processes write the same shards, index and config as one."""
    cfg = shaped_config("v4-tiny-fp8", layers=2, experts=4)
    write_random_checkpoint(cfg, tmp_path / "one", seed=5)
    write_random_checkpoint(cfg, tmp_path / "two", seed=5, jobs=2)
    one = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert one == sorted(p.name for p in (tmp_path / "two").iterdir())
    assert not [n for n in one if n.endswith(".tmp")]
    for name in one:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_random_checkpoint_gives_finite_logits_at_v4_flash_width(tmp_path):
    """V4-Flash's hidden size, attention and FP8 layout with a narrow MoE: the logits are finite and
    of the init's size."""
    from hybridkv.model import ContiguousKV, ForwardBatch

    cfg = shaped_config("v4-flash", layers=2, vocab=256, experts=4, moe_inter=256)
    write_random_checkpoint(cfg, tmp_path / "m")
    model, cfg = load_model(tmp_path / "m")
    ids = torch.arange(2, 12)
    with torch.no_grad():
        logits = model.logits(model(ids, ForwardBatch.build([(ContiguousKV(cfg), 0, len(ids))])))
    assert bool(torch.isfinite(logits).all())
    assert 0 < logits.std().item() < 100
    # wo_a as the release's conversion writes it: FP8 values widened to bf16, which pack back exactly
    from hybridkv.model.attention import Attention
    from hybridkv.ops.qgemm.fp8_exact import exact_fp8
    wo_a = [m.wo_a.weight for m in model.modules() if isinstance(m, Attention)]
    assert wo_a and all(exact_fp8(w) is not None for w in wo_a)


def test_release_bf16_weights_stay_bf16_in_a_half_precision_model(tmp_path):
    """The head, the compressors' projections and the norms are written in bf16 as the release
    stores them. A bf16 (inference) model keeps the head and compressor weights in bf16, half their
    float32 bytes, and computes the same logits as with widened float32 copies; a float32 model
    (training, the reference) widens them at load."""
    from safetensors import safe_open

    from hybridkv.model import ContiguousKV, ForwardBatch
    from hybridkv.weights import INDEX_FILE, load_state

    cfg = shaped_config("v4-tiny-fp8", experts=4)
    write_random_checkpoint(cfg, tmp_path / "m", seed=5)
    import json
    index = json.loads((tmp_path / "m" / INDEX_FILE).read_text())["weight_map"]
    csa = next(i for i, r in enumerate(cfg.compress_ratios) if r == 4)
    comp = f"layers.{csa}.attn.compressor"
    for name in ("head.weight", f"{comp}.wkv.weight", f"{comp}.wgate.weight", "layers.0.attn_norm.weight", "hc_head_fn"):
        with safe_open(tmp_path / "m" / index[name], "pt") as f:
            assert f.get_slice(name).get_dtype() == ("F32" if name == "hc_head_fn" else "BF16"), name
    narrow, _ = load_model(tmp_path / "m", dtype=torch.bfloat16)
    comp = narrow.layers[csa].attn.compressor
    assert narrow.head.weight.dtype == comp.wkv.weight.dtype == comp.wgate.weight.dtype == torch.bfloat16
    assert narrow.layers[0].attn_norm.weight.dtype == torch.float32
    wide, _ = load_model(tmp_path / "m")
    assert wide.head.weight.dtype == torch.float32
    from hybridkv.model import Transformer
    widened = Transformer(cfg, dtype=torch.bfloat16)
    load_state(widened, tmp_path / "m")
    assert widened.head.weight.dtype == torch.float32
    ids = torch.arange(2, 40)
    with torch.no_grad():
        a, b = (m.logits(m(ids, ForwardBatch.build([(ContiguousKV(cfg, dtype=torch.bfloat16), 0, len(ids))])))
                for m in (narrow, widened))
    assert torch.equal(a, b)


_PEAK_SCRIPT = """
import json, resource, sys
from hybridkv.tools.random_checkpoint import shaped_config, write_random_checkpoint
cfg = shaped_config("v4-tiny-fp8", layers=8, experts=128, moe_inter=1024)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
write_random_checkpoint(cfg, sys.argv[1])
print(json.dumps({"before": before * 1024, "after": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def test_host_memory_stays_near_one_part(tmp_path):
    """Writing a ~480 MB checkpoint of 8 blocks (~56 MB each) raises the process's peak RSS by far
    less than the checkpoint (a float32 model of it would be ~3.5 GB): parts are made and streamed
    one at a time."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "m")], capture_output=True, text=True,
                         env={**os.environ}, check=True)
    peak = json.loads(out.stdout.strip().splitlines()[-1])
    files = [tmp_path / "m" / f for f in os.listdir(tmp_path / "m") if f.endswith(".safetensors")]
    total, largest = sum(f.stat().st_size for f in files), max(f.stat().st_size for f in files)
    growth = peak["after"] - peak["before"]
    assert total > 400e6 and largest < total / 6
    # the module objects of the two meta models and the allocator's slack take ~120 MB here
    assert growth < 2 * largest + 150e6, (growth, largest, total)
