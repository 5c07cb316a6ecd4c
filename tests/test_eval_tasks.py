"""hybridkv.eval.tasks: every evaluation task builds a prompt within its length from the task pools,
with its references present in the prompt, deterministically by seed."""

import pytest

from hybridkv.eval.tasks import ALL_TASKS, MAX_NEW, NEEDLE_TASKS, SUITES, expand_tasks, make_eval_sample
from hybridkv.tasks.generators import NIAH_VARIANTS, Pools, build_tokenizer

LENGTH = 2048


@pytest.fixture(scope="module")
def pools() -> Pools:
    return Pools(build_tokenizer(vocab_size=1024, seed=0, n_texts=1500), prose_split="eval")


@pytest.mark.parametrize("task", ALL_TASKS)
def test_eval_sample_fits_and_holds_its_references(task, pools):
    tok = pools.tok
    depth = 0.25 if task in NEEDLE_TASKS else None
    s = make_eval_sample(task, 0, pools, LENGTH, depth)
    assert s.task == task and s.prompt[0] == tok.bos_id
    assert LENGTH - 200 <= len(s.prompt) <= LENGTH
    assert s.references and 0 < s.max_new_tokens <= max(MAX_NEW.values())
    if depth is not None:
        assert s.depth == depth
    prompt = tok.decode(s.prompt).lower()
    refs = [s.references[0].removeprefix(s.meta["prefix"] + " ")] if s.metric == "mrcr" else s.references
    for ref in refs:
        assert ref.lower() in prompt
    again = make_eval_sample(task, 0, pools, LENGTH, depth)
    assert (again.prompt, again.references) == (s.prompt, s.references)
    assert make_eval_sample(task, 1, pools, LENGTH, depth).prompt != s.prompt


def test_expand_tasks():
    assert expand_tasks("passkey,mrcr") == ["passkey", "mrcr"]
    assert expand_tasks("ruler,niah_single_1") == list(SUITES["ruler"])
    with pytest.raises(ValueError, match="unknown task"):
        expand_tasks("ruler,nope")


def test_expand_tasks_over_real_text():
    assert expand_tasks("passkey,niah_single_1", "realtext") == ["passkey_realtext", "niah_single_1_realtext"]
    # a suite keeps its members with a real-text haystack; the realtext suite is all of them
    assert expand_tasks("ruler,passkey", "realtext") == [t + "_realtext" for t in NIAH_VARIANTS
                                                         if t not in ("niah_multikey_2", "niah_multikey_3")] + \
        ["passkey_realtext"]
    assert set(expand_tasks("realtext")) == set(expand_tasks("ruler,passkey", "realtext")) == set(SUITES["realtext"])
    assert expand_tasks("passkey_realtext,passkey", "realtext") == ["passkey_realtext"]
    with pytest.raises(ValueError, match="'vt' has no real-text haystack"):
        expand_tasks("passkey,vt", "realtext")
    with pytest.raises(ValueError, match="no task of 'mrcr' has a realtext haystack"):
        expand_tasks("mrcr", "realtext")
    with pytest.raises(ValueError, match="unknown haystack"):
        expand_tasks("passkey", "essays")


def test_eval_prompts_of_real_text_come_from_the_held_out_prose():
    from hybridkv.eval.runner import build_samples
    tok = build_tokenizer(vocab_size=512, seed=0, n_texts=300)
    samples = build_samples(tok, ["passkey_realtext"], [2048], 2)
    held, trained = Pools(tok, prose_split="eval"), Pools(tok, prose_split="train")
    for i, (_, s) in enumerate(samples):
        assert s.task == "passkey_realtext" and s.max_new_tokens == MAX_NEW["passkey"] and len(s.prompt) == 2048
        assert s.depth == (i + 0.5) / 2
        assert s.prompt == make_eval_sample("passkey_realtext", i, held, 2048, s.depth).prompt
        assert s.prompt != make_eval_sample("passkey_realtext", i, trained, 2048, s.depth).prompt
