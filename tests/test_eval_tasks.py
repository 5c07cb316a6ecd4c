"""hybridkv.eval.tasks: every evaluation task builds a prompt within its length from the task pools,
with its references present in the prompt, deterministically by seed."""

import pytest

from hybridkv.eval.tasks import ALL_TASKS, MAX_NEW, NEEDLE_TASKS, SUITES, expand_tasks, make_eval_sample
from hybridkv.tasks.generators import Pools, build_tokenizer

LENGTH = 2048


@pytest.fixture(scope="module")
def pools() -> Pools:
    return Pools(build_tokenizer(vocab_size=1024, seed=0, n_texts=1500))


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
