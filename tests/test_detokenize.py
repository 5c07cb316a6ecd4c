"""engine/detokenize.release: what text a step may release, given everything decoded so far."""

import pytest

from hybridkv.engine.detokenize import partial_stop, release

CASES = [
    # (id, decoded, released, stops, final, expected (new text, stopped))
    ("plain", "hello", "he", [], False, ("llo", False)),
    ("partial-character-held", "ok \ufffd", "ok", [], False, (" ", False)),
    ("partial-character-at-the-end", "ok \ufffd", "ok", [], True, (" \ufffd", False)),
    ("stop-prefix-held", "alpha be", "al", ["beta"], False, ("pha ", False)),
    ("stop-prefix-not-a-stop", "alpha bex", "alpha ", ["beta"], False, ("bex", False)),
    ("stop-cut", "alpha beta gamma", "alpha ", ["beta"], False, ("", True)),
    ("stop-cut-mid-step", "alpha beta gamma", "al", ["gam", "beta"], False, ("pha ", True)),
    ("earliest-stop-wins", "x ab cd", "", ["cd", "ab"], True, ("x ", True)),
    ("final-releases-held-prefix", "alpha be", "alpha ", ["beta"], True, ("be", False)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_release(case):
    _, decoded, released, stops, final, expected = case
    assert release(decoded, released, stops, final) == expected


def test_partial_stop_is_the_longest_prefix_suffix():
    assert partial_stop("abcab", ["abc"]) == 2 and partial_stop("abcab", ["bx", "cabd"]) == 3
    assert partial_stop("abc", ["abc"]) == 0          # a whole stop string is a cut, not a prefix
