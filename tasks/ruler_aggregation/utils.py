"""RULER's aggregation tasks for lm-eval: common-words extraction (cwe) and frequent-words extraction
(fwe), one set of samples per nominal length with exact per-sample fit.

Construction follows NVIDIA RULER scripts/data/synthetic/common_words_extraction.py and
freq_words_extraction.py (templates, answer prefixes and tokens to generate from
scripts/data/synthetic/constants.py; cwe freq_cw 30, freq_ucw 3, num_cw 10 and fwe alpha 2.0 from
scripts/synthetic.yaml); the commit and the deliberate differences are in README.md beside this file.
lm-eval loads this module by file path (`!function utils.<name>`). The pieces shared with S-NIAH
(tokenizer loading, token counts, the exact-fit search, metadata parsing, per-cell generators, scoring)
come from ccq_eval.tasks.s_niah.construction.

Neither task has a target position: `depths` is ignored and the cell is the length. lm-eval calls
the dataset builders as fn(**task_metadata). Metadata keys (all optional except a tokenizer): lengths,
samples_per_cell, seed, tokenizer / pretrained.
"""

from __future__ import annotations

import functools
import math
import random
import string
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from ccq_eval.tasks.s_niah.construction import (
    METRIC_LENGTHS,
    as_dataset,
    cell_rng,
    doc_to_target,
    doc_to_text,
    fit_haystack,
    load_tokenizer,
    parse_grid,
    process_results,
    prompt_token_count,
)

from ccq_eval.errors import UserError

__all__ = [
    "CWE_ANSWER_PREFIX", "CWE_BUDGET", "CWE_MIN_WORDS", "CWE_SETTINGS", "CWE_TASK", "CWE_TEMPLATE",
    "FWE_ANSWER_PREFIX", "FWE_BUDGET", "FWE_TASK", "FWE_TEMPLATE", "NUM_CW", "AggregationError",
    "CweSetting", "cwe_context", "cwe_example", "cwe_question", "doc_to_target", "doc_to_text",
    "draw_cwe", "draw_fwe", "fwe_context", "fwe_min_words", "fwe_question", "generate_docs", "load_words",
    "make_cwe_sample", "make_fwe_sample", "numbered", "process_results", "rank_vocab", "ruler_cwe",
    "ruler_fwe", "zipf_counts",
]

CWE_TASK = "ccq_ruler_cwe"
FWE_TASK = "ccq_ruler_fwe"
FAMILY = "ccq-ruler-aggregation"  # namespace of the per-cell generators
NO_DEPTH = -1  # the generators' depth slot: these tasks have no target position, the cell is the length


class AggregationError(UserError, ValueError):
    """Bad settings for the word-extraction tasks; the message says what is wrong and what to use instead."""


def fit_count(count: Callable[[int], int], *, target: int, guess: int, minimum: int) -> int:
    """Largest n >= minimum with count(n) <= target (fit_haystack's invariant: count(n + 1) > target);
    the caller has checked count(minimum) <= target."""
    return fit_haystack(lambda m: count(m + minimum - 1), target, max(1, guess - minimum + 1)) + minimum - 1


def memoized(count: Callable[[int], int]) -> Callable[[int], int]:
    return functools.lru_cache(maxsize=None)(count)


# ================================================================ common-words extraction (cwe)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
    "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
CWE_BUDGET = 120  # tokens_to_generate of common_words_extraction; also max_gen_toks in the YAML
NUM_CW = 10  # synthetic.yaml cwe: num_cw 10
RULER_LONG_FROM = 4096  # RULER uses its synthetic.yaml frequencies from 4096 tokens, smaller ones below


class CweSetting(NamedTuple):
    name: str
    freq_cw: int  # repeats of each common word in the sample
    freq_ucw: int  # repeats of each uncommon word
    example_words: int  # distinct words of the in-context example (10 common); 0: no example
    example_freq_cw: int
    example_freq_ucw: int


