"""Suites: a fixed grid of tasks and lengths under one name (`ccq-eval run --suite NAME`).

A suite's lengths may depend on the model: each part says how its grid meets the context the model was
trained at (its config.json's max_position_embeddings).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ccq_eval.model.registry import ModelEntry


@dataclass(frozen=True)
class SuitePart:
    """Task aliases of a suite with their length grid (empty: the tasks have none, LongBench)."""

    tasks: tuple[str, ...]
    lengths: tuple[int, ...] = ()
    past_training_context: bool = False  # add 2x the model's training context if the grid stays within it
    up_to_twice_training_context: bool = False  # cut the grid at 2x the training context when that is shorter
    needs_longbench_data: bool = False  # only the datasets whose files --longbench-dir holds
    left_out_without_data: bool = False  # a task whose data no source holds is left out with a note


@dataclass(frozen=True)
class Suite:
    description: str
    parts: tuple[SuitePart, ...]


SUITES: dict[str, Suite] = {
    "paper": Suite(
        "the papers' grid: S-NIAH-1/2/3 at 1K-8K (and past the model's training context), perplexity "
        "(both protocols) at 4K/8K/14K/20K, LongBench / LongBench-E datasets found in --longbench-dir, "
        "the zero-shot table's tasks whose data is found (--zeroshot-dir, the hub or the datasets cache), the "
        "recall table's tasks whose data is found (--recall-dir, the hub or the datasets cache)",
        (SuitePart(("s-niah-1", "s-niah-2", "s-niah-3"), (1024, 2048, 4096, 8192), past_training_context=True),
         SuitePart(("ppl",), (4096, 8192, 14336, 20480)),
         SuitePart(("longbench", "longbench-e"), needs_longbench_data=True),
         SuitePart(("zeroshot",), left_out_without_data=True),
         SuitePart(("recall",), left_out_without_data=True)),
    ),
    # The lengths fla's README evaluates RULER at (4K-32K); a model trained on less is evaluated up to twice
    # its training context, as far past it as --suite paper goes.
    "ruler": Suite(
        "RULER's 13 tasks at 4K/8K/16K/32K (up to twice the model's training context when that is "
        "shorter); the QA tasks read --qa-dir (or the hub) and are left out when neither has their data",
        (SuitePart(("ruler",), (4096, 8192, 16384, 32768), up_to_twice_training_context=True),),
    ),
    # fla's README command for "the task results reported in the GLA paper", plus social_iqa (Gated DeltaNet
    # paper): lm-eval's own configs, zero-shot, wikitext in HFLM's windows unless --rolling-windows carry.
    "zeroshot": Suite(
        "the GLA / Gated DeltaNet papers' zero-shot table: lm-eval's wikitext, lambada_openai, piqa, hellaswag, "
        "winogrande, arc_easy, arc_challenge, boolq, sciq, copa, openbookqa, social_iqa (data from "
        "--zeroshot-dir, the hub or the datasets cache)",
        (SuitePart(("zeroshot",)),),
    ),
    # The Based / JRT recall-intensive table (--recall-protocol, --recall-length and --recall-prompt apply).
    "recall": Suite(
        "the Based / JRT recall table: SWDE, SQuAD, FDA, TriviaQA, NQ, DROP cut to 2048 tokens around the answer "
        "(data from --recall-dir, the hub or the datasets cache)",
        (SuitePart(("recall",)),),
    ),
}


def training_context(model: ModelEntry) -> int | None:
    """The context a local checkpoint was trained at, as its config.json records it
    (max_position_embeddings); None when there is no local config or no such field."""
    config = Path(model.source) / "config.json"
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def suite_lengths(part: SuitePart, model: ModelEntry) -> list[int]:
    """A part's lengths for one model: its grid, plus twice the training context when the grid never goes
    past it (past_training_context), or the grid's lengths below twice the training context and that
    length itself when the grid goes further (up_to_twice_training_context)."""
    lengths = list(part.lengths)
    if not lengths or not (part.past_training_context or part.up_to_twice_training_context):
        return lengths
    trained = training_context(model)
    if trained is None:
        return lengths
    if part.past_training_context and max(lengths) <= trained:
        lengths.append(2 * trained)
    if part.up_to_twice_training_context and 2 * trained < max(lengths):
        lengths = [length for length in lengths if length < 2 * trained] + [2 * trained]
    return lengths
