"""The tokenizer as the lm-eval adapter uses it: ids without special tokens, BOS as unscored context."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TokenCodec:
    """Text <-> token ids for the adapter's scorer, generator and truncator.

    `prefix` is the unscored context put before every text: [BOS] when the tokenizer has one.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def bos_token_id(self) -> int | None:
        return getattr(self.tokenizer, "bos_token_id", None)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def eos_text(self) -> str | None:
        return self.tokenizer.eos_token

    @property
    def prefix(self) -> list[int]:
        return [self.bos_token_id] if self.bos_token_id is not None else []

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def whole_characters(self, ids: Sequence[int]) -> bool:
        """Whether `ids` decode to text that encodes back to them: no partial character at an edge."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self.encode(text) == list(ids)
