"""Token-exact generators of long-context samples from pre-tokenised pools.

`Pools` encodes the filler material once (template sentences, RULER's repeated noise, needle-like
distractors); a sample is then assembled by concatenating token pieces: BOS, the instruction, a
haystack filled to an exact token count with whole pieces, the needles inserted at piece boundaries
nearest their depths, and the question. Nothing long is ever re-tokenised, so a 16K-token sample
takes a few milliseconds.

Lengths: `make_sample(..., length)` returns a prompt of EXACTLY `length` tokens (the completion
comes on top); `training_example(..., length)` returns prompt + completion (+ the start of a next document) of
exactly `length`.
Depth is the fraction of the haystack (0 = right after the instruction, 1 = right before the
question) at which the first needle sits.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from hybridkv.tasks import prose, text
from hybridkv.tasks.text import tokenizer_corpus
from hybridkv.tasks.tokenizer import TaskTokenizer

NIAH_VARIANTS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                 "niah_multikey_3", "niah_multivalue", "niah_multiquery")
TASKS = (*NIAH_VARIANTS, "passkey", "vt", "assoc", "copy")
TRAIN_TASKS = TASKS          # the default training mix (uniform)
# Training drills beyond RULER's families, only where a recipe names them:
# niah_multikey_hard: niah_multikey_1 whose three distractor keys each share a word with the asked key
# (its adjective or its noun), so a needle is found by the whole key, not by one of its words.
DRILLS = ("niah_multikey_hard",)
# Real-text haystacks: a family whose haystack is filler (template sentences or RULER's noise) also
# comes with real English prose as its haystack (`hybridkv.tasks.prose`), named with this suffix:
# `passkey_realtext`, `niah_single_2_realtext`, ... The pools' `prose_split` says which part of the
# prose fills them (training reads "train", the evaluation "eval"). niah_single_1 and niah_single_2
# differ only in their haystack (RULER's noise, template sentences), so over real text they are one
# family drawn with different seeds; niah_multikey_2/3 (haystacks of distractor needles), vt, assoc
# and copy have no real-text variant.
REALTEXT = "_realtext"
REALTEXT_FAMILIES = ("passkey", "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
                     "niah_multivalue", "niah_multiquery", "niah_multikey_hard")
REALTEXT_TASKS = tuple(t + REALTEXT for t in REALTEXT_FAMILIES)
GENERATED_TASKS = (*TASKS, *DRILLS, *REALTEXT_TASKS)


def family(task: str) -> str:
    """The task family of a task name: `passkey_realtext` -> `passkey`."""
    return task.removesuffix(REALTEXT)


def realtext_task(task: str) -> str:
    """The real-text variant of a task (itself if it is one), or a ValueError naming those that have one."""
    if task.endswith(REALTEXT):
        return task
    if task not in REALTEXT_FAMILIES:
        raise ValueError(f"task {task!r} has no real-text haystack; these do: {', '.join(REALTEXT_FAMILIES)}")
    return task + REALTEXT


class Units:
    """Token pieces (flat array + offsets) that fill a span to an exact token count with whole pieces:
    random pieces (or the pieces in cyclic order) up to a tail, then a tail of pieces whose lengths
    sum exactly to what is left (a coin-change table over the piece lengths)."""

    def __init__(self, pieces: list[list[int]], cyclic: bool = False):
        self.lens = np.array([len(p) for p in pieces], np.int64)
        if not len(pieces) or self.lens.min() < 1:
            raise ValueError("units need non-empty pieces")
        self.starts = np.concatenate([[0], np.cumsum(self.lens)[:-1]])
        self.flat = np.concatenate([np.asarray(p, np.int32) for p in pieces])
        self.cyclic = cyclic
        self.by_len = {int(n): np.flatnonzero(self.lens == n) for n in np.unique(self.lens)}
        longest, limit = int(self.lens.max()), 8 * int(self.lens.max()) + 64
        self.reach = np.zeros(limit + 1, bool)
        self.reach[0] = True
        for r in range(1, limit + 1):
            self.reach[r] = any(self.reach[r - n] for n in self.by_len if n <= r)
        ok = [t for t in range(limit - longest) if self.reach[t:t + longest + 1].all()]
        self.tail = ok[0] if ok else limit

    def fill(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`n` tokens and the piece boundaries (offsets 0..n, both ends included). Only an `n` that no
        sum of piece lengths reaches (a few tokens) ends with a cut piece."""
        greedy = n - self.tail
        idx = np.zeros(0, np.int64)
        if greedy > 0:
            k = greedy // int(self.lens.min()) + 1
            if self.cyclic:
                idx = (int(rng.integers(len(self.lens))) + np.arange(k)) % len(self.lens)
            else:
                idx = rng.integers(len(self.lens), size=k)
            idx = idx[:np.searchsorted(np.cumsum(self.lens[idx]), greedy, side="right")]
        rest = n - int(self.lens[idx].sum())
        tail = []
        while rest > 0:
            options = [m for m in self.by_len if m <= rest and rest - m < len(self.reach) and self.reach[rest - m]]
            if not options:
                break
            m = options[int(rng.integers(len(options)))]
            group = self.by_len[m]
            tail.append(int(group[int(rng.integers(len(group)))]))
            rest -= m
        idx = np.concatenate([idx, np.asarray(tail, np.int64)])
        lens = self.lens[idx]
        ends = np.cumsum(lens)
        total = int(ends[-1]) if len(ends) else 0
        tokens = self.flat[np.repeat(self.starts[idx] - (ends - lens), lens) + np.arange(total)]
        bounds = np.concatenate([[0], ends])
        if rest > 0:   # unreachable remainder: a cut piece
            cut = int(rng.integers(len(self.lens)))
            piece = self.flat[self.starts[cut]:self.starts[cut] + self.lens[cut]]
            tokens = np.concatenate([tokens, np.resize(piece, rest)])
            bounds = np.append(bounds, n)
        return tokens, bounds


