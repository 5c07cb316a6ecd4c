import json

import pytest

from hybridkv.config import ModelConfig, load_config
from hybridkv.errors import ConfigError
from hybridkv.presets import PRESETS, V4_TINY, get_preset


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


@pytest.mark.parametrize("change, message", [
    ({"kv_source_layer_ids": [2, 9]}, "kv_source_layer_ids names layer 9, outside"),
    ({"kv_source_layer_ids": [1, 6]}, "names layer 1, which does not compress"),
    ({"index_source_layer_ids": [2, 6, 4]}, "strictly increasing"),
    ({"candidate_source_layer_id": 7}, "must be one of kv_source_layer_ids"),
    ({"index_source_layer_ids": [2, 5, 6], "candidate_source_layer_id": 6}, "Reindex layer 5 comes before"),
])
def test_v41_validation(fixtures, change, message):
    base = json.loads((fixtures / "v4-tiny" / "config.json").read_text())
    base.update({"model_type": "deepseek_v41", "num_hidden_layers": 8, "num_nextn_predict_layers": 0,
                 "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1], "kv_source_layer_ids": [2, 6],
                 "index_source_layer_ids": [2, 6], "candidate_source_layer_id": 6, "candidate_topk_blocks": 4,
                 "candidate_block_size": 8})
    ModelConfig.from_dict(base)  # the base plan is valid
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**base, **change})


def test_load_config_sources(fixtures):
    assert load_config("v4-flash").hidden_size == 4096
    assert load_config(fixtures / "v4-tiny").hidden_size == 128
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(fixtures / "does-not-exist")
