"""The pivots papers print, from the tidy frame (ccq_eval.analysis.tidy), and `ccq-eval table`'s text.

Pivots: S-NIAH and the other RULER families' accuracy per length, perplexity per length and per
position bucket, LongBench per dataset with category averages, LongBench-E per bucket, the zero-shot suite
in the GLA / Gated DeltaNet papers' layout (ccq_eval.analysis.zeroshot), the recall-intensive tasks in the
Based / JRT papers' layout (ccq_eval.analysis.recall), and a catch-all of overall values
for any other lm-eval task; each family's entry in ccq_eval.task_families names its own.
Views of `ccq-eval table`: paper (those pivots), tidy (one row per value), ruler (RULER's task x length
table with its average and effective length, ccq_eval.analysis.ruler) and recall (the Based / JRT recall
table alone, ccq_eval.analysis.recall).

The reading side (tidy_table, load_tidy, metric_infos, ...) and the sweeps are re-exported here: a caller
that reads results and tabulates them imports this module alone.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from ccq_eval.analysis.formatting import (  # noqa: F401  (re-exported: how tables are written)
    FORMATS,
    NON_FINITE_NOTE,
    AnalysisOptionError,
    check_format,
    display_task,
    failed_label,
    has_failures,
    length_label,
    markdown_escape,
    to_csv,
    to_latex,
    to_markdown,
    with_failures_shown,
)
from ccq_eval.analysis.recall import recall_pivot
from ccq_eval.analysis.ruler import DEFAULT_THRESHOLD, render_ruler
from ccq_eval.analysis.sweeps import (  # noqa: F401  (re-exported: the sweeps are read with the tables)
    ccq_attachment,
    ccq_sweep_points,
    sweep_attachments,
    sweep_points,
)
from ccq_eval.analysis.tidy import (  # noqa: F401  (re-exported: the tidy frame the pivots read)
    CELL_FAMILIES,
    TIDY_COLUMNS,
    MetricInfo,
    aggregate,
    doc_cell,
    load_tidy,
    longbench_dataset,
    metric_infos,
    primary_metric,
    split_metric,
    stored_value,
    task_family,
    tidy_table,
)
from ccq_eval.analysis.zeroshot import zeroshot_pivot
from ccq_eval.task_families import FAMILIES, RECALL, TaskFamily
from ccq_eval.tasks.longbench import categories as longbench_categories

VIEWS = ("paper", "tidy", "ruler", "recall")


@dataclass
class Pivot:
    title: str
    frame: pd.DataFrame
    note: str = ""


def _length_pivot(rows: pd.DataFrame) -> pd.DataFrame:
    pivot = rows.pivot_table(index=["task", "model"], columns="length", values="value", aggfunc="first")
    pivot = pivot.reindex(sorted(pivot.columns), axis=1)
    pivot.columns = [length_label(c) for c in pivot.columns]
    pivot = pivot.rename(index=display_task, level="task")
    return pivot


def _family_rows(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame:
    return tidy[tidy["family"] == family.name]


def length_pivot(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame | None:
    """task x model x length of a family's primary metric (S-NIAH accuracy, sweep perplexity)."""
    rows = _family_rows(tidy, family)
    rows = rows[rows["primary"] & rows["length"].notna() & rows["depth"].isna() & rows["bucket"].isna()]
    return None if rows.empty else _length_pivot(rows)


