"""Every recipe is well formed: stages end in increasing order at the last step, the task mixes
name real tasks, and every task of every stage fits the stage's length with the recipe's
tokenizer (a run must not die an hour in)."""

import functools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from hybridkv.cli import build_parser, train_recipe
from hybridkv.tasks.generators import GENERATED_TASKS, TASKS, Pools, build_tokenizer, training_example
from hybridkv.tasks.tokenizer import TaskTokenizer
from hybridkv.train.data import TaskBatches
from hybridkv.train.rundir import model_config
from hybridkv.errors import TrainingError
from hybridkv.tasks.generators import REALTEXT_FAMILIES
from hybridkv.train.loop import train
from hybridkv.train.recipes import RECIPES, SMOKE_MODEL, SMOKE_V41_MODEL, SPARSE_FROM_2K, Stage, get_recipe

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "tiny-v4"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_the_shipped_lineage_is_the_one_its_card_and_log_record():
    """models/tiny-v4 is the average of tiny-v4-anypos and tiny-v4-long, each continuing the one
    before from tiny-v4; the steps and tokens of each run are the ones the model card reports
    (docs/training-log.md has the runs)."""
    chain, r = [], get_recipe("tiny-v4-long")
    while r is not None:
        chain.append((r.name, r.steps, round(r.tokens() / 1e6, 1), r.seed))
        r = get_recipe(r.base) if r.base else None
    assert chain[::-1] == [("tiny-v4", 2750, 90.1, 0), ("tiny-v4-needles", 1400, 45.9, 1),
                           ("tiny-v4-keys", 1250, 41.0, 2), ("tiny-v4-hexsplit", 1150, 37.7, 9),
                           ("tiny-v4-polish", 800, 26.2, 11), ("tiny-v4-anypos", 800, 26.2, 13),
                           ("tiny-v4-long", 700, 22.9, 14)]
    tiny_v41 = get_recipe("tiny-v41")
    assert (tiny_v41.steps, round(tiny_v41.tokens() / 1e6, 1), tiny_v41.base) == (2750, 80.3, None)
    # only the recipes behind shipped or compared models, the smoke recipes, and the real-prose
    # continuations of the shipped model with the V4.1 twin (not yet trained)
    assert set(RECIPES) == {name for name, *_ in chain} | {"tiny-v41", "smoke", "smoke-v41", "tiny-v4-prose",
                                                           "tiny-v4-prose-keys", "tiny-v4-prose-uuid",
                                                           "tiny-v4-mtp-chain", "tiny-v41-prose", "tiny-v41-wide",
                                                           "tiny-v41-needles"}
    # the shipped MTP block: trained alone on the last recipe's export, also as the engine chains it
    mtp = get_recipe("tiny-v4-mtp-chain")
    assert (mtp.base, mtp.trains, mtp.mtp_chain, mtp.loss.mtp, mtp.steps, round(mtp.tokens() / 1e6, 1)) == \
        ("tiny-v4-prose-uuid", "mtp.", 1, 1.0, 400, 1.6)


def test_the_shipped_v41_lineage_is_the_one_its_card_records():
    """models/tiny-v41 is tiny-v41-needles continuing tiny-v41-wide's export, on the same model, the
    indexer trained the same way; steps and tokens as its card reports."""
    needles, wide = get_recipe("tiny-v41-needles"), get_recipe("tiny-v41-wide")
    assert needles.base == "tiny-v41-wide" and wide.base is None
    assert [(r.steps, round(r.tokens() / 1e6, 1)) for r in (wide, needles)] == [(2750, 80.3), (600, 16.4)]
    assert needles.model == wide.model
    assert (needles.reuse_layers_train_indexer, needles.indexer_clip) == (True, 1.0)
    assert all(not st.dense_indexer and st.qat_experts for st in needles.stages)
    assert [(st.seq_len, st.batch) for st in needles.stages] == [(4096, 8), (8192, 4), (16384, 1)]
    assert json.loads((SHIPPED_TOKENIZER.parent / "tiny-v41" / "config.json").read_text())["index_topk"] == \
        wide.model["index_topk"]


