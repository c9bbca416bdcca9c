"""S-NIAH prompts with the needle's exact token positions, from the task's own construction.

The prompts are those `ccq-eval run` evaluates: tasks/s_niah/utils.py's `generate_docs` builds them
(same seed, key, value, haystack fit), and each doc's `needle_char_offset` comes from the
construction (the haystack reports where it put the needle), not from a text search. Characters map
to tokens through the tokenizer's offsets (fast tokenizers) or, for others (e.g. the byte-level
ByT5 of the embedded models), through prefix encodings that must agree with the whole prompt's
tokens; otherwise a clear error. Tokens are those the ccq adapter feeds: BOS when the tokenizer has
one, then the text without special tokens. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ccq_eval.inspection import InspectError

# `ccq-eval inspect --task` names -> the S-NIAH variant of ccq_eval.tasks.s_niah.utils
TASKS = {"s-niah-1": "s_niah_1", "s-niah-2": "s_niah_2", "s-niah-3": "s_niah_3"}
TASKS.update({f"ccq_{v}": v for v in list(TASKS.values())})
TASKS.update({v: v for v in list(TASKS.values()) if v.startswith("s_")})


@dataclass(frozen=True)
class NeedlePrompt:
    """One S-NIAH prompt as token ids, with the needle's and its value's token spans [start, end)."""

    task: str
    length: int
    depth: float
    sample: int
    input_ids: list[int]
    needle: tuple[int, int]
    value: tuple[int, int]

    @property
    def answer_position(self) -> int:
        """The last prompt token: the model predicts the answer's first token there."""
        return len(self.input_ids) - 1


def resolve_task(name: str) -> str:
    if name not in TASKS:
        raise InspectError(f"inspect --task {name!r}: choose one of s-niah-1, s-niah-2, s-niah-3")
    return TASKS[name]


def sniah_utils():
    """The S-NIAH task's hooks (tasks/s_niah/utils.py, installed as ccq_eval.tasks.s_niah.utils)."""
    from ccq_eval.tasks.s_niah import utils

    return utils


def char_span_to_tokens(tokenizer: Any, text: str, start: int, end: int) -> tuple[int, int]:
    """Token span [a, b) of text's encoding (no special tokens) covering characters [start, end):
    the tokens whose characters overlap it."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        inside = [i for i, (a, b) in enumerate(offsets) if a < end and b > start]
        if not inside:
            raise InspectError(f"no token covers characters {start}..{end} of the prompt")
        return inside[0], inside[-1] + 1
    bounds = []
    for cut in (start, end):
        prefix = list(tokenizer.encode(text[:cut], add_special_tokens=False))
        if ids[: len(prefix)] != prefix:
            raise InspectError(
                f"{type(tokenizer).__name__} tokenises the prompt differently across the needle's boundary, "
                "so its token positions are not exact; use a fast tokenizer (offset mapping) or a byte-level one")
        bounds.append(len(prefix))
    return bounds[0], bounds[1]


def needle_prompts(task: str, tokenizer_spec: str, lengths: list[int], depths: list[float], seed: int = 42,
                   samples_per_cell: int = 1) -> list[NeedlePrompt]:
    """The S-NIAH prompts of one task for a tokenizer (a folder or 'byt5'), with token spans."""
    utils = sniah_utils()
    variant = resolve_task(task)
    try:
        docs = utils.generate_docs(variant, tokenizer=tokenizer_spec, lengths=lengths, depths=depths, seed=seed,
                                   samples_per_cell=samples_per_cell)
    except utils.SNiahError as error:
        raise InspectError(str(error)) from None
    tokenizer = utils.load_tokenizer(tokenizer_spec)
    bos = getattr(tokenizer, "bos_token_id", None)
    head = [] if bos is None else [bos]
    _, kinds = utils.VARIANTS[variant]
    prompts = []
    for doc in docs:
        text = doc["input"]
        needle = utils.NEEDLE.format(kinds=kinds, key=doc["key"], value=doc["value"])
        start = doc["needle_char_offset"]
        value_start = start + len(utils.NEEDLE.split("{value}")[0].format(kinds=kinds, key=doc["key"]))
        if text[start : start + len(needle)] != needle:  # the construction and the prompt disagree: a bug
            raise InspectError(f"S-NIAH construction: the needle is not at offset {start} of the prompt")
        needle_span = char_span_to_tokens(tokenizer, text, start, start + len(needle))
        value_span = char_span_to_tokens(tokenizer, text, value_start, value_start + len(doc["value"]))
        ids = head + list(tokenizer.encode(text, add_special_tokens=False))
        shift = len(head)
        prompts.append(NeedlePrompt(
            task=doc["task"], length=doc["length"], depth=float(doc["depth"]), sample=doc["sample"], input_ids=ids,
            needle=(needle_span[0] + shift, needle_span[1] + shift),
            value=(value_span[0] + shift, value_span[1] + shift)))
    return prompts