def position_bucket_pivot(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame | None:
    """task x model x end of the position bucket, of a family's primary metric (bucketed perplexity)."""
    rows = _family_rows(tidy, family)
    rows = rows[rows["primary"] & rows["bucket"].notna()]
    return None if rows.empty else _length_pivot(rows)


def longbench_pivot(tidy: pd.DataFrame, family: str = "longbench") -> pd.DataFrame | None:
    """model x dataset (official order) with category averages and the mean of categories."""
    rows = tidy[(tidy["family"] == family) & tidy["primary"] & tidy["length"].isna() & tidy["bucket"].isna()]
    if rows.empty:
        return None
    scores: dict[str, dict[str, float]] = defaultdict(dict)
    for row in rows.itertuples():
        dataset = longbench_dataset(row.task)
        if dataset is not None:
            scores[row.model][dataset] = float(row.value)
    if not scores:
        return None
    present = [d for d in longbench_categories.DATASET_CATEGORY if any(d in s for s in scores.values())]
    table: dict[str, dict[str, float]] = {}
    for model, per_dataset in scores.items():
        line = {dataset: per_dataset.get(dataset, math.nan) for dataset in present}
        averages = longbench_categories.category_averages(per_dataset, language="all")
        for slug, label in longbench_categories.CATEGORY_LABELS.items():
            if slug in averages:
                line[f"{label} avg"] = averages[slug]
        if averages:
            line["Avg (categories)"] = sum(averages.values()) / len(averages)
        table[model] = line
    frame = pd.DataFrame.from_dict(table, orient="index")
    frame.index.name = "model"
    return frame.sort_index()


def length_bucket_pivot(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame | None:
    """dataset x model x length bucket (LongBench-E's score_0-4k, ...)."""
    rows = _family_rows(tidy, family)
    rows = rows[rows["bucket"].notna()]
    if rows.empty:
        return None
    rows = rows.assign(dataset=[longbench_dataset(t) or t for t in rows["task"]])
    return rows.pivot_table(index=["dataset", "model"], columns="bucket", values="value", aggfunc="first")


def overall_pivot(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame | None:
    """model x (task, metric) of the overall values (any other lm-eval task)."""
    rows = _family_rows(tidy, family)
    rows = rows[rows["length"].isna()]
    if rows.empty:
        return None
    label = rows["task"] + " " + rows["metric"]
    rows = rows.assign(column=label.where(rows["filter"].isin(["none", None]), label + " (" + rows["filter"] + ")"))
    return rows.pivot_table(index="model", columns="column", values="value", aggfunc="first")




def longbench_shown(tidy: pd.DataFrame, family: TaskFamily) -> pd.DataFrame | None:
    """longbench_pivot with a model's failed datasets, and the averages over them, shown as failed."""
    frame = longbench_pivot(tidy, family.name)
    rows = _family_rows(tidy, family)
    rows = rows[rows["primary"] & rows["length"].isna() & rows["bucket"].isna()]
    failed = rows[~rows["value"].map(math.isfinite)]
    if frame is None or failed.empty:
        return frame
    datasets = {longbench_dataset(task) for task in rows["task"]}
    shown = frame.astype(object)
    for model, task, value in failed[["model", "task", "value"]].itertuples(index=False):
        for column in shown.columns:
            cell = shown.at[model, column]
            average_over_it = column not in datasets and isinstance(cell, float) and math.isnan(cell)
            if column == longbench_dataset(task) or average_over_it:
                shown.at[model, column] = failed_label(value)
    return shown


# FamilyTable.pivot -> (the pivot, whether it reads the tidy frame with failures already shown).
# longbench_pivot and zeroshot_pivot average over tasks, so they read the numbers and mark failures
# themselves. A pivot's frame may carry a note of its own in frame.attrs["note"] (what its values are).
PIVOTS: dict[str, tuple[Callable[[pd.DataFrame, TaskFamily], pd.DataFrame | None], bool]] = {
    "per_length": (length_pivot, True),
    "per_position_bucket": (position_bucket_pivot, True),
    "longbench_categories": (longbench_shown, False),
    "per_length_bucket": (length_bucket_pivot, True),
    "zeroshot_paper": (zeroshot_pivot, False),
    "recall_paper": (recall_pivot, False),
    "overall": (overall_pivot, True),
}


def paper_pivots(tidy: pd.DataFrame) -> list[Pivot]:
    """The tables every family's entry names (task_families.FAMILIES), in that order, those with rows."""
    pivots = []
    shown = with_failures_shown(tidy)
    for family in FAMILIES:
        for table in family.tables:
            make_pivot, reads_shown = PIVOTS[table.pivot]
            frame = make_pivot(shown if reads_shown else tidy, family)
            if frame is not None and not frame.empty:
                note = "; ".join(part for part in (table.note, frame.attrs.get("note", "")) if part)
                if has_failures(frame):
                    note = f"{note}; {NON_FINITE_NOTE}" if note else NON_FINITE_NOTE
                pivots.append(Pivot(table.title, frame, note))
    return pivots


def _render_tidy(tidy: pd.DataFrame, fmt: str, digits: int) -> str:
    frame = with_failures_shown(tidy.drop(columns=["source"]))
    if fmt != "csv":  # csv keeps every column; the others drop bookkeeping, and protocol where nothing has one
        empty = ["protocol"] if frame["protocol"].isna().all() else []
        frame = frame.drop(columns=["family", "primary", "higher_is_better", *empty])
    if fmt == "csv":
        return to_csv(frame)
    if fmt == "latex":
        return to_latex(frame, digits, "All results") + "\n"
    return to_markdown(frame, digits) + (f"\n\n_{NON_FINITE_NOTE}_" if has_failures(frame) else "") + "\n"


def _render_paper(tidy: pd.DataFrame, fmt: str, digits: int, pivots: list[Pivot] | None = None) -> str:
    parts = []
    for pivot in paper_pivots(tidy) if pivots is None else pivots:
        if fmt == "markdown":
            parts.append(f"### {pivot.title}\n\n" + to_markdown(pivot.frame, digits)
                         + (f"\n\n_{pivot.note}_" if pivot.note else ""))
        elif fmt == "latex":
            parts.append(to_latex(pivot.frame, digits, pivot.title))
        else:
            parts.append(f"# {pivot.title}\n" + to_csv(pivot.frame).rstrip("\n"))
    return "\n\n".join(parts) + "\n"


def _render_recall(tidy: pd.DataFrame, fmt: str, digits: int) -> str:
    """The recall table alone (the paper view's recall pivot); an AnalysisOptionError when no recall task is in
    the results."""
    pivots = [pivot for pivot in paper_pivots(tidy) if pivot.title == RECALL.tables[0].title]
    if not pivots:
        raise AnalysisOptionError("--view recall: these results hold no recall task (ccq_recall_* or lm-eval's swde, "
                                  "fda, squad_completion); run -t recall first")
    return _render_paper(tidy, fmt, digits, pivots)


def render_tables(tidy: pd.DataFrame, fmt: str = "markdown", view: str = "paper", digits: int = 2,
                  threshold: float = DEFAULT_THRESHOLD) -> str:
    """The tidy frame (view="tidy"), the paper pivots (view="paper") or RULER's task x length view with its
    average and effective length at `threshold` (view="ruler") as markdown, csv or LaTeX."""
    check_format(fmt)
    if view == "tidy":
        return _render_tidy(tidy, fmt, digits)
    if view == "paper":
        return _render_paper(tidy, fmt, digits)
    if view == "ruler":
        return render_ruler(tidy, fmt, digits, threshold)
    if view == "recall":
        return _render_recall(tidy, fmt, digits)
    raise AnalysisOptionError(f"unknown view {view!r}; valid: {', '.join(VIEWS)}")
