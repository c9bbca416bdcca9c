"""The report's sample browser (ccq_eval.analysis.report): one block per cell of a task with a length grid
that generates answers (S-NIAH and the other RULER tasks: model, task, length, depth) with its failures
(expected answer, generated text, the prompt around the needle), and one per perplexity (model, task,
length) with its worst documents. Plain data; the template samples.html.j2 lays it out.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ccq_eval.analysis.formatting import display_task, length_text
from ccq_eval.analysis.tidy import doc_cell, metric_infos, primary_metric, split_metric, stored_value
from ccq_eval.harness.store import StoredUnit
from ccq_eval.task_families import PERPLEXITY, family_of

# Characters of the prompt shown on each side of the needle, and of a document's start.
CONTEXT_CHARS = 240
EXCERPT_CHARS = 400
# Generated text longer than this is cut (S-NIAH budgets are a few dozen tokens; a runaway model's
# output would bloat the page).
GENERATED_CHARS = 600
_NOT_ARCHIVED = "; not archived>"


@dataclass(frozen=True)
class PromptWindow:
    """Characters `low` to `high` of a prompt of `length` characters, as (text, is an answer) pieces."""

    pieces: list[tuple[str, bool]]
    low: int
    high: int
    length: int


@dataclass(frozen=True)
class AnswerFailure:
    """An S-NIAH sample scored below full marks. `window` is the prompt around the needle (None when
    the prompt was not logged or was archived; `archived_prompt` is then the archive's placeholder)."""

    doc_id: Any
    score: float
    expected: str  # every accepted answer, " / " between them
    generated: str  # cut at GENERATED_CHARS
    window: PromptWindow | None
    archived_prompt: str | None = None


@dataclass(frozen=True)
class PerplexityDocument:
    """A document of a perplexity cell; `excerpt` is the start of its text (None when archived)."""

    doc_id: Any
    label: str
    perplexity: float
    tokens: int
    excerpt: str | None


@dataclass
class SampleCell:
    """One block of the sample browser: a cell of a task that generates answers (its failures, the first
    few listed, the others counted) or a perplexity (model, task, length) with its worst documents."""

    model: str
    task: str
    length: int | None
    depth: float | None
    summary: str
    failures: list[AnswerFailure] = field(default_factory=list)
    unlisted_failures: int = 0
    documents: list[PerplexityDocument] = field(default_factory=list)

    @property
    def filter_values(self) -> dict[str, str]:
        """The block's value for each select of the browser (its data-* attributes)."""
        return {"model": self.model, "task": self.task,
                "length": "" if self.length is None else str(self.length),
                "depth": "" if self.depth is None else f"{self.depth:g}"}


@dataclass(frozen=True)
class Select:
    """A select of the sample browser: `name` is the filter_values key it matches; options are
    (value, text) pairs."""

    name: str
    options: list[tuple[str, str]]


def _generated(sample: dict[str, Any]) -> str:
    for key in ("filtered_resps", "resps"):
        value = sample.get(key)
        while isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, str):
            return value
    return ""


def _archived(text: str) -> bool:
    return text.startswith("<") and text.endswith(_NOT_ARCHIVED)


def needle_context(prompt: str, answers: Sequence[str], offset: Any = None) -> PromptWindow:
    """The prompt around the needle: CONTEXT_CHARS on each side of the first answer found (from the
    needle's offset on, when the document records it), every answer marked."""
    start_at = int(offset) if isinstance(offset, (int, float)) and 0 <= offset < len(prompt) else 0
    positions = [prompt.find(a, start_at) for a in answers if a]
    positions = [p for p in positions if p >= 0] or [start_at]
    centre = min(positions)
    low, high = max(0, centre - CONTEXT_CHARS), min(len(prompt), centre + CONTEXT_CHARS)
    window = prompt[low:high]
    marks: list[tuple[int, int]] = []
    for answer in answers:
        found = window.find(answer) if answer else -1
        while found >= 0:
            marks.append((found, found + len(answer)))
            found = window.find(answer, found + len(answer))
    pieces, cursor = [], 0
    for begin, end in sorted(marks):
        if begin < cursor:
            continue
        pieces += [(window[cursor:begin], False), (window[begin:end], True)]
        cursor = end
    pieces.append((window[cursor:], False))
    return PromptWindow(pieces, low, high, len(prompt))


def _answer_failure(sample: dict[str, Any], score: float) -> AnswerFailure:
    doc = sample.get("doc") or {}
    answers = [str(a) for a in doc.get("outputs") or [sample.get("target", "")]]
    generated = _generated(sample)
    shown = generated if len(generated) <= GENERATED_CHARS else generated[:GENERATED_CHARS] + "…"
    prompt = str(doc.get("input", ""))
    archived = _archived(prompt)
    window = needle_context(prompt, answers, doc.get("needle_char_offset")) if prompt and not archived else None
    return AnswerFailure(sample.get("doc_id"), score, " / ".join(answers), shown, window,
                        prompt if archived else None)


def _full_marks(values: Iterable[float]) -> float:
    return 100.0 if any(v > 1.0 for v in values) else 1.0


