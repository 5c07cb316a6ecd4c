"""hybridkv.tasks.prose and the real-text haystacks: the standard library's prose, split by source
into a training and an evaluation part that are disjoint and stable; `_realtext` samples that are
token-exact, seeded and made of the evaluation part only; training batches made of the training
part only."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from hybridkv.tasks import prose
from hybridkv.tasks.generators import (REALTEXT_FAMILIES, REALTEXT_TASKS, Pools, build_tokenizer, make_sample,
                                       realtext_task, training_example)
from hybridkv.train.data import TaskBatches


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(vocab_size=1024, seed=0, n_texts=1500)


@pytest.fixture(scope="module")
def eval_pools(tok):
    return Pools(tok, seed=0, prose_split="eval")


def _sentences(split: str) -> set[str]:
    return {p.strip() for p in prose.pieces(split)}


def test_every_source_is_in_one_split_by_its_name_alone():
    names = [s.name for s in prose.sources()]
    assert names == sorted(names) and len(names) == len(set(names))
    train, held = prose.split_sources("train"), prose.split_sources("eval")
    assert {s.name for s in train}.isdisjoint(s.name for s in held)
    assert len(train) + len(held) == len(names)
    assert 0.15 < len(held) / len(names) < 0.35
    # each kind of source is on both sides
    for kind in ("topic:", "doc:"):
        assert any(s.name.startswith(kind) for s in train) and any(s.name.startswith(kind) for s in held)
    # the split of a name is fixed (a hash of the name, not of the set of sources a machine has)
    assert [prose.split_of(n) for n in ("topic:assert", "topic:for", "doc:json", "doc:argparse", "doc:math",
                                        "file:LICENSE.txt")] == ["train", "train", "eval", "eval", "train", "train"]


def test_no_held_out_sentence_is_in_the_training_text():
    """Sources are disjoint, and the held-out part drops the paragraphs that repeat a training sentence."""
    train, held = _sentences("train"), _sentences("eval")
    assert len(held) > 1000 and len(train) > 3 * len(held)
    assert held.isdisjoint(train)


def test_the_prose_is_prose():
    text = "\n\n".join([
        "The \"assert\" statement\n**********************",
        "Assert statements are a convenient way to insert debugging\nassertions into a program, as "
        ":func:`repr` and ``eval`` show for *every* object.",
        "   assert_stmt ::= \"assert\" expression [\",\" expression]",
        ">>> print(1)\n1",
        "* a bullet that is long enough to count as eight words of text",
        "if __debug__:\n    if not expression: raise AssertionError",
    ])
    assert prose.prose_paragraphs(text) == [
        "Assert statements are a convenient way to insert debugging assertions into a program, as repr and "
        "eval show for every object."]
    assert prose.sentences("It works. So does this! Is it 3? Yes, see \"os.path\". Done.") == [
        "It works.", "So does this!", "Is it 3?", "Yes, see \"os.path\".", "Done."]
    for piece in prose.pieces("eval")[:500]:
        assert piece[0] in " \n" and ">>>" not in piece


def test_the_text_is_the_same_in_a_fresh_process_which_imports_nothing_with_side_effects():
    code = ("import sys; from hybridkv.tasks import prose; f = [prose.fingerprint(s) for s in prose.SPLITS]; "
            "import json; print(json.dumps([f, sorted(m for m in ('antigravity', 'this', 'idlelib', 'tkinter', "
            "'turtle', 'readline') if m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    fingerprints, imported = json.loads(out.stdout)
    assert fingerprints == [prose.fingerprint(s) for s in prose.SPLITS]
    assert imported == [] and out.stderr == ""


def test_unknown_split():
    with pytest.raises(ValueError, match="unknown prose split 'test'"):
        prose.pieces("test")
    with pytest.raises(ValueError, match="unknown prose split"):
        Pools(build_tokenizer(vocab_size=300, n_texts=50), prose_split="dev")


def test_realtext_task_names():
    assert realtext_task("passkey") == "passkey_realtext" == realtext_task("passkey_realtext")
    assert set(REALTEXT_TASKS) == {realtext_task(t) for t in REALTEXT_FAMILIES}
    with pytest.raises(ValueError, match="'vt' has no real-text haystack"):
        realtext_task("vt")


def test_pools_without_a_prose_split_make_no_realtext_sample(tok):
    with pytest.raises(ValueError, match="prose split"):
        make_sample("passkey_realtext", 0, Pools(tok, seed=0), 1024)


@pytest.mark.parametrize("task", REALTEXT_TASKS)
@pytest.mark.parametrize("length", [1024, 8192])
def test_realtext_sample_is_exact_seeded_and_made_of_held_out_prose(task, length, tok, eval_pools):
    s = make_sample(task, 3, eval_pools, length, depth=0.4)
    assert s.task == task and len(s.prompt) == length and s.prompt[0] == tok.bos_id
    again = make_sample(task, 3, eval_pools, length, depth=0.4)
    assert (again.prompt, again.answers) == (s.prompt, s.answers)
    assert make_sample(task, 4, eval_pools, length, depth=0.4).prompt != s.prompt
    assert abs(s.meta["placed_depth"] - 0.4) < 0.05
    text = tok.decode(s.prompt)
    for a in s.answers:
        assert a in text
    # the haystack without its needles: sentences of the held-out prose only
    start, end = s.meta["context"]
    hay = _NEEDLE.sub("\n", tok.decode(s.prompt[start:end]))
    said = [x.strip() for line in hay.split("\n") for x in prose.sentences(line) if x.strip()]
    held = _sentences("eval")
    assert len(said) > 5 and sum(x in held for x in said) >= 0.9 * len(said)
    assert not any(x in _sentences("train") for x in said)


_NEEDLE = re.compile(r" One of the special magic \w+s for \S+ is: \S+\.|"
                     r" The pass key is \d+\. Remember it\. \d+ is the pass key\.")


def test_synthetic_tasks_are_unchanged_by_the_prose_split(tok):
    """A pool with a prose split gives the synthetic tasks the samples a pool without one gives."""
    plain, with_prose = Pools(tok, seed=0), Pools(tok, seed=0, prose_split="eval")
    for task in ("passkey", "niah_single_2", "niah_multikey_1"):
        assert make_sample(task, 5, plain, 2048, 0.5).prompt == make_sample(task, 5, with_prose, 2048, 0.5).prompt


def test_training_batches_read_the_training_prose_only(tok):
    data = TaskBatches(tok, seed=3, next_document=64)
    try:
        assert data.pools.prose_split == "train"
        ids, sup = data.get(0, 4, 2048, {"passkey_realtext": 1.0, "niah_single_2_realtext": 1.0})
        assert ids.shape == (4, 2048) and sup.any(dim=1).all()
        train, long_held = _sentences("train"), [s for s in _sentences("eval") if len(s) > 60]
        for row in ids:
            text = tok.decode(row.tolist())
            # its haystack is training prose, and no sentence of the held-out part only
            assert any(len(s) > 60 and s in text for s in train)
            assert not any(s in text for s in long_held)
    finally:
        data.close()


def test_realtext_training_examples_fit_exactly(tok):
    pools = Pools(tok, seed=0, prose_split="train")
    for task in REALTEXT_TASKS:
        ids, sup = training_example(11, pools, 1024, {task: 1.0}, next_document=32)
        assert len(ids) == 1024 and sup.any() and ids.dtype == np.int32
