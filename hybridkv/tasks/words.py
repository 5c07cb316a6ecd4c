"""English word lists (nouns, adjectives, verbs) from the `wonderwords` package: lowercase,
alphabetic only, profanity removed, sorted and cached, so seeded sampling is reproducible.

The lists are shared (not copied per call): treat them as read-only.
"""

from __future__ import annotations

from functools import cache

from wonderwords.random_word import RandomWord, filter_profanity


@cache
def _load(name: str) -> list[str]:
    raw = (w.strip().lower() for w in RandomWord.read_words(name))
    return sorted(set(filter_profanity(w for w in raw if w.isascii() and w.isalpha())))


def nouns() -> list[str]:
    return _load("nounlist.txt")


def adjectives() -> list[str]:
    return _load("adjectivelist.txt")


def verbs() -> list[str]:
    return _load("verblist.txt")
