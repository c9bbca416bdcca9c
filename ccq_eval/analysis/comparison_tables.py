"""Comparisons as `compare` and the report print them: p-values adjusted for their number, significance
marks and verdicts on the adjusted p-values, and the tables with the note that says how to read them.

The family of an adjustment is every p-value one table set prints: all rows of all pairs `compare` prints
(and the report's per-length tables), the cells of `compare --summary` (and the report's verdict table, the
same table from verdict_summary). The raw p-value stays beside the adjusted one; the confidence intervals
are per comparison, not adjusted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from ccq_eval.analysis.formatting import (
    FORMATS,
    NON_FINITE_NOTE,
    AnalysisOptionError,
    csv_safe,
    display_task,
    failed_label,
    markdown_escape,
    to_latex,
    to_markdown,
)
from ccq_eval.analysis.p_values import (
    DEFAULT_ALPHA,
    DEFAULT_P_ADJUST,
    METHOD_NAMES,
    adjust_p_values,
    check_p_adjust,
    family_size,
    significance_mark,
)
from ccq_eval.analysis.pairing import group_order
from ccq_eval.analysis.ruler import RULER_FAMILY_NAMES
from ccq_eval.analysis.tidy import task_family
from ccq_eval.analysis.zeroshot import paper_header
from ccq_eval.task_families import RECALL_PAPER_COLUMNS, ZEROSHOT, ZEROSHOT_PAPER_COLUMNS

ADJUSTMENT_COLUMNS = ("p_adjusted", "p_adjust", "p_family")
Comparisons = Iterable[tuple[str, str, pd.DataFrame]]


def _judged(frame: pd.DataFrame, alpha: float) -> pd.DataFrame:
    """`frame` with sig and verdict read from its adjusted p-values (a failed row stays failed)."""
    marks, verdicts = [], []
    for p_value, delta, higher_is_better, verdict in zip(frame["p_adjusted"], frame["delta"],
                                                        frame["higher_is_better"], frame["verdict"]):
        mark = significance_mark(p_value, alpha) if math.isfinite(p_value) else ""
        if verdict != "failed":
            verdict = "not significant"
            if mark and delta != 0:
                verdict = "variant better" if (delta > 0) == bool(higher_is_better) else "variant worse"
        marks.append(mark)
        verdicts.append(verdict)
    return frame.assign(sig=marks, verdict=verdicts)


def adjust_comparisons(frames: Sequence[pd.DataFrame], method: str = DEFAULT_P_ADJUST,
                       alpha: float = DEFAULT_ALPHA) -> list[pd.DataFrame]:
    """compare_models' frames with p_adjusted (adjusted by `method` over every p-value of all the frames:
    one family), p_adjust (the method), p_family (the family's size) beside p_value, and sig and verdict
    read from the adjusted p-values."""
    check_p_adjust(method)
    raw = np.concatenate([frame["p_value"].to_numpy(dtype=float) for frame in frames]) if frames else np.empty(0)
    adjusted, size = adjust_p_values(raw, method), family_size(raw)
    shown, start = [], 0
    for frame in frames:
        frame = frame.drop(columns=[c for c in ADJUSTMENT_COLUMNS if c in frame.columns])
        at = frame.columns.get_loc("p_value") + 1
        for offset, (column, values) in enumerate((("p_adjusted", adjusted[start:start + len(frame)]),
                                                   ("p_adjust", method), ("p_family", size))):
            frame.insert(at + offset, column, values)
        start += len(frame)
        shown.append(_judged(frame, alpha))
    return shown


def _method_of(frame: pd.DataFrame) -> tuple[str, int]:
    """(adjustment method, family size) of a frame adjust_comparisons made ('none' for one it did not)."""
    if "p_adjust" not in frame.columns or frame.empty:
        return "none", family_size(frame["p_value"]) if "p_value" in frame.columns else 0
    return str(frame["p_adjust"].iloc[0]), int(frame["p_family"].iloc[0])


METHOD_DESCRIPTIONS = {"holm": "Holm's step-down method", "bonferroni": "the Bonferroni method"}


def comparison_note(alpha: float = DEFAULT_ALPHA, method: str = "none", family: int = 0) -> str:
    """How to read a comparison table whose p-values `method` adjusted over a family of `family`."""
    tests = "(exact McNemar for right/wrong scores, exact sign test otherwise)"
    marks = f"* p<{alpha:g}, ** p<{alpha / 5:g}, *** p<{alpha / 50:g}"
    if method == "none":
        return f"delta = variant - baseline; CI: paired bootstrap over the same samples; sig: {marks} {tests}"
    p_values = "1 p-value" if family == 1 else f"{family} p-values"
    return (f"delta = variant - baseline; CI: paired bootstrap over the same samples, per comparison; p: "
            f"adjusted by {METHOD_DESCRIPTIONS[method]} over a family of {p_values} (all those printed "
            f"together; family-wise error rate), the raw p-value beside it {tests}; sig, on the adjusted p: {marks}")


def _protocols(frame: pd.DataFrame) -> list[str]:
    """The frame's protocol of each row (compare_models' "protocol": how a zero-shot rolling task was
    scored), "" where it names none."""
    if "protocol" not in frame.columns:
        return [""] * len(frame)
    return [value if isinstance(value, str) else "" for value in frame["protocol"]]


def _with_protocol(name: str, protocol: str) -> str:
    """'word_perplexity (HFLM windows)': a metric or column name with the protocol that scored it, if any."""
    return f"{name} ({protocol})" if protocol else name


def comparison_display(frame: pd.DataFrame, baseline: str, variant: str,
                       confidence: float = 0.95) -> pd.DataFrame:
    """compare_models' frame as printed: task display names, the models' names as column heads, the CI
    and p-values as text (the adjusted one headed by its method, the raw one beside it); indexed by
    (task, length)."""
    method, _ = _method_of(frame)
    shown = frame.copy()
    shown["task"] = shown["task"].map(display_task)
    shown["metric"] = [_with_protocol(metric, protocol) for metric, protocol in zip(frame["metric"], _protocols(frame))]
    shown = shown.rename(columns={"baseline": baseline, "variant": variant})
    level = f"{confidence * 100:g}%"
    shown[f"{level} CI"] = [f"[{lo:+.3f}, {hi:+.3f}]" if math.isfinite(lo) else "-"
                            for lo, hi in zip(frame["ci_low"], frame["ci_high"])]

    def as_text(values: Iterable[float]) -> list[str]:
        return [f"{p:.3g}" if math.isfinite(p) else "-" for p in values]

    if method == "none":
        p_columns = ["p_value"]
        shown["p_value"] = as_text(frame["p_value"])
    else:
        p_columns = [f"p ({METHOD_NAMES[method]})", "p (raw)"]
        shown[p_columns[0]], shown[p_columns[1]] = as_text(frame["p_adjusted"]), as_text(frame["p_value"])
    for column in (baseline, variant, "delta"):
        shown[column] = [v if math.isfinite(v) else failed_label(v) for v in shown[column]]
    columns = ["task", "length", "metric", "n", baseline, variant, "delta", f"{level} CI", *p_columns, "sig",
               "verdict", "test"]
    return shown[columns].set_index(["task", "length"])


def render_comparison(frame: pd.DataFrame, baseline: str, variant: str, fmt: str = "markdown",
                      confidence: float = 0.95, alpha: float = DEFAULT_ALPHA) -> str:
    """One pair's frame (from compare_models or adjust_comparisons) as `compare` prints it."""
    if fmt == "csv":
        return csv_safe(frame).to_csv(index=False)
    table = comparison_display(frame, baseline, variant, confidence)
    note = comparison_note(alpha, *_method_of(frame))
    if (frame["verdict"] == "failed").any():
        note += f"; {NON_FINITE_NOTE}"
    if fmt == "latex":
        return to_latex(table, 3, f"{variant} vs {baseline}") + "\n"
    if fmt != "markdown":
        raise AnalysisOptionError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    heading = f"### {markdown_escape(variant)} vs {markdown_escape(baseline)}"
    return f"{heading}\n\n" + to_markdown(table, 3) + f"\n\n_{note}_\n"


