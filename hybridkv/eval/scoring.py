"""Scores as the benchmarks define them.

RULER: case-insensitive substring match. `string_match_all` (every task but qa) is the fraction of
the references present in the output; `string_match_part` (qa) is 1 if any reference is present.
`word_match_all` is the strict variant reported beside it for needle tasks: a reference counts only
as a whole word of the output (a pass key 91747 is not found in "9174779"). `leading_match_all`, the
strictest, counts a reference only among the output's first words (as many as there are references):
an answer that lists several needles' values scores by the values it gives first, not by any it names.
MRCR: 0 unless the output starts with the random prefix; otherwise the difflib SequenceMatcher ratio
of the output (prefix removed) against the expected answer (prefix removed).
"""

from __future__ import annotations

import difflib
import re


def string_match_all(output: str, references: list[str]) -> float:
    out = output.lower()
    return sum(r.lower() in out for r in references) / len(references) if references else 0.0


def _words(output: str) -> list[str]:
    """The output's words in order, lower-cased; a UUID's dashes stay inside its word."""
    return re.findall(r"[\w-]+", output.lower())


def word_match_all(output: str, references: list[str]) -> float:
    words = set(_words(output))
    return sum(r.lower() in words for r in references) / len(references) if references else 0.0


def leading_match_all(output: str, references: list[str]) -> float:
    lead = set(_words(output)[:len(references)])
    return sum(r.lower() in lead for r in references) / len(references) if references else 0.0


def string_match_part(output: str, references: list[str]) -> float:
    out = output.lower()
    return float(any(r.lower() in out for r in references))


def mrcr_score(output: str, answer: str, prefix: str) -> float:
    if not output.startswith(prefix):
        return 0.0
    expected = answer[len(prefix):] if answer.startswith(prefix) else answer
    return difflib.SequenceMatcher(None, output[len(prefix):], expected).ratio()


SCORERS = {"string_match_all": string_match_all, "string_match_part": string_match_part}
