"""RULER's multi-needle NIAH tasks (niah_multikey_1/2/3, niah_multivalue, niah_multiquery) for lm-eval,
with an explicit depth x length grid for the target needle.

Construction follows NVIDIA RULER scripts/data/synthetic/niah.py (arguments from scripts/synthetic.yaml,
template and answer prefix from scripts/data/synthetic/constants.py, scoring from
scripts/eval/synthetic/constants.py); the deliberate differences are listed in README.md beside this
file. The pieces shared with S-NIAH (haystacks, sizing, keys and values, metadata, scoring) come from
ccq_eval.tasks.s_niah.construction. lm-eval loads this file through `!function utils.<name>` (by file
path), so it keeps no state between tasks and uses no dataclasses.

lm-eval calls the dataset builders as fn(**task_metadata). Metadata keys (all optional except a
tokenizer): lengths, depths, samples_per_cell, seed, tokenizer / pretrained, haystack.
"""

from __future__ import annotations

import random
from typing import Any, NamedTuple

from ccq_eval.tasks.s_niah import construction
from ccq_eval.tasks.s_niah.construction import (
    GENERATION_BUDGET,
    NEEDLE,
    EssayHaystack,
    NiahError,
    as_dataset,
    cell_rng,
    draw_value,
    essay_haystack,
    fit_to_length,
    load_key_words,
    load_tokenizer,
    parse_grid,
    prompt_token_count,
)

# lm-eval looks the prompt and scoring hooks up in this file (the task YAML names utils.<hook>);
# they are S-NIAH's: the doc's input, its gold values, RULER's string_match_all as acc and acc_<L>.
doc_to_text = construction.doc_to_text
doc_to_target = construction.doc_to_target
process_results = construction.process_results

# ---------------------------------------------------------------- RULER facts
# RULER's niah template and answer prefix (constants.py TASKS['niah']) in RULER's own plural form.
# The answer prefix is part of the model input: the model continues it.
RULER_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
RULER_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
# RULER's needle depths in percent: round(linspace(0, 100, 40)); it draws every needle's depth from
# them without replacement. Here only the needles other than the target are drawn from them.
RULER_DEPTHS = tuple(round(100 * i / 39) for i in range(40))
FAMILY = "RULER NIAH"
NEEDLE_HAYSTACK = "needles"  # the `haystack` field of the multikey_2/3 docs


class Variant(NamedTuple):
    """One task's RULER arguments (scripts/synthetic.yaml)."""

    haystack: str  # "essay" (sentences of a corpus) or "needle" (needles of other keys, one per line)
    key_kinds: str  # "words" or "uuids"
    value_kinds: str  # "numbers" or "uuids"
    num_keys: int  # keys with needles in the text (RULER: max(num_needle_k, num_needle_q))
    num_values: int  # values (needles) per key: num_needle_v
    num_queries: int  # keys the question asks about: num_needle_q


VARIANTS = {
    "niah_multikey_1": Variant("essay", "words", "numbers", num_keys=4, num_values=1, num_queries=1),
    "niah_multikey_2": Variant("needle", "words", "numbers", num_keys=1, num_values=1, num_queries=1),
    "niah_multikey_3": Variant("needle", "uuids", "uuids", num_keys=1, num_values=1, num_queries=1),
    "niah_multivalue": Variant("essay", "words", "numbers", num_keys=1, num_values=4, num_queries=1),
    "niah_multiquery": Variant("essay", "words", "numbers", num_keys=4, num_values=1, num_queries=4),
}


# ---------------------------------------------------------------- prompt
def template_kind(variant: Variant) -> tuple[str, str, str]:
    """(template, answer prefix, value kind) as RULER words them for this variant: with one value asked
    (one query, one value per key) RULER replaces 'Some'->'A', 'are all'->'is', 'are'->'is',
    'answers'->'answer' and drops the plural "s" of the value kind."""
    template, prefix, kind = RULER_TEMPLATE, RULER_ANSWER_PREFIX, variant.value_kinds
    if variant.num_queries * variant.num_values == 1:
        for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(old, new), prefix.replace(old, new)
        kind = kind[:-1]
    return template, prefix, kind


def query_text(queries: list[str]) -> str:
    """RULER's list of asked keys: "a", or "a, b, c, and d"."""
    return ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]


def build_prompt(variant: Variant, queries: list[str], context: str) -> str:
    """Full model input: the template with the answer prefix appended."""
    template, prefix, kind = template_kind(variant)
    query = query_text(queries)
    return template.format(type_needle_v=kind, context=context, query=query) + prefix.format(
        type_needle_v=kind, query=query
    )


def context_offset(variant: Variant) -> int:
    """Character offset at which build_prompt places the context."""
    template, _, kind = template_kind(variant)
    return len(template.split("{context}")[0].format(type_needle_v=kind))