def test_tiny_v41_wide_scales_the_selection_to_v41s_finer_entries():
    """tiny-v41-wide is tiny-v41 (data, lengths, budget, layers) but for the indexer's training (the
    Reuse layers' attention in its target, its gradients clipped apart, the top-k from halfway
    through the 2K stage) and the selection: top-k
    entries of ratio 1 cover what tiny-v4's top-64 entries of ratio 4 cover, and the candidate pool
    is 32 times the top-k, V4.1-Flash's proportion (top-512 in 16,384 positions)."""
    from hybridkv.config import ModelConfig
    from hybridkv.presets import PRESETS

    wide, base, v4 = get_recipe("tiny-v41-wide"), get_recipe("tiny-v41"), get_recipe("tiny-v4")
    # the same data and lengths at every step; the top-k from halfway through the 2K stage
    assert wide.steps == base.steps and round(wide.tokens()) == round(base.tokens())
    for step in range(wide.steps):
        w, b = wide.stage(step), base.stage(step)
        assert (w.seq_len, w.batch, w.tasks, w.qat_experts) == (b.seq_len, b.batch, b.tasks, b.qat_experts)
        assert w.dense_indexer == (b.dense_indexer and step < SPARSE_FROM_2K), step
    assert replace(wide, name=base.name, model=base.model, stages=base.stages, reuse_layers_train_indexer=False,
                   indexer_clip=None) == base
    assert wide.reuse_layers_train_indexer and wide.indexer_clip == 1.0
    changed = {k for k in wide.model if wide.model[k] != base.model.get(k)}
    assert changed == {"index_topk", "candidate_topk_blocks"}
    cfg, v4_cfg, flash = (ModelConfig.from_dict(m) for m in (wide.model, v4.model, PRESETS["v4.1-flash"]))
    assert cfg.index_topk * min(r for r in cfg.compress_ratios if r) == v4_cfg.index_topk * 4
    pool = lambda c: c.candidate_topk_blocks * c.candidate_block_size  # noqa: E731
    assert pool(cfg) // cfg.index_topk == pool(flash) // flash.index_topk == 32


@functools.cache
def _tiny_v4_tokenizer() -> TaskTokenizer:
    """tiny-v4's tokenizer: the shipped one without the hex rule that `tiny-v4-hexsplit` added to it
    (same vocabulary and merges)."""
    spec = json.loads(TaskTokenizer.load(SHIPPED_TOKENIZER).tokenizer.to_str())
    pre = spec["pre_tokenizer"]
    pre["pretokenizers"] = [st for st in pre["pretokenizers"] if st.get("type") != "Split"]
    return TaskTokenizer(Tokenizer.from_str(json.dumps(spec)))


def _adds_hex_chars_in_chain(r) -> bool:
    while r is not None:
        if r.adds_hex_chars:
            return True
        r = get_recipe(r.base) if r.base else None
    return False


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_is_well_formed(name):
    r = get_recipe(name)
    ends = [s.until for s in r.stages]
    assert ends == sorted(set(ends)) and ends[-1] == r.steps
    for s in r.stages:
        assert set(s.tasks or r.task_weights or TASKS) <= set(GENERATED_TASKS)
        assert set(r.task_mix(s.until - 1) or TASKS) <= set(GENERATED_TASKS)
    cfg = model_config(r, r.vocab_size)
    assert cfg.vocab_size == r.vocab_size


@pytest.mark.parametrize("name", [n for n in sorted(RECIPES) if n.startswith("tiny-v4")])
def test_every_stage_task_fits_its_length(name):
    r = get_recipe(name)
    # tiny-v4's tokenizer, with the hex rule from tiny-v4-hexsplit on (the recipe that adds it)
    tok = _tiny_v4_tokenizer().with_hex_chars() if _adds_hex_chars_in_chain(r) else _tiny_v4_tokenizer()
    assert tok.hex_chars == r.hex_chars
    assert tok.vocab_size == r.vocab_size
    pools = Pools(tok, seed=0, prose_split="train")
    for s in r.stages:
        for task in r.task_mix(s.until - 1):
            ids, sup = training_example(7, pools, s.seq_len, {task: 1.0}, r.next_document)
            assert len(ids) == s.seq_len and sup.any()
            if r.next_document:    # the longest next document leaves the prompt the least room
                assert training_example(7, pools, s.seq_len - r.next_document, {task: 1.0})[1].any()


