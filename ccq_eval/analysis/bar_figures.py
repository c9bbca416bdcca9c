"""Grouped bar charts: LongBench per dataset with its category averages, LongBench-E per length bucket, the
zero-shot suite's accuracies (with their average) and perplexities in the papers' columns, and the recall
table (ccq_eval.analysis.recall) with its average."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ccq_eval.analysis import recall, tables, zeroshot
from ccq_eval.analysis.figure_style import STYLE, is_ccq, plt, save_figure


def _grouped_bars(pivot: pd.DataFrame, columns: list[str], averages: list[str], colors: dict, title: str,
                  ylabel: str, out: Path, stem: str) -> list[Path]:
    """model x column bars, a group per column, the average columns after a rule."""
    columns = columns + averages
    models = list(pivot.index)
    width = 0.8 / max(len(models), 1)
    x = np.arange(len(columns))
    with plt.rc_context(STYLE | {"axes.grid.axis": "y"}):
        fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(columns) * max(1, len(models) / 2)), 3.2),
                               layout="constrained")
        for k, model in enumerate(models):
            values = pivot.loc[model, columns].to_numpy(dtype=float)
            ax.bar(x + (k - (len(models) - 1) / 2) * width, values, width, label=model, color=colors[model],
                   edgecolor="black" if is_ccq(model) else "none", linewidth=0.4)
        ax.set_xticks(x, columns, rotation=35, ha="right", rotation_mode="anchor")
        if averages:
            ax.axvline(len(columns) - len(averages) - 0.5, color="grey", linewidth=0.8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        fig.legend(*ax.get_legend_handles_labels(), loc="outside upper right", ncol=min(len(models), 4),
                   frameon=False)
        return save_figure(fig, out, stem)


def longbench_bars(tidy: pd.DataFrame, out: Path, colors: dict) -> list[Path]:
    pivot = tables.longbench_pivot(tidy)
    if pivot is None or pivot.empty:
        return []
    datasets = [c for c in pivot.columns if not c.endswith(" avg") and not c.startswith("Avg")]
    averages = [c for c in pivot.columns if c.endswith(" avg") or c.startswith("Avg")]
    return _grouped_bars(pivot, datasets, averages, colors, "LongBench: score per dataset and category averages",
                         "score", out, "longbench_per_dataset")


def longbench_e_bars(tidy: pd.DataFrame, out: Path, colors: dict) -> list[Path]:
    rows = tidy[(tidy["family"] == "longbench-e") & tidy["primary"] & tidy["bucket"].notna()]
    if rows.empty:
        return []
    buckets = sorted(rows["bucket"].unique(), key=lambda b: float("".join(c for c in b.split("-")[0] if c.isdigit())
                                                                  or 0))
    rows = rows.groupby(["model", "bucket"], as_index=False)["value"].mean()  # mean over datasets
    models = sorted(rows["model"].unique())
    width = 0.8 / len(models)
    x = np.arange(len(buckets))
    with plt.rc_context(STYLE | {"axes.grid.axis": "y"}):
        fig, ax = plt.subplots(figsize=(4.5, 3.0), layout="constrained")
        for k, model in enumerate(models):
            values = [rows[(rows["model"] == model) & (rows["bucket"] == b)]["value"].mean() for b in buckets]
            ax.bar(x + (k - (len(models) - 1) / 2) * width, values, width, label=model, color=colors[model])
        ax.set_xticks(x, buckets)
        ax.set_xlabel("LongBench-E length bucket (words)")
        ax.set_ylabel("mean score over datasets")
        ax.set_title("LongBench-E by length bucket")
        fig.legend(*ax.get_legend_handles_labels(), loc="outside upper right", frameon=False)
        return save_figure(fig, out, "longbench_e_per_bucket")


def zeroshot_bars(tidy: pd.DataFrame, out: Path, colors: dict) -> list[Path]:
    """The zero-shot suite in the papers' columns (ccq_eval.analysis.zeroshot): its accuracies in % with their
    average, and its perplexities (a rolling task's column names its protocol), as grouped bars;
    a failed or missing value draws no bar."""
    pivot = zeroshot.zeroshot_pivot(tidy)
    if pivot is None:
        return []
    numbers = pivot.map(lambda v: v if isinstance(v, float) else math.nan)
    accuracy = zeroshot.accuracy_columns(pivot)
    averages = [c for c in accuracy if c == zeroshot.AVERAGE_HEADER]
    perplexity = [c for c in pivot.columns if c not in accuracy and c != zeroshot.AVERAGE_HEADER]
    paths = []
    if accuracy:
        paths += _grouped_bars(numbers, [c for c in accuracy if c not in averages], averages, colors,
                               "Zero-shot accuracy (the GLA / Gated DeltaNet papers' columns)", "accuracy (%)", out,
                               "zeroshot_accuracy")
    if perplexity:
        paths += _grouped_bars(numbers, perplexity, [], colors, "Zero-shot perplexity (lower is better)",
                               "perplexity", out, "zeroshot_perplexity")
    return paths


def recall_bars(tidy: pd.DataFrame, out: Path, colors: dict) -> list[Path]:
    """The recall table (SWDE ... DROP, each set of rules in its own columns) in % with its averages, as grouped
    bars; a failed or missing value draws no bar."""
    pivot = recall.recall_pivot(tidy)
    if pivot is None:
        return []
    numbers = pivot.map(lambda v: v if isinstance(v, float) else math.nan)
    shown = recall.recall_columns(pivot)
    averages = [c for c in shown if c.startswith(recall.AVERAGE_HEADER)]
    return _grouped_bars(numbers, [c for c in shown if c not in averages], averages, colors,
                         "Recall-intensive tasks (Based / JRT): contains", "contains (%)", out, "recall_contains")