def render_comparisons(comparisons: Comparisons, fmt: str = "markdown", confidence: float = 0.95,
                       alpha: float = DEFAULT_ALPHA, p_adjust: str = DEFAULT_P_ADJUST) -> str:
    """Every pair's comparison as `compare` prints them, one after the other, the p-values of all of them
    adjusted together by `p_adjust` (holm, bonferroni or none)."""
    comparisons = list(comparisons)
    frames = adjust_comparisons([frame for _, _, frame in comparisons], p_adjust, alpha)
    return "\n".join(render_comparison(frame, baseline, variant, fmt, confidence, alpha)
                     for (baseline, variant, _), frame in zip(comparisons, frames))


def _summary_order(task: str, metric: str = "") -> tuple[int, int, str]:
    """S-NIAH first, then the other RULER families in their order, then the recall tasks in the order of the
    papers' columns (SWDE, SQD, FDA, TQA, NQ, DROP; either protocol's names), then every other task by name,
    then the zero-shot suite in the order of the papers' columns."""
    family = task_family(task)
    if family in RULER_FAMILY_NAMES:
        return 0, RULER_FAMILY_NAMES.index(family), task
    for column, names in enumerate((ours, stock) for ours, stock, _ in RECALL_PAPER_COLUMNS):
        if task in names:
            return 1, column, task
    if family == ZEROSHOT.name:
        columns = [(paper_task, paper_metric) for paper_task, paper_metric, _ in ZEROSHOT_PAPER_COLUMNS]
        return 2, columns.index((task, metric)) if (task, metric) in columns else len(columns), task
    return 1, len(RECALL_PAPER_COLUMNS), task


