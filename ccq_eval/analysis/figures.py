"""Paper-style figures from the tidy results table (PNG and PDF, matplotlib Agg).

- S-NIAH depth x length heatmaps, one panel per model, one figure per S-NIAH task;
- accuracy vs length of each RULER family (S-NIAH, NIAH with competitors, variable tracking,
  common / frequent words, QA): one figure per family, one panel per task, models overlaid;
- RULER's task x length heatmap, one figure per model, with the average over its tasks per length and
  its effective length (ccq_eval.analysis.ruler), when the results hold RULER tasks beyond S-NIAH;
- perplexity vs length for both protocols: the truncated-document sweep (ppl at each
  evaluated length) and the position-bucketed curve (ppl of each position bucket);
- LongBench scores per dataset as grouped bars (and LongBench-E per bucket);
- the zero-shot suite's accuracies (the papers' columns) with their average, and its perplexities, as
  grouped bars (ccq_eval.analysis.bar_figures, with the LongBench bars);
- score vs lambda of each `run --ccq-attach` sweep, a panel per task and a curve per length.

Colour-blind safe (ccq_eval.analysis.figure_style): a model's family (its name without a trailing "-ccq")
owns one hue of the Okabe-Ito palette, so the same model gets the same colour in every figure; the CCQ
variant takes the full colour, solid lines and filled markers, the baseline a lighter shade, dashed lines
and hollow markers. Every model also has its own marker shape and size, so curves that lie on top of each
other stay visible. Heatmaps use the sequential, colour-blind-safe cividis map with cell values
in a contrasting colour. Legends of line plots sit below the panels, outside every axes, so that they
never cover a marker.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from ccq_eval.analysis import ruler
from ccq_eval.analysis.bar_figures import longbench_bars, longbench_e_bars, recall_bars, zeroshot_bars
from ccq_eval.analysis.figure_style import (  # noqa: F401  (re-exported: the figures' look)
    HEATMAP_CMAP,
    MARKERS,
    PALETTE,
    STYLE,
    is_ccq,
    log_y_axis,
    model_colors,
    model_family,
    plt,
    safe_name,
    save_figure,
)
from ccq_eval.analysis.formatting import display_task, length_label
from ccq_eval.analysis.sweeps import ccq_sweep_points
from ccq_eval.harness.store import ResultsError
from ccq_eval.task_families import FAMILY_BY_NAME

# Panel titles of tasks whose display name is an id (ccq_eval.analysis.formatting.display_task).
PANEL_TITLES = {"ppl_sweep": "truncated-document sweep", "ppl_buckets": "position buckets"}


def _line_style(model: str, index: int, count: int) -> dict:
    """The index-th of `count` overlaid curves: its own marker, drawn larger and lower the earlier it
    comes, so identical curves show as nested markers instead of hiding each other; CCQ variants solid
    and filled, baselines dashed and hollow."""
    ccq = is_ccq(model)
    return {"linestyle": "-" if ccq else (0, (4, 2)), "marker": MARKERS[index % len(MARKERS)],
            "markersize": 4 + 2.5 * (count - 1 - index), "linewidth": 1.5, "zorder": 2 + index,
            "markerfacecolor": None if ccq else "white", "markeredgewidth": 1.2,
            "clip_on": False}  # a marker at 0 % or 100 % is drawn whole, not cut by the axes


def panel_title(task: str) -> str:
    """A task's display name with words for ids: 'ccq_niah_multikey_1' -> 'NIAH multikey 1'."""
    name = display_task(task)
    return PANEL_TITLES.get(name, name).replace("_", " ")


def _text_color(rgba) -> str:
    """Black on light cells, white on dark ones (relative luminance of the cell's colour)."""
    red, green, blue = rgba[:3]
    return "black" if 0.2126 * red + 0.7152 * green + 0.0722 * blue > 0.45 else "white"


def length_ticks(ax: plt.Axes, lengths: Iterable[float]) -> None:
    lengths = sorted({int(x) for x in lengths})
    # Doubling lengths (1K, 2K, 4K, ...) read best on a log axis; evenly spaced ones (position
    # buckets every 2K) would crowd its right end, so they stay linear.
    ratios = sorted(b / a for a, b in itertools.pairwise(lengths) if a > 0)
    if ratios and ratios[len(ratios) // 2] >= 1.5:
        ax.set_xscale("log", base=2)
    ax.set_xticks(lengths)
    ax.set_xticklabels([length_label(x) for x in lengths])
    ax.minorticks_off()


def panel_grid(count: int, width: float = 3.2, height: float = 2.6, max_cols: int = 4, min_width: float = 6.4):
    """A grid of `count` panels; at least `min_width` inches wide, so that one panel still has room for
    the figure's title and a legend of several models."""
    cols = min(count, max_cols)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(width * cols, min_width), height * rows + 0.6), squeeze=False,
                             layout="constrained")
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:count])