# Tried in this order from RULER's setting for the nominal length; the first whose smallest prompt
# (CWE_MIN_WORDS words beside its example) fits is used.
CWE_SETTINGS = (
    CweSetting("ruler", 30, 3, 40, 10, 3),  # synthetic.yaml freq_cw 30, freq_ucw 3; example get_example(40, 10, 3)
    CweSetting("ruler-short", 6, 1, 20, 3, 1),  # RULER below 4096: get_example(n, 6, 1), example (20, 3, 1)
    CweSetting("short-no-example", 6, 1, 0, 0, 0),
    CweSetting("small-no-example", 3, 1, 0, 0, 0),  # the frequencies of RULER's short example
)
CWE_MIN_WORDS = 2 * NUM_CW  # 10 common + 10 uncommon words: the size of RULER's smallest example


@functools.lru_cache(maxsize=1)
def load_words() -> tuple[str, ...]:
    """RULER's word pool: the wonderwords package's noun, adjective and verb lists, deduplicated and
    sorted (RULER reads them with the same wonderwords function)."""
    from wonderwords import random_word

    words: set[str] = set()
    for name in ("nounlist.txt", "adjectivelist.txt", "verblist.txt"):
        words.update(random_word._get_words_from_text_file(name))
    return tuple(sorted(words))


def numbered(words: Sequence[str]) -> str:
    """RULER's list format: "1. word1 2. word2 3. word3 ..."."""
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def cwe_context(common: Sequence[str], uncommon: Sequence[str], freq_cw: int, freq_ucw: int,
                shuffle_seed: int) -> str:
    """RULER's get_example: common words freq_cw times and the others freq_ucw times, shuffled with a
    fresh random.Random(shuffle_seed) (RULER: random.Random(random_seed)), numbered."""
    word_list = list(common) * freq_cw + list(uncommon) * freq_ucw
    random.Random(shuffle_seed).shuffle(word_list)
    return numbered(word_list)


def cwe_question(context: str) -> str:
    """Template with the answer prefix appended (the model continues it)."""
    return CWE_TEMPLATE.format(context=context) + CWE_ANSWER_PREFIX


def cwe_example(context: str, common: Sequence[str]) -> str:
    """RULER's in-context example: the filled template and answer prefix + " " + the numbered answer.
    The prompt is example + "\\n" + question."""
    return cwe_question(context) + " " + numbered(common)


class CweDraw(NamedTuple):
    order: list[str]  # the pool in random order: the first NUM_CW are the common words, the rest uncommon
    example_order: list[str]  # the example's words (a separate draw, as in RULER)
    shuffle_seed: int  # shuffles both lists, as RULER's random_seed does


def draw_cwe(rng: random.Random) -> CweDraw:
    words = load_words()
    order = rng.sample(words, len(words))
    example_order = rng.sample(words, max(s.example_words for s in CWE_SETTINGS))
    return CweDraw(order, example_order, rng.getrandbits(32))


class CweSample(NamedTuple):
    prompt: str
    num_words: int
    prompt_tokens: int
    setting: CweSetting


def cwe_prompt(draw: CweDraw, setting: CweSetting, num_words: int) -> str:
    """The model input with num_words distinct words: the setting's example (if any), "\n", the question."""
    question = cwe_question(cwe_context(draw.order[:NUM_CW], draw.order[NUM_CW:num_words], setting.freq_cw,
                                        setting.freq_ucw, draw.shuffle_seed))
    if not setting.example_words:
        return question
    words = draw.example_order[: setting.example_words]
    example = cwe_example(cwe_context(words[:NUM_CW], words[NUM_CW:], setting.example_freq_cw,
                                      setting.example_freq_ucw, draw.shuffle_seed), words[:NUM_CW])
    return example + "\n" + question


