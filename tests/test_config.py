import json

import pytest

from hybridkv.config import ModelConfig
from hybridkv.errors import ConfigError
from hybridkv.presets import PRESETS, V4_TINY, get_preset, load_config


def test_golden_configs_load(fixtures):
    c = ModelConfig.from_json(fixtures / "v4-tiny")
    assert c.compress_ratios == (0, 4, 128, 4, 128, 4, 0)
    assert c.rope_scaling.factor == 4 and c.rope_scaling.original_max_position_embeddings == 256
    assert [c.layer_kind(i) for i in range(6)] == ["swa", "csa", "hca", "csa", "hca", "csa"]
    assert c.block_tokens == 128 and not c.quantized and not c.kv_pow2_scales
    q = ModelConfig.from_json(fixtures / "v4-tiny-fp8")
    assert q.quantized and q.fp8_block == (128, 128) and q.expert_dtype == "fp4" and q.kv_pow2_scales


def test_round_trip_keeps_unknown_fields(tmp_path):
    d = dict(V4_TINY, some_future_field={"a": 1})
    c = ModelConfig.from_dict(d)
    c.save(tmp_path)
    again = ModelConfig.from_json(tmp_path)
    assert again == c
    assert json.loads((tmp_path / "config.json").read_text())["some_future_field"] == {"a": 1}


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_validate(name):
    c = get_preset(name)
    assert c.vocab_size > 0


def test_preset_dims():
    f = get_preset("v4-flash")
    assert (f.hidden_size, f.num_hidden_layers, f.head_dim, f.index_topk) == (4096, 43, 512, 512)
    assert sum(r == 4 for r in f.compress_ratios) == 21 and sum(r == 128 for r in f.compress_ratios) == 20
    p = get_preset("v4-pro")
    assert sum(r == 4 for r in p.compress_ratios) == 30 and sum(r == 128 for r in p.compress_ratios) == 31
    v = get_preset("v4.1-flash")
    assert v.family == "v4.1" and v.kv_source_layer_ids == (2, 8, 14, 20)
    assert v.candidate_topk_blocks == 2048 and v.candidate_block_size == 8


@pytest.mark.parametrize("change, message", [
    ({"compress_ratios": [0, 4, 128, 4, 128, 4]}, "compress_ratios has 6 entries but num_hidden_layers (6) + "
                                                  "num_nextn_predict_layers (1) = 7"),
    ({"qk_rope_head_dim": 64}, "head_dim - qk_rope_head_dim = 32 is not a multiple of the FP8 KV block (64)"),
    ({"num_key_value_heads": 2}, "num_key_value_heads must be 1"),
    ({"o_groups": 3}, "must be divisible by o_groups"),
    ({"scoring_func": "relu"}, "scoring_func must be one of"),
    ({"num_experts_per_tok": 9}, "exceeds n_routed_experts"),
    ({"index_head_dim": 48}, "index_head_dim (48) must be a power of two"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling.type 'linear' is not supported"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
])
def test_validation_errors(change, message):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict({**V4_TINY, **change})
    assert message in str(e.value)


def test_missing_compress_ratios():
    d = dict(V4_TINY)
    d.pop("compress_ratios")
    with pytest.raises(ConfigError, match="no 'compress_ratios'"):
        ModelConfig.from_dict(d)


def _v41_base(fixtures) -> dict:
    base = json.loads((fixtures / "v4-tiny" / "config.json").read_text())
    base.update({"model_type": "deepseek_v41", "num_hidden_layers": 8, "num_nextn_predict_layers": 0,
                 "num_hash_layers": 0, "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1], "kv_source_layer_ids": [2, 4],
                 "index_source_layer_ids": [2, 4, 6], "candidate_source_layer_id": 4, "candidate_topk_blocks": 4,
                 "candidate_block_size": 8})
    return base


@pytest.mark.parametrize("change, message", [
    ({"kv_source_layer_ids": [2, 9]}, "kv_source_layer_ids names layer 9, outside"),
    ({"kv_source_layer_ids": [1, 4]}, "names layer 1, which does not compress"),
    ({"index_source_layer_ids": [2, 6, 4]}, "strictly increasing"),
    ({"index_source_layer_ids": [2, 6]}, r"kv source layer\(s\) \[4\] must also be in index_source_layer_ids"),
    ({"candidate_source_layer_id": 6}, "must be one of kv_source_layer_ids"),
    ({"index_source_layer_ids": [2, 3, 4, 6]}, "Reindex layer 3 comes before the candidate source layer 4"),
    ({"kv_source_layer_ids": [3, 4], "index_source_layer_ids": [3, 4, 6]}, "layer 2 compresses .* before the first kv"),
    ({"kv_source_layer_ids": [2, 5], "index_source_layer_ids": [2, 5, 6], "candidate_source_layer_id": 5},
     r"layer 4 \(ratio 1\) reads the compressed KV of layer 2 \(ratio 2\)"),
    ({"kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 3, 4], "candidate_source_layer_id": 2},
     r"index source layer 4 \(ratio 1\) takes its top-k inside the candidate pool of layer 2 \(ratio 2\)"),
    ({"candidate_topk_blocks": 2, "index_topk": 16}, "can hold as few as 9 positions, fewer than index_topk"),
    ({"candidate_block_size": 0}, "candidate_block_size as a positive integer"),
    ({"num_hash_layers": 1}, "num_hash_layers must be 0 for DeepSeek-V4.1"),
    ({"head_dim": 112, "qk_rope_head_dim": 16}, r"head_dim \(112\) must be a multiple of 32"),
    ({"index_head_dim": 48}, r"index_head_dim \(48\) must be a multiple of 32"),
    ({"kv_source_layer_ids": None}, "a V4.1 config needs kv_source_layer_ids"),
])
def test_v41_validation(fixtures, change, message):
    base = _v41_base(fixtures)
    c = ModelConfig.from_dict(base)  # the base plan is valid
    assert [c.layer_kind(i) for i in range(8)] == ["swa", "swa", "full", "reuse", "full", "reuse", "reindex", "reuse"]
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**base, **change})