def _figure_legend(fig: plt.Figure, axes: Sequence[plt.Axes], max_columns: int = 4) -> None:
    """One legend for all panels, below them and outside every axes (constrained layout keeps room for
    it), so it never covers a marker; every label any panel draws, in the order they first appear."""
    entries: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        fig.legend([_legend_key(handle) for handle in entries.values()], list(entries), loc="outside lower center",
                   ncol=min(len(entries), max_columns), frameon=False)


LEGEND_MARKER_SIZE = 6.0


def _legend_key(handle: object) -> object:
    """A curve's legend key at one marker size for every model (the panels nest markers by size; in the
    legend that would make the first models' keys overlap their neighbours)."""
    if not isinstance(handle, Line2D):
        return handle
    return Line2D([], [], color=handle.get_color(), linestyle=handle.get_linestyle(), linewidth=handle.get_linewidth(),
                  marker=handle.get_marker(), markersize=LEGEND_MARKER_SIZE,
                  markerfacecolor=handle.get_markerfacecolor(), markeredgecolor=handle.get_markeredgecolor(),
                  markeredgewidth=handle.get_markeredgewidth())


def _score_limit(rows: pd.DataFrame) -> float:
    """Our RULER and LongBench tasks score in percent; other tasks in 0-1 unless a value says otherwise."""
    if rows["family"].isin([*ruler.RULER_FAMILY_NAMES, "longbench", "longbench-e"]).all():
        return 100.0
    return 1.0 if rows["value"].max() <= 1.0 else 100.0


def sniah_heatmaps(tidy: pd.DataFrame, out: Path) -> list[Path]:
    rows = tidy[(tidy["family"] == "s-niah") & tidy["primary"] & tidy["length"].notna() & tidy["depth"].notna()]
    paths = []
    for task, task_rows in rows.groupby("task", sort=True):
        models = sorted(task_rows["model"].unique())
        vmax = _score_limit(task_rows)
        with plt.rc_context(STYLE | {"axes.grid": False}):
            fig, axes = panel_grid(len(models), width=3.4, height=2.8)
            image = None
            for ax, model in zip(axes, models):
                grid = task_rows[task_rows["model"] == model].pivot_table(
                    index="depth", columns="length", values="value", aggfunc="first")
                grid = grid.sort_index().reindex(sorted(grid.columns), axis=1)
                image = ax.imshow(grid.to_numpy(dtype=float), cmap=HEATMAP_CMAP, vmin=0, vmax=vmax,
                                  aspect="auto", interpolation="nearest")
                ax.set_xticks(range(grid.shape[1]), [length_label(c) for c in grid.columns])
                ax.set_yticks(range(grid.shape[0]), [f"{d:g}%" for d in grid.index])
                ax.set_xlabel("context length (tokens)")
                ax.set_ylabel("needle depth")
                ax.set_title(model)
                _heatmap_labels(ax, image, grid.to_numpy(dtype=float), vmax)
            fig.suptitle(f"{display_task(task)}: accuracy by needle depth and context length")
            fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy")
            paths += save_figure(fig, out, f"sniah_heatmap_{safe_name(display_task(task))}")
    return paths


def _heatmap_labels(ax: plt.Axes, image, values: np.ndarray, vmax: float) -> None:
    """Each cell's value written on it in a colour that contrasts with the cell."""
    for (i, j), value in np.ndenumerate(values):
        if not math.isnan(value):
            ax.text(j, i, f"{value:.0f}" if vmax > 1 else f"{value:.2f}", ha="center", va="center", fontsize=8,
                    color=_text_color(image.cmap(image.norm(value))))