def make_cwe_sample(tokenizer: Any, draw: CweDraw, *, length: int, guess: int) -> CweSample:
    """The prompt with the most distinct words that fits length - CWE_BUDGET tokens, in the first
    setting (from RULER's for this length on) whose smallest prompt fits."""
    target = length - CWE_BUDGET
    pool = len(draw.order)
    start = 0 if length >= RULER_LONG_FROM else 1
    for setting in CWE_SETTINGS[start:]:
        def count(n: int, setting: CweSetting = setting) -> int:
            if n > pool:  # past the word pool: treated as not fitting, checked below
                return target + 1
            return prompt_token_count(tokenizer, cwe_prompt(draw, setting, n))

        count = memoized(count)
        if count(CWE_MIN_WORDS) <= target:
            break
    else:
        raise AggregationError(
            f"length {length} is too small for {CWE_TASK}: with {CWE_MIN_WORDS} words, common ones "
            f"{setting.freq_cw} times, and no in-context example the prompt takes {count(CWE_MIN_WORDS)} tokens "
            f"of this tokenizer and the generation budget is {CWE_BUDGET}, so the minimum length is "
            f"{count(CWE_MIN_WORDS) + CWE_BUDGET}"
        )
    n = fit_count(count, target=target, guess=guess, minimum=CWE_MIN_WORDS)
    if n >= pool:
        raise AggregationError(
            f"length {length} is too long for {CWE_TASK} with this tokenizer: the prompt would need more than "
            f"the {pool} distinct words of the word pool (RULER switches to a larger English word list there, "
            "which is not shipped); use a shorter length"
        )
    return CweSample(cwe_prompt(draw, setting, n), n, count(n), setting)


# ================================================================ frequent-words extraction (fwe)
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
FWE_BUDGET = 50  # tokens_to_generate of freq_words_extraction; also max_gen_toks in the YAML
ALPHA = 2.0  # synthetic.yaml fwe: alpha 2.0
ZETA_ALPHA = math.pi**2 / 6  # Riemann zeta(2), bit-equal to scipy.special.zeta(2.0) that RULER calls
CODED_WORD_LETTERS = 6  # RULER's coded_wordlen
NOISE_WORD = "..."  # RULER replaces the top-ranked word with dots, "noise" the prompt says to ignore
NUM_ANSWERS = 3


def fwe_vocab_size(length: int) -> int:
    """RULER: max_seq_length minus tokens_to_generate, // 50."""
    return (length - FWE_BUDGET) // 50


def draw_coded_words(rng: random.Random, count: int) -> list[str]:
    """`count` distinct random lowercase words of CODED_WORD_LETTERS letters (RULER: random.choices,
    redrawn until distinct)."""
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < count:
        word = "".join(rng.choices(string.ascii_lowercase, k=CODED_WORD_LETTERS))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def rank_vocab(words: Sequence[str], shuffle_seed: int) -> list[str]:
    """RULER's ranking: the words sorted, shuffled with a fresh random.Random(shuffle_seed), the first
    replaced by the noise word."""
    ranked = sorted(set(words))
    random.Random(shuffle_seed).shuffle(ranked)
    ranked[0] = NOISE_WORD
    return ranked


def draw_fwe(rng: random.Random, length: int) -> tuple[list[str], int]:
    """One sample's ranked vocabulary and shuffle seed (RULER ranks the words and shuffles the text
    with the same random_seed)."""
    words = draw_coded_words(rng, fwe_vocab_size(length))
    shuffle_seed = rng.getrandbits(32)
    return rank_vocab(words, shuffle_seed), shuffle_seed


def zipf_counts(num_words: int, vocab_size: int) -> list[int]:
    """RULER's counts: the word of rank k appears int(num_words * k**-alpha / zeta(alpha)) times."""
    k = np.arange(1, vocab_size + 1)
    return [int(c) for c in (num_words * (k**-ALPHA) / ZETA_ALPHA).astype(int)]


