"""KV accounting: the figures of SPEC §2.3, the CLI, and measured bytes against the formula."""

import json

import pytest
import torch

from hybridkv.cache.layout import entry_bytes, kv_layout
from hybridkv.cli import main
from hybridkv.demo import kv_accounting
from hybridkv.model import ContiguousKV, ForwardBatch
from hybridkv.presets import get_preset
from hybridkv.weights import load_model


def test_entry_formats():
    f = get_preset("v4-flash")
    assert entry_bytes(f, "fp8") == entry_bytes(f, "fp8").__class__(584, 68, 584)
    assert (entry_bytes(f, "bf16").main, entry_bytes(f, "bf16").index) == (1024, 256)
    v = entry_bytes(get_preset("v4.1-flash"), "v41")
    assert (v.main, v.index, v.window) == (288, 68, 528)


@pytest.mark.parametrize("preset, per_token", [
    ("v4-flash", 3514.25),
    ("v4-pro", 5031.4375),
    ("v4.1-flash", 890.0),
    ("v3.2", 48068.0),
])
def test_spec_bytes_per_token(preset, per_token):
    assert kv_layout(get_preset(preset)).bytes_per_token == pytest.approx(per_token, abs=1e-9)


def test_v4_flash_breakdown_and_window():
    lay = kv_layout(get_preset("v4-flash"))
    assert lay.per_token == {"CSA main": 21 * 584 / 4, "CSA indexer": 21 * 68 / 4, "HCA": 20 * 584 / 128}
    assert lay.fixed["window"] == 44 * 128 * 584                      # ≈ 3.3 MB per request
    assert lay.total(1 << 20) - lay.fixed_bytes == pytest.approx(3.685e9, rel=1e-3)
    assert kv_layout(get_preset("v4-flash")).bytes_per_token / kv_layout(get_preset("v3.2")).bytes_per_token < 0.08


def test_cli_json(capsys):
    assert main(["kv-calc", "--preset", "v4-flash", "--context", "512k", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["bytes_per_token_total"] == 3514.25 and r["context"] == 524288
    assert r["total_bytes"] == 3514.25 * 524288 + r["fixed_bytes_total"]


def test_cli_table_and_errors(capsys, fixtures):
    assert main(["kv-calc", "--config", str(fixtures / "v4-tiny"), "--context", "4096", "--format", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "CSA indexer" in out and "format bf16" in out
    assert main(["kv-calc", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_measured_bytes_match_formula(fixtures):
    """Entries held after a run, priced in the fp8 layout, equal kv-calc's per-token figure times
    the number of whole entries; the held window and compressor state equal the fixed part."""
    model, cfg = load_model(fixtures / "v4-tiny")
    kv = ContiguousKV(cfg)
    n = 512  # a multiple of every ratio, so every entry is whole
    with torch.no_grad():
        for start in range(0, n, 200):
            m = min(200, n - start)
            model(torch.arange(start, start + m) % cfg.vocab_size, ForwardBatch.build([(kv, start, m)]))
    rows = {kind: (entries, held, fp8) for kind, entries, held, fp8 in kv_accounting(kv)}
    lay = kv_layout(cfg, "fp8")
    for kind in ("CSA main", "CSA indexer", "HCA"):
        assert rows[kind][2] == pytest.approx(lay.per_token[kind] * n)
    assert rows["CSA main"][0] == 3 * n // 4 and rows["HCA"][0] == 2 * n // 128
    assert rows["window"][2] == lay.fixed["window"]
    assert rows["compressor state"][1] == lay.fixed["compressor state"]
    # what this run holds in float32 storage: d × 4 bytes per entry
    assert rows["CSA main"][1] == rows["CSA main"][0] * cfg.head_dim * 4
