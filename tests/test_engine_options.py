"""The engine options have one definition: every front end (generate, serve, eval; demo for the
model options) takes the same flags with the same defaults, the earlier spellings map to the same
values with a warning naming the new flag, serve runs the tiers and memory policies, the caller's
EngineConfig is never changed, and `--dtype auto` resolves per device."""

import copy

import pytest
import torch

from hybridkv.cli import build_parser, main, server_from_args
from hybridkv.engine import LLM, EngineConfig, SamplingParams
from hybridkv.engine.config import engine_options, resolve_dtype
from hybridkv.errors import ConfigError
from hybridkv.eval import cli as eval_cli

TOKENIZER = "tests/fixtures/tokenizer-tiny/tokenizer.json"


def parse(front_end: str, *flags: str):
    """The namespace of one front end's command line with `flags` (its required arguments added)."""
    if front_end == "eval":
        return eval_cli.build_parser().parse_args(["MODEL_DIR", *flags])
    required = {"generate": ["MODEL_DIR", "--prompt", "x"], "serve": ["MODEL_DIR"], "demo": []}[front_end]
    return build_parser().parse_args([front_end, *required, *flags])


def comparable(ns) -> dict:
    opts = engine_options(ns)
    opts["tiers"] = vars(opts["tiers"])
    return {**opts, "device": ns.device, "dtype": ns.dtype}


# every engine flag with a value other than its default
EVERY_FLAG = ["--device", "cuda:1", "--dtype", "bfloat16", "--kv-format", "fp8", "--num-blocks", "99",
              "--max-num-seqs", "3", "--max-num-batched-tokens", "777", "--max-model-len", "32k",
              "--no-enable-prefix-caching", "--window-policy", "checkpoint(256)", "--snapshot-bytes", "64M",
              "--memory-policy", "recency-512", "--resident-pages", "12", "--oracle-query-tokens", "8",
              "--indexer", "random", "--indexer-seed", "5", "--enforce-eager", "--kv-dram-size", "2G",
              "--kv-dram-ttl", "block=1h,state=1m", "--kv-disk-dir", "KVDIR", "--kv-disk-size", "1G",
              "--kv-disk-lifetime", "2h", "--kv-redis-url", "redis://127.0.0.1:6379/0", "--kv-redis-ttl", "3h",
              "--kv-write-policy", "request_end"]


def test_every_front_end_takes_the_same_engine_flags():
    got = {fe: comparable(parse(fe, *EVERY_FLAG)) for fe in ("generate", "serve", "eval")}
    assert got["generate"] == got["serve"] == got["eval"]
    g = got["generate"]
    assert (g["num_blocks"], g["max_model_len"], g["snapshot_bytes"], g["cuda_graphs"]) == (99, 32768, 64 << 20, False)
    assert (g["tiers"]["disk_dir"], g["tiers"]["write_policy"], g["tiers"]["dram_ttl"]) == \
        ("KVDIR", "request_end", {"block": 3600.0, "state": 60.0})
    demo = parse("demo", "--device", "cuda:1", "--dtype", "bfloat16")
    assert (demo.device, demo.dtype) == ("cuda:1", "bfloat16")


def test_same_defaults_except_what_eval_sizes_itself():
    defaults = {fe: comparable(parse(fe)) for fe in ("generate", "serve", "eval")}
    assert defaults["generate"] == defaults["serve"]
    assert EngineConfig.from_args(parse("serve")) == EngineConfig()
    shared = defaults["serve"]
    # eval sizes the pool and the step budget to its prompts, runs 8 at once, keeps no DRAM tier
    expected_eval = {k: v for k, v in shared.items() if k not in ("num_blocks", "max_num_batched_tokens")}
    expected_eval.update(max_num_seqs=8, tiers={**shared["tiers"], "dram_bytes": 0})
    assert defaults["eval"] == expected_eval
    demo = parse("demo")
    assert (demo.device, demo.dtype) == (shared["device"], shared["dtype"]) == ("cpu", "auto")


@pytest.mark.parametrize("front_end", ["generate", "serve", "eval"])
@pytest.mark.parametrize("old,new", [
    (["--max-concurrency", "5"], ["--max-num-seqs", "5"]),
    (["--max-batched-tokens", "300"], ["--max-num-batched-tokens", "300"]),
    (["--policy", "recency-256"], ["--memory-policy", "recency-256"]),
    (["--prefix-cache", "off"], ["--no-enable-prefix-caching"]),
    (["--prefix-cache", "checkpoint(512)"], ["--enable-prefix-caching", "--window-policy", "checkpoint(512)"]),
], ids=["max-concurrency", "max-batched-tokens", "policy", "prefix-cache-off", "prefix-cache-policy"])
def test_deprecated_spellings_map_to_the_new_flags(front_end, old, new, capsys):
    assert comparable(parse(front_end, *old)) == comparable(parse(front_end, *new))
    err = capsys.readouterr().err
    assert f"warning: {old[0]}" in err and "deprecated" in err and f"use {new[0]}" in err
    parse(front_end, *new)
    assert capsys.readouterr().err == ""


