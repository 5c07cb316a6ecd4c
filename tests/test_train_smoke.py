"""The smoke recipe end to end on the CPU: the loss drops, a run resumes (from its own state and
from the portable files a fresh machine gets), and the export loads as a release-format model whose
logits are the trained model's."""

import json
from dataclasses import replace

import pytest
import torch

from hybridkv.model import ContiguousKV, ForwardBatch, Transformer
from hybridkv.tasks.tokenizer import TaskTokenizer
from hybridkv.train.export import export_model
from hybridkv.train.forward import TrainOptions, train_forward
from hybridkv.train.loop import train
from hybridkv.train.rundir import load_portable, model_config, prepare_tokenizer, save_portable
from hybridkv.train.recipes import get_recipe
from hybridkv.weights import load_model


@pytest.fixture(scope="module", params=["smoke", "smoke-v41"])
def smoke_run(tmp_path_factory, request):
    run = tmp_path_factory.mktemp(request.param)
    recipe = get_recipe(request.param)
    progress = train(recipe, run, echo=lambda *_: None)
    return recipe, run, progress


def _log(run):
    return [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]


def test_smoke_loss_drops(smoke_run):
    recipe, run, progress = smoke_run
    assert progress["step"] == recipe.steps
    rows = _log(run)
    assert rows[-1]["lm"] < rows[0]["lm"] - 0.5, (rows[0]["lm"], rows[-1]["lm"])
    assert (run / "loss.png").stat().st_size > 0
    assert rows[-1]["qat_experts"] and not rows[-1]["dense_indexer"] and rows[0]["dense_indexer"]


def test_resume_continues_the_same_run(smoke_run, tmp_path):
    """Stopping after k steps and resuming gives the uninterrupted run's weights."""
    recipe, run, _ = smoke_run
    if recipe.name != "smoke":
        pytest.skip("the loop is the same for every model family; checked once")
    short = replace(recipe, steps=6)
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "tokenizer.json").write_bytes((run / "tokenizer.json").read_bytes())
    # One thread: threaded CPU reductions differ from run to run, and an MoE routing near-tie can
    # turn that noise into a different expert update (1e-3 between two uninterrupted runs). On one
    # thread the loop is deterministic, so resuming must give the same weights bit for bit.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(short, a, echo=lambda *_: None)
        train(short, b, echo=lambda *_: None, stop_at_step=3, portable_dir=tmp_path / "p")
        with pytest.raises(ValueError, match=f"--seed {short.seed}"):   # another data stream is refused
            train(replace(short, seed=short.seed + 1), b, resume=True, echo=lambda *_: None)
        train(short, b, resume=True, echo=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    wa = torch.load(a / "state.pt", weights_only=False)["model"]
    wb = torch.load(b / "state.pt", weights_only=False)["model"]
    assert wa.keys() == wb.keys()
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not differ, differ
    # the checkpoint at step 3 also went to the portable directory, as the loop saved it; a run
    # already complete writes its state there without training
    early = load_portable(tmp_path / "p")
    assert early["progress"]["step"] == 3 and early["model"].keys() == wb.keys()
    train(short, b, resume=True, echo=lambda *_: None, portable_dir=tmp_path / "done")
    done = load_portable(tmp_path / "done")
    assert done["progress"]["step"] == 6 and all(torch.equal(done["model"][k], wb[k]) for k in wb)
    # a fresh machine: only the portable files
    c = tmp_path / "c"
    save_portable(wb, torch.load(b / "state.pt", weights_only=False)["progress"], c)
    (c / "tokenizer.json").write_bytes((run / "tokenizer.json").read_bytes())
    progress = train(replace(short, steps=8), c, resume=True, echo=lambda *_: None)
    assert progress["step"] == 8


def test_a_recipe_that_trains_the_mtp_block_leaves_the_rest_as_it_was(smoke_run, tmp_path):
    """`trains="mtp."` with `mtp_chain`, continuing an exported model: the MTP block's tensors move,
    both MTP losses are logged, and the export keeps every other tensor of the base byte for byte
    (it refuses to export without the base)."""
    from safetensors import safe_open

    from hybridkv.errors import TrainingError

    recipe, run, _ = smoke_run
    if recipe.name != "smoke":
        pytest.skip("the loop is the same for every model family; checked once")
    base = export_model(recipe, run, tmp_path / "base")
    mtp_only = replace(recipe, steps=4, base="smoke", trains="mtp.", mtp_chain=1)
    train(mtp_only, tmp_path / "run", init_from=base, echo=lambda *_: None)
    assert {"mtp0", "mtp1"} <= set(_log(tmp_path / "run")[-1])
    with pytest.raises(TrainingError, match="--init-from"):
        export_model(mtp_only, tmp_path / "run", tmp_path / "nobase")
    out = export_model(mtp_only, tmp_path / "run", tmp_path / "out", base=base)

    def tensors(d):
        got = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                got.update({k: h.get_tensor(k) for k in h.keys()})
        return got

    before, after = tensors(base), tensors(out)
    assert before.keys() == after.keys()
    same = {k for k in before if before[k].dtype == after[k].dtype
            and torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8))}
    assert {k for k in before if not k.startswith("mtp.")} <= same
    assert any(k.startswith("mtp.0.attn.") and k not in same for k in before)