class Pools:
    """Pre-tokenised material shared by all samples: filler `sentences`, RULER's repeated `noise`,
    and needle-like distractors (`number_needles` with word keys, `uuid_needles`); each piece is
    encoded once with a leading space so pieces concatenate.

    `prose_split` ("train" or "eval") is the part of the real prose that the `_realtext` tasks'
    haystacks are made of; None: the pools make no real-text haystack."""

    def __init__(self, tok: TaskTokenizer, seed: int = 0, n_sentences: int = 4096, n_needles: int = 2048,
                 prose_split: str | None = None):
        if prose_split is not None and prose_split not in prose.SPLITS:
            raise ValueError(f"unknown prose split {prose_split!r}; choose from {', '.join(prose.SPLITS)}")
        self.tok, self.seed, self.prose_split = tok, seed, prose_split
        self._realtext: Pools | None = None
        rng = random.Random(f"pools:{seed}")
        sentences = [" " + text.sentence(rng) for _ in range(n_sentences)]
        self.needle_keys: set[str] = set()
        number_needles, uuid_needles = [], []
        for _ in range(n_needles):
            key = text.word_key(rng)
            self.needle_keys.add(key)
            number_needles.append(text.niah_needle("number", key, text.number(rng)))
            uuid_needles.append(text.niah_needle("uuid", text.uuid_str(rng), text.uuid_str(rng)))
        self.sentences = Units(tok.encode_batch(sentences))
        self.noise = Units(tok.encode_batch([" " + s for s in text.NOISE]), cyclic=True)
        self.number_needles = Units(tok.encode_batch(number_needles))
        self.uuid_needles = Units(tok.encode_batch(uuid_needles))
        self._cache: dict[str, np.ndarray] = {}

    def encode(self, s: str) -> np.ndarray:
        return np.asarray(self.tok.encode(s), np.int32)

    def realtext(self) -> "Pools":
        """These pools with the prose split's sentences, in reading order (cyclic, from a random
        start), as both filler kinds (`sentences` and `noise`): what a `_realtext` task is built from.
        Encoded once, when first asked for."""
        if self.prose_split is None:
            raise ValueError("real-text tasks need pools with a prose split: Pools(..., prose_split='train') "
                             "to train, 'eval' to evaluate")
        if self._realtext is None:
            view = copy.copy(self)
            view.sentences = view.noise = Units(self.tok.encode_batch(list(prose.pieces(self.prose_split))),
                                                cyclic=True)
            view._realtext = view
            self._realtext = view
        return self._realtext

    def fixed(self, s: str) -> np.ndarray:
        """The tokens of a recurring string (instructions), encoded once."""
        if s not in self._cache:
            self._cache[s] = self.encode(s)
        return self._cache[s]


