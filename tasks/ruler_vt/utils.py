"""RULER variable tracking (vt) for lm-eval, on a depth x length grid with exact per-sample fit.

Construction follows NVIDIA RULER scripts/data/synthetic/variable_tracking.py (template, answer prefix
and 30 tokens to generate from scripts/data/synthetic/constants.py; num_chains 1, num_hops 4, noise
haystack from scripts/synthetic.yaml); the commit and the deliberate differences are in README.md
beside this file. lm-eval loads this module by file path (`!function utils.<name>`), so it keeps no
state between tasks. The pieces shared with S-NIAH (tokenizer loading, token counts, the exact-fit
search, metadata parsing, per-cell generators, scoring) come from ccq_eval.tasks.s_niah.construction.

lm-eval calls the dataset builder as fn(**task_metadata). Metadata keys (all optional except a
tokenizer): lengths, depths, samples_per_cell, seed, tokenizer / pretrained.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ccq_eval.tasks.s_niah.construction import (
    NOISE_LINE,
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
    "ANSWER_PREFIX", "GENERATION_BUDGET", "ICL_MIN_NOISE", "ICL_TOKENS", "NUM_HOPS",
    "SAMPLE_MIN_NOISE_WITH_ICL", "TASK", "TEMPLATE", "VariableTrackingError", "VtDraw", "VtSample",
    "build_prompt", "chain_statements", "doc_to_target", "doc_to_text", "draw_sample", "example_for",
    "example_gaps", "example_text", "fit_example", "generate_docs", "hop_gaps", "layout", "make_sample",
    "process_results", "question_text", "ruler_vt",
]

TASK = "ccq_ruler_vt"
FAMILY = "ccq-ruler-vt"  # namespace of the per-cell generators

# ---------------------------------------------------------------- RULER facts (constants.py, synthetic.yaml)
TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
# Appended to the prompt and continued by the model (prepare.py: template + answer_prefix; call_api.py:
# input + answer_prefix), trailing space included.
ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)
GENERATION_BUDGET = 30  # tokens_to_generate of variable_tracking; also max_gen_toks in the YAML
NUM_HOPS = 4  # synthetic.yaml vt: num_chains 1, num_hops 4 -> one chain of 5 variables
NAME_LETTERS = 5  # generate_chains: k = 5 letters per variable, 3 in the in-context example
EXAMPLE_NAME_LETTERS = 3
VALUE_RANGE = (10000, 99998)  # np.random.randint(10000, 99999): high end excluded
ICL_TOKENS = 500  # RULER builds its in-context example with max_seq_length=500 and no generation budget
ICL_MIN_NOISE = 5  # the smallest example RULER searches ('incremental' = 5 noise lines)
# The example is kept only while the sample itself still gets this many noise lines beside it.
SAMPLE_MIN_NOISE_WITH_ICL = 5


class VariableTrackingError(UserError, ValueError):
    """Bad variable-tracking settings; the message says what is wrong and what to use instead."""


# ---------------------------------------------------------------- chains and layout
def chain_statements(names: Sequence[str], value: str) -> list[str]:
    """RULER's assignments: the first variable gets the value, each next one the previous variable
    (those lines end with a space, as in RULER)."""
    return [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(len(names) - 1)]


def draw_names(rng: random.Random, count: int, letters: int) -> list[str]:
    """`count` distinct names of `letters` random uppercase letters, a duplicate drawn again (RULER draws
    with random.choices too; a duplicate fails its sample, which it draws again: README difference 5)."""
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    return names


def layout(n: int, statements: Sequence[str], gaps: Sequence[int]) -> tuple[str, list[int]]:
    """n noise lines joined by newlines, statement i as its own line before noise line gaps[i]
    (gaps[i] == n: after the last line); gaps are non-decreasing and statements sharing a gap keep
    their order. Returns the context and each statement's character offset in it."""
    lines: list[str] = []
    offsets: list[int] = []
    position, k = 0, 0
    for line in range(n + 1):
        while k < len(statements) and gaps[k] == line:
            offsets.append(position)
            lines.append(statements[k])
            position += len(statements[k]) + 1
            k += 1
        if line < n:
            lines.append(NOISE_LINE)
            position += len(NOISE_LINE) + 1
    return "\n".join(lines), offsets


