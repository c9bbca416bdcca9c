"""S-NIAH-1/2/3 (RULER's single needle-in-a-haystack) for lm-eval, with an explicit depth x length grid.

Construction follows NVIDIA RULER scripts/data/synthetic/niah.py (templates from
scripts/data/synthetic/constants.py, scoring from scripts/eval/synthetic/constants.py); the
deliberate differences are listed in README.md beside this file. This module is loaded by
lm-eval through `!function utils.<name>` (by file path, not as a package module), so it keeps
no state between tasks and uses no dataclasses. The pieces it shares with RULER's multi-needle
tasks (tasks/ruler_niah) live in construction.py and are imported from the installed package;
every one of them stays importable from here too.

lm-eval calls the dataset builders as fn(**task_metadata). Metadata keys (all optional except a
tokenizer): lengths, depths, samples_per_cell, seed, tokenizer / pretrained, haystack.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ccq_eval.tasks.s_niah.construction import (
    DEFAULT_DEPTHS,
    DEFAULT_HAYSTACK_CORPUS,
    DEFAULT_LENGTHS,
    DEFAULT_SAMPLES_PER_CELL,
    DEFAULT_SEED,
    GENERATION_BUDGET,
    HERE,
    KNOWN_METADATA,
    METRIC_LENGTHS,
    NEEDLE,
    NOISE_LINE,
    EssayHaystack,
    NiahError,
    NoiseHaystack,
    SNiahError,
    as_dataset,
    cell_rng,
    doc_to_target,
    doc_to_text,
    draw_value,
    ends_sentence,
    essay_haystack,
    fit_haystack,
    fit_to_length,
    load_key_words,
    load_tokenizer,
    log,
    parse_grid,
    postprocess_prediction,
    process_results,
    prompt_token_count,
    sentence_ends,
    split_sentences,
    string_match_all,
)

# Names this module offers: its own and, for the callers that import them from here, the shared ones.
__all__ = [
    "ANSWER_PREFIX",
    "DEFAULT_DEPTHS",
    "DEFAULT_HAYSTACK_CORPUS",
    "DEFAULT_LENGTHS",
    "DEFAULT_SAMPLES_PER_CELL",
    "DEFAULT_SEED",
    "GENERATION_BUDGET",
    "HERE",
    "KNOWN_METADATA",
    "METRIC_LENGTHS",
    "NEEDLE",
    "NOISE_LINE",
    "TEMPLATE",
    "VARIANTS",
    "EssayHaystack",
    "NiahError",
    "NoiseHaystack",
    "SNiahError",
    "Sample",
    "as_dataset",
    "build_prompt",
    "cell_rng",
    "context_offset",
    "doc_to_target",
    "doc_to_text",
    "draw_value",
    "ends_sentence",
    "essay_haystack",
    "fit_haystack",
    "fit_to_length",
    "generate_docs",
    "load_key_words",
    "load_tokenizer",
    "log",
    "make_sample",
    "parse_grid",
    "postprocess_prediction",
    "process_results",
    "prompt_token_count",
    "s_niah_1",
    "s_niah_2",
    "s_niah_3",
    "sentence_ends",
    "split_sentences",
    "string_match_all",
]

# ---------------------------------------------------------------- S-NIAH's prompt
# RULER's niah template (TASKS['niah']), singular form: RULER writes it in the plural and, for a
# single needle and a single query, replaces 'Some'->'A', 'are all'->'is', 'are'->'is' and drops
# the plural "s" of the value kind. The answer prefix is appended to the prompt and continued by
# the model (prepare.py: template + answer_prefix; call_api.py: input + answer_prefix).
TEMPLATE = (
    "A special magic {kind} is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\n"
    "What is the special magic {kind} for {key} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic {kind} for {key} mentioned in the provided text is"

VARIANTS = {
    # task: (haystack type, value kind in the plural)
    "s_niah_1": ("noise", "numbers"),
    "s_niah_2": ("essay", "numbers"),
    "s_niah_3": ("essay", "uuids"),
}


# ---------------------------------------------------------------- prompts and lengths
def build_prompt(context: str, key: str, kind: str) -> str:
    """Full model input: RULER template with the answer prefix appended."""
    return TEMPLATE.format(kind=kind, context=context, key=key) + ANSWER_PREFIX.format(kind=kind, key=key)


def context_offset(kind: str) -> int:
    """Character offset at which build_prompt places the context (the template's text before it)."""
    return len(TEMPLATE.split("{context}")[0].format(kind=kind))


class Sample(NamedTuple):
    prompt: str
    num_haystack: int
    prompt_tokens: int
    needle_char_offset: int  # where the needle starts in prompt, from the construction


def make_sample(
    haystack: EssayHaystack | NoiseHaystack,
    tokenizer: Any,
    *,
    length: int,
    depth: float,
    key: str,
    value: str,
    kinds: str,
    guess: int,
    task: str = "s_niah",
) -> Sample:
    """The prompt with the most haystack units that fits length - GENERATION_BUDGET tokens."""
    kind = kinds[:-1]  # "numbers" -> "number", as RULER singularises for one needle
    needle = NEEDLE.format(kinds=kinds, key=key, value=value)
    memo: dict[int, int] = {}

    def count(n: int) -> int:
        if n not in memo:
            memo[n] = prompt_token_count(tokenizer, build_prompt(haystack.context(n, depth, needle), key, kind))
        return memo[n]

    n = fit_to_length(count, length=length, guess=guess, task=task, unit=haystack.unit)
    context, offset = haystack.context_and_offset(n, depth, needle)
    return Sample(build_prompt(context, key, kind), n, count(n), context_offset(kind) + offset)


# ---------------------------------------------------------------- dataset builders
def generate_docs(task: str, **metadata: Any) -> list[dict]:
    """All grid docs of one S-NIAH task, ordered by length, depth, sample index."""
    if task not in VARIANTS:
        raise SNiahError(f"unknown S-NIAH task {task!r}: choose one of {', '.join(VARIANTS)}")
    grid = parse_grid(metadata)
    tokenizer = load_tokenizer(grid["tokenizer"])
    haystack_type, kinds = VARIANTS[task]
    haystack = NoiseHaystack() if haystack_type == "noise" else essay_haystack(grid["haystack"])
    keys = load_key_words()
    docs = []
    for length in grid["lengths"]:
        guess = 64  # then the previous sample's fit: the next one differs only by key, value and depth
        for depth in grid["depths"]:
            for index in range(grid["samples_per_cell"]):
                rng = cell_rng(grid["seed"], task, length, depth, index)
                key = rng.choice(keys)
                value = draw_value(rng, kinds)
                sample = make_sample(
                    haystack, tokenizer, length=length, depth=depth, key=key, value=value, kinds=kinds,
                    guess=guess, task=f"ccq_{task}",
                )
                guess = sample.num_haystack
                docs.append(
                    {
                        "input": sample.prompt,
                        "outputs": [value],
                        "length": length,
                        "depth": depth,
                        "sample": index,
                        "key": key,
                        "value": value,
                        "task": f"ccq_{task}",
                        "haystack": haystack.source,
                        "haystack_unit": haystack.unit,
                        "num_haystack": sample.num_haystack,
                        "prompt_tokens": sample.prompt_tokens,
                        "generation_budget": GENERATION_BUDGET,
                        "needle_char_offset": sample.needle_char_offset,
                        "answer_prefix": ANSWER_PREFIX.format(kind=kinds[:-1], key=key),
                        "seed": grid["seed"],
                        "tokenizer": grid["tokenizer_name"],
                    }
                )
    return docs


def s_niah_1(**metadata: Any) -> dict:
    return as_dataset(generate_docs("s_niah_1", **metadata))


def s_niah_2(**metadata: Any) -> dict:
    return as_dataset(generate_docs("s_niah_2", **metadata))


def s_niah_3(**metadata: Any) -> dict:
    return as_dataset(generate_docs("s_niah_3", **metadata))