@dataclass
class Sample:
    task: str
    prompt: list[int]            # BOS + instruction + haystack with needles + question; exactly `length` tokens
    answers: list[str]           # every reference string (scored with string_match_all)
    completion: list[int]        # the reference answer as the model should emit it, ending with EOS
    depth: float | None          # haystack fraction of the (first) needle
    meta: dict = field(default_factory=dict)


@dataclass
class _Spec:
    """A task's pieces before the haystack is sized: `inserts` go into the haystack at their depths
    (the first is the needle whose depth the sample reports)."""
    head: np.ndarray
    units: Units
    inserts: list[tuple[np.ndarray, float]]
    question: np.ndarray
    answers: list[str]
    completion: np.ndarray
    meta: dict = field(default_factory=dict)


def _depths(rng: random.Random, depth: float | None, n: int) -> list[float]:
    first = rng.random() if depth is None else depth
    return [first, *(rng.random() for _ in range(n - 1))]


def _distinct(draw: Callable[[], str], n: int, avoid: set[str] = frozenset()) -> list[str]:
    """`n` different draws, none in `avoid`."""
    out: list[str] = []
    while len(out) < n:
        if (x := draw()) not in avoid and x not in out:
            out.append(x)
    return out


def _niah(task: str, rng: random.Random, pools: Pools, depth: float | None, length: int) -> _Spec:
    kind = "uuid" if task in ("niah_single_3", "niah_multikey_3") else "number"
    units = {"niah_single_1": pools.noise, "niah_multikey_2": pools.number_needles,
             "niah_multikey_3": pools.uuid_needles}.get(task, pools.sentences)
    n = 4 if task in ("niah_multikey_1", "niah_multikey_hard", "niah_multivalue", "niah_multiquery") else 1
    keys = _distinct(partial(text.uuid_str if task == "niah_multikey_3" else text.word_key, rng), n, pools.needle_keys)
    if task == "niah_multikey_hard":
        keys = [keys[0], *_distinct(partial(text.word_key_sharing, rng, keys[0]), n - 1, pools.needle_keys | {keys[0]})]
    if task == "niah_multivalue":
        keys = [keys[0]] * n
    values = _distinct(partial(text.uuid_str, rng) if kind == "uuid" else partial(text.number, rng), n)
    depths = _depths(rng, depth, n)
    needles = [(pools.encode(text.niah_needle(kind, k, v)), d) for k, v, d in zip(keys, values, depths)]
    if task == "niah_multivalue":      # answer in order of appearance
        values = [v for _, v in sorted(zip(depths, values))]
    queried = keys[:n] if task == "niah_multiquery" else keys[:1]
    answers = values if task in ("niah_multivalue", "niah_multiquery") else values[:1]
    question = pools.encode(text.niah_question(kind, queried, len(answers) > 1))
    return _Spec(pools.fixed(text.niah_head(kind)), units, needles, question, answers,
                 pools.encode(text.answer(answers)), {"keys": queried})


def _passkey(rng: random.Random, pools: Pools, depth: float | None, length: int) -> _Spec:
    key = text.number(rng, 5)
    needle = pools.encode(text.passkey_needle(key))
    return _Spec(pools.fixed(text.PASSKEY_HEAD), pools.noise, [(needle, _depths(rng, depth, 1)[0])],
                 pools.fixed(text.PASSKEY_QUESTION), [key], pools.encode(text.answer([key])))


