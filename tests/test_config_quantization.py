"""How config.json spells a model's quantisation: FP8 linears (the release's quantization_config),
or float linears with FP4/FP8 routed experts (the release's quantization_config with the modules
transformers must leave unconverted), read back to the same ModelConfig."""

import json
from pathlib import Path

import pytest

from hybridkv.config import EXPERTS_ONLY_UNCONVERTED, ModelConfig
from hybridkv.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _shipped() -> dict:
    return json.loads((ROOT / "models" / "tiny-v4" / "config.json").read_text())


def test_float_linears_with_fp4_experts_write_an_experts_only_quantization_config():
    d = _shipped()
    qc = d["quantization_config"]
    assert qc["expert_dtype"] == d["expert_dtype"] == "fp4"
    assert qc["modules_to_not_convert"] == list(EXPERTS_ONLY_UNCONVERTED)
    c = ModelConfig.from_dict(d)
    assert c.quantization_config is None and not c.quantized and not c.kv_pow2_scales and c.expert_dtype == "fp4"
    assert c.to_dict() == d
    # a config written before (no quantization_config) is the same model
    old = {k: v for k, v in d.items() if k != "quantization_config"}
    assert ModelConfig.from_dict(old) == c


def test_fp8_linears_and_float_experts_keep_their_spelling(fixtures):
    fp8 = json.loads((fixtures / "v4-tiny-fp8" / "config.json").read_text())
    c = ModelConfig.from_dict(fp8)
    assert c.quantized and c.kv_pow2_scales and "modules_to_not_convert" not in c.to_dict()["quantization_config"]
    float_experts = ModelConfig.from_dict({**_shipped(), "expert_dtype": "bf16", "quantization_config": None})
    assert "quantization_config" not in float_experts.to_dict()


def test_expert_dtype_inside_the_quantization_config_is_read():
    """V4.1 releases (and transformers) keep expert_dtype in the quantization config."""
    d = _shipped()
    d.pop("expert_dtype")
    assert ModelConfig.from_dict(d).expert_dtype == "fp4"


@pytest.mark.parametrize("change, says", [
    ({"modules_to_not_convert": ["lm_head"]}, "modules_to_not_convert"),
    ({"weight_block_size": [32, 32]}, "weight_block_size"),
    ({"expert_dtype": "fp8"}, "disagree"),
], ids=["other-modules", "block", "two-expert-dtypes"])
def test_an_experts_only_config_hybridkv_cannot_run_is_refused(change, says):
    d = _shipped()
    d["quantization_config"] = {**d["quantization_config"], **change}
    with pytest.raises(ConfigError, match=says):
        ModelConfig.from_dict(d)


def test_an_experts_only_config_needs_quantised_experts():
    d = _shipped()
    d["expert_dtype"] = "bf16"
    d["quantization_config"] = {k: v for k, v in d["quantization_config"].items() if k != "expert_dtype"}
    with pytest.raises(ConfigError, match="quantises only the routed experts"):
        ModelConfig.from_dict(d)