def test_v41_plan(fixtures):
    c = ModelConfig.from_json(fixtures / "v41-tiny")
    assert c.family == "v4.1" and c.kv_pow2_scales  # the V4.1 reference always uses ue8m0 KV scales
    assert [c.layer_kind(i) for i in range(10)] == ["swa", "swa", "full", "reuse", "reuse", "reuse", "full", "reuse",
                                                    "reindex", "reuse"]
    assert [c.kv_source(i) for i in range(10)] == [None, None, 2, 2, 2, 2, 6, 6, 6, 6]
    assert [c.index_source(i) for i in range(10)] == [None, None, 2, 2, 2, 2, 6, 6, 8, 8]
    assert [i for i in range(10) if c.uses_candidates(i)] == [8]
    f = get_preset("v4.1-flash")
    assert [i for i in range(40) if f.layer_kind(i) == "reindex"] == [24, 28, 32, 36]
    assert f.fp8_block == (32, 32) and f.index_source(27) == 24 and f.kv_source(39) == 20


def test_v41_release_config_nesting(fixtures):
    """A multimodal release nests the language model under text_config; -1 means no candidate pool."""
    text = {k: v for k, v in json.loads((fixtures / "v41-tiny" / "config.json").read_text()).items()
            if k not in ("architectures",)}
    text["model_type"] = "deepseek_v41_text"
    release = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForConditionalGeneration"],
               "text_config": text, "vision_config": {"num_hidden_layers": 32, "hidden_size": 1024}}
    c = ModelConfig.from_dict(release)
    assert c.model_type == "deepseek_v41" and c.num_hidden_layers == 10 and c.multimodal
    assert c.extra["vision_config"]["hidden_size"] == 1024
    assert not ModelConfig.from_json(fixtures / "v41-tiny").multimodal
    off = ModelConfig.from_dict({**text, "model_type": "deepseek_v41", "candidate_source_layer_id": -1,
                                 "index_source_layer_ids": [2, 6]})
    assert off.candidate_source_layer_id is None and not any(off.uses_candidates(i) for i in range(10))


def test_load_config_sources(fixtures):
    assert load_config("v4-flash").hidden_size == 4096
    assert load_config(fixtures / "v4-tiny").hidden_size == 128
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(fixtures / "does-not-exist")
