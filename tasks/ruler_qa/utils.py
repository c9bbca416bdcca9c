"""RULER QA (SQuAD v2 and HotpotQA among distractor documents) for lm-eval, on a depth x length grid.

Construction follows NVIDIA RULER scripts/data/synthetic/qa.py (template, answer prefix and 32 tokens
to generate from scripts/data/synthetic/constants.py; scoring string_match_part from
scripts/eval/synthetic/constants.py; commit named in README.md, where the deliberate differences are
listed). lm-eval loads this file by path (`!function utils.<name>`); the data readers live in the
package module ccq_eval.tasks.ruler_qa.data, and the sizing, grid, tokenizer and scoring helpers are
S-NIAH's (ccq_eval.tasks.s_niah.construction).

lm-eval calls the dataset builders as fn(**task_metadata). Metadata keys: tokenizer / pretrained
(required), lengths, depths, samples_per_cell, seed, qa_dir.
"""

from __future__ import annotations

import difflib
import logging
import random
from typing import Any, NamedTuple

from ccq_eval.tasks.ruler_qa.data import QAData, QAError, load_qa_data
from ccq_eval.tasks.s_niah.construction import (
    as_dataset,
    cell_rng,
    doc_to_text,
    fit_haystack,
    load_tokenizer,
    parse_grid,
    postprocess_prediction,
    prompt_token_count,
)

log = logging.getLogger(__name__)

__all__ = [
    "ANSWER_PREFIX", "DOCUMENT_PROMPT", "DOCUMENT_SEPARATOR", "GENERATION_BUDGET", "TASKS", "TEMPLATE",
    "DistractorStream", "QASample", "build_prompt", "doc_to_target", "doc_to_text", "document_offset",
    "generate_docs", "make_sample", "process_results", "ruler_qa_hotpot", "ruler_qa_squad", "sample_for",
    "string_match_part",
]

# ---------------------------------------------------------------- RULER's prompt (constants.py, qa.py)
TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
    "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}"
)
# Appended to the template and continued by the model (prepare.py: template + answer_prefix).
ANSWER_PREFIX = " Answer:"
DOCUMENT_PROMPT = "Document {i}:\n{document}"
DOCUMENT_SEPARATOR = "\n\n"
GENERATION_BUDGET = 32  # RULER's tokens_to_generate for qa; also max_gen_toks in the YAML

TASKS = {"ccq_ruler_qa_squad": "squad", "ccq_ruler_qa_hotpot": "hotpotqa"}
RNG_FAMILY = "ccq-ruler-qa"
QA_METADATA = "qa_dir"
_CONTEXT_OFFSET = len(TEMPLATE.split("{context}")[0])  # characters before the first document


def build_prompt(documents: list[str], question: str) -> str:
    """The full model input: RULER's template over numbered documents, with the answer prefix appended."""
    context = DOCUMENT_SEPARATOR.join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(documents))
    return TEMPLATE.format(context=context, query=question) + ANSWER_PREFIX


def document_offset(documents: list[str], position: int) -> int:
    """Character offset in build_prompt(documents, ...) of document `position` (0-based): its "Document i:"."""
    before = sum(len(DOCUMENT_PROMPT.format(i=i + 1, document=d)) + len(DOCUMENT_SEPARATOR)
                 for i, d in enumerate(documents[:position]))
    return _CONTEXT_OFFSET + before


# ---------------------------------------------------------------- one sample's documents
class DistractorStream:
    """The distractor documents of one sample in the order it draws them, each with a random sort key.

    As RULER's generate_input_output: first the question's preferred distractors (SQuAD: the other
    paragraphs of its article; HotpotQA: the record's other paragraphs) in random order, then the other
    documents in random order (a lazily drawn permutation); the gold documents never. The first n items
    are the n distractors of a prompt, so one more distractor adds one document and keeps the others.
    When every document is used the sequence starts again (RULER repeats its documents too)."""

    def __init__(self, rng: random.Random, n_documents: int, gold: list[int], preferred: list[int]):
        self.rng = rng
        self.n_documents = n_documents
        preferred = [i for i in dict.fromkeys(preferred) if i not in gold]
        self.preferred = rng.sample(preferred, len(preferred))  # RULER: random.sample(curr_more, k)
        self.excluded = set(gold) | set(preferred)
        self.distinct = n_documents - len(set(gold))  # distractors available before documents repeat
        if self.distinct <= 0:
            raise QAError("the QA data has no document besides the question's gold ones: give the full file")
        self.items: list[tuple[int, float]] = []  # (document index, sort key)
        self._swaps: dict[int, int] = {}
        self._drawn = 0

    def _next_other(self) -> int:
        # Fisher-Yates over range(n_documents), one position at a time, skipping excluded documents
        while True:
            i = self._drawn
            j = self.rng.randrange(i, self.n_documents)
            value = self._swaps.get(j, j)
            self._swaps[j] = self._swaps.get(i, i)
            self._drawn += 1
            if value not in self.excluded:
                return value

    def take(self, n: int) -> list[tuple[int, float]]:
        while len(self.items) < n:
            k = len(self.items)
            if k >= self.distinct:
                document = self.items[k % self.distinct][0]
            elif k < len(self.preferred):
                document = self.preferred[k]
            else:
                document = self._next_other()
            self.items.append((document, self.rng.random()))
        return self.items[:n]