def test_export_is_the_trained_model(smoke_run, tmp_path):
    recipe, run, _ = smoke_run
    out = export_model(recipe, run, tmp_path / "model")
    model, cfg = load_model(out)
    assert cfg.expert_dtype is None or cfg.to_dict().get("expert_dtype") == recipe.model.get("expert_dtype")
    tok = prepare_tokenizer(recipe, run)
    assert (out / "tokenizer.json").exists() and tok.vocab_size <= cfg.vocab_size
    trained = Transformer(model_config(recipe, cfg.vocab_size), dtype=torch.float32)
    trained.load_state_dict(torch.load(run / "state.pt", weights_only=False)["model"])
    ids = torch.randint(2, cfg.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = trained.logits(train_forward(trained, ids, TrainOptions(dense_indexer=False, qat_indexer=True,
                                                                        qat_experts=True)).stream)
        got = model.logits(model(ids[0], ForwardBatch.build([(ContiguousKV(cfg), 0, 300)])))
    err = float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    # bf16 export of float32 weights (V4.1's FP4/FP8 round trips and top-k amplify it more)
    assert err < (2e-2 if cfg.family == "v4" else 5e-2), err
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > (0.95 if cfg.family == "v4" else 0.9)


def test_continuing_a_model_starts_from_its_weights(smoke_run, tmp_path):
    """A recipe with a `base` starts from an exported model (--init-from): step 0 of the new run is
    the exported model (its loss on the first batch is the trained one's, not an untrained one's),
    it keeps the base's tokenizer, records where it started, and refuses a model of another shape."""
    recipe, run, _ = smoke_run
    if recipe.name != "smoke":
        pytest.skip("the loop is the same for every model family; checked once")
    base = export_model(recipe, run, tmp_path / "base")
    cont = replace(recipe, name="smoke-continued", base="smoke", steps=2, warmup=1)
    with pytest.raises(ValueError, match="--init-from"):
        train(cont, tmp_path / "none", echo=lambda *_: None)
    with pytest.raises(ValueError, match="trains from scratch"):
        train(recipe, tmp_path / "scratch", init_from=base, echo=lambda *_: None)
    with pytest.raises(ValueError, match="hex_chars"):   # a hex-rule continuation of a model without the rule
        train(replace(cont, hex_chars=True), tmp_path / "hex", init_from=base, echo=lambda *_: None)
    assert not (tmp_path / "hex" / "tokenizer.json").exists()
    # adding the rule to the base's vocabulary: same ids for text without hex runs, one token per
    # character inside them; a base that already has the rule is refused
    adds = replace(cont, name="smoke-hexsplit", hex_chars=True, adds_hex_chars=True)
    train(adds, tmp_path / "adds", init_from=base, echo=lambda *_: None)
    old, new = TaskTokenizer.load(base), TaskTokenizer.load(tmp_path / "adds")
    assert new.hex_chars and not old.hex_chars and new.vocab_size == old.vocab_size
    text, uuid = "The special magic number for bad-cafe is: 4096.", "5d5b7bcc-e790-4f2a-bd1e-0c9a3f7e2b11"
    assert new.encode(text) == old.encode(text)
    assert len(new.encode(uuid)) == len(uuid) > len(old.encode(uuid)) and new.decode(new.encode(uuid)) == uuid
    with pytest.raises(ValueError, match="hex_chars"):
        train(adds, tmp_path / "adds-again", init_from=tmp_path / "adds", echo=lambda *_: None)
    assert not (tmp_path / "adds-again" / "tokenizer.json").exists()
    progress = train(cont, tmp_path / "cont", init_from=base, echo=lambda *_: None)
    assert progress["step"] == 2 and progress["init_from"]["path"] == "base"
    assert (tmp_path / "cont" / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    scratch = replace(recipe, steps=1, log_every=1)
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / "tokenizer.json").write_bytes((run / "tokenizer.json").read_bytes())
    train(scratch, tmp_path / "fresh", echo=lambda *_: None)
    untrained_lm = _log(tmp_path / "fresh")[0]["lm"]
    trained_lm = _log(run)[-1]["lm"]
    cont_lm = _log(tmp_path / "cont")[0]["lm"]
    assert abs(cont_lm - trained_lm) < abs(untrained_lm - trained_lm) / 2, (untrained_lm, trained_lm, cont_lm)
    other = replace(cont, model={**recipe.model, "sliding_window": 64})
    with pytest.raises(ValueError, match="sliding_window"):
        train(other, tmp_path / "other", init_from=base, echo=lambda *_: None)


def test_a_recipe_with_hex_chars_trains_its_tokenizer_with_them(tmp_path):
    """The run's tokenizer.json follows the recipe's tokenizer rule (the hex rule of tiny-v4-hexsplit)."""
    uuid = "ffbd21fe-d631-43b9-a042-e368d5c4c325"
    for hex_chars in (False, True):
        tok = prepare_tokenizer(replace(get_recipe("smoke"), hex_chars=hex_chars), tmp_path / str(hex_chars))
        assert (tmp_path / str(hex_chars) / "tokenizer.json").exists()
        assert (len(tok.encode(uuid)) == len(uuid)) == hex_chars
        assert tok.hex_chars == hex_chars == TaskTokenizer.load(tmp_path / str(hex_chars)).hex_chars


def test_portable_parts_of_two_saves_are_refused_and_a_smaller_save_drops_old_parts(tmp_path):
    """Parts that do not form one save (an interrupted copy, or parts of two saves mixed) get a
    TrainingError naming the directory; a later save with fewer parts removes the earlier extra
    ones, so the directory holds one state."""
    from hybridkv.errors import TrainingError
    from hybridkv.train import rundir
    big = {"w": torch.randn(600_000)}                                     # 2.4 MB
    small = {"w": torch.randn(16)}
    d = tmp_path / "p"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rundir, "PART_BYTES", 1 << 20)                         # several parts for `big`
        first = save_portable(big, {"step": 1}, d)
        assert len(first) > 1
        (d / first[0].name).write_bytes(b"not a part")
        with pytest.raises(TrainingError, match="do not form one saved state"):
            load_portable(d)
        assert len(save_portable(small, {"step": 2}, d)) == 1
    assert sorted(p.name for p in d.iterdir()) == [first[0].name]
    state = load_portable(d)
    assert state["progress"]["step"] == 2 and torch.equal(state["model"]["w"], small["w"])