@pytest.mark.parametrize("name", [n for n in sorted(RECIPES) if get_recipe(n).filler_seed is not None])
def test_a_continuation_keeping_filler_keeps_its_bases(name):
    """`filler_seed` exists so that a continuation sees the filler its base already learned: it must
    be the seed the base drew its filler with."""
    r = get_recipe(name)
    base = get_recipe(r.base)
    assert r.filler_seed == base.pool_seed
    assert r.seed != r.filler_seed      # and fresh examples


def test_filler_seed_keeps_the_haystack_material_and_draws_new_examples():
    tok = _tiny_v4_tokenizer().with_hex_chars()
    base, kept, fresh = TaskBatches(tok, 9), TaskBatches(tok, 11, pool_seed=9), TaskBatches(tok, 11)
    try:
        assert np.array_equal(kept.pools.sentences.flat, base.pools.sentences.flat)
        assert not np.array_equal(fresh.pools.sentences.flat, base.pools.sentences.flat)
        mix = {"niah_single_3": 1.0}
        ids_base, sup_base = base.get(0, 2, 1024, mix)
        ids_kept, sup_kept = kept.get(0, 2, 1024, mix)
        # new answers (UUIDs) on the base's filler
        assert not torch.equal(ids_kept[sup_kept], ids_base[sup_base])
    finally:
        for b in (base, kept, fresh):
            b.close()


def test_train_command_line_overrides_the_recipe():
    a = build_parser().parse_args(["train", "--recipe", "tiny-v4-polish", "--lr", "3e-4", "--answer-weight", "1",
                                   "--seed", "12"])
    r, default = train_recipe(a), get_recipe("tiny-v4-polish")
    assert (r.lr, r.loss.answer, r.seed) == (3e-4, 1.0, 12)
    assert (default.lr, default.loss.answer, default.seed) == (5e-4, 4.0, 11)
    assert r.loss.mtp == default.loss.mtp and r.filler_seed == default.filler_seed
    assert r.loss.answer_end == default.loss.answer_end == 0.0
    end = train_recipe(build_parser().parse_args(["train", "--recipe", "tiny-v4-anypos", "--answer-end-weight", "8"]))
    assert (end.loss.answer_end, get_recipe("tiny-v4-anypos").loss.answer_end) == (8.0, 0.0)
    assert end.base == "tiny-v4-polish" and end.pool_seed == get_recipe("tiny-v4-polish").pool_seed


def test_batches_of_a_next_document_recipe_end_their_answers_before_the_row_end():
    r = get_recipe("tiny-v4-anypos")
    assert r.next_document == 128
    tok = _tiny_v4_tokenizer().with_hex_chars()
    data = TaskBatches(tok, r.seed, r.pool_seed, r.next_document)
    try:
        ids, sup = data.get(0, 8, 1024, r.task_mix(0))
        after_eos = [int((sup[row].flip(0).cumsum(0) == 0).sum()) for row in range(8)]
        assert max(after_eos) > 0 and all(a < 128 for a in after_eos)
        for row, a in enumerate(after_eos):
            if a:
                assert ids[row, -a] == tok.bos_id
    finally:
        data.close()


def test_prose_recipes_put_half_of_each_real_text_familys_rows_over_real_prose():
    """tiny-v4-prose continues the anypos/long average on its filler; it and tiny-v41-prose move half the
    weight of every family with a real-text variant to that variant, and nothing else."""
    r, v41 = get_recipe("tiny-v4-prose"), get_recipe("tiny-v41-prose")
    assert r.base == "tiny-v4-long" and r.hex_chars and not r.adds_hex_chars and r.realtext_share == 0.5
    assert (r.steps, r.stages[-1].seq_len) == (600, 32768)
    for recipe in (r, v41):
        for s in recipe.stages:
            plain, mixed = s.tasks or recipe.task_weights, recipe.task_mix(s.until - 1)
            assert sum(mixed.values()) == pytest.approx(sum(plain.values()))
            for task, w in plain.items():
                if task in REALTEXT_FAMILIES:
                    assert mixed[task] == pytest.approx(w / 2) == mixed[task + "_realtext"]
                else:
                    assert mixed[task] == w and task + "_realtext" not in mixed
    plain_v41 = get_recipe("tiny-v41")
    shape = [(s.until, s.seq_len, s.batch) for s in v41.stages]
    assert shape == [(s.until, s.seq_len, s.batch) for s in plain_v41.stages]
    assert plain_v41.task_mix(0) == {"passkey": 1.0} and v41.task_mix(0) == {"passkey": 0.5, "passkey_realtext": 0.5}
    with pytest.raises(TrainingError, match="realtext_share"):
        replace(r, realtext_share=1.5)


