"""Text <-> token ids through a model directory's `tokenizer.json` (HF `tokenizers`).

Two ways in: `encode` reads special-token strings as the special tokens (a raw completion prompt,
which its writer owns whole), and `encode_segments` takes a chat prompt as `(text, trusted)`
segments and reads special tokens from the trusted (template) text only: content that spells
`<｜User｜>` stays plain text and cannot forge a turn.
"""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path

from hybridkv.errors import RequestError


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _HFTokenizer

        self._path = str(path)
        self._tok = _HFTokenizer.from_file(self._path)
        self._special_ids = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        names = sorted(self._special_ids, key=len, reverse=True)
        self._special_split = re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    @cached_property
    def _plain(self):
        """A second instance that reads special-token strings as plain text: the flag is per
        instance, and toggling one shared instance would race between threads."""
        from tokenizers import Tokenizer as _HFTokenizer

        tok = _HFTokenizer.from_file(self._path)
        tok.encode_special_tokens = True
        return tok

    @cached_property
    def max_token_bytes(self) -> int:
        """The UTF-8 length of the vocabulary's longest token (as decoded alone)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max((len(self._tok.decode([i], skip_special_tokens=False).encode("utf-8", "replace"))
                    for i in vocab.values()), default=1)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "Tokenizer | None":
        path = Path(model_dir) / "tokenizer.json"
        return cls(path) if path.exists() else None

    def encode(self, text: str) -> list[int]:
        return _encode(self._tok, text)

    def encode_segments(self, segments: list[tuple[str, bool]]) -> list[int]:
        """Ids of a prompt given as `(text, trusted)` segments. Special tokens come only from
        trusted text; the plain text between two of them is encoded as one piece, so a prompt
        whose content spells no special token gets the same ids as `encode` of the joined text."""
        ids: list[int] = []
        run: list[str] = []

        def flush() -> None:
            if run:
                ids.extend(_encode(self._plain, "".join(run)))
                run.clear()

        for text, trusted in segments:
            pieces = self._special_split.split(text) if trusted and self._special_split else [text]
            for k, piece in enumerate(pieces):
                if k % 2:            # a special token of the template
                    flush()
                    ids.append(self._special_ids[piece])
                elif piece:
                    run.append(piece)
        flush()
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    @cached_property
    def decodes_by_concatenation(self) -> bool:
        """Whether decode(a + b) == decode(a) + decode(b) wherever decode(a) ends in a whole
        character: a byte-level decoder (each token's bytes, laid end to end, read as UTF-8)."""
        return type(self._tok.decoder).__name__ == "ByteLevel"

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _encode(tok, text: str) -> list[int]:
    try:
        return tok.encode(text, add_special_tokens=False).ids
    except TypeError:
        if isinstance(text, str):   # the tokenizer takes only valid Unicode
            raise RequestError("the text holds a lone UTF-16 surrogate (e.g. '\\ud800'), which is not valid "
                               "Unicode; send well-formed text") from None
        raise


def require(tokenizer: Tokenizer | None, what: str) -> Tokenizer:
    if tokenizer is None:
        raise RequestError(f"{what} needs a tokenizer, but the model directory has no tokenizer.json; "
                           f"pass token ids instead")
    return tokenizer
