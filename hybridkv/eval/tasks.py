"""The evaluation suite: RULER families, MRCR-like multi-round coreference, and passkey, as prompts
sized to a target token length with the model's own tokenizer, deterministic by seed.

The needle, variable-tracking and passkey families come from `hybridkv.tasks.generators` (shared
with training, token-exact assembly). This module adds the families the training mix does not use:
common- and frequent-word extraction (cwe, fwe), templated fact QA (qa), and MRCR.

Real-text haystacks (`passkey_realtext`, `niah_single_1_realtext`, ...; the `realtext` suite, or
`expand_tasks(..., haystack="realtext")`) hide the same needles in the held-out part of the real
prose (`hybridkv.tasks.prose`), which training never reads; their pools must be made with
`prose_split="eval"` (`hybridkv.eval.runner.build_samples` does).
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field

from hybridkv.tasks import words
from hybridkv.tasks.generators import REALTEXT as REALTEXT_SUFFIX
from hybridkv.tasks.generators import NIAH_VARIANTS, REALTEXT_FAMILIES, Pools, family, make_sample

# RULER's generation budgets (tokens)
MAX_NEW = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32, "passkey": 16, "mrcr": 160}
RULER = (*NIAH_VARIANTS, "vt", "cwe", "fwe", "qa")
# the evaluation's families with a real-text variant (the drills are training's)
REALTEXT = tuple(t + REALTEXT_SUFFIX for t in ("passkey", *NIAH_VARIANTS) if t in REALTEXT_FAMILIES)
SUITES = {"ruler": RULER, "mrcr": ("mrcr",), "passkey": ("passkey",), "realtext": REALTEXT}
NEEDLE_TASKS = frozenset(("passkey", *NIAH_VARIANTS, *REALTEXT))
HAYSTACKS = ("synthetic", "realtext")


@dataclass
class EvalSample:
    task: str
    prompt: list[int]
    references: list[str]
    metric: str                 # "string_match_all" | "string_match_part" | "mrcr"
    max_new_tokens: int
    depth: float | None = None
    meta: dict = field(default_factory=dict)


def expand_tasks(spec: str, haystack: str = "synthetic") -> list[str]:
    """'ruler,mrcr,passkey' or individual task names -> task list (order kept, no duplicates).

    `haystack="realtext"`: every task becomes its real-text variant (`passkey` -> `passkey_realtext`);
    a suite keeps the members that have one, a task named alone without one is an error."""
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}; choose from {', '.join(HAYSTACKS)}")
    out: list[str] = []
    for name in (t.strip() for t in spec.split(",") if t.strip()):
        members = SUITES.get(name, (name,))
        for task in members:
            if task not in ALL_TASKS:
                raise ValueError(f"unknown task {task!r}; choose from {', '.join(SUITES)} or {', '.join(ALL_TASKS)}")
            if haystack == "realtext" and task not in REALTEXT:
                variant = f"{task}{REALTEXT_SUFFIX}"
                if variant not in REALTEXT:
                    if name in SUITES:
                        continue
                    raise ValueError(f"task {task!r} has no real-text haystack; these do: "
                                     f"{', '.join(family(t) for t in REALTEXT)}")
                task = variant
            if task not in out:
                out.append(task)
    if not out:
        raise ValueError(f"no task of {spec!r} has a {haystack} haystack")
    return out


def make_eval_sample(task: str, seed: int, pools: Pools, length: int, depth: float | None = None) -> EvalSample:
    if task in NEEDLE_TASKS or task == "vt":
        kw = {} if depth is None or task == "vt" else {"depth": depth}
        s = make_sample(task, seed, pools, length, **kw)
        kind = family(task)
        budget = MAX_NEW["passkey"] if kind == "passkey" else MAX_NEW["vt" if kind == "vt" else "niah"]
        return EvalSample(task, s.prompt, s.answers, "string_match_all", budget, s.depth, dict(s.meta))
    return _EXTRA[task](random.Random(f"eval:{task}:{seed}:{length}"), pools, length)


# ----- families beyond the training mix -----

def _fit(pools: Pools, head: str, tail: str, items: list[str], length: int, sep: str = " ") -> list[int]:
    """Prompt = BOS + head + as many items as fit + tail, within `length` tokens."""
    tok = pools.tok
    fixed = 1 + len(tok.encode(head)) + len(tok.encode(tail)) + 2
    ids: list[int] = []
    for item in items:
        piece = tok.encode(sep + item)
        if fixed + len(ids) + len(piece) > length:
            break
        ids.extend(piece)
    return [tok.bos_id, *tok.encode(head), *ids, *tok.encode("\n" + tail)]


def _cwe(rng: random.Random, pools: Pools, length: int) -> EvalSample:
    """Common words: 10 words appear 30 times, many others 3 times, in a shuffled numbered list."""
    vocab = rng.sample(words.nouns() + words.adjectives() + words.verbs(), 400)
    common, rare = vocab[:10], vocab[10:]
    items = [w for w in common for _ in range(30)] + [w for w in rare for _ in range(3)]
    rng.shuffle(items)
    numbered = [f"{i + 1}. {w}" for i, w in enumerate(items)]
    head = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n"
    tail = "Question: What are the 10 most common words in the above list? Answer: The top 10 words that appear most often in the list are:"
    prompt = _fit(pools, head, tail, numbered, length, sep="\n")
    return EvalSample("cwe", prompt, common, "string_match_all", MAX_NEW["cwe"])


def _fwe(rng: random.Random, pools: Pools, length: int) -> EvalSample:
    """Frequent words: a Zipf(α=2) stream over coded words; answer = the 3 most frequent after the
    placeholder at rank 1."""
    n_vocab = max(50, length // 50)
    vocab = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(n_vocab)]
    weights = [1 / (k + 1) ** 2 for k in range(n_vocab)]
    stream = rng.choices(vocab, weights=weights, k=length)
    stream = ["..." if w == vocab[0] else w for w in stream]
    head = "Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words.\n"
    tail = "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text? Answer: According to the coded text above, the three most frequently appeared words are:"
    prompt = _fit(pools, head, tail, stream, length)
    return EvalSample("fwe", prompt, vocab[1:4], "string_match_all", MAX_NEW["fwe"])


def _qa(rng: random.Random, pools: Pools, length: int) -> EvalSample:
    """Templated fact QA: documents "The {attribute} of {name} is {value}."; one of them is asked."""
    tok = pools.tok
    attrs = ("favorite color", "home town", "pet", "profession", "hobby", "lucky number")
    head = ("Answer the question based on the given documents. Only give me the answer and do not output "
            "any other words.\n")
    ids, kept, total = [], [], 1 + len(tok.encode(head)) + 40   # room for the question
    while True:
        name = f"{rng.choice(words.adjectives()).title()} {rng.choice(words.nouns()).title()}"
        attr = rng.choice(attrs)
        value = str(rng.randint(10, 999)) if attr == "lucky number" else rng.choice(words.nouns())
        piece = tok.encode(f"\nDocument {len(kept) + 1}: The {attr} of {name} is {value}.")
        if total + len(piece) > length:
            break
        ids.extend(piece)
        kept.append((name, attr, value))
        total += len(piece)
    name, attr, value = kept[rng.randrange(len(kept))]
    question = tok.encode(f"\nQuestion: What is the {attr} of {name}? Answer:")
    return EvalSample("qa", [tok.bos_id, *tok.encode(head.rstrip("\n")), *ids, *question], [value],
                      "string_match_part", MAX_NEW["qa"])


_FORMS = ("poem", "short story", "riddle", "letter", "haiku", "limerick", "essay", "song")


def _mrcr(rng: random.Random, pools: Pools, length: int, n_needles: int = 4) -> EvalSample:
    """Multi-round coreference: a long synthetic chat of writing requests hides n identical asks; the
    model must reproduce the reply to the i-th one, prefixed by a random string."""
    tok = pools.tok
    topic, form = rng.choice(words.nouns()), rng.choice(_FORMS)
    needle_ask = f"Write a {form} about {topic}."

    def reply() -> str:
        return " ".join(f"The {rng.choice(words.adjectives())} {rng.choice(words.nouns())} "
                        f"{rng.choice(words.verbs())}s." for _ in range(rng.randint(3, 6)))

    def turn(ask: str) -> tuple[str, str, int]:
        rep = reply()
        return ask, rep, len(tok.encode(f"\nUser: {ask}\nAssistant: {rep}"))

    budget = length - 80
    turns = []
    while sum(t[2] for t in turns) < budget:
        turns.append(turn(f"Write a {rng.choice(_FORMS)} about {rng.choice(words.nouns())}."))
    slots = sorted(rng.sample(range(len(turns)), min(n_needles, len(turns))))
    for i in slots:
        turns[i] = turn(needle_ask)
    while sum(t[2] for t in turns) > budget:   # trim the last filler turns, keeping every needle
        fillers = [i for i in range(len(turns)) if i not in slots]
        if not fillers:
            break
        drop = fillers[-1]
        turns.pop(drop)
        slots = [i - (i > drop) for i in slots]
    answers = [turns[i][1] for i in slots]
    which = rng.randrange(len(answers))
    prefix = uuid.UUID(int=rng.getrandbits(128)).hex[:10]
    ordinal = ("1st", "2nd", "3rd", "4th", "5th", "6th", "7th", "8th")[which]
    text = "".join(f"\nUser: {a}\nAssistant: {r}" for a, r, _ in turns)
    question = (f"\nUser: Prepend {prefix} to the {ordinal} (1 indexed) {form} about {topic}. "
                f"Do not include any other text in your response.\nAssistant:")
    prompt = [tok.bos_id, *tok.encode(text.lstrip("\n")), *tok.encode(question)]
    return EvalSample("mrcr", prompt, [f"{prefix} {answers[which]}"], "mrcr", MAX_NEW["mrcr"],
                      meta={"prefix": prefix, "n_needles": len(answers), "which": which + 1})


_EXTRA = {"cwe": _cwe, "fwe": _fwe, "qa": _qa, "mrcr": _mrcr}
ALL_TASKS = (*RULER, "mrcr", "passkey", *REALTEXT)
