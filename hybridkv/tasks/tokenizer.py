"""The task tokenizer: a byte-level BPE (HF `tokenizers`) with the DeepSeek-V4 special tokens
(BOS = 0, EOS = 1) and every digit its own token, saved as a `tokenizer.json` that the engine and
server load like any model directory's tokenizer."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from hybridkv.server.chat_format import BOS, EOS, SPECIAL_TOKENS


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
    def train(cls, texts: Iterable[str], vocab_size: int = 4096) -> "TaskTokenizer":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
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

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)
