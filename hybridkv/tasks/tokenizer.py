"""The task tokenizer: a byte-level BPE (HF `tokenizers`) with the DeepSeek-V4 special tokens
(BOS = 0, EOS = 1) and every digit its own token, saved as a `tokenizer.json` that the engine and
server load like any model directory's tokenizer.

Optionally (`hex_chars`) every character of a hex run that holds a digit is its own token too: the
letters of `5d5b7bcc-e790` are single tokens the way its digits are, while words of a–f letters
alone (`bad`, `cafe`, `deadbeef`) merge as before. Without it, BPE merges that English taught it
(`ed`, `ad`, `cf`, `bab`) land inside UUIDs, and the shipped model miscopies UUIDs mostly at those
tokens, even from inside its sliding window (models/tiny-v4/README.md)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from hybridkv.chat.format import BOS, EOS, SPECIAL_TOKENS


# One character of a hex run (0-9, a-f, and '-' joining the groups of a UUID) that holds a digit:
# a digit; a letter with a digit ahead in its run; or a letter or dash right after such a character,
# continuing the previous match (\G: where the last match ended, so a chain starts only at a digit
# or a letter with a digit ahead). Matches are isolated before the byte-level split.
HEX_RUN_CHAR = r"[0-9]|[a-f](?=[0-9a-f-]*[0-9])|(?<=[0-9a-f-])\G[a-f-]"
# the rule as tokenizer.json stores it (what `pre_tokenizers.Split(Regex(HEX_RUN_CHAR), "isolated")` saves)
_HEX_SPLIT_SPEC = {"type": "Split", "pattern": {"Regex": HEX_RUN_CHAR}, "behavior": "Isolated", "invert": False}


class TaskTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.bos_id = self._id(BOS)
        self.eos_id = self._id(EOS)

    def _id(self, token: str) -> int:
        i = self.tokenizer.token_to_id(token)
        if i is None:
            raise ValueError(f"tokenizer lacks the special token {token!r}")
        return i

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096, hex_chars: bool = False) -> "TaskTokenizer":
        tok = Tokenizer(models.BPE())
        steps = [pre_tokenizers.Split(Regex(HEX_RUN_CHAR), behavior="isolated")] if hex_chars else []
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps + [pre_tokenizers.Digits(individual_digits=True),
                                                             pre_tokenizers.ByteLevel(add_prefix_space=False)])
        tok.decoder = decoders.ByteLevel()
        specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    def save(self, path: str | Path) -> Path:
        """Write tokenizer.json into `path` (a directory) or to `path` (a .json file); returns the file."""
        path = Path(path)
        file = path if path.suffix == ".json" else path / "tokenizer.json"
        file.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(file))
        return file

    @classmethod
    def load(cls, path: str | Path) -> "TaskTokenizer":
        path = Path(path)
        return cls(Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path)))

    def with_hex_chars(self) -> "TaskTokenizer":
        """This tokenizer with the `hex_chars` rule put in front of its pre-tokenizer: the vocabulary
        and merges stay, so every text without a hex run holding a digit encodes to the same ids, and
        such runs become one token per character (every byte is in a byte-level BPE's vocabulary).
        A model continued with it reads every other text exactly as before."""
        if self.hex_chars:
            return self
        spec = json.loads(self.tokenizer.to_str())
        pre = spec.get("pre_tokenizer") or {"type": "Sequence", "pretokenizers": []}
        steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
        spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [_HEX_SPLIT_SPEC, *steps]}
        return TaskTokenizer(Tokenizer.from_str(json.dumps(spec)))

    @property
    def hex_chars(self) -> bool:
        """Whether this tokenizer has the `hex_chars` rule, trained with it or added (its pre-tokenizer
        holds the split)."""
        pre = json.loads(self.tokenizer.to_str()).get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", [pre])
        return any(st.get("type") == "Split" and st.get("pattern") == {"Regex": HEX_RUN_CHAR} for st in steps)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