class QASample:
    """A question drawn by the sample's generator, its gold documents and its distractor stream.
    With n distractors (laid out in the order of their sort keys, a uniformly random order) the gold
    documents go, consecutively and in their record order, before distractor int(n * depth / 100)."""

    def __init__(self, data: QAData, rng: random.Random, depth: float):
        self.question_index = rng.randrange(len(data.questions))
        question = data.questions[self.question_index]
        self.question: str = question["query"]
        self.answers: list[str] = list(question["outputs"])
        self.gold: list[str] = [data.documents[i] for i in question["context"]]
        self.depth = depth
        self._documents = data.documents
        self.stream = DistractorStream(rng, len(data.documents), question["context"], question["more_context"])

    def gold_position(self, n: int) -> int:
        """0-based position of the first gold document among n distractors."""
        return int(n * (self.depth / 100))

    def documents(self, n: int) -> list[str]:
        items = self.stream.take(n)
        order = sorted(range(n), key=lambda k: (items[k][1], k))
        distractors = [self._documents[items[k][0]] for k in order]
        p = self.gold_position(n)
        return distractors[:p] + self.gold + distractors[p:]

    def prompt(self, n: int) -> str:
        return build_prompt(self.documents(n), self.question)


def sample_for(data: QAData, task: str, *, seed: int, length: int, depth: float, index: int) -> QASample:
    """The sample of one grid cell: its own generator, so it does not depend on the rest of the grid."""
    return QASample(data, cell_rng(seed, task, length, depth, index, family=RNG_FAMILY), depth)


class Fit(NamedTuple):
    prompt: str
    num_distractors: int
    prompt_tokens: int
    gold_char_offset: int


def make_sample(sample: QASample, tokenizer: Any, *, length: int, guess: int, task: str) -> Fit:
    """The prompt with the most distractors n such that its tokens + GENERATION_BUDGET <= length."""
    memo: dict[int, int] = {}

    def count(n: int) -> int:
        if n not in memo:
            memo[n] = prompt_token_count(tokenizer, sample.prompt(n))
        return memo[n]

    try:
        n = fit_haystack(count, length - GENERATION_BUDGET, guess)
    except ValueError:
        minimum = count(1) + GENERATION_BUDGET
        raise QAError(
            f"length {length} is too small for {task} (depth {sample.depth}): its question, gold document(s) and "
            f"one distractor take {count(1)} tokens of this tokenizer plus {GENERATION_BUDGET} to generate, so this "
            f"sample needs a length of at least {minimum}; use longer lengths"
        ) from None
    documents = sample.documents(n)
    offset = document_offset(documents, sample.gold_position(n))
    return Fit(build_prompt(documents, sample.question), n, count(n), offset)


# ---------------------------------------------------------------- dataset builders
def _check_keys(metadata: dict[str, Any]) -> None:
    for key in metadata:
        if key != QA_METADATA and difflib.get_close_matches(key, [QA_METADATA], n=1, cutoff=0.7):
            log.warning("RULER QA metadata key %r is not used; did you mean %r?", key, QA_METADATA)


def generate_docs(task: str, **metadata: Any) -> list[dict]:
    """All grid docs of one RULER QA task, ordered by length, depth, sample index."""
    if task not in TASKS:
        raise QAError(f"unknown RULER QA task {task!r}: choose one of {', '.join(TASKS)}")
    _check_keys(metadata)
    qa_dir = metadata.get(QA_METADATA)
    grid = parse_grid({k: v for k, v in metadata.items() if k != QA_METADATA}, family="RULER QA")
    tokenizer = load_tokenizer(grid["tokenizer"])
    data = load_qa_data(task, qa_dir)
    docs, repeated = [], 0
    for length in grid["lengths"]:
        guess = 8  # then the previous sample's fit
        for depth in grid["depths"]:
            for index in range(grid["samples_per_cell"]):
                sample = sample_for(data, task, seed=grid["seed"], length=length, depth=depth, index=index)
                fit = make_sample(sample, tokenizer, length=length, guess=guess, task=task)
                guess = fit.num_distractors
                repeated += fit.num_distractors > sample.stream.distinct
                first_gold = sample.gold_position(fit.num_distractors) + 1
                docs.append({
                    "input": fit.prompt,
                    "outputs": sample.answers,
                    "length": length,
                    "depth": depth,
                    "sample": index,
                    "task": task,
                    "dataset": TASKS[task],
                    "question": sample.question,
                    "question_index": sample.question_index,
                    "haystack_unit": "document",
                    "num_haystack": fit.num_distractors,
                    "num_documents": fit.num_distractors + len(sample.gold),
                    "gold_documents": list(range(first_gold, first_gold + len(sample.gold))),
                    "prompt_tokens": fit.prompt_tokens,
                    "generation_budget": GENERATION_BUDGET,
                    "needle_char_offset": fit.gold_char_offset,
                    "answer_prefix": ANSWER_PREFIX,
                    "seed": grid["seed"],
                    "tokenizer": grid["tokenizer_name"],
                    "data_file": data.source,
                })
    if repeated:
        log.warning("%s: %d samples needed more distractors than %s has documents; documents repeat in them",
                    task, repeated, data.source)
    return docs


def ruler_qa_squad(**metadata: Any) -> dict:
    return as_dataset(generate_docs("ccq_ruler_qa_squad", **metadata))


def ruler_qa_hotpot(**metadata: Any) -> dict:
    return as_dataset(generate_docs("ccq_ruler_qa_hotpot", **metadata))


# ---------------------------------------------------------------- scoring (RULER string_match_part)
def string_match_part(prediction: str, references: list[str]) -> float:
    """100 when any reference is a case-insensitive substring of the prediction, else 0 (one sample)."""
    pred = prediction.lower()
    return 100.0 if any(ref.lower() in pred for ref in references) else 0.0


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    score = string_match_part(postprocess_prediction(results[0]), doc["outputs"])
    return {"acc": score, f"acc_{doc['length']}": score}


def doc_to_target(doc: dict) -> str:
    return doc["outputs"][0]
