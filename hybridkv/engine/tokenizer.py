"""Text <-> token ids through a model directory's `tokenizer.json` (HF `tokenizers`)."""

from __future__ import annotations

from pathlib import Path

from hybridkv.errors import RequestError


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _HFTokenizer

        self._tok = _HFTokenizer.from_file(str(path))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "Tokenizer | None":
        path = Path(model_dir) / "tokenizer.json"
        return cls(path) if path.exists() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def require(tokenizer: Tokenizer | None, what: str) -> Tokenizer:
    if tokenizer is None:
        raise RequestError(f"{what} needs a tokenizer, but the model directory has no tokenizer.json; "
                           f"pass token ids instead")
    return tokenizer
