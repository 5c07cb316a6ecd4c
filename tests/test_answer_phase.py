"""The answer-phase probe: teacher-forced whole-answer and closing checks on the shipped model."""

import subprocess
import sys
from pathlib import Path

from hybridkv.tasks.generators import Pools, make_sample
from hybridkv.tasks.tokenizer import TaskTokenizer
from hybridkv.train.answer_phase import answer_checks
from hybridkv.train.export import float_model

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "tiny-v4"


def test_a_pass_key_is_copied_and_closed_and_a_wrong_one_is_not():
    model = float_model(SHIPPED).eval()
    tok = TaskTokenizer.load(SHIPPED)
    s = make_sample("passkey", 0, Pools(tok, seed=0), 512, 0.5)
    assert answer_checks(model, s.prompt, s.completion) == (True, True)
    key = s.answers[0]
    wrong = tok.encode(" " + key[:2] + str((int(key[2]) + 1) % 10) + key[3:] + ".") + [tok.eos_id]
    assert len(wrong) == len(s.completion) and wrong != s.completion
    whole, _ = answer_checks(model, s.prompt, wrong)
    assert not whole


def test_command_prints_one_row_per_shift():
    r = subprocess.run([sys.executable, "-m", "hybridkv.train.answer_phase", str(SHIPPED), "--task", "passkey",
                        "--length", "384", "--samples", "1", "--shifts", "0,7"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["0", "7"]
    r = subprocess.run([sys.executable, "-m", "hybridkv.train.answer_phase", str(SHIPPED), "--shifts", "5000"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "--shifts must lie in" in r.stderr
    r = subprocess.run([sys.executable, "-m", "hybridkv.train.answer_phase", str(SHIPPED), "--task", "nope",
                        "--length", "384", "--samples", "1", "--shifts", "0"], capture_output=True, text=True)
    assert r.returncode != 0 and "unknown task 'nope'" in r.stderr and "Traceback" not in r.stderr
