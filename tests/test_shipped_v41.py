"""The shipped DeepSeek-V4.1 model (`models/tiny-v41`): a V4.1 config within the size limit, and
retrieval through the engine on the CPU in its packed `v41` layout (FP4 global KV with e4m3
scales, FP8 window rows, FP4 indexer keys). Its card's commands: tests/test_readme_commands.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

from hybridkv.config import ModelConfig

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-v41"


def test_shipped_v41_model_is_a_v41_model_within_the_size_limit():
    cfg = ModelConfig.from_json(MODEL)
    assert cfg.model_type == "deepseek_v41" and cfg.index_topk == 256 and cfg.candidate_topk_blocks == 1024
    assert sum(p.stat().st_size for p in MODEL.rglob("*") if p.is_file()) <= 32 * 2**20


def test_shipped_v41_model_answers_needles_in_its_packed_layout(tmp_path):
    """Three pass keys and six single needles at 4K, held-out prompts (seed 1000), the packed
    layout, on the CPU: at least 8 of the 9 answered (its card: 95-100 % at 4K-16K on the H200)."""
    subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", str(MODEL), "--tasks",
                    "passkey,niah_single_1,niah_single_2", "--lengths", "4096", "--samples", "3", "--seed", "1000",
                    "--kv-format", "v41", "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    results = [(r["task"], r["depth"], r["score"], r["output"]) for r in run["results"]]
    assert len(results) == 9 and sum(score for _, _, score, _ in results) >= 8, results