def hop_gaps(n: int, depth: float, hop_fractions: Sequence[float]) -> list[int]:
    """Gaps of the whole chain among n noise lines: the first assignment before line
    int(n * depth / 100) (S-NIAH's noise rule), each hop in gap first + int((n + 1 - first) * f) for its
    fraction f in [0, 1): uniform over the gaps from the first assignment's to the one after the last
    line. The fractions are sorted, so the chain reads in order."""
    first = int(n * (depth / 100))
    return [first] + [first + int((n + 1 - first) * f) for f in sorted(hop_fractions)]


def question_text(context: str, value: str, num_variables: int) -> str:
    """One query: RULER's template with the answer prefix appended."""
    return TEMPLATE.format(context=context, query=value) + ANSWER_PREFIX.format(num_v=num_variables, query=value)


def example_text(context: str, names: Sequence[str], value: str) -> str:
    """RULER's in-context example: its input (template + answer prefix) + " " + the answer + "\\n". The
    prompt is example + "\\n" + question (RULER inserts the example before the template with a
    newline)."""
    return question_text(context, value, len(names)) + " " + " ".join(names) + "\n"


# ---------------------------------------------------------------- one sample
class VtDraw(NamedTuple):
    """Everything random about one sample, drawn once from its cell's generator."""

    names: list[str]
    value: str
    hop_fractions: list[float]
    example_names: list[str]
    example_value: str
    example_position_seed: int


class VtSample(NamedTuple):
    prompt: str
    num_haystack: int
    prompt_tokens: int
    needle_char_offsets: list[int]  # each assignment's start in prompt, in chain order
    example_haystack: int  # noise lines of the in-context example; 0 without one


def draw_sample(rng: random.Random) -> VtDraw:
    names = draw_names(rng, NUM_HOPS + 1, NAME_LETTERS)
    value = str(rng.randint(*VALUE_RANGE))
    hop_fractions = [rng.random() for _ in range(NUM_HOPS)]
    # The example is a different draw: RULER builds it with value 12345 and 3-letter names, then gives
    # each sample a renamed copy with a new random value (randomize_icl); drawing them directly is the same.
    example_names = draw_names(rng, NUM_HOPS + 1, EXAMPLE_NAME_LETTERS)
    example_value = str(rng.randint(*VALUE_RANGE))
    return VtDraw(names, value, hop_fractions, example_names, example_value, rng.getrandbits(64))


def example_gaps(n: int, draw: VtDraw) -> list[int]:
    """The example's assignment gaps: RULER's rule, before distinct noise lines drawn at random
    (sorted(random.sample(range(n), len(chain)))), so n >= len(chain)."""
    return sorted(random.Random(draw.example_position_seed).sample(range(n), NUM_HOPS + 1))


def example_for(n: int, draw: VtDraw) -> str:
    """The in-context example with n noise lines."""
    statements = chain_statements(draw.example_names, draw.example_value)
    context = layout(n, statements, example_gaps(n, draw))[0]
    return example_text(context, draw.example_names, draw.example_value)


def fit_example(tokenizer: Any, draw: VtDraw) -> int:
    """Noise lines of the in-context example, RULER's size: the most (at least ICL_MIN_NOISE) whose
    input fits ICL_TOKENS tokens, counted as RULER counts it (no special tokens, answer left out);
    ICL_MIN_NOISE where even those exceed it (byte-level tokenizers), RULER's own fallback size."""
    def count(m: int) -> int:  # m = 1 stands for ICL_MIN_NOISE lines
        n = m + ICL_MIN_NOISE - 1
        context = layout(n, chain_statements(draw.example_names, draw.example_value), example_gaps(n, draw))[0]
        text = question_text(context, draw.example_value, NUM_HOPS + 1)
        return len(tokenizer.encode(text, add_special_tokens=False, verbose=False))

    try:
        return fit_haystack(count, ICL_TOKENS, 8) + ICL_MIN_NOISE - 1
    except ValueError:
        return ICL_MIN_NOISE


