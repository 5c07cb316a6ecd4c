"""The text of every task: filler sentence templates, RULER's repeated noise, and the instruction,
needle, question and answer strings, plus `tokenizer_corpus`, which renders all of them (and chat
formatting) as training text for the tokenizer."""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Iterator

from hybridkv.chat.format import encode_messages
from hybridkv.tasks import words

NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")

TEMPLATES = (
    "The {adj} {noun} {verbs} the {noun}.",
    "A {noun} never {verbs} without a {adj} {noun}.",
    "Every {noun} wants to {verb} the {adj} {noun}.",
    "Nobody knows why the {noun} {verbs} so often.",
    "In the {adj} {noun}, a {noun} {verbs} quietly.",
    "The {noun} and the {noun} {verb} together near the {noun}.",
    "Sometimes a {adj} {noun} can {verb} a {noun}.",
    "It is {adj} to {verb} a {noun} before the {noun} {verbs}.",
    "My {noun} is more {adj} than your {noun}.",
    "They will {verb} the {noun} tomorrow.",
    "Why does the {adj} {noun} {verb} the {noun}?",
    "We watched a {adj} {noun} {verb} by the {noun}.",
    "Her {noun} seems {adj} today.",
    "The {noun} of the {noun} is {adj}.",
    "Please do not {verb} the {adj} {noun}.",
    "After the {noun}, everyone {verbs} the {noun}.",
    "A {adj} {noun} is still a {adj} {noun}.",
    "Each {noun} {verbs} a different {noun}.",
    "There is a {adj} {noun} in the {noun}.",
    "The old {noun} {verbs} while the {noun} sleeps.",
    "You should {verb} the {noun} with a {adj} {noun}.",
    "His {noun} {verbs} the {adj} {noun} every morning.",
    "No {noun} is too {adj} to {verb}.",
    "The {noun} was {adj}, and the {noun} was {adj}.",
    "Can a {noun} {verb} a {noun}?",
    "Our {adj} {noun} {verbs} around the {noun}.",
    "If the {noun} {verbs}, the {noun} {verbs} too.",
    "Long ago a {adj} {noun} lived near a {noun}.",
    "The {noun} loves to {verb} on {adj} days.",
    "Without a {noun}, the {noun} cannot {verb}.",
    "This {noun} belongs to the {adj} {noun}.",
    "Nothing about the {noun} is {adj}.",
    "Somewhere a {noun} {verbs} the {adj} {noun} again.",
    "I think the {noun} will {verb} soon.",
    "What a {adj} {noun} that was!",
    "Then the {noun} {verbs}, and the {adj} {noun} {verbs} back.",
)

_SLOT = re.compile(r"\{(adj|noun|verb|verbs)\}")
_ARTICLE = re.compile(r"\b([Aa]) (?=[aeiou])")


def third_person(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2:-1] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def sentence(rng: random.Random) -> str:
    """One filler sentence from a random template, each slot a fresh random word."""
    pick = {"adj": words.adjectives, "noun": words.nouns, "verb": words.verbs}

    def fill(m: re.Match) -> str:
        slot = m.group(1)
        return third_person(rng.choice(words.verbs())) if slot == "verbs" else rng.choice(pick[slot]())

    return _ARTICLE.sub(r"\1n ", _SLOT.sub(fill, rng.choice(TEMPLATES)))


def word_key(rng: random.Random) -> str:
    return f"{rng.choice(words.adjectives())}-{rng.choice(words.nouns())}"


def word_key_sharing(rng: random.Random, key: str) -> str:
    """A word key that shares exactly one word with `key` (its adjective or its noun)."""
    adjective, noun = key.split("-")
    if rng.random() < 0.5:
        return f"{adjective}-{rng.choice(words.nouns())}"
    return f"{rng.choice(words.adjectives())}-{noun}"


def uuid_str(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def var_name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=5))


def enumerate_keys(keys: list[str]) -> str:
    """'a' / 'a and b' / 'a, b, and c'."""
    if len(keys) < 3:
        return " and ".join(keys)
    return ", ".join(keys[:-1]) + ", and " + keys[-1]


# ----- needle families (RULER) -----

def niah_head(kind: str) -> str:
    return (f"Some special magic {kind}s are hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {kind}s afterwards.")


def niah_needle(kind: str, key: str, value: str) -> str:
    return f" One of the special magic {kind}s for {key} is: {value}."


def niah_question(kind: str, keys: list[str], several: bool) -> str:
    k = enumerate_keys(keys)
    if several:
        return (f"\nWhat are all the special magic {kind}s for {k} mentioned in the provided text? "
                f"The special magic {kind}s for {k} mentioned in the provided text are")
    return (f"\nWhat is the special magic {kind} for {k} mentioned in the provided text? "
            f"The special magic {kind} for {k} mentioned in the provided text is")


def answer(values: list[str], sep: str = ", ") -> str:
    return " " + sep.join(values) + "."


# ----- passkey -----

PASSKEY_HEAD = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                "I will quiz you about the important information there.")
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_needle(key: str) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key."


# ----- variable tracking (RULER vt) -----

VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text."


def vt_statement(name: str, source: str) -> str:
    return f" VAR {name} = {source}."


