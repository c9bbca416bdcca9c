"""The tokenizer as the lm-eval adapter uses it: ids without special tokens, BOS as unscored context."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

# Threads for on_threads. The fast (Rust) tokenizers release the GIL while they encode and decode, so
# threads scale with cores; beyond about 16 a request list of LongBench's size gains nothing.
MAX_ENCODE_THREADS = 16

T = TypeVar("T")
R = TypeVar("R")


def on_threads(function: Callable[[T], R], items: Iterable[T], settle: Callable[[], object]) -> list[R]:
    """[function(item) for item in items], in order, on up to MAX_ENCODE_THREADS threads: a LongBench
    unit's prompts are tens of thousands of tokens each, and tokenising them one after another on one
    core would keep the GPU waiting for tens of seconds. `settle` as in ahead_on_threads."""
    return list(ahead_on_threads(function, items, settle))


def ahead_on_threads(function: Callable[[T], R], items: Iterable[T],
                     settle: Callable[[], object]) -> Iterator[R]:
    """function(item) for each item, in order, all computed ahead on up to MAX_ENCODE_THREADS threads and
    yielded as each is ready, so that a consumer starts on the first while the rest are still worked on.

    A fast tokenizer resets truncation or padding state that an earlier caller left on it, and such a
    reset from two threads at once fails ("Already borrowed"). So `settle` (TokenCodec.settle: an empty
    encode) runs alone first, and the threads find nothing to reset."""
    items = list(items)
    workers = min(MAX_ENCODE_THREADS, os.cpu_count() or 1, len(items))
    if workers <= 1:
        yield from map(function, items)
        return
    settle()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        yield from pool.map(function, items)


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

    def settle(self) -> None:
        """One encode on this thread, of nothing: it puts in place the settings encode() asks for (no
        truncation, no padding), so that encodes on several threads afterwards change no state."""
        self.encode("")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def whole_characters(self, ids: Sequence[int]) -> bool:
        """Whether `ids` decode to text that encodes back to them: no partial character at an edge."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self.encode(text) == list(ids)