def _summary_column(task: str, metric: str, metrics_of_task: int) -> str:
    """A summary column's name: the papers' header of a zero-shot metric ("LMB. ppl"), else the task, with
    the metric where the task is compared on several."""
    header = paper_header(task, metric)
    if header is not None:
        return header
    return display_task(task) + (f" {metric}" if metrics_of_task > 1 else "")


def _summary_picks(comparisons: Comparisons) -> list[tuple[str, str, pd.Series]]:
    """(row, column, compare row) of each summary cell: a task's pooled group, else its longest length, per
    metric compared."""
    picks = []
    for baseline, variant, frame in comparisons:
        keys = list(dict.fromkeys(zip(frame["task"], frame["metric"])))
        for task, metric in sorted(keys, key=lambda key: _summary_order(*key)):
            group = frame[(frame["task"] == task) & (frame["metric"] == metric)]
            pooled = group[group["length"] == "all"]
            row = pooled.iloc[0] if not pooled.empty else group.loc[group["length"].map(group_order).idxmax()]
            column = _with_protocol(_summary_column(task, metric, sum(t == task for t, _ in keys)),
                                    _protocols(pooled if not pooled.empty else group)[0])
            column += "" if not pooled.empty else f" @{row['length']}"
            picks.append((f"{variant} vs {baseline}", column, row))
    return picks


def _by_backbone(table: pd.DataFrame, comparisons: list, backbones: Mapping[str, str | None]) -> pd.DataFrame:
    """The summary with its rows grouped by the variant's backbone (a `backbone` column first), where some row
    sets a variant against a baseline of another backbone; as it is otherwise."""
    pairs = {f"{variant} vs {baseline}": (backbones.get(variant), backbones.get(baseline))
             for baseline, variant, _ in comparisons}
    if not any(None not in pair and pair[0] != pair[1] for pair in pairs.values()):
        return table
    grouped = table.copy()
    grouped.insert(0, "backbone", [pairs[label][0] or "?" for label in grouped.index])
    order = sorted(range(len(grouped)), key=lambda i: (grouped["backbone"].iloc[i],
                                                       pairs[grouped.index[i]][1] or "?"))
    return grouped.iloc[order]


