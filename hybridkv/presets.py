"""Named model configurations with the real dimensions of the public releases, plus tiny ones for
tests. Presets are data: each is the `config.json` dict a release ships (release field names).
`load_config` takes a preset name or a config.json / model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridkv.config import ModelConfig
from hybridkv.errors import ConfigError

_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128]}
_YARN_V4 = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}

V4_FLASH: dict[str, Any] = {
    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_nextn_predict_layers": 1,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "rope_theta": 10000, "compress_rope_theta": 160000, "rope_scaling": _YARN_V4,
    "max_position_embeddings": 1048576,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "num_hash_layers": 3, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "norm_topk_prob": True,
    "topk_method": "noaux_tc", "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": _FP8, "expert_dtype": "fp4",
}

V4_PRO: dict[str, Any] = {
    **V4_FLASH,
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
    "o_groups": 16, "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0], "index_topk": 1024,
    "n_routed_experts": 384, "moe_intermediate_size": 3072, "routed_scaling_factor": 2.5,
}

# V4.1-Flash text backbone. Shapes, plan and quantisation from the release config; the RoPE fields
# are taken equal to V4-Flash's.
V41_FLASH: dict[str, Any] = {
    **V4_FLASH,
    "model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
    "hidden_size": 5120, "num_hidden_layers": 40, "num_nextn_predict_layers": 3, "q_lora_rank": 1280,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "index_n_heads": 32, "index_topk": 512,
    "n_routed_experts": 384, "moe_intermediate_size": 2304, "num_hash_layers": 0, "rms_norm_eps": 1e-20,
    "quantization_config": {**_FP8, "weight_block_size": [32, 32]},
}

# DeepSeek-V3.2 (MLA + DSA), for KV accounting comparisons only.
V32: dict[str, Any] = {
    "model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"],
    "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 576,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048, "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16", "quantization_config": _FP8,
}

# The shapes of the shipped golden checkpoints (tests and meta instantiation).
V4_TINY: dict[str, Any] = {
    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 6, "num_hash_layers": 1,
    "num_nextn_predict_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "norm_topk_prob": True, "topk_method": "noaux_tc",
    "swiglu_limit": 10.0, "q_lora_rank": 64, "head_dim": 96, "qk_rope_head_dim": 32, "o_groups": 2,
    "o_lora_rank": 32, "sliding_window": 128, "compress_ratios": [0, 4, 128, 4, 128, 4, 0],
    "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 256, "beta_fast": 32,
                     "beta_slow": 1},
    "index_n_heads": 16, "index_head_dim": 64, "index_topk": 16, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}

V4_TINY_FP8: dict[str, Any] = {
    **V4_TINY,
    "hidden_size": 256, "num_hidden_layers": 4, "moe_intermediate_size": 128, "q_lora_rank": 128,
    "head_dim": 128, "qk_rope_head_dim": 64, "o_lora_rank": 128, "compress_ratios": [0, 4, 128, 4, 0],
    "index_head_dim": 128, "torch_dtype": "bfloat16", "quantization_config": _FP8, "expert_dtype": "fp4",
}

PRESETS: dict[str, dict[str, Any]] = {
    "v4-flash": V4_FLASH,
    "v4-pro": V4_PRO,
    "v4.1-flash": V41_FLASH,
    "v3.2": V32,
    "v4-tiny": V4_TINY,
    "v4-tiny-fp8": V4_TINY_FP8,
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})


def load_config(source: str | Path) -> ModelConfig:
    """A preset name, a config.json path, or a model directory."""
    if isinstance(source, str) and source in PRESETS:
        return get_preset(source)
    return ModelConfig.from_json(source)