def fwe_context(ranked: Sequence[str], num_words: int, shuffle_seed: int) -> tuple[str, list[str]]:
    """RULER's gen_text: each ranked word its Zipf count of times, shuffled with a fresh
    random.Random(shuffle_seed), joined by spaces. Returns the context and the answer (ranks 2..4)."""
    counts = zipf_counts(num_words, len(ranked))
    words = [word for word, count in zip(ranked, counts, strict=True) for _ in range(count)]
    random.Random(shuffle_seed).shuffle(words)
    return " ".join(words), list(ranked[1 : 1 + NUM_ANSWERS])


def fwe_question(context: str) -> str:
    """Template with the answer prefix appended (the model continues it)."""
    return FWE_TEMPLATE.format(context=context) + FWE_ANSWER_PREFIX


def answer_is_defined(num_words: int, vocab_size: int) -> bool:
    """The three answer words appear and the next rank appears fewer times than the third of them."""
    counts = zipf_counts(num_words, vocab_size)
    last = counts[NUM_ANSWERS]
    return last >= 1 and (len(counts) <= NUM_ANSWERS + 1 or counts[NUM_ANSWERS + 1] < last)


def fwe_min_words(vocab_size: int) -> int:
    """Smallest num_words from which every larger one gives a defined answer: past 1 / (gap between the
    shares of ranks 4 and 5) their counts always differ, so only smaller values are checked."""
    if vocab_size < NUM_ANSWERS + 1:
        raise AggregationError(f"{FWE_TASK} needs a vocabulary of at least {NUM_ANSWERS + 1} words; use a "
                               f"length of at least {50 * (NUM_ANSWERS + 1) + FWE_BUDGET}")
    rate = ((NUM_ANSWERS + 1) ** -ALPHA - (NUM_ANSWERS + 2) ** -ALPHA) / ZETA_ALPHA
    safe = math.ceil(1 / rate) + 1
    undefined = [n for n in range(1, safe) if not answer_is_defined(n, vocab_size)]
    return undefined[-1] + 1 if undefined else 1


class FweSample(NamedTuple):
    prompt: str
    num_words: int
    prompt_tokens: int
    answer: list[str]
    answer_counts: list[int]


def fwe_minimum_length(tokenizer: Any, ranked: Sequence[str], shuffle_seed: int, start: int) -> int:
    """The smallest nominal length from `start` on whose own smallest text with a defined answer fits it.
    The vocabulary grows with the length ((length - 50) // 50 words) and with it that smallest text
    (27 words with a 4-word vocabulary, 53 from 5 words on), so the length a too-short length's text would
    need is not enough: each candidate is sized with its own vocabulary, `ranked`'s words first and more
    coded words drawn after them (the smallest texts show only the first five or so ranks). The tokens a
    candidate needs never fall as it grows, so stepping to them finds the smallest."""
    def vocabulary(size: int) -> list[str]:  # `ranked`, then the same extra words for every size
        extra = [word for word in draw_coded_words(random.Random(shuffle_seed), size + len(ranked))
                 if word not in ranked]
        return list(ranked) + extra[: max(0, size - len(ranked))]

    candidate = start
    while True:
        words = vocabulary(fwe_vocab_size(candidate))
        size = fwe_min_words(len(words))
        text = fwe_question(fwe_context(words, size, shuffle_seed)[0])
        needed = prompt_token_count(tokenizer, text) + FWE_BUDGET
        if needed <= candidate:
            return candidate
        candidate = needed