@pytest.mark.parametrize("name,model", [("tiny-v4-prose", SMOKE_MODEL), ("tiny-v41-prose", SMOKE_V41_MODEL)])
def test_prose_recipes_train_on_the_cpu(name, model, tmp_path):
    """The prose recipes' data mix through the training loop: a smoke-size model, a few steps of
    each recipe's last stage mix (half of its needle rows over the training prose)."""
    r = get_recipe(name)
    mix = r.task_mix(r.steps - 1)
    small = replace(r, model=model, vocab_size=512, tokenizer_texts=300, steps=3, base=None, warmup=1, log_every=1,
                    kl_queries=16, stages=[Stage(3, 640, 2, dense_indexer=False, qat_experts=True, tasks=mix)])
    progress = train(small, tmp_path, echo=lambda *_: None)
    assert progress["step"] == 3
    rows = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(np.isfinite(row["loss"]) for row in rows)
    # the rows those steps trained on: some over the training prose
    tok = TaskTokenizer.load(tmp_path)
    data = TaskBatches(tok, small.seed, small.pool_seed, small.next_document)
    try:
        texts = [tok.decode(row.tolist()) for step in range(3) for row in data.get(step, 2, 640, mix)[0]]
    finally:
        data.close()
    from hybridkv.tasks import prose
    long_sentences = [p.strip() for p in prose.pieces("train") if len(p) > 60]
    assert any(any(s in t for s in long_sentences) for t in texts)


def test_the_shipped_model_is_a_base_tiny_v4_prose_accepts(tmp_path):
    """`hybridkv train --recipe tiny-v4-prose --init-from models/tiny-v4` passes the base checks
    (architecture, tokenizer rule) and keeps the shipped tokenizer."""
    from hybridkv.train.loop import _take_base
    _take_base(get_recipe("tiny-v4-prose"), SHIPPED_TOKENIZER, tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (SHIPPED_TOKENIZER / "tokenizer.json").read_bytes()
    with pytest.raises(TrainingError, match="does not keep hex characters apart"):
        _take_base(get_recipe("tiny-v4-needles"), SHIPPED_TOKENIZER, tmp_path / "other")


def test_indexer_clip_keeps_the_indexers_gradients_out_of_the_models_clip():
    """With `indexer_clip`, however large the indexers' gradients, the rest of the model is clipped
    by its own norm; without it one norm over every parameter scales both."""
    from hybridkv.train.export import float_model
    from hybridkv.train.loop import _Clip
    model = float_model(FIXTURES / "v41-tiny")
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-4)
    for n, p in model.named_parameters():
        if ".indexer." in n:
            p.grad.fill_(10.0)
    rest = [p for n, p in model.named_parameters() if ".indexer." not in n]
    rest_norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in rest])))
    saved = [p.grad.clone() for p in model.parameters()]
    logs = {}
    base = get_recipe("smoke-v41")
    norm = _Clip(model, replace(base, clip=1.0, indexer_clip=1.0))(logs)
    assert abs(float(norm) - rest_norm) < 1e-4 * rest_norm and rest_norm < 1.0
    assert all(torch.equal(p.grad, torch.full_like(p, 1e-4)) for p in rest)      # under its own clip: untouched
    assert logs["indexer_grad_norm"] > 100
    for p, g in zip(model.parameters(), saved):
        p.grad = g
    _Clip(model, replace(base, clip=1.0))({})
    assert all(float(p.grad.max()) < 1e-5 for p in rest)                         # scaled by the indexers' norm