def vt_question(value: str, n_vars: int) -> str:
    return (f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
            f"Answer: According to the chain(s) of variable assignment in the text above, {n_vars} variables "
            f"are assigned the value {value}, they are:")


# ----- associative recall and copy (training only) -----

ASSOC_HEAD = ("Key-value pairs are hidden in the following text. Memorize them; I will ask you for the value "
              "of one key.")


def assoc_pair(key: str, value: str) -> str:
    return f" {key}: {value}."


def assoc_question(key: str) -> str:
    return f"\nWhat is the value for {key}? The value for {key} is"


def assoc_value(rng: random.Random) -> str:
    return rng.choice(words.nouns()) if rng.random() < 0.5 else number(rng, rng.randint(3, 6))


COPY_HEAD = "A secret string is hidden in the following text. Memorize it exactly; you will be asked to repeat it."
COPY_INTRO = " The secret string is:"
COPY_QUESTION = "\nRepeat the secret string exactly. The secret string is:"


def copy_piece(rng: random.Random) -> str:
    """A word, a number or a hex run: one space-led piece of a copy task's secret string."""
    r = rng.random()
    if r < 0.4:
        return " " + rng.choice(words.nouns() if r < 0.25 else words.verbs())
    if r < 0.7:
        return " " + number(rng, rng.randint(2, 5))
    return " " + "".join(rng.choices("0123456789abcdef", k=rng.randint(3, 8)))


# ----- tokenizer training text -----

_FORMS = ("poem", "short story", "riddle", "letter", "haiku", "limerick", "essay", "song")


def _chat(rng: random.Random) -> str:
    """A short conversation of writing requests, in the V4 chat format or as plain User:/Assistant: text."""
    msgs = [{"role": "system", "content": sentence(rng)}] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": f"Write a {rng.choice(_FORMS)} about {rng.choice(words.nouns())}."})
        msgs.append({"role": "assistant", "content": " ".join(sentence(rng) for _ in range(rng.randint(1, 3)))})
    if rng.random() < 0.5:
        return encode_messages(msgs, thinking_mode=rng.choice(("chat", "thinking")))
    turns = "".join(f"\n{m['role'].title()}: {m['content']}" for m in msgs)
    ask = f"Prepend {uuid_str(rng)[:10]} to the 2nd (1 indexed) poem about {rng.choice(words.nouns())}."
    return f"{turns}\nUser: {ask}\nAssistant:"


def _sample_text(rng: random.Random) -> str:
    kind = rng.randrange(10)
    filler = " ".join(sentence(rng) for _ in range(rng.randint(2, 6)))
    if kind == 0:
        return " ".join(NOISE * rng.randint(1, 3))
    if kind == 1:
        v = rng.choice(("number", "uuid"))
        keys = [uuid_str(rng) if v == "uuid" and rng.random() < 0.5 else word_key(rng) for _ in range(2)]
        value = uuid_str(rng) if v == "uuid" else number(rng)
        return (niah_head(v) + " " + filler + niah_needle(v, keys[0], value) + niah_needle(v, keys[1], value)
                + niah_question(v, keys, rng.random() < 0.5) + answer([value, number(rng)]))
    if kind == 2:
        key = number(rng, 5)
        return PASSKEY_HEAD + " " + " ".join(NOISE) + passkey_needle(key) + PASSKEY_QUESTION + answer([key])
    if kind == 3:
        names, value = [var_name(rng) for _ in range(5)], number(rng, 5)
        chain = vt_statement(names[0], value) + "".join(vt_statement(b, f"VAR {a}") for a, b in zip(names, names[1:]))
        return VT_HEAD + chain + vt_question(value, 5) + answer(names, " ")
    if kind == 4:
        key, value = word_key(rng), assoc_value(rng)
        return ASSOC_HEAD + assoc_pair(key, value) + " " + filler + assoc_question(key) + answer([value])
    if kind == 5:
        secret = "".join(copy_piece(rng) for _ in range(rng.randint(4, 10)))
        return COPY_HEAD + COPY_INTRO + secret + "." + COPY_QUESTION + secret + "."
    if kind == 6:
        listed = "\n".join(f"{i + 1}. {rng.choice(words.nouns())}" for i in range(rng.randint(5, 30)))
        return f"Below is a numbered list of words.\n{listed}\nAnswer: The top 10 words are: {filler}"
    if kind == 7:
        coded = " ".join("".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(rng.randint(10, 40)))
        return f"Read the following coded text.\n{coded} .... {coded[:20]}"
    if kind == 8:
        return _chat(rng)
    docs = "\n".join(f"Document {i + 1}: {sentence(rng)} The lucky number of {word_key(rng)} is {number(rng, 3)}."
                      for i in range(rng.randint(1, 5)))
    return f"Answer the question based on the given documents.\n{docs}\nQuestion: What is the pet of Ann? Answer:"


def tokenizer_corpus(n: int, seed: int = 0) -> Iterator[str]:
    """`n` texts covering everything the generators and the evaluation suite emit: filler, noise,
    every task's instruction/needle/question/answer strings, digits, hex, UUIDs, numbered lists,
    coded words, documents and V4 chat formatting."""
    rng = random.Random(f"tokenizer-corpus:{seed}")
    for _ in range(n):
        yield _sample_text(rng)