def answer_prefix(variant: Variant, queries: list[str]) -> str:
    _, prefix, kind = template_kind(variant)
    return prefix.format(type_needle_v=kind, query=query_text(queries))


# ---------------------------------------------------------------- needles
class Needles(NamedTuple):
    """What one sample asks about, drawn from its cell's generator before any sizing."""

    keys: list[str]  # distinct keys with needles in the text; the first num_queries are asked
    values: list[list[str]]  # each key's values
    texts: list[str]  # needle sentences, key by key and value by value: texts[0] is the target needle
    depths: list[float]  # each text's depth in percent; the target's is the grid depth
    num_queries: int
    haystack_seed: int  # seeds the needle haystack's stream of distractor needles (multikey_2/3)

    @property
    def queries(self) -> list[str]:
        """Keys the question asks about, in its order; queries[0] is the target key."""
        return self.keys[: self.num_queries]

    @property
    def outputs(self) -> list[str]:
        """Gold values in RULER's answer order: per asked key, its values in order."""
        return [value for key_values in self.values[: self.num_queries] for value in key_values]

    @property
    def num_gold(self) -> int:
        """texts[:num_gold] are the needles of the asked keys (the gold values, in outputs order)."""
        return len(self.outputs)


def draw_key(rng: random.Random, kinds: str, word_keys: list[str]) -> str:
    return rng.choice(word_keys) if kinds == "words" else draw_value(rng, kinds)


def draw_needles(variant: Variant, rng: random.Random, depth: float, word_keys: list[str]) -> Needles:
    """Distinct keys (the first is the target), their values, and the other needles' depths: drawn
    without replacement from RULER_DEPTHS other than the target's depth."""
    keys: list[str] = []
    while len(keys) < variant.num_keys:
        key = draw_key(rng, variant.key_kinds, word_keys)
        if key not in keys:
            keys.append(key)
    values = [[draw_value(rng, variant.value_kinds) for _ in range(variant.num_values)] for _ in keys]
    texts = [NEEDLE.format(kinds=variant.value_kinds, key=key, value=value)
             for key, key_values in zip(keys, values) for value in key_values]
    others = rng.sample([d for d in RULER_DEPTHS if d != depth], len(texts) - 1)
    return Needles(keys, values, texts, [depth, *others], variant.num_queries, rng.getrandbits(64))


class NeedleHaystack:
    """RULER's needle haystack ("needles as the haystack"): n needles with random keys (never the
    target's) and values, one per line; the target needle is its own line, inserted before line
    int(n * depth / 100) (depth 100: after the last). Line i is the i-th needle of a stream seeded
    per sample, so n + 1 units are n units plus one line."""

    unit = "needle"
    source = NEEDLE_HAYSTACK

    def __init__(self, seed: int, variant: Variant, target_key: str, word_keys: list[str]):
        self._rng = random.Random(seed)
        self._variant = variant
        self._target_key = target_key
        self._word_keys = word_keys
        self._pairs: list[tuple[str, str]] = []
        self._lines: list[str] = []

    def pairs(self, n: int) -> list[tuple[str, str]]:
        """(key, value) of the first n haystack needles."""
        variant = self._variant
        while len(self._pairs) < n:
            key = draw_key(self._rng, variant.key_kinds, self._word_keys)
            if key == self._target_key:
                continue
            value = draw_value(self._rng, variant.value_kinds)
            self._pairs.append((key, value))
            self._lines.append(NEEDLE.format(kinds=variant.value_kinds, key=key, value=value))
        return self._pairs[:n]

    def lines(self, n: int) -> list[str]:
        """The first n haystack needles."""
        self.pairs(n)
        return self._lines[:n]

    def context_and_offsets(self, n: int, depth: float, needle: str) -> tuple[str, int, list[int]]:
        """The context, the target needle's character offset and every haystack needle's offset."""
        lines = self.lines(n)
        before = int(n * (depth / 100))
        starts, position = [], 0
        for line in lines:
            starts.append(position)
            position += len(line) + 1
        target_offset = starts[before] if before < n else position
        shift = len(needle) + 1  # lines from `before` on move down by the target's line
        offsets = [start if i < before else start + shift for i, start in enumerate(starts)]
        return "\n".join([*lines[:before], needle, *lines[before:]]), target_offset, offsets


def layout(
    needles: Needles, haystack: EssayHaystack | NeedleHaystack, n: int
) -> tuple[str, list[int], list[int]]:
    """The context with n haystack units, the gold needles' offsets in it (outputs order) and the
    distractor needles' offsets (essay: in draw order; needle haystack: in line order)."""
    if isinstance(haystack, NeedleHaystack):
        context, target, distractors = haystack.context_and_offsets(n, needles.depths[0], needles.texts[0])
        return context, [target], distractors
    context, offsets = haystack.context_and_offsets(n, list(zip(needles.depths, needles.texts)))
    return context, offsets[: needles.num_gold], offsets[needles.num_gold :]


