"""hybridkv.tasks: the word lists, the task tokenizer (and its use by the engine), and the
token-exact sample generators."""

import re
import shutil

import numpy as np
import pytest

from hybridkv.chat.format import BOS, EOS, SPECIAL_TOKENS
from hybridkv.tasks import words
from hybridkv.tasks.generators import (NIAH_VARIANTS, TASKS, TRAIN_TASKS, Pools, Units, build_tokenizer,
                                       make_sample, tokenizer_corpus, training_example)
from hybridkv.tasks.tokenizer import TaskTokenizer

# the string whose occurrence marks where a task's depth-placed insert sits (from the sample itself)
MARKERS = {
    **{t: lambda s: f"for {s.meta['keys'][0]} is:" for t in NIAH_VARIANTS},
    "passkey": lambda s: "The pass key is",
    "vt": lambda s: f"= {s.meta['value']}.",
    "assoc": lambda s: f"{s.meta['key']}:",
    "copy": lambda s: "The secret string is:",
}


@pytest.fixture(scope="module")
def tok() -> TaskTokenizer:
    return build_tokenizer(vocab_size=1024, seed=0, n_texts=1500)


@pytest.fixture(scope="module")
def pools(tok) -> Pools:
    return Pools(tok, seed=0)


def test_word_lists_are_sorted_lowercase_alphabetic():
    for ws in (words.nouns(), words.adjectives(), words.verbs()):
        assert len(ws) > 500 and ws == sorted(set(ws))
        assert all(w.isascii() and w.isalpha() and w.islower() for w in ws)


