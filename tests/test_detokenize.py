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


@pytest.mark.parametrize("model_dir", ["models/tiny-v4", "tests/fixtures/tokenizer-tiny"])
def test_output_text_equals_decoding_every_token(model_dir):
    """`OutputText` against a decode of the whole output at every step, on the shipped tokenizers:
    characters of 2, 3 and 4 bytes split across tokens, special tokens, random ids (bytes no UTF-8
    reader accepts), and the step that drops its stop token. It decodes a bounded tail only."""
    import random
    from pathlib import Path

    from hybridkv.engine.detokenize import OutputText
    from hybridkv.engine.tokenizer import Tokenizer
    root = Path(__file__).resolve().parents[1]
    tok = Tokenizer.from_model_dir(root / model_dir) if model_dir.startswith("models") else \
        Tokenizer(root / model_dir / "tokenizer.json")
    assert tok.decodes_by_concatenation
    rng = random.Random(0)
    text = "naïve café — 日本語のテキスト 🙂🚀 and plain words, " * 3
    ids = tok.encode(text)
    vocab = tok._tok.get_vocab_size(with_added_tokens=True)
    for _ in range(40):                                    # random ids spliced in, specials included
        ids.insert(rng.randrange(len(ids)), rng.randrange(vocab))
    out, longest = OutputText(), 0
    for n in range(1, len(ids) + 1):
        assert out.decode(tok, ids[:n]) == tok.decode(ids[:n]), n
        longest = max(longest, n - out.anchor)
        if n % 17 == 0:                                    # a stop token's step: the ids without it
            assert out.decode(tok, ids[:n - 1]) == tok.decode(ids[:n - 1]), n
    assert longest < 20


def test_output_text_decodes_everything_for_other_decoders():
    from hybridkv.engine.detokenize import OutputText

    class Plain:
        decodes_by_concatenation = False
        calls: list[int] = []

        def decode(self, ids):
            self.calls.append(len(ids))
            return "".join(map(str, ids))

    tok, out = Plain(), OutputText()
    assert [out.decode(tok, list(range(n))) for n in (1, 2, 3)] == ["0", "01", "012"]
    assert tok.calls == [1, 2, 3] and out.anchor == 0


def test_partial_stop_is_the_longest_suffix_that_begins_a_stop_string():
    """Against its definition (every suffix shorter than the stop string tried), on random short
    strings over a small alphabet, where suffixes and prefixes overlap often."""
    import random

    def definition(text, stops):
        return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
                   default=0)
    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 3))]
        assert partial_stop(text, stops) == definition(text, stops), (text, stops)
