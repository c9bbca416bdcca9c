"""NIAH prompts with the needles' exact token positions, from the tasks' own construction.

The prompts are those `ccq-eval run` evaluates: the `generate_docs` of tasks/s_niah/utils.py (S-NIAH)
or tasks/ruler_niah/utils.py (RULER's multi-key / multi-value / multi-query NIAH) builds them (same
seed, keys, values, haystack fit), and each doc's `needle_char_offset` (the target needle: the one
whose value the question asks first) and `distractor_char_offsets` (needles under other keys) come
from the construction (the haystack reports where it put each needle), not from a text search. Characters map
to tokens through the tokenizer's offsets (fast tokenizers) or, for others (e.g. the byte-level
ByT5 of the embedded models), through prefix encodings that must agree with the whole prompt's
tokens; otherwise a clear error. Tokens are those the ccq adapter feeds: BOS when the tokenizer has
one, then the text without special tokens. No torch here.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

from ccq_eval.harness.run_options import DEFAULT_SEED
from ccq_eval.inspection import InspectError

# The task folder (ccq_eval.tasks.<folder>.utils) whose generate_docs builds each variant's prompts.
VARIANT_FOLDERS = {
    **{f"s_niah_{i}": "s_niah" for i in (1, 2, 3)},
    **{f"niah_multikey_{i}": "ruler_niah" for i in (1, 2, 3)},
    "niah_multivalue": "ruler_niah",
    "niah_multiquery": "ruler_niah",
}
# The lm-eval task of each variant; `inspect --task` takes `run --task`'s names for them (ccq_eval.harness.
# task_registry: the alias, s-niah-1 or niah-multikey-2, or the lm-eval name, ccq_s_niah_1).
VARIANT_TASKS = {f"ccq_{variant}": variant for variant in VARIANT_FOLDERS}
# Every needle of these tasks reads "One of the special magic {numbers|uuids} for {key} is: {value}."
# (RULER's needle, tasks/s_niah/construction.py); the value is digits or a UUID.
_NEEDLE = re.compile(r"One of the special magic (?:numbers|uuids) for \S+ is: (?P<value>[0-9a-f-]+)\.")


@dataclass(frozen=True)
class NeedlePrompt:
    """One NIAH prompt as token ids, with the target needle's and its value's token spans [start, end) and
    the spans of the distractor needles (needles under keys the question does not ask; none in S-NIAH)."""

    task: str
    length: int
    depth: float
    sample: int
    input_ids: list[int]
    needle: tuple[int, int]
    value: tuple[int, int]
    distractors: tuple[tuple[int, int], ...] = ()

    @property
    def answer_position(self) -> int:
        """The last prompt token: the model predicts the answer's first token there."""
        return len(self.input_ids) - 1


def resolve_task(name: str) -> str:
    """An `inspect --task` name -> its variant, through `run`'s vocabulary, so that both commands take the
    same names for the same task; a name of lm-eval's RULER port stops with `run`'s line that names ours."""
    from ccq_eval.harness.task_registry import LMEVAL_RULER_PORT, LmEvalPortTaskError, UnknownTaskError, resolve_tasks

    choices = ", ".join(variant.replace("_", "-") for variant in VARIANT_FOLDERS)
    try:
        tasks = resolve_tasks([name], ours_only=True)
    except LmEvalPortTaskError as error:  # name ours where inspect reads it, else list inspect's tasks
        if resolve_tasks([LMEVAL_RULER_PORT[name]])[0] in VARIANT_TASKS:
            raise InspectError(str(error)) from None
        raise InspectError(f"inspect --task {name!r}: choose one of {choices}") from None
    except UnknownTaskError:
        raise InspectError(f"inspect --task {name!r}: choose one of {choices}") from None
    if len(tasks) != 1 or tasks[0] not in VARIANT_TASKS:
        raise InspectError(f"inspect --task {name!r}: choose one of {choices} (one task; their lm-eval names "
                           "ccq_s_niah_1, ... work too)")
    return VARIANT_TASKS[tasks[0]]


def task_utils(variant: str):
    """The hooks of the variant's task folder (tasks/<folder>/utils.py, installed as
    ccq_eval.tasks.<folder>.utils)."""
    return importlib.import_module(f"ccq_eval.tasks.{VARIANT_FOLDERS[variant]}.utils")


def needle_char_spans(text: str, start: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Character spans [a, b) of the needle that starts at `start` in text and of its value."""
    match = _NEEDLE.match(text, start)
    if match is None:  # the construction and the prompt disagree: a bug
        raise InspectError(f"NIAH construction: no needle starts at offset {start} of the prompt")
    return (start, match.end()), match.span("value")


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


def needle_prompts(task: str, tokenizer_spec: str, lengths: list[int], depths: list[float],
                   seed: int = DEFAULT_SEED,
                   samples_per_cell: int = 1) -> list[NeedlePrompt]:
    """The prompts of one NIAH task for a tokenizer (a folder or 'byt5'), with token spans."""
    variant = resolve_task(task)
    utils = task_utils(variant)
    try:
        docs = utils.generate_docs(variant, tokenizer=tokenizer_spec, lengths=lengths, depths=depths, seed=seed,
                                   samples_per_cell=samples_per_cell)
    except ValueError as error:  # the tasks' own settings errors (NiahError): already one line
        raise InspectError(str(error)) from None
    tokenizer = utils.load_tokenizer(tokenizer_spec)
    bos = getattr(tokenizer, "bos_token_id", None)
    head = [] if bos is None else [bos]
    shift = len(head)

    def token_span(text: str, span: tuple[int, int]) -> tuple[int, int]:
        start, end = char_span_to_tokens(tokenizer, text, *span)
        return start + shift, end + shift

    prompts = []
    for doc in docs:
        text = doc["input"]
        needle, value = needle_char_spans(text, doc["needle_char_offset"])
        distractors = tuple(token_span(text, needle_char_spans(text, offset)[0])
                            for offset in doc.get("distractor_char_offsets") or [])
        prompts.append(NeedlePrompt(
            task=doc["task"], length=doc["length"], depth=float(doc["depth"]), sample=doc["sample"],
            input_ids=head + list(tokenizer.encode(text, add_special_tokens=False)),
            needle=token_span(text, needle), value=token_span(text, value), distractors=distractors))
    return prompts
