"""Every recipe is well formed: stages end in increasing order at the last step, the task mixes
name real tasks, and every task of every stage fits the stage's length with the recipe's
tokenizer (a run must not die an hour in)."""

import functools
from pathlib import Path

import pytest

from hybridkv.tasks.generators import GENERATED_TASKS, TASKS, Pools, build_tokenizer, training_example
from hybridkv.tasks.tokenizer import TaskTokenizer
from hybridkv.train.loop import model_config
from hybridkv.train.recipes import RECIPES, get_recipe

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "tiny-v4"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_is_well_formed(name):
    r = get_recipe(name)
    ends = [s.until for s in r.stages]
    assert ends == sorted(set(ends)) and ends[-1] == r.steps
    for s in r.stages:
        assert set(s.tasks or r.task_weights or TASKS) <= set(GENERATED_TASKS)
    cfg = model_config(r, r.vocab_size)
    assert cfg.vocab_size == r.vocab_size


@functools.cache
def _hex_tokenizer(vocab_size: int, n_texts: int) -> TaskTokenizer:
    """tiny-v4-hex's tokenizer (seed 0), which its continuations keep."""
    return build_tokenizer(vocab_size, 0, n_texts, hex_chars=True)


@pytest.mark.parametrize("name", [n for n in sorted(RECIPES) if n.startswith("tiny-v4")])
def test_every_stage_task_fits_its_length(name):
    r = get_recipe(name)
    # the shipped tokenizer is tiny-v4's; the hex-rule recipes train (or continue) tiny-v4-hex's, or
    # add the rule to the shipped one
    if r.adds_hex_chars:
        tok = TaskTokenizer.load(SHIPPED_TOKENIZER).with_hex_chars()
    elif r.hex_chars:
        tok = _hex_tokenizer(r.vocab_size, r.tokenizer_texts)
    else:
        tok = TaskTokenizer.load(SHIPPED_TOKENIZER)
    assert tok.hex_chars == r.hex_chars
    assert tok.vocab_size == r.vocab_size
    pools = Pools(tok, seed=0)
    for s in r.stages:
        for task in s.tasks or r.task_weights:
            ids, sup = training_example(7, pools, s.seq_len, {task: 1.0})
            assert len(ids) == s.seq_len and sup.any()
