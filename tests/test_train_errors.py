"""A user's mistakes with `hybridkv train` and the training tools (average, answer_phase,
indexer_report) print one line, `error: ...`, exit 2, show no traceback and leave nothing behind."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv import cli
from hybridkv.errors import TrainingError
from hybridkv.train import answer_phase, average, indexer_report
from hybridkv.train.export import export_model
from hybridkv.train.recipes import RECIPES, get_recipe

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "tiny-v4"


def one_line_error(capsys, main, argv: list[str], *fragments: str) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in err, (f, err)
    return err


def train_cli(capsys, tmp_path, *args: str, fragments=()) -> str:
    out = tmp_path / "run"
    err = one_line_error(capsys, cli.main, ["train", *args, *([] if "--out" in args else ["--out", str(out)])],
                         *fragments)
    assert not out.exists(), f"a failed command left {sorted(p.name for p in out.iterdir())} in its run directory"
    return err


def _continuation(hex_chars: bool) -> str:
    """A recipe that continues another model and whose base's tokenizer has (or lacks) the hex rule."""
    for name in RECIPES:
        r = get_recipe(name)
        if r.base and (r.hex_chars and not r.adds_hex_chars) == hex_chars:
            return name
    pytest.skip(f"no continuation recipe whose base tokenizer has hex_chars={hex_chars}")


def test_unknown_recipe(capsys, tmp_path):
    train_cli(capsys, tmp_path, "--recipe", "nope", fragments=("unknown recipe 'nope'", "smoke"))


@pytest.mark.parametrize("flag, value, says", [
    ("--lr", "-1", "positive learning rate"), ("--lr", "0", "positive learning rate"),
    ("--lr", "nan", "positive learning rate"), ("--steps", "0", "at least 1"),
    ("--answer-weight", "-0.5", ">= 0"), ("--max-minutes", "0", "must be positive"),
    ("--device", "gpu", "not a device"),
], ids=lambda v: str(v))
def test_bad_override(capsys, tmp_path, flag, value, says):
    train_cli(capsys, tmp_path, "--recipe", "smoke", flag, value, fragments=(flag, says))


def test_continuing_without_a_base_model(capsys, tmp_path):
    name = _continuation(hex_chars=False)
    train_cli(capsys, tmp_path, "--recipe", name, fragments=(f"recipe {name!r} continues", "--init-from"))


def test_init_from_with_a_recipe_that_trains_from_scratch(capsys, tmp_path):
    train_cli(capsys, tmp_path, "--recipe", "smoke", "--init-from", str(SHIPPED), fragments=("trains from scratch",))


def test_init_from_a_directory_that_is_not_a_model(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    train_cli(capsys, tmp_path, "--recipe", _continuation(hex_chars=False), "--init-from", str(tmp_path / "empty"),
              fragments=("not a model directory", "no config.json"))


def test_init_from_a_model_whose_tokenizer_is_not_the_recipes(capsys, tmp_path):
    """The shipped model's tokenizer keeps hex characters apart; a recipe that continues a model
    without that rule refuses it."""
    train_cli(capsys, tmp_path, "--recipe", _continuation(hex_chars=False), "--init-from", str(SHIPPED),
              fragments=("hex_chars",))


def test_init_from_a_model_of_another_architecture(capsys, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    shutil.copy(SHIPPED / "tokenizer.json", base)
    cfg = json.loads((SHIPPED / "config.json").read_text())
    cfg["index_topk"] = cfg["index_topk"] // 2
    (base / "config.json").write_text(json.dumps(cfg))
    train_cli(capsys, tmp_path, "--recipe", _continuation(hex_chars=True), "--init-from", str(base),
              fragments=("config differs", "index_topk"))


def test_resume_with_nothing_to_resume(capsys, tmp_path):
    train_cli(capsys, tmp_path, "--recipe", "smoke", "--resume", fragments=("--resume", "nothing to continue"))


def test_export_only_mistakes(capsys, tmp_path):
    train_cli(capsys, tmp_path, "--recipe", "smoke", "--export-only", fragments=("pass --export",))
    train_cli(capsys, tmp_path, "--recipe", "smoke", "--export-only", "--export", str(tmp_path / "model"),
              fragments=("nothing to export",))
    assert not (tmp_path / "model").exists()


def test_a_run_resumed_or_exported_with_another_recipe(capsys, tmp_path, one_step_smoke_run):
    """A smoke run resumed or exported as a V4.1 model names the run and the recipe, with no
    traceback, and the run is left as it was."""
    before = {p.name: p.stat().st_mtime_ns for p in one_step_smoke_run.iterdir()}
    one_line_error(capsys, cli.main, ["train", "--recipe", "smoke-v41", "--resume", "--out", str(one_step_smoke_run)],
                   "--resume", "is not a 'smoke-v41' model", "resume it with the recipe it was trained with")
    one_line_error(capsys, cli.main, ["train", "--recipe", "smoke-v41", "--export-only", "--out", str(one_step_smoke_run),
                                      "--export", str(tmp_path / "model")],
                   "does not hold a 'smoke-v41' model")
    assert {p.name: p.stat().st_mtime_ns for p in one_step_smoke_run.iterdir()} == before
    assert not (tmp_path / "model").exists()


def test_average_mistakes(capsys, tmp_path, one_step_smoke_run):
    one_line_error(capsys, average.main, [str(SHIPPED), str(SHIPPED), "--weight", "2", "--out", str(tmp_path / "o")],
                   "weight must lie in [0, 1]")
    other = export_model(get_recipe("smoke"), one_step_smoke_run, tmp_path / "smoke")
    one_line_error(capsys, average.main, [str(SHIPPED), str(other), "--out", str(tmp_path / "o")],
                   "different configs", "not one architecture")
    assert not (tmp_path / "o").exists()


def test_diagnostic_tools_mistakes(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    for main in (answer_phase.main, indexer_report.main):
        one_line_error(capsys, main, [str(tmp_path / "empty")], "no tokenizer.json")
    one_line_error(capsys, answer_phase.main, [str(SHIPPED), "--shifts", "a,b"], "--shifts takes comma-separated")
    one_line_error(capsys, indexer_report.main, [str(SHIPPED), "--samples", "0"], "--samples 0")
    one_line_error(capsys, indexer_report.main, [str(SHIPPED), "--tasks", "nope", "--length", "512",
                                                 "--samples", "1"], "--tasks nope")


def test_the_command_line_itself_prints_no_traceback(tmp_path):
    """The same through the real entry point, in a fresh interpreter."""
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "train", "--recipe", "nope", "--out", str(tmp_path / "r")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("error: unknown recipe") and r.stderr.count("\n") == 1, r.stderr


def test_training_errors_are_value_errors():
    """Callers of the library that caught ValueError still do."""
    with pytest.raises(ValueError, match="unknown recipe") as e:
        get_recipe("nope")
    assert isinstance(e.value, TrainingError)
