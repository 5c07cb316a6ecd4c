"""`hybridkv eval` end to end on the shipped model: prompts in its tokenizer, the engine under two
memory policies, scores, device KV bytes, the JSON/markdown/PNG outputs and `eval compare`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-v4"


@pytest.fixture(scope="module")
def eval_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", str(MODEL), "--tasks", "passkey,niah_single_2,qa",
                    "--lengths", "1024", "--samples", "2", "--memory-policy", "full,recency-256", "--out", str(out)],
                   check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    return out


def test_eval_writes_results_and_plots(eval_dir):
    data = json.loads((eval_dir / "results.json").read_text())
    runs = {r["policy"]: r for r in data["runs"]}
    assert set(runs) == {"full", "recency-256"}
    for run in runs.values():
        assert len(run["results"]) == 3 * 2
        for r in run["results"]:
            assert 0.0 <= r["score"] <= 1.0 and r["prompt_tokens"] <= 1024 and r["references"]
            assert r["device_kv_bytes"] and all(v >= 0 for v in r["device_kv_bytes"].values())
    table = (eval_dir / "results.md").read_text()
    assert "policy `full`" in table and "passkey" in table
    assert list(eval_dir.glob("*.png"))


def test_recency_policy_holds_less_csa_kv_than_full(eval_dir):
    """1024-token prompts hold 8+ KV blocks; recency-256 keeps the CSA main entries of ~3."""
    runs = {r["policy"]: r for r in json.loads((eval_dir / "results.json").read_text())["runs"]}

    def csa(run):
        return sum(sum(v for k, v in r["device_kv_bytes"].items() if "csa" in k.lower() and "index" not in k.lower())
                   for r in run["results"])

    assert 0 < csa(runs["recency-256"]) < csa(runs["full"])


def test_eval_compare(eval_dir):
    out = subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", "compare", str(eval_dir / "results.json"),
                          str(eval_dir / "results.json")], check=True, capture_output=True, text=True).stdout
    assert "passkey" in out
    out = subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", "compare", str(eval_dir / "results.json"),
                          str(eval_dir / "results.json"), "--labels", "v4,v41"], check=True, capture_output=True,
                         text=True).stdout
    assert "| v4 | v41 | Δ |" in out


def test_shipped_model_retrieves_and_the_policy_that_drops_the_needle_does_not(eval_dir):
    """The shipped model answers 1K passkey prompts (needles at depths 25% and 75%) with every
    CSA entry resident; recency-256 keeps only the last 256 tokens' CSA entries, which hold
    neither needle, and the answers are lost."""
    runs = {r["policy"]: r for r in json.loads((eval_dir / "results.json").read_text())["runs"]}

    def passkey(run):
        return [r["score"] for r in run["results"] if r["task"] == "passkey"]

    assert passkey(runs["full"]) == [1.0, 1.0]
    assert sum(passkey(runs["recency-256"])) < 2.0


def test_eval_report_redraws_from_the_json(eval_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", "report", str(eval_dir / "results.json"),
                          "--out", str(tmp_path)], check=True, capture_output=True, text=True).stdout
    assert "policy `full`" in out and "passkey" in out
    assert {p.name for p in tmp_path.glob("*.png")} >= {"accuracy_full.png", "needle_heatmap_full.png", "kv_bytes.png"}


def test_eval_command_line_may_start_with_an_option():
    """`hybridkv eval -h` shows the evaluation's help; options before the model reach its parser."""
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", "-h"], capture_output=True, text=True)
    assert r.returncode == 0 and "usage: hybridkv eval" in r.stdout and "--tasks" in r.stdout
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", "--tasks", "passkey"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "required: model_dir" in r.stderr and "unrecognized" not in r.stderr


def test_eval_report_names_a_bad_results_file(tmp_path):
    bad = tmp_path / "results.json"
    bad.write_text('{"runs": [{"policy": "full"}]}')
    for args in (["report", str(bad)], ["report", str(tmp_path / "missing.json")], ["compare", str(bad), str(bad)]):
        r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", *args], capture_output=True, text=True)
        assert r.returncode == 2 and "cannot read evaluation results from" in r.stderr and "Traceback" not in r.stderr


