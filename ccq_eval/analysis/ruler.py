"""RULER's own view of the results: task x length accuracy per model, the average over the tasks per
length and the effective length (`ccq-eval table --view ruler`, the report and the RULER figures).

RULER's tasks are those of the families S-NIAH, NIAH (multi-key, multi-value, multi-query), variable
tracking, common / frequent words extraction and QA (ccq_eval.task_families), chosen by family, never
by task name; RULER_TASKS (ccq_eval.harness.task_registry) gives their order and the count of 13.

Effective length, as RULER defines it (NVIDIA/RULER, README.md at commit c3f5e3b: its main results table
and the note under it): the longest length at which the model's average over the tasks exceeds a
qualitative threshold, Llama-2-7B's average at 4K, 85.6. The table reads it as a prefix: in nearly all of
its rows the effective length is the longest length up to which every length passes; a score equal to the
threshold passes (Qwen3-32B: 85.6 at 128K is underlined, its effective length ">128K"); a model below the
threshold at the shortest length has none ("<4K"), one above it at every length evaluated at least the
longest (">128K"). Tables here write those "below 4K" and "at least 128K". Precisely: lengths are taken
in increasing order, and the effective length is the last one before the first length whose average is
below the threshold, failed (NaN / inf) or undefined (a task of the model lacks that length).

RULER's average, and so its effective length, is over its 13 tasks: a model whose results hold fewer (or
other tasks of the families beside them) gets its average over the tasks it has, labelled with their count,
and no effective length, since an average over a few tasks (S-NIAH alone is far easier than the rest) is
not comparable with RULER's threshold or with another model's effective length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from ccq_eval.analysis.formatting import (
    AnalysisOptionError,
    display_task,
    failed_label,
    length_label,
    markdown_escape,
    to_csv,
    to_latex,
    to_markdown,
)
from ccq_eval.harness.task_registry import RULER_TASKS
from ccq_eval.task_families import RULER_AGGREGATION, RULER_NIAH, RULER_QA, RULER_VT, S_NIAH, TaskFamily

RULER_FAMILIES: tuple[TaskFamily, ...] = (S_NIAH, RULER_NIAH, RULER_VT, RULER_AGGREGATION, RULER_QA)
RULER_FAMILY_NAMES = tuple(family.name for family in RULER_FAMILIES)
DEFAULT_THRESHOLD = 85.6  # RULER's: Llama-2-7B's average at 4K, in % (its README)
RULER_TASK_COUNT = len(RULER_TASKS)
NOT_DEFINED = "n/a"  # the effective length of a model without RULER's full task set


def ruler_order(task: str, family: str) -> tuple[int, int, str]:
    """Sort key of a RULER task: RULER's own order of its 13 tasks, then any other task of the families."""
    position = RULER_TASKS.index(task) if task in RULER_TASKS else len(RULER_TASKS)
    return position, RULER_FAMILY_NAMES.index(family), task


def ruler_values(tidy: pd.DataFrame) -> pd.DataFrame:
    """The primary per-length values (no depth, no bucket) of the RULER families' tasks: model, task,
    family, length, value."""
    rows = tidy[tidy["family"].isin(RULER_FAMILY_NAMES) & tidy["primary"] & tidy["length"].notna()
                & tidy["depth"].isna() & tidy["bucket"].isna()]
    return rows[["model", "task", "family", "length", "value"]].astype({"length": int})


def check_threshold(threshold: float) -> None:
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and 0 <= threshold <= 100):
        raise AnalysisOptionError(f"--threshold {threshold}: give an accuracy in percent from 0 to 100 "
                                  f"(RULER's is {DEFAULT_THRESHOLD:g})")


def effective_length(lengths: Sequence[int], averages: Mapping[int, float], threshold: float) -> int | None:
    """The longest of `lengths` whose average, and every shorter length's, is at or above `threshold`
    (None when the shortest is not); a length without an average, or a non-finite one, stops the walk."""
    found = None
    for length in sorted(lengths):
        value = averages.get(length)
        if value is None or not math.isfinite(value) or value < threshold:
            break
        found = length
    return found


def effective_length_label(found: int | None, lengths: Sequence[int]) -> str:
    """'2K'; 'below 1K' when the shortest length is below the threshold; 'at least 4K' when no length is
    (4K being the longest evaluated), where RULER writes '<4K' and '>128K'."""
    if not lengths:
        return "-"
    if found is None:
        return "below " + length_label(min(lengths))
    if found == max(lengths):
        return "at least " + length_label(found)
    return length_label(found)


@dataclass(frozen=True)
class RulerBlock:
    """One model's RULER results: `values` is task x length (lm-eval task names in RULER's order, lengths in
    tokens), `present` says which of those cells the results hold (a failed, non-finite value included),
    `averages` the mean over all the tasks at each length where every task has a value (NaN when one of them
    failed), `effective` the effective length at `threshold`, None where the average is below it at the
    shortest length and where the block does not hold RULER's 13 tasks (`complete`)."""

    model: str
    values: pd.DataFrame
    present: pd.DataFrame
    averages: dict[int, float]
    threshold: float
    effective: int | None

    @property
    def tasks(self) -> list[str]:
        return list(self.values.index)

    @property
    def lengths(self) -> list[int]:
        return [int(length) for length in self.values.columns]

    @property
    def ruler_task_count(self) -> int:
        """How many of RULER's 13 tasks the average holds."""
        return sum(task in RULER_TASKS for task in self.tasks)

    @property
    def complete(self) -> bool:
        """Whether the block holds exactly RULER's 13 tasks, the set its average and effective length are
        defined over."""
        return set(self.tasks) == set(RULER_TASKS)

    @property
    def effective_label(self) -> str:
        """The effective length as printed: 'n/a' for a block without RULER's full task set."""
        return effective_length_label(self.effective, self.lengths) if self.complete else NOT_DEFINED

    @property
    def average_label(self) -> str:
        ruler = f"{self.ruler_task_count} of {RULER_TASK_COUNT}"
        others = len(self.tasks) - self.ruler_task_count
        return f"average ({ruler} tasks)" if not others else f"average ({len(self.tasks)} tasks, {ruler} of RULER's)"


