"""Random-weight checkpoints with a preset's real shapes load as release-format models and serve."""

import torch

from hybridkv.engine import LLM, SamplingParams
from hybridkv.tools.random_checkpoint import shaped_config, write_random_checkpoint
from hybridkv.weights import load_model


def test_shaped_config_keeps_the_pattern():
    c = shaped_config("v4-flash", layers=4, vocab=1024, experts=8, moe_inter=256)
    assert list(c.compress_ratios) == [0, 0, 4, 128, 0]
    assert (c.head_dim, c.hidden_size, c.index_topk, c.vocab_size) == (512, 4096, 512, 1024)


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