def build_prompt(draw: VtDraw, n: int, depth: float, example_haystack: int) -> tuple[str, list[int]]:
    """The model input: the in-context example with example_haystack noise lines (none when 0), a
    newline, then the question over n noise lines with the chain from `depth` on. Returns the prompt and
    each assignment's character offset in it."""
    statements = chain_statements(draw.names, draw.value)
    context, offsets = layout(n, statements, hop_gaps(n, depth, draw.hop_fractions))
    lead = example_for(example_haystack, draw) + "\n" if example_haystack else ""
    start = len(lead) + len(TEMPLATE.split("{context}")[0])
    return lead + question_text(context, draw.value, len(draw.names)), [start + offset for offset in offsets]


def make_sample(tokenizer: Any, draw: VtDraw, *, length: int, depth: float, guess: int) -> VtSample:
    """The prompt with the most noise lines that fits length - GENERATION_BUDGET tokens, with RULER's
    in-context example when the sample still gets SAMPLE_MIN_NOISE_WITH_ICL lines beside it, else
    without one."""
    target = length - GENERATION_BUDGET

    def counter(example_haystack: int) -> Callable[[int], int]:
        memo: dict[int, int] = {}

        def count(n: int) -> int:
            if n not in memo:
                memo[n] = prompt_token_count(tokenizer, build_prompt(draw, n, depth, example_haystack)[0])
            return memo[n]

        return count

    example_haystack = fit_example(tokenizer, draw)
    count = counter(example_haystack)
    if count(SAMPLE_MIN_NOISE_WITH_ICL) > target:
        example_haystack, count = 0, counter(0)
        if count(1) > target:
            raise VariableTrackingError(
                f"length {length} is too small for {TASK}: with one noise line and no in-context example the "
                f"prompt takes {count(1)} tokens of this tokenizer and the generation budget is "
                f"{GENERATION_BUDGET}, so the minimum length is {count(1) + GENERATION_BUDGET}"
            )
    n = fit_haystack(count, target, guess)
    prompt, offsets = build_prompt(draw, n, depth, example_haystack)
    return VtSample(prompt, n, count(n), offsets, example_haystack)


# ---------------------------------------------------------------- dataset builder
def generate_docs(**metadata: Any) -> list[dict]:
    """All grid docs of ccq_ruler_vt, ordered by length, depth, sample index."""
    grid = parse_grid(metadata, family="RULER variable tracking")
    tokenizer = load_tokenizer(grid["tokenizer"])
    docs = []
    for length in grid["lengths"]:
        guess = 16  # then the previous sample's fit
        for depth in grid["depths"]:
            for index in range(grid["samples_per_cell"]):
                draw = draw_sample(cell_rng(grid["seed"], TASK, length, depth, index, family=FAMILY))
                sample = make_sample(tokenizer, draw, length=length, depth=depth, guess=guess)
                guess = sample.num_haystack
                docs.append(
                    {
                        "input": sample.prompt,
                        "outputs": list(draw.names),
                        "length": length,
                        "depth": depth,
                        "sample": index,
                        "variables": list(draw.names),
                        "value": draw.value,
                        "task": TASK,
                        "haystack": "noise",
                        "haystack_unit": "line",
                        "num_haystack": sample.num_haystack,
                        "example_haystack": sample.example_haystack,
                        "prompt_tokens": sample.prompt_tokens,
                        "generation_budget": GENERATION_BUDGET,
                        "needle_char_offsets": sample.needle_char_offsets,
                        "answer_prefix": ANSWER_PREFIX.format(num_v=len(draw.names), query=draw.value),
                        "seed": grid["seed"],
                        "tokenizer": grid["tokenizer_name"],
                    }
                )
    return docs


def ruler_vt(**metadata: Any) -> dict:
    return as_dataset(generate_docs(**metadata))