def answer_cells(unit: StoredUnit, task: str, failures_per_cell: int) -> list[SampleCell]:
    """One cell per (length, depth) of a task that generates answers (S-NIAH, the other RULER tasks): its
    failures with expected answer, generated text and context, the first `failures_per_cell` listed."""
    name = primary_metric(task, metric_infos(unit, task))
    samples = unit.samples(task)
    first_filter = samples[0].get("filter", "none") if samples else "none"
    scored = []
    for sample in samples:
        value = stored_value(sample.get(name))
        length, depth = doc_cell(sample.get("doc"))
        if sample.get("filter", "none") == first_filter and isinstance(value, float) and length is not None:
            scored.append((int(length), depth, value, sample))
    full = _full_marks(v for _, _, v, _ in scored)
    by_cell: dict[tuple[int, float | None], list[tuple[float, dict]]] = defaultdict(list)
    for length, depth, value, sample in scored:
        by_cell[(length, depth)].append((value, sample))
    cells = []
    for (length, depth), entries in sorted(by_cell.items(), key=lambda item: (item[0][0], item[0][1] or 0.0)):
        failures = [(v, s) for v, s in entries if v < full]
        where = f"{length_text(length)}" + ("" if depth is None else f", depth {depth:g}%")
        outcome = f"{len(failures)} of {len(entries)} failed" if failures else f"all {len(entries)} right"
        summary = f"{unit.model} · {display_task(task)} · {where}: {outcome}"
        cells.append(SampleCell(unit.model, task, length, depth, summary,
                                failures=[_answer_failure(s, v) for v, s in failures[:failures_per_cell]],
                                unlisted_failures=max(0, len(failures) - failures_per_cell)))
    return cells


def _perplexity_document(sample: dict[str, Any], perplexity: float, tokens: int) -> PerplexityDocument:
    doc = sample.get("doc") or {}
    label = doc.get("document") or (f"block {doc['block_index']}" if "block_index" in doc else "")
    text = str(doc.get("text", ""))
    excerpt = None if _archived(text) else text[:EXCERPT_CHARS] + ("…" if len(text) > EXCERPT_CHARS else "")
    return PerplexityDocument(sample.get("doc_id"), str(label), perplexity, tokens, excerpt)


def perplexity_cells(unit: StoredUnit, task: str, worst_documents: int) -> list[SampleCell]:
    """One cell per evaluated length: its `worst_documents` documents of highest perplexity."""
    name = primary_metric(task, metric_infos(unit, task))
    by_length: dict[int, list[tuple[float, int, dict]]] = defaultdict(list)
    for sample in unit.samples(task):
        for key in sample.get("metrics") or [k for k in sample if k == name or k.startswith(f"{name}@")]:
            base, suffix_length, bucket = split_metric(key)
            value = stored_value(sample.get(key))
            if base != name or bucket is not None or not isinstance(value, tuple) or value[1] <= 0:
                continue
            length = suffix_length or doc_cell(sample.get("doc"))[0]
            if length is None:
                continue
            nll, tokens = value
            by_length[int(length)].append((math.exp(nll / tokens), int(tokens), sample))
    cells = []
    for length, documents in sorted(by_length.items()):
        documents.sort(key=lambda entry: -entry[0])
        summary = (f"{unit.model} · {display_task(task)} · {length_text(length)}: worst "
                   f"{min(worst_documents, len(documents))} of {len(documents)} documents "
                   f"(perplexity {documents[0][0]:.2f} to {documents[-1][0]:.2f})")
        worst = [_perplexity_document(sample, perplexity, tokens)
                 for perplexity, tokens, sample in documents[:worst_documents]]
        cells.append(SampleCell(unit.model, task, length, None, summary, documents=worst))
    return cells


def generates_answers(task: str) -> bool:
    """Whether the sample browser lists `task`'s failed answers: a family with per-cell rows that generates
    (S-NIAH and the other RULER families), chosen by family."""
    family = family_of(task)
    return family.cell_rows and family.request_type == "generate_until"


def sample_cells(units: Sequence[StoredUnit], *, failures_per_cell: int, worst_documents: int) -> list[SampleCell]:
    """Every block of the browser, by model and task: answer cells and perplexity cells."""
    cells = []
    for unit in sorted(units, key=lambda u: u.model):
        for task in sorted(unit.leaf_tasks()):
            if task not in unit.samples_paths:
                continue
            if generates_answers(task):
                cells += answer_cells(unit, task, failures_per_cell)
            elif family_of(task) is PERPLEXITY:
                cells += perplexity_cells(unit, task, worst_documents)
    return cells


def sample_selects(cells: Sequence[SampleCell]) -> list[Select]:
    """The browser's selects: every model, task, length and depth of the cells."""
    lengths = sorted({c.length for c in cells if c.length is not None})
    depths = sorted({c.depth for c in cells if c.depth is not None})
    return [
        Select("model", [(m, m) for m in sorted({c.model for c in cells})]),
        Select("task", [(t, display_task(t)) for t in sorted({c.task for c in cells})]),
        Select("length", [(str(x), length_text(x)) for x in lengths]),
        Select("depth", [(f"{d:g}", f"{d:g}%") for d in depths]),
    ]