def make_fwe_sample(tokenizer: Any, ranked: Sequence[str], shuffle_seed: int, *, length: int,
                    guess: int) -> FweSample:
    """The prompt with the largest num_words that fits length - FWE_BUDGET tokens."""
    target = length - FWE_BUDGET
    minimum = fwe_min_words(len(ranked))

    @memoized
    def count(n: int) -> int:
        return prompt_token_count(tokenizer, fwe_question(fwe_context(ranked, n, shuffle_seed)[0]))

    if count(minimum) > target:
        here = count(minimum) + FWE_BUDGET
        needed = fwe_minimum_length(tokenizer, ranked, shuffle_seed, here)
        declared = next((n for n in METRIC_LENGTHS if n >= needed), None)
        why = "" if needed == here else (
            f"; a longer length has a larger vocabulary ({fwe_vocab_size(needed)} words at {needed}) and so a "
            f"longer smallest text (num_words {fwe_min_words(fwe_vocab_size(needed))})")
        raise AggregationError(
            f"length {length} is too small for {FWE_TASK}: the smallest text with a defined answer "
            f"(num_words {minimum}) takes {count(minimum)} tokens of this tokenizer and the generation budget "
            f"is {FWE_BUDGET}{why}, so the minimum length is {needed}"
            + (f" (the shortest length with a metric: {declared})" if declared else "")
        )
    n = fit_count(count, target=target, guess=guess, minimum=minimum)
    context, answer = fwe_context(ranked, n, shuffle_seed)
    counts = zipf_counts(n, len(ranked))[1 : 1 + NUM_ANSWERS]
    return FweSample(fwe_question(context), n, count(n), answer, counts)


# ================================================================ dataset builders
def common_fields(task: str, grid: dict, length: int, index: int) -> dict:
    return {"length": length, "sample": index, "task": task, "seed": grid["seed"], "tokenizer": grid["tokenizer_name"]}


def generate_docs(task: str, **metadata: Any) -> list[dict]:
    """All docs of ccq_ruler_cwe or ccq_ruler_fwe: samples_per_cell samples per length, in order."""
    if task not in (CWE_TASK, FWE_TASK):
        raise AggregationError(f"unknown task {task!r}: choose {CWE_TASK} or {FWE_TASK}")
    grid = parse_grid(metadata, family="RULER word extraction")
    tokenizer = load_tokenizer(grid["tokenizer"])
    docs = []
    for length in grid["lengths"]:
        guess = 64  # then the previous sample's fit
        for index in range(grid["samples_per_cell"]):
            rng = cell_rng(grid["seed"], task, length, NO_DEPTH, index, family=FAMILY)
            if task == CWE_TASK:
                draw = draw_cwe(rng)
                cwe = make_cwe_sample(tokenizer, draw, length=length, guess=guess)
                guess, common = cwe.num_words, draw.order[:NUM_CW]
                fields = {
                    "input": cwe.prompt, "outputs": list(common), "common_words": list(common),
                    "freq_cw": cwe.setting.freq_cw, "freq_ucw": cwe.setting.freq_ucw,
                    "example_words": cwe.setting.example_words, "num_haystack": cwe.num_words,
                    "haystack_unit": "word", "prompt_tokens": cwe.prompt_tokens, "generation_budget": CWE_BUDGET,
                    "answer_prefix": CWE_ANSWER_PREFIX,
                }
            else:
                ranked, shuffle_seed = draw_fwe(rng, length)
                fwe = make_fwe_sample(tokenizer, ranked, shuffle_seed, length=length, guess=guess)
                guess = fwe.num_words
                fields = {
                    "input": fwe.prompt, "outputs": fwe.answer, "frequent_words": fwe.answer,
                    "answer_counts": fwe.answer_counts, "vocab_size": len(ranked), "num_haystack": fwe.num_words,
                    "haystack_unit": "word", "prompt_tokens": fwe.prompt_tokens, "generation_budget": FWE_BUDGET,
                    "answer_prefix": FWE_ANSWER_PREFIX,
                }
            docs.append(fields | common_fields(task, grid, length, index))
    return docs


def ruler_cwe(**metadata: Any) -> dict:
    return as_dataset(generate_docs(CWE_TASK, **metadata))


def ruler_fwe(**metadata: Any) -> dict:
    return as_dataset(generate_docs(FWE_TASK, **metadata))