def _model_block(model: str, own: pd.DataFrame, threshold: float) -> RulerBlock:
    order = sorted(set(zip(own["task"], own["family"])), key=lambda pair: ruler_order(*pair))
    tasks, lengths = [task for task, _ in order], sorted(set(own["length"]))
    values = pd.DataFrame(math.nan, index=tasks, columns=lengths)
    present = pd.DataFrame(False, index=tasks, columns=lengths)
    for task, length, value in own[["task", "length", "value"]].itertuples(index=False):
        values.at[task, length], present.at[task, length] = float(value), True
    averages = {}
    for length in lengths:
        if present[length].all():  # a task without this length leaves it without an average
            column = values[length]
            averages[length] = math.fsum(column) / len(column) if column.map(math.isfinite).all() else math.nan
    complete = set(tasks) == set(RULER_TASKS)
    return RulerBlock(model, values, present, averages, float(threshold),
                      effective_length(lengths, averages, threshold) if complete else None)


def ruler_blocks(tidy: pd.DataFrame, threshold: float = DEFAULT_THRESHOLD) -> list[RulerBlock]:
    """One RulerBlock per model with per-length values of a RULER task, in model order."""
    check_threshold(threshold)
    rows = ruler_values(tidy)
    return [_model_block(str(model), own, threshold) for model, own in rows.groupby("model", sort=True)]


def _shown(value: float) -> float | str:
    return value if math.isfinite(value) else failed_label(value)


def block_frame(block: RulerBlock) -> pd.DataFrame:
    """A block as printed: a row per task (display names) and the average row, a column per length."""
    rows = {display_task(task): [_shown(block.values.at[task, length]) if block.present.at[task, length] else None
                                 for length in block.lengths]
            for task in block.tasks}
    rows[block.average_label] = [_shown(block.averages[length]) if length in block.averages else None
                                 for length in block.lengths]
    frame = pd.DataFrame.from_dict(rows, orient="index", columns=[length_label(x) for x in block.lengths],
                                   dtype=object)
    frame.index.name = "task"
    return frame


def summary_frame(blocks: Sequence[RulerBlock]) -> pd.DataFrame:
    """RULER's main table: a row per model, its tasks, its average per length and its effective length."""
    lengths = sorted({length for block in blocks for length in block.lengths})
    rows = {}
    for block in blocks:
        line: dict[str, object] = {"tasks": f"{block.ruler_task_count} of {RULER_TASK_COUNT}"}
        for length in lengths:
            line[length_label(length)] = _shown(block.averages[length]) if length in block.averages else None
        line["effective length"] = block.effective_label
        rows[block.model] = line
    frame = pd.DataFrame.from_dict(rows, orient="index", dtype=object)
    frame.index.name = "model"
    return frame


def ruler_note(threshold: float) -> str:
    return (f"accuracy in % (RULER string match); average: over the model's RULER tasks at each length, '-' "
            f"where one of them lacks that length; effective length: only for a model with all "
            f"{RULER_TASK_COUNT} of RULER's tasks ('{NOT_DEFINED}' otherwise: an average over fewer tasks is not "
            f"RULER's), the longest length whose average, and the average at every shorter length, is at or above "
            f"{threshold:g} (RULER's threshold {DEFAULT_THRESHOLD:g} is Llama-2-7B's average at 4K); 'below L': "
            f"below it already at the shortest length L; 'at least L': at or above it at every length "
            f"evaluated, the longest being L")


def ruler_tables(tidy: pd.DataFrame, threshold: float = DEFAULT_THRESHOLD) -> list[tuple[str, pd.DataFrame]]:
    """(title, frame) of the RULER view: the summary over models, then one block per model."""
    blocks = ruler_blocks(tidy, threshold)
    if not blocks:
        return []
    tables = [(f"RULER average per length and effective length (threshold {threshold:g})", summary_frame(blocks))]
    tables += [(f"RULER accuracy per task and length: {block.model}", block_frame(block)) for block in blocks]
    return tables


def render_ruler(tidy: pd.DataFrame, fmt: str = "markdown", digits: int = 2,
                 threshold: float = DEFAULT_THRESHOLD) -> str:
    """The RULER view (`ccq-eval table --view ruler`) as markdown, csv or LaTeX."""
    tables = ruler_tables(tidy, threshold)
    if not tables:
        families = ", ".join(family.title for family in RULER_FAMILIES)
        raise AnalysisOptionError(f"--view ruler: the results hold no per-length value of a RULER task ({families});"
                                  " run them with `ccq-eval run -t ruler`, or choose --view paper")
    parts = []
    for title, frame in tables:
        if fmt == "markdown":
            parts.append(f"### {markdown_escape(title)}\n\n" + to_markdown(frame, digits))
        elif fmt == "latex":
            parts.append(to_latex(frame, digits, title))
        else:
            parts.append(f"# {title}\n" + to_csv(frame).rstrip("\n"))
    note = ruler_note(threshold)
    if fmt == "markdown":
        parts.append(f"_{note}_")
    return "\n\n".join(parts) + "\n"