def test_special_tokens_and_digits(tok):
    assert tok.bos_id == 0 and tok.eos_id == 1 and tok.vocab_size == 1024
    assert [tok.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.encode(BOS + "Hi")[0] == 0 and tok.encode("Hi" + EOS)[-1] == 1
    digit_ids = [tok.encode(d) for d in "0123456789"]
    assert all(len(i) == 1 for i in digit_ids)
    ids = tok.encode("pass key 9876543210 and 0042")
    assert [i for i in ids if [i] in digit_ids] == [*(digit_ids[int(d)][0] for d in "98765432100042")]


@pytest.mark.parametrize("text", ["The pass key is 71432. Remember it.", "VAR ABCDE = 12345.",
                                  "ffbd21fe-d631-43b9-a042-e368d5c4c325", "Grüße, 日本語!\n\tdone  ",
                                  "<｜User｜>Write a poem.<｜Assistant｜></think>Ok."])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.tokenizer.decode(ids, skip_special_tokens=False) == text
    plain = text
    for special in SPECIAL_TOKENS:
        plain = plain.replace(special, "")
    assert tok.decode(ids) == plain     # special tokens are skipped
    assert tok.decode([tok.bos_id, *tok.encode("plain"), tok.eos_id]) == "plain"


def test_save_and_load(tok, tmp_path):
    file = tok.save(tmp_path / "model")
    assert file == tmp_path / "model" / "tokenizer.json" and file.exists()
    text = "One of the special magic numbers for brave-otter is: 1234567."
    for path in (tmp_path / "model", file):
        loaded = TaskTokenizer.load(path)
        assert loaded.encode(text) == tok.encode(text) and (loaded.bos_id, loaded.eos_id) == (0, 1)


def test_hex_chars_split_hex_runs_with_digits_and_nothing_else(tok, tmp_path):
    """With hex_chars, every character of a UUID (or of any hex run holding a digit) is one token;
    text without such runs is split exactly as by the plain tokenizer (words of a-f letters alone
    included); text round-trips; and a saved tokenizer.json keeps the rule (the engine and server
    load that file)."""
    hex_tok = build_tokenizer(vocab_size=1024, seed=0, n_texts=1500, hex_chars=True)
    pieces = lambda t, text: [t.tokenizer.id_to_token(i).replace("Ġ", " ") for i in t.encode(text)]  # noqa: E731
    uuid = "5d5b7bcc-e790-447f-8d1f-32d8f194644f"
    assert pieces(hex_tok, f"The special magic uuid is {uuid}.")[-37:] == [*uuid, "."]
    assert pieces(hex_tok, "bbad-4e5f x")[:9] == list("bbad-4e5f")     # a letters-only group of a UUID
    assert any(len(p) > 1 and set(p) <= set("abcdef") for p in pieces(tok, uuid))  # the plain one merges
    split = lambda t, text: [p for p, _ in t.tokenizer.pre_tokenizer.pre_tokenize_str(text)]  # noqa: E731
    for text in ("a bad cafe fed-up bed", "deadbeef and faded decade", "The pass key is 71432.",
                 "VAR ABCDE = 12345.", "Grüße, 日本語!\n\tdone  "):
        assert split(hex_tok, text) == split(tok, text)
        assert hex_tok.decode(hex_tok.encode(text)) == text
    assert split(hex_tok, "ab12cd ef-12ab") == ["a", "b", "1", "2", "c", "d", "Ġ", "e", "f", "-", "1", "2", "a", "b"]
    loaded = TaskTokenizer.load(hex_tok.save(tmp_path))
    assert loaded.encode(uuid) == hex_tok.encode(uuid) and len(loaded.encode(uuid)) == len(uuid)


def test_engine_loads_and_streams_with_the_task_tokenizer(fixtures, tmp_path):
    """A model directory carrying the task tokenizer: the engine encodes like it, and streamed text
    deltas concatenate to the decoded output."""
    from hybridkv.engine import LLM, SamplingParams

    tok = build_tokenizer(vocab_size=512, seed=1, n_texts=300)   # the tiny checkpoint's vocabulary
    model_dir = tmp_path / "m"
    shutil.copytree(fixtures / "v4-tiny", model_dir, ignore=shutil.ignore_patterns("golden.safetensors"))
    tok.save(model_dir)
    llm = LLM(model_dir, num_blocks=16, max_num_seqs=2)
    sample = make_sample("passkey", 0, Pools(tok, n_sentences=64, n_needles=16), 256)
    assert llm.tokenizer.encode(tok.decode(sample.prompt[1:])) == sample.prompt[1:]
    llm.engine.finished = {}
    events = list(llm.stream([sample.prompt], SamplingParams(max_tokens=24, temperature=1.0, seed=3)))
    seq = next(iter(llm.engine.finished.values()))
    assert "".join(e.text for e in events) == seq.text == llm.tokenizer.decode(seq.output_ids)
    assert llm.tokenizer.decode([*tok.encode(" 123."), tok.eos_id]) == " 123." + EOS


@pytest.mark.parametrize("task", TASKS)
def test_sample_layout(task, tok, pools):
    length = 2048
    s = make_sample(task, 7, pools, length, depth=0.3)
    assert s.task == task and len(s.prompt) == length and s.prompt[0] == tok.bos_id
    assert tok.bos_id not in s.prompt[1:] and tok.eos_id not in s.prompt
    assert s.answers and s.completion[-1] == tok.eos_id and s.completion.count(tok.eos_id) == 1
    prompt, completion = tok.decode(s.prompt), tok.decode(s.completion)
    assert tok.encode(prompt) == s.prompt[1:]      # the assembled pieces are the canonical tokenization
    for a in s.answers:
        assert a in prompt and a in completion
    assert s.depth == 0.3
    # the depth-placed insert sits at the requested fraction of the haystack
    start, end = (len(tok.decode(s.prompt[:i])) for i in s.meta["context"])
    marker = MARKERS[task](s)
    found, at = [], prompt.find(marker, start)
    while 0 <= at < end:
        found.append((at - start) / (end - start))
        at = prompt.find(marker, at + 1)
    assert found and min(abs(f - 0.3) for f in found) < 0.05


@pytest.mark.parametrize("task", TASKS)
def test_samples_are_deterministic_by_seed(task, tok, pools):
    a, b = make_sample(task, 3, pools, 1024), make_sample(task, 3, pools, 1024)
    assert (a.prompt, a.completion, a.answers, a.depth) == (b.prompt, b.completion, b.answers, b.depth)
    assert 0.0 <= a.depth <= 1.0
    assert make_sample(task, 4, pools, 1024).prompt != a.prompt
    # another depth keeps the needles and moves them
    shallow, deep = make_sample(task, 3, pools, 1024, depth=0.1), make_sample(task, 3, pools, 1024, depth=0.9)
    assert sorted(shallow.answers) == sorted(deep.answers) and shallow.prompt != deep.prompt


def test_samples_repeat_across_pool_rebuilds(tok, pools):
    again = Pools(tok, seed=0)
    for task in ("niah_multikey_2", "copy"):
        assert make_sample(task, 5, again, 1500).prompt == make_sample(task, 5, pools, 1500).prompt


def test_needle_variants(tok, pools):
    def sample(task):
        return make_sample(task, 11, pools, 4096, depth=0.5)

    noise = tok.decode(sample("niah_single_1").prompt)
    assert noise.count("The grass is green.") > 50
    assert len(sample("niah_single_2").answers[0]) == 7
    assert sample("niah_single_3").answers[0].count("-") == 4
    mk1 = tok.decode(sample("niah_multikey_1").prompt)
    assert mk1.count("One of the special magic numbers for") == 4
    mk2 = tok.decode(sample("niah_multikey_2").prompt)
    assert mk2.count("One of the special magic numbers for") > 100
    mk3 = sample("niah_multikey_3")
    assert tok.decode(mk3.prompt).count("One of the special magic uuids for") > 50
    assert mk3.meta["keys"][0].count("-") == 4
    mv = sample("niah_multivalue")
    assert len(mv.answers) == 4 and tok.decode(mv.prompt).count(f"for {mv.meta['keys'][0]} is:") == 4
    mq = sample("niah_multiquery")
    assert len(mq.answers) == 4 and len(set(mq.meta["keys"])) == 4
    assert tok.decode(mq.completion) == " " + ", ".join(mq.answers) + "."


def test_vt_chain_and_passkey(tok, pools):
    vt = make_sample("vt", 2, pools, 3000)
    text = tok.decode(vt.prompt)
    names, value = vt.answers, vt.meta["value"]
    assert len(names) == 5 and f"VAR {names[0]} = {value}." in text
    assert all(text.index(f"VAR {b} = VAR {a}.") > text.index(f"VAR {a} =") for a, b in zip(names, names[1:]))
    pk = make_sample("passkey", 2, pools, 3000)
    key = pk.answers[0]
    assert len(key) == 5 and f"The pass key is {key}. Remember it. {key} is the pass key." in tok.decode(pk.prompt)
    assert tok.decode(pk.completion) == f" {key}."


def test_training_examples(tok, pools):
    seen = set()
    for seed in range(40):
        ids, sup = training_example(seed, pools, 1024)
        assert ids.dtype == np.int32 and ids.shape == sup.shape == (1024,) and sup.dtype == bool
        assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and (ids == tok.eos_id).sum() == 1
        n = int(sup.sum())
        assert n >= 2 and sup[-n:].all()           # one contiguous block at the end
        seen.add(tok.decode(ids[-n:]))
    assert len(seen) == 40
    a, b = training_example(5, pools, 2000), training_example(5, pools, 2000)
    assert (a[0] == b[0]).all() and (a[1] == b[1]).all()
    ids, sup = training_example(9, pools, 800, weights={"copy": 1.0})
    target = tok.decode(ids[sup])
    assert target.endswith(".") and target.strip(" .") in tok.decode(ids[~sup])
    assert set(TRAIN_TASKS) <= set(TASKS)
    # training draws are kept apart from the evaluation samples of the same seed
    ids, sup = training_example(0, pools, 1024, weights={"passkey": 1.0})
    assert ids[sup].tolist() != make_sample("passkey", 0, pools, 1024).completion


def test_training_examples_with_a_next_document_end_their_answers_anywhere(tok, pools):
    ends = []
    for seed in range(60):
        plain_ids, plain_sup = training_example(seed, pools, 1024)
        ids, sup = training_example(seed, pools, 1024, next_document=128)
        assert ids.dtype == np.int32 and ids.shape == sup.shape == (1024,)
        # the same task and answer as without, then BOS and filler the loss does not count as answer
        assert ids[sup].tolist() == plain_ids[plain_sup].tolist()
        eos = int(np.flatnonzero(sup)[-1])
        assert ids[eos] == tok.eos_id and (ids == tok.eos_id).sum() == 1
        assert sup[eos - int(sup.sum()) + 1:eos + 1].all() and not sup[eos + 1:].any()
        if eos < 1023:
            assert ids[eos + 1] == tok.bos_id and (ids[eos + 2:] != tok.bos_id).all()
        ends.append(1023 - eos)
    # the answers end at many places of the last 128-token block, at every phase of a CSA block
    assert 0 <= min(ends) and max(ends) <= 127 and len(set(ends)) > 30
    assert {e % 4 for e in ends} == {0, 1, 2, 3}
    again = training_example(7, pools, 1024, next_document=128)
    assert (again[0] == training_example(7, pools, 1024, next_document=128)[0]).all()


def test_too_short_or_unknown(pools):
    with pytest.raises(ValueError, match="too short"):
        make_sample("niah_multiquery", 0, pools, 64)
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("nope", 0, pools, 1024)


def test_units_fill_exactly():
    units = Units([[1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]], cyclic=True)
    rng = np.random.default_rng(0)
    for n in range(0, 300):
        tokens, bounds = units.fill(rng, n)
        assert len(tokens) == n and bounds[0] == 0 and bounds[-1] == n and (np.diff(bounds) > 0).all()
        if n >= 8:    # every count past a few tokens is whole pieces
            pieces = [tuple(tokens[a:b]) for a, b in zip(bounds, bounds[1:])]
            assert set(pieces) <= {(1, 2, 3, 4), (5, 6, 7, 8, 9), (10, 11, 12, 13, 14, 15)}


def test_tokenizer_corpus_is_deterministic_and_covers_the_tasks():
    texts = list(tokenizer_corpus(400, seed=3))
    assert texts == list(tokenizer_corpus(400, seed=3))
    joined = "\n".join(texts)
    for s in ("special magic numbers", "special magic uuids", "pass key", "VAR ", "secret string", "Document 1:",
              "<｜Assistant｜>", "\n1. ", "\nUser: "):
        assert s in joined


@pytest.mark.parametrize("task", ["passkey", "niah_single_1", "niah_single_2", "niah_single_3"])
@pytest.mark.parametrize("length", [1024, 4096])
def test_single_needle_appears_exactly_once(task, length, tok, pools):
    """RULER's validity check: one needle, once, whatever the haystack length; its value is in the
    prompt only inside that needle (the passkey needle states its key twice by design)."""
    for seed in range(3):
        s = make_sample(task, seed, pools, length, depth=0.5)
        prompt = tok.decode(s.prompt)
        value = s.answers[0]
        if task == "passkey":
            assert prompt.count("Remember it.") == 1
            assert prompt.count(value) == 2
        else:
            key = s.meta["keys"][0]
            assert prompt.count(f"for {key} is:") == 1
            assert prompt.count(value) == 1
        assert len(s.prompt) == length


def test_hard_multikey_distractors_share_one_word_with_the_asked_key(tok, pools):
    """niah_multikey_hard (a training drill): four needles; each distractor key shares exactly one
    word (adjective or noun) with the asked key; the answer is the asked key's value."""
    from hybridkv.tasks.generators import GENERATED_TASKS, TRAIN_TASKS
    assert "niah_multikey_hard" in GENERATED_TASKS and "niah_multikey_hard" not in TRAIN_TASKS
    shared = set()
    for seed in range(12):
        s = make_sample("niah_multikey_hard", seed, pools, 2048)
        prompt = tok.decode(s.prompt)
        asked = s.meta["keys"][0]
        needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d+)\.", prompt)
        assert len(needles) == 4 and len({k for k, _ in needles}) == 4 and len({v for _, v in needles}) == 4
        assert dict(needles)[asked] == s.answers[0]
        for key, _ in needles:
            if key != asked:
                same = [a == b for a, b in zip(key.split("-"), asked.split("-"))]
                assert sum(same) == 1
                shared.add(same.index(True))
    assert shared == {0, 1}          # both the adjective and the noun are shared somewhere