def ruler_heatmaps(tidy: pd.DataFrame, out: Path, threshold: float = ruler.DEFAULT_THRESHOLD) -> list[Path]:
    """RULER's task x length accuracy, one figure per model with the average row beneath its tasks and the
    effective length at `threshold` in the title (a model without RULER's 13 tasks has none: the title says how
    many it has); drawn when the results hold RULER tasks beyond S-NIAH."""
    if not set(ruler.ruler_values(tidy)["family"]) - {"s-niah"}:
        return []
    paths = []
    for block in ruler.ruler_blocks(tidy, threshold):
        values = np.vstack([block.values.to_numpy(dtype=float),
                            [block.averages.get(length, math.nan) for length in block.lengths]])
        labels = [panel_title(task) for task in block.tasks] + [block.average_label]
        with plt.rc_context(STYLE | {"axes.grid": False}):
            fig, ax = plt.subplots(figsize=(max(5.0, 2.8 + 0.7 * len(block.lengths)), 1.4 + 0.3 * len(labels)),
                                   layout="constrained")
            image = ax.imshow(values, cmap=HEATMAP_CMAP, vmin=0, vmax=100, aspect="auto", interpolation="nearest")
            ax.set_xticks(range(len(block.lengths)), [length_label(x) for x in block.lengths])
            ax.set_yticks(range(len(labels)), labels)
            ax.axhline(len(block.tasks) - 0.5, color="white", linewidth=2)
            ax.set_xlabel("context length (tokens)")
            _heatmap_labels(ax, image, values, 100.0)
            effective = (f"effective length {block.effective_label} (average at or above {threshold:g})"
                         if block.complete else
                         f"no effective length: {block.ruler_task_count} of {ruler.RULER_TASK_COUNT} RULER tasks")
            ax.set_title(f"{block.model}: RULER accuracy by task and length\n{effective}")
            fig.colorbar(image, ax=ax, shrink=0.8, label="accuracy")
            paths += save_figure(fig, out, f"ruler_heatmap_{safe_name(block.model)}")
    return paths


def _curves(rows: pd.DataFrame, out: Path, stem: str, title: str, ylabel: str, colors: dict,
            log_y: bool = False, score: bool = False, xlabel: str = "context length (tokens)") -> list[Path]:
    tasks = sorted(rows["task"].unique())
    with plt.rc_context(STYLE):
        fig, axes = panel_grid(len(tasks))
        for ax, task in zip(axes, tasks):
            task_rows = rows[rows["task"] == task]
            models = sorted(task_rows["model"].unique())
            for index, model in enumerate(models):
                curve = task_rows[task_rows["model"] == model].sort_values("length")
                ax.plot(curve["length"].astype(float), curve["value"], color=colors[model], label=model,
                        **_line_style(model, index, len(models)))
            length_ticks(ax, task_rows["length"])
            ax.set_title(panel_title(task))
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            if log_y:
                log_y_axis(ax)
            if score:
                ax.set_ylim(-0.03 * _score_limit(rows), 1.03 * _score_limit(rows))
        _figure_legend(fig, axes)
        fig.suptitle(title)
        return save_figure(fig, out, stem)


def accuracy_figure(family: str) -> tuple[str, str]:
    """(file stem, title) of a RULER family's accuracy-vs-length figure."""
    if family == "s-niah":
        return "sniah_accuracy_vs_length", "S-NIAH accuracy vs context length"
    title = FAMILY_BY_NAME[family].title
    title = title if title.startswith("RULER") else f"RULER {title}"
    return f"{safe_name(family.replace('-', '_'))}_accuracy_vs_length", f"{title}: accuracy vs context length"


def accuracy_curves(tidy: pd.DataFrame, out: Path, colors: dict) -> list[Path]:
    """Accuracy vs length, one figure per RULER family with per-length values (a panel per task)."""
    rows = tidy[tidy["family"].isin(ruler.RULER_FAMILY_NAMES) & tidy["primary"] & tidy["length"].notna()
                & tidy["depth"].isna() & tidy["bucket"].isna()]
    paths = []
    for family in ruler.RULER_FAMILY_NAMES:
        family_rows = rows[rows["family"] == family]
        if not family_rows.empty:
            stem, title = accuracy_figure(family)
            paths += _curves(family_rows, out, stem, title, "accuracy", colors, score=True)
    return paths


def perplexity_curves(tidy: pd.DataFrame, out: Path, colors: dict) -> list[Path]:
    paths = []
    ppl = tidy[tidy["family"] == "ppl"]
    sweep = ppl[ppl["primary"] & ppl["length"].notna() & ppl["depth"].isna() & ppl["bucket"].isna()]
    if not sweep.empty:
        paths += _curves(sweep, out, "ppl_vs_length_sweep",
                         "Perplexity vs length\n(truncated-document sweep: first L tokens of each document)",
                         "perplexity", colors, log_y=True)
    position = ppl[ppl["primary"] & ppl["bucket"].notna()]
    if not position.empty:
        paths += _curves(position, out, "ppl_vs_position_buckets",
                         "Perplexity by token position\n(position buckets of long blocks, one pass per block)",
                         "perplexity of bucket", colors, log_y=True,
                         xlabel="token position (end of bucket)")
    return paths


def _sweep_panel_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """One task's primary values per (model, length) without depth or bucket; tasks without per-length
    values (LongBench) keep their overall value, as one curve."""
    rows = rows[rows["primary"] & rows["depth"].isna() & rows["bucket"].isna()]
    per_length = rows[rows["length"].notna()]
    return per_length if not per_length.empty else rows