def test_vllm_second_spellings():
    ns = parse("serve", "--kv-cache-dtype", "fp8", "--num-gpu-blocks-override", "40")
    assert (ns.kv_format, ns.num_blocks) == ("fp8", 40)
    assert parse("serve", "--kv-cache-dtype", "auto").kv_format == "native"
    with pytest.raises(SystemExit):      # one option, two spellings: not both at once
        parse("serve", "--kv-format", "bf16", "--kv-cache-dtype", "fp8")


def test_bad_engine_options_are_one_line_errors(capsys):
    with pytest.raises(SystemExit):
        parse("serve", "--kv-cache-dtype", "fp8_e5m2")
    assert "--kv-format" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="lists several"):
        EngineConfig.from_args(parse("serve", "--memory-policy", "full,recency-512"))
    with pytest.raises(ConfigError, match="unknown memory policy"):
        EngineConfig(memory_policy="lru")
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)


def _serve(fixtures, *flags):
    return server_from_args(build_parser().parse_args(
        ["serve", str(fixtures / "v4-tiny"), "--tokenizer", TOKENIZER, "--num-blocks", "32", *flags]))


def _run_one(engine, n_tokens: int):
    seq = engine.add_request([2 + i % 300 for i in range(n_tokens)], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    return seq


def test_serve_runs_the_tier_flags(fixtures, tmp_path):
    server = _serve(fixtures, "--kv-disk-dir", str(tmp_path / "kv"), "--kv-dram-size", "0", "--max-num-seqs", "2")
    engine = server.engine
    assert engine.ec.max_num_seqs == 2 and engine.ec.tiers.disk_dir == str(tmp_path / "kv")
    _run_one(engine, 300)
    engine.close()      # the pending disk writes land
    stats = engine.cache_stats()
    assert "dram" not in stats and stats["disk"]["stored"] >= 2   # the two complete blocks of 128
    assert list((tmp_path / "kv").rglob("*"))


def test_serve_runs_a_memory_policy(fixtures):
    server = _serve(fixtures, "--memory-policy", "recency-256", "--max-model-len", "2048")
    engine = server.engine
    assert str(engine.memory) == "recency-256" and engine.ec.enable_prefix_caching is True
    assert server.driver is not None and engine.max_model_len == 2048
    _run_one(engine, 640)
    assert engine.stats.pages_evicted > 0       # CSA KV left the device, as under eval


def test_serve_refuses_what_a_policy_cannot_do(fixtures, capsys):
    args = ["serve", str(fixtures / "v4-tiny"), "--tokenizer", TOKENIZER, "--num-blocks", "16"]
    assert main([*args, "--memory-policy", "full,oracle-8"]) == 2
    assert "hybridkv eval" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["full", "recency-256"])
def test_the_callers_config_is_never_changed(fixtures, policy):
    """The engine resolves enable_prefix_caching (None: on) in its own copy."""
    ec = EngineConfig(num_blocks=16, max_num_seqs=2, memory_policy=policy, tiers={"dram_bytes": 0})
    before = copy.deepcopy(ec)
    llm = LLM(fixtures / "v4-tiny", engine_config=ec)
    assert llm.engine.ec is not ec and llm.engine.ec.enable_prefix_caching is True
    llm.generate([[2 + i % 300 for i in range(40)]], SamplingParams(max_tokens=2))
    assert ec == before and ec.enable_prefix_caching is None
    second = LLM(fixtures / "v4-tiny", engine_config=ec, max_num_seqs=3)    # a keyword over the config
    assert second.engine.ec.max_num_seqs == 3 and ec == before


def test_dtype_resolution():
    assert resolve_dtype("auto", "cuda") is torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda", 1)) is torch.bfloat16
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype(None, "cuda:0") is torch.bfloat16
    assert resolve_dtype("float32", "cuda") is torch.float32
    assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    assert resolve_dtype(torch.float16, "cpu") is torch.float16
    with pytest.raises(ConfigError, match="compute dtype"):
        resolve_dtype("float8", "cpu")


def test_llm_and_serve_compute_in_the_resolved_dtype(fixtures):
    assert LLM(fixtures / "v4-tiny", num_blocks=8).model.dtype is torch.float32          # CPU: auto = float32
    assert LLM(fixtures / "v4-tiny", dtype="bfloat16", num_blocks=8).model.dtype is torch.bfloat16
    assert _serve(fixtures, "--dtype", "bfloat16").engine.model.dtype is torch.bfloat16