def comparison_summary(comparisons: Comparisons, p_adjust: str = DEFAULT_P_ADJUST,
                       alpha: float = DEFAULT_ALPHA, backbones: Mapping[str, str | None] | None = None) -> pd.DataFrame:
    """compare_models' frames of several (baseline, variant) pairs as one table: a row per pair, a column
    per task, each cell "delta [CI low, CI high], p = P" and the significance mark, over all of the task's
    paired samples (S-NIAH and the other RULER tasks: every length pooled) or, where a task has no such
    group (the perplexity sweep: one value per length), at its longest length ("@2048" in the column's
    name). P is adjusted by `p_adjust` over the cells of this table, the raw p-value beside it. `backbones`
    (model -> family without CCQ): rows that set a model against another family's are grouped by backbone."""
    comparisons = list(comparisons)
    picks = _summary_picks(comparisons)
    raw = np.array([float(row["p_value"]) for _, _, row in picks])
    adjusted = adjust_p_values(raw, p_adjust)
    rows: dict[str, dict[str, str]] = {}
    for (label, column, row), p_value, p_adjusted in zip(picks, raw, adjusted):
        text = f"{row['delta']:+.3g} [{row['ci_low']:+.3g}, {row['ci_high']:+.3g}], "
        if p_adjust == "none":
            text += f"p = {p_value:.2g}{significance_mark(p_value, alpha)}"
        else:
            text += (f"p = {p_adjusted:.2g}{significance_mark(p_adjusted, alpha)} "
                     f"({METHOD_NAMES[p_adjust]}; raw {p_value:.2g})")
        rows.setdefault(label, {})[column] = text
    table = pd.DataFrame.from_dict(rows, orient="index").rename_axis("comparison")
    table = _by_backbone(table, comparisons, backbones or {})
    table.attrs["p_family"] = family_size(raw)
    return table


def verdict_summary(comparisons: Comparisons, p_adjust: str = DEFAULT_P_ADJUST, alpha: float = DEFAULT_ALPHA,
                    backbones: Mapping[str, str | None] | None = None) -> tuple[pd.DataFrame, str]:
    """(comparison_summary, the note that says how to read it): the verdict table. `compare --summary` and the
    report both take it from here (through stats.verdict_table), so they print the same numbers."""
    check_p_adjust(p_adjust)
    comparisons = list(comparisons)
    table = comparison_summary(comparisons, p_adjust, alpha, backbones)
    families = {task_family(task) for _, _, frame in comparisons for task in frame["task"]}
    parts = [comparison_note(alpha, p_adjust, table.attrs["p_family"])]
    if families & set(RULER_FAMILY_NAMES):  # only what the table holds is explained
        pooled = "S-NIAH and RULER tasks" if families & set(RULER_FAMILY_NAMES) - {"s-niah"} else "S-NIAH"
        parts.append(f"{pooled}: all lengths pooled")
    if any("@" in str(column) for column in table.columns):
        parts.append("a column named @L: at length L only (perplexity: lower is better)")
    return table, "; ".join(parts)


def render_verdict(table: pd.DataFrame, note: str, fmt: str = "markdown") -> str:
    """A verdict table and its note (verdict_summary) as `compare --summary` prints them."""
    if fmt == "csv":
        return csv_safe(table).to_csv()
    if fmt == "latex":
        return to_latex(table, 3, "CCQ against its baseline") + "\n"
    if fmt != "markdown":
        raise AnalysisOptionError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    return to_markdown(table, 3) + f"\n\n_{note}_\n"


def render_summary(comparisons: Comparisons, fmt: str = "markdown", alpha: float = DEFAULT_ALPHA,
                   p_adjust: str = DEFAULT_P_ADJUST, backbones: Mapping[str, str | None] | None = None) -> str:
    """comparison_summary as `compare --summary` prints it, with the note that says how to read it."""
    return render_verdict(*verdict_summary(comparisons, p_adjust, alpha, backbones), fmt)