def sweep_panels(tidy: pd.DataFrame, members: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """task -> the rows of one sweep's panel (members: its model and lambda points): the tasks evaluated at
    two lambdas or more (a baseline's other tasks, with its lambda = 0 point only, draw no panel)."""
    rows = tidy.merge(members[["model", "lambda"]], on="model")
    panels = {task: _sweep_panel_rows(task_rows) for task, task_rows in rows.groupby("task", sort=True)}
    return {task: task_rows for task, task_rows in panels.items() if task_rows["lambda"].nunique() >= 2}


def ccq_sweep_curves(tidy: pd.DataFrame, out: Path) -> list[Path]:
    """One figure per --ccq-attach sweep with two or more lambdas: score vs lambda, a panel per task
    and a curve per context length (lambda = 0 is the plain checkpoint)."""
    points = ccq_sweep_points(tidy)
    paths = []
    for sweep, members in points.groupby("sweep", sort=True):
        if members["lambda"].nunique() < 2:
            continue
        panels = sweep_panels(tidy, members)
        if not panels:
            continue
        lengths = sorted({int(x) for p in panels.values() for x in p["length"].dropna()})
        shade = {length: plt.get_cmap(HEATMAP_CMAP)(0.85 * i / max(len(lengths) - 1, 1))
                 for i, length in enumerate(lengths)}
        with plt.rc_context(STYLE):
            fig, axes = panel_grid(len(panels))
            for ax, (task, task_rows) in zip(axes, panels.items()):
                curves = task_rows.groupby(task_rows["length"].fillna(-1), sort=True)
                for index, (length, curve) in enumerate(curves):
                    curve = curve.sort_values("lambda")
                    label = "all" if length < 0 else f"{length_label(length)} tokens"
                    ax.plot(curve["lambda"], curve["value"], marker=MARKERS[index % len(MARKERS)], label=label,
                            color=shade.get(int(length), PALETTE[0]), linewidth=1.5, markersize=5)
                family = task_rows["family"].iloc[0]
                # a perplexity: the ppl family's, or a primary metric where lower is better (wikitext's)
                direction = task_rows.get("higher_is_better")
                perplexity = family == "ppl" or (direction is not None and direction.eq(False).all())
                ax.set_title(panel_title(task))
                ax.set_xlabel("lambda (constant gate)")
                ax.set_ylabel("accuracy" if family in ruler.RULER_FAMILY_NAMES else
                              "perplexity" if perplexity else "score")
                ticks = sorted(members["lambda"].unique())
                ax.set_xticks(ticks, [f"{lam:g}" for lam in ticks])
                if perplexity:
                    log_y_axis(ax)
                else:
                    ax.set_ylim(-0.03 * _score_limit(task_rows), 1.03 * _score_limit(task_rows))
            _figure_legend(fig, axes)
            fig.suptitle(f"{sweep}: score vs lambda (CCQ attached training-free, constant gate)")
            paths += save_figure(fig, out, f"ccq_sweep_{safe_name(sweep)}")
    return paths


def draw_all(tidy: pd.DataFrame, out: Path, threshold: float = ruler.DEFAULT_THRESHOLD) -> list[Path]:
    """Every figure the results support, as PNG and PDF under `out`; returns their paths. `threshold`: the
    RULER heatmaps' effective-length threshold (% accuracy)."""
    out = Path(out)
    for folder in (out, *out.parents):
        if folder.exists() and not folder.is_dir():
            raise ResultsError(f"--output {out}: {folder} is a file, not a folder; give a folder for the "
                               "figures")
    out.mkdir(parents=True, exist_ok=True)
    colors = model_colors(sorted(tidy["model"].unique()))
    tidy = tidy[np.isfinite(tidy["value"])]  # a failed (NaN / inf) value has no point; the tables show it
    paths = []
    paths += sniah_heatmaps(tidy, out)
    paths += accuracy_curves(tidy, out, colors)
    paths += ruler_heatmaps(tidy, out, threshold)
    paths += perplexity_curves(tidy, out, colors)
    paths += longbench_bars(tidy, out, colors)
    paths += longbench_e_bars(tidy, out, colors)
    paths += zeroshot_bars(tidy, out, colors)
    paths += recall_bars(tidy, out, colors)
    paths += ccq_sweep_curves(tidy, out)
    if not paths:
        raise ResultsError(
            "nothing to draw: the results hold no per-length RULER (S-NIAH, ...) or perplexity values, no "
            "LongBench scores, no zero-shot accuracies and no recall scores (figures need the samples_<task>.jsonl "
            "logs of RULER / perplexity runs)"
        )
    return paths
