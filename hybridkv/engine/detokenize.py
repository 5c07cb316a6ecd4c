"""The text a request releases, token by token: the one path by which generated text leaves the
engine. `LLM.stream`'s events, `LLM.generate`'s text and the server's replies all read it.

Released text is final, never taken back:
- a character whose bytes span several tokens decodes to U+FFFD until its last byte arrives, so
  trailing U+FFFD is held back until then (or the end, where invalid bytes stay U+FFFD);
- text that could be the beginning of a stop string is held back until it cannot be;
- a stop string ends the text before it (the stop string itself is never released);
- the token that stops a request (EOS, a stop token id) adds no text.
"""

from __future__ import annotations

import os


def partial_stop(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that could start one of the stop strings."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def first_stop(text: str, stops: list[str], start: int = 0) -> int:
    """Where the earliest stop string begins in text at or after `start` (-1 if none does)."""
    return min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)


def release(decoded: str, released: str, stops: list[str], final: bool) -> tuple[str, bool]:
    """(the new text to release, whether a stop string ended it). `decoded` is the decode of every
    output token that counts as text; `released` is what earlier steps released; `final`: the
    request ends with this step whatever the text says."""
    base = len(released) if decoded.startswith(released) else len(os.path.commonprefix([decoded, released]))
    if stops:
        # released text holds no stop string; one may end where the held-back suffix began
        cut = first_stop(decoded, stops, max(0, base - max(len(s) for s in stops) + 1))
        if cut >= 0:
            return decoded[base:max(base, cut)], True
    if final:
        return decoded[base:], False
    end = len(decoded)
    while end > base and decoded[end - 1] == "\ufffd":
        end -= 1
    if stops:
        end -= partial_stop(decoded[:end], stops)
    return decoded[base:max(base, end)], False