def test_eval_merge_joins_an_evaluation_split_by_task(eval_dir, tmp_path):
    """Parts of one evaluation (split by task, as parallel processes run it) merge into the table the
    whole run gives; a cell present in two parts is refused."""
    whole = json.loads((eval_dir / "results.json").read_text())
    parts = []
    for i, tasks in enumerate((["passkey"], ["niah_single_2", "qa"])):
        part = {"command": f"part {i}", "runs": [{**r, "tasks": [t for t in r["tasks"] if t in tasks],
                                                  "results": [x for x in r["results"] if x["task"] in tasks]}
                                                 for r in whole["runs"]]}
        parts.append(tmp_path / f"part{i}.json")
        parts[-1].write_text(json.dumps(part))
    out = tmp_path / "merged"
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", "merge", *map(str, parts), "--out", str(out)],
                       capture_output=True, text=True, check=True)
    assert "policy `full`" in r.stdout
    merged = {m["policy"]: m for m in json.loads((out / "results.json").read_text())["runs"]}
    def outputs(run):
        return sorted((x["task"], x["length"], x["depth"], x["output"]) for x in run["results"])

    for run in whole["runs"]:
        assert outputs(merged[run["policy"]]) == outputs(run)
        assert set(merged[run["policy"]]["tasks"]) == set(run["tasks"])
    assert (out / "results.md").read_text().count("|") == (eval_dir / "results.md").read_text().count("|")
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", "merge", str(parts[0]), str(parts[0]),
                        "--out", str(tmp_path / "twice")], capture_output=True, text=True)
    assert r.returncode == 2 and "in two results files" in r.stderr


def test_eval_workers_give_the_single_process_results(eval_dir, tmp_path):
    """--workers runs each (task, length) cell as its own process and merges them: the same prompts
    and, at the same thread count, the same greedy outputs as one process."""
    out = tmp_path / "workers"
    subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", str(MODEL), "--tasks", "passkey,niah_single_2",
                    "--lengths", "1024,512", "--samples", "2", "--memory-policy", "full,recency-256", "--workers", "2",
                    "--threads-per-worker", "2", "--out", str(out)], check=True, capture_output=True, text=True)
    got = {r["policy"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    whole = {r["policy"]: r for r in json.loads((eval_dir / "results.json").read_text())["runs"]}
    assert list(got) == ["full", "recency-256"]
    for policy, run in got.items():
        assert run["tasks"] == ["passkey", "niah_single_2"] and run["lengths"] == [512, 1024]
        assert len(run["results"]) == 2 * 2 * 2

        def cells(r, length):
            return sorted((x["task"], x["depth"], tuple(x["references"]), x["output"]) for x in r["results"]
                          if x["length"] == length and x["task"] in ("passkey", "niah_single_2"))

        assert cells(run, 1024) == cells(whole[policy], 1024)


def test_eval_in_another_compute_dtype_is_labelled_apart(tmp_path):
    """--dtype bfloat16 runs the engine in bf16 (the GPU setting); its runs carry the dtype in their
    label, so a comparison or merge never mixes them with float32 results."""
    out = tmp_path / "bf16"
    subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", str(MODEL), "--tasks", "passkey", "--lengths", "1024",
                    "--samples", "1", "--dtype", "bfloat16", "--out", str(out)], check=True, capture_output=True)
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["policy"] for r in runs] == ["full+bfloat16"]
    assert [r["score"] for r in runs[0]["results"]] == [1.0]


def test_eval_over_real_text_names_its_tasks_and_its_text(tmp_path):
    from hybridkv.tasks import prose
    out = tmp_path / "realtext"
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", str(MODEL), "--haystack", "realtext",
                        "--tasks", "passkey", "--lengths", "512", "--samples", "1", "--out", str(out)],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads((out / "results.json").read_text())
    assert data["haystack_text"] == prose.describe("eval") and prose.fingerprint("eval") in data["haystack_text"]
    (run,) = data["runs"]
    assert run["tasks"] == ["passkey_realtext"] and [x["prompt_tokens"] for x in run["results"]] == [512]
    assert "passkey_realtext" in (out / "results.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "hybridkv.cli", "eval", str(MODEL), "--haystack", "realtext",
                          "--tasks", "passkey,vt", "--out", str(tmp_path / "bad")], capture_output=True, text=True)
    assert bad.returncode == 2 and "'vt' has no real-text haystack" in bad.stderr and "Traceback" not in bad.stderr