def _vt(rng: random.Random, pools: Pools, depth: float | None, length: int, hops: int = 4) -> _Spec:
    names = _distinct(partial(text.var_name, rng), hops + 1)
    value = text.number(rng, 5)
    first = _depths(rng, depth, 1)[0]
    depths = [first, *sorted(first + (1 - first) * rng.random() for _ in range(hops))]
    sources = [value, *(f"VAR {a}" for a in names[:-1])]
    inserts = [(pools.encode(text.vt_statement(b, s)), d) for b, s, d in zip(names, sources, depths)]
    return _Spec(pools.fixed(text.VT_HEAD), pools.noise, inserts, pools.encode(text.vt_question(value, len(names))),
                 names, pools.encode(text.answer(names, " ")), {"value": value})


def _assoc(rng: random.Random, pools: Pools, depth: float | None, length: int) -> _Spec:
    n = max(1, min(rng.randint(4, 32), length // 48))
    keys = _distinct(partial(text.word_key, rng), n)
    values = [text.assoc_value(rng) for _ in keys]
    depths = _depths(rng, depth, n)
    inserts = [(pools.encode(text.assoc_pair(k, v)), d) for k, v, d in zip(keys, values, depths)]
    return _Spec(pools.fixed(text.ASSOC_HEAD), pools.sentences, inserts, pools.encode(text.assoc_question(keys[0])),
                 [values[0]], pools.encode(text.answer([values[0]])), {"key": keys[0], "pairs": n})


def _copy(rng: random.Random, pools: Pools, depth: float | None, length: int) -> _Spec:
    target = rng.randint(16, 32)
    pieces: list[str] = []
    secret = np.zeros(0, np.int32)
    while len(secret) < target:        # 16..32 tokens of whole pieces
        piece = text.copy_piece(rng)
        ids = pools.encode(piece)
        if len(secret) + len(ids) > 32:
            if len(secret) >= 16:
                break
            continue
        pieces.append(piece)
        secret = np.concatenate([secret, ids])
    period = pools.fixed(".")
    d = rng.uniform(0.0, 0.25) if depth is None else depth
    insert = np.concatenate([pools.fixed(text.COPY_INTRO), secret, period])
    return _Spec(pools.fixed(text.COPY_HEAD), pools.sentences, [(insert, d)], pools.fixed(text.COPY_QUESTION),
                 ["".join(pieces).strip()], np.concatenate([secret, period]), {"secret_tokens": len(secret)})


# every builder: (rng, pools, depth, length) -> _Spec
_BUILDERS: dict[str, Callable[[random.Random, Pools, float | None, int], _Spec]] = {
    **{t: partial(_niah, t) for t in (*NIAH_VARIANTS, "niah_multikey_hard")}, "passkey": _passkey, "vt": _vt,
    "assoc": _assoc, "copy": _copy}


def _spec(task: str, seed: int, pools: Pools, length: int, depth: float | None,
          stream: str = "sample") -> tuple[_Spec, random.Random]:
    """The task's pieces and the generator that goes on to size the haystack; `stream` keeps training
    draws apart from evaluation draws of the same seed."""
    if task not in GENERATED_TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(GENERATED_TASKS)}")
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be within [0, 1], got {depth}")
    material = pools.realtext() if task.endswith(REALTEXT) else pools
    rng = random.Random(f"{pools.seed}:{stream}:{task}:{seed}:{length}")
    return _BUILDERS[family(task)](rng, material, depth, length), rng


def _assemble(spec: _Spec, pools: Pools, rng: random.Random, prompt_len: int) -> tuple[np.ndarray, dict]:
    """BOS + head + haystack (exact size) with the inserts at the boundaries nearest their depths + question."""
    fixed = 1 + len(spec.head) + len(spec.question) + sum(len(t) for t, _ in spec.inserts)
    size = prompt_len - fixed
    if size < 0:
        raise ValueError(f"a length of {prompt_len} tokens is too short for this task (needs {fixed} + haystack)")
    hay, bounds = spec.units.fill(np.random.default_rng(rng.getrandbits(64)), size)
    at = [int(bounds[np.abs(bounds - d * size).argmin()]) for _, d in spec.inserts]
    order = sorted(range(len(at)), key=lambda i: (at[i], i))
    pieces = [np.array([pools.tok.bos_id], np.int32), spec.head]
    start = pos = 1 + len(spec.head)
    prev, where = 0, [0] * len(at)
    for i in order:
        pieces.append(hay[prev:at[i]])
        pos += at[i] - prev
        where[i] = pos
        pieces.append(spec.inserts[i][0])
        pos += len(spec.inserts[i][0])
        prev = at[i]
    pieces += [hay[prev:], spec.question]
    prompt = np.concatenate(pieces)
    meta = {"context": (start, len(prompt) - len(spec.question)),
            "positions": where, "placed_depth": at[0] / size if size else 0.0}
    return prompt, meta


def make_sample(task: str, seed: int, pools: Pools, length: int, depth: float | None = None) -> Sample:
    """A prompt of exactly `length` tokens, deterministic in (task, seed, length, depth, pools.seed);
    the same seed at another depth keeps the needles and moves them."""
    spec, rng = _spec(task, seed, pools, length, depth)
    prompt, meta = _assemble(spec, pools, rng, length)
    completion = [*spec.completion.tolist(), pools.tok.eos_id]
    return Sample(task, prompt.tolist(), spec.answers, completion, spec.inserts[0][1], {**spec.meta, **meta})


def training_example(seed: int, pools: Pools, length: int, weights: dict[str, float] | None = None,
                     next_document: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids, supervised): a task drawn by `weights` (uniform over TRAIN_TASKS by default), prompt +
    completion + EOS of exactly `length` int32 tokens (the haystack absorbs the difference); the mask
    is True on the completion tokens, EOS included.

    `next_document` > 0: the row goes on after the EOS with the start of a next document (BOS +
    filler) of 0 to `next_document` - 1 tokens, drawn per example. Without it every answer ends at
    the row's end, at a fixed position within the compression blocks (rows are multiples of 128),
    and a model can learn to copy and stop by that position, which a prompt of any other length
    does not share."""
    tasks = list(weights) if weights else list(TRAIN_TASKS)
    pick = random.Random(f"{pools.seed}:train-task:{seed}:{length}")
    task = pick.choices(tasks, weights=[weights[t] for t in tasks] if weights else None)[0]
    after = pick.randrange(next_document) if next_document > 0 else 0
    spec, rng = _spec(task, seed, pools, length, None, stream="train")
    completion = np.append(spec.completion, np.int32(pools.tok.eos_id)).astype(np.int32)
    prompt, _ = _assemble(spec, pools, rng, length - len(completion) - after)
    pieces = [prompt, completion]
    if after:
        filler, _ = pools.sentences.fill(np.random.default_rng(rng.getrandbits(64)), after - 1)
        pieces += [np.array([pools.tok.bos_id], np.int32), filler.astype(np.int32)]
    ids = np.concatenate(pieces)
    supervised = np.zeros(length, bool)
    supervised[len(prompt):len(prompt) + len(completion)] = True
    return ids, supervised


def build_tokenizer(vocab_size: int = 4096, seed: int = 0, n_texts: int = 20_000,
                    hex_chars: bool = False) -> TaskTokenizer:
    """The task tokenizer, trained on `tokenizer_corpus(n_texts, seed)` (hex_chars: see
    `hybridkv.tasks.tokenizer`)."""
    return TaskTokenizer.train(tokenizer_corpus(n_texts, seed), vocab_size, hex_chars=hex_chars)


if __name__ == "__main__":
    import time

    t0 = time.perf_counter()
    tok = build_tokenizer()
    t1 = time.perf_counter()
    pools = Pools(tok)
    t2 = time.perf_counter()
    print(f"tokenizer: {tok.vocab_size} ids in {t1 - t0:.2f} s; pools in {(t2 - t1) * 1e3:.0f} ms")
    for n in (2048, 16384, 131072):
        for task in TASKS:
            make_sample(task, 0, pools, n)
            reps = 20
            t = time.perf_counter()
            for s in range(reps):
                make_sample(task, s, pools, n)
            print(f"{task:16s} {n:7d} tokens: {(time.perf_counter() - t) / reps * 1e3:6.2f} ms/sample")
    t = time.perf_counter()
    for s in range(100):
        training_example(s, pools, 16384)
    print(f"training_example 16384 tokens: {(time.perf_counter() - t) / 100 * 1e3:.2f} ms/example")