class Sample(NamedTuple):
    prompt: str
    num_haystack: int
    prompt_tokens: int
    needle_char_offsets: list[int]  # gold needles' offsets in prompt, in outputs order
    distractor_char_offsets: list[int]  # the other needles' offsets in prompt


def make_sample(
    variant: Variant,
    needles: Needles,
    haystack: EssayHaystack | NeedleHaystack,
    tokenizer: Any,
    *,
    length: int,
    guess: int,
    task: str,
) -> Sample:
    """The prompt with the most haystack units that fits length - GENERATION_BUDGET tokens."""
    memo: dict[int, int] = {}

    def count(n: int) -> int:
        if n not in memo:
            context = layout(needles, haystack, n)[0]
            memo[n] = prompt_token_count(tokenizer, build_prompt(variant, needles.queries, context))
        return memo[n]

    n = fit_to_length(count, length=length, guess=guess, task=task, unit=haystack.unit)
    context, gold, distractors = layout(needles, haystack, n)
    shift = context_offset(variant)
    return Sample(build_prompt(variant, needles.queries, context), n, count(n), [shift + o for o in gold],
                  [shift + o for o in distractors])


# ---------------------------------------------------------------- dataset builders
def sample_construction(
    task: str, seed: int, length: int, depth: float, index: int, word_keys: list[str],
    essay: EssayHaystack | None,
) -> tuple[Needles, EssayHaystack | NeedleHaystack]:
    """One sample's needles and haystack (an essay haystack is shared; a needle haystack is the sample's)."""
    variant = VARIANTS[task]
    rng = cell_rng(seed, task, length, depth, index, family="ccq-ruler-niah")
    needles = draw_needles(variant, rng, depth, word_keys)
    if variant.haystack == "needle":
        return needles, NeedleHaystack(needles.haystack_seed, variant, needles.queries[0], word_keys)
    return needles, essay


def generate_docs(task: str, **metadata: Any) -> list[dict]:
    """All grid docs of one task, ordered by length, depth, sample index."""
    if task not in VARIANTS:
        raise NiahError(f"unknown RULER NIAH task {task!r}: choose one of {', '.join(VARIANTS)}")
    grid = parse_grid(metadata, family=FAMILY)
    tokenizer = load_tokenizer(grid["tokenizer"])
    variant = VARIANTS[task]
    essay = essay_haystack(grid["haystack"]) if variant.haystack == "essay" else None
    word_keys = load_key_words()
    docs = []
    for length in grid["lengths"]:
        guess = 64  # then the previous sample's fit: the next one differs only by needles and depth
        for depth in grid["depths"]:
            for index in range(grid["samples_per_cell"]):
                needles, haystack = sample_construction(task, grid["seed"], length, depth, index, word_keys,
                                                        essay)
                sample = make_sample(variant, needles, haystack, tokenizer, length=length, guess=guess,
                                     task=f"ccq_{task}")
                guess = sample.num_haystack
                docs.append(
                    {
                        "input": sample.prompt,
                        "outputs": needles.outputs,
                        "length": length,
                        "depth": depth,
                        "sample": index,
                        "key": needles.queries[0],
                        "keys": needles.queries,
                        "value": needles.outputs[0],
                        "values": needles.outputs,
                        "task": f"ccq_{task}",
                        "haystack": haystack.source,
                        "haystack_unit": haystack.unit,
                        "num_haystack": sample.num_haystack,
                        "prompt_tokens": sample.prompt_tokens,
                        "generation_budget": GENERATION_BUDGET,
                        "needle_char_offset": sample.needle_char_offsets[0],
                        "needle_char_offsets": sample.needle_char_offsets,
                        "needle_depths": needles.depths[: needles.num_gold],
                        "distractor_char_offsets": sample.distractor_char_offsets,
                        "answer_prefix": answer_prefix(variant, needles.queries),
                        "seed": grid["seed"],
                        "tokenizer": grid["tokenizer_name"],
                    }
                )
    return docs


def niah_multikey_1(**metadata: Any) -> dict:
    return as_dataset(generate_docs("niah_multikey_1", **metadata))


def niah_multikey_2(**metadata: Any) -> dict:
    return as_dataset(generate_docs("niah_multikey_2", **metadata))


def niah_multikey_3(**metadata: Any) -> dict:
    return as_dataset(generate_docs("niah_multikey_3", **metadata))


def niah_multivalue(**metadata: Any) -> dict:
    return as_dataset(generate_docs("niah_multivalue", **metadata))


def niah_multiquery(**metadata: Any) -> dict:
    return as_dataset(generate_docs("niah_multiquery", **metadata))
