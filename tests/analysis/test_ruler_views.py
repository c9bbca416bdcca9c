"""RULER's own view (table --view ruler), its figures, and `compare` over the RULER tasks, on a small results
folder written here: five RULER tasks of five families at 1K and 2K, 12 samples per length, with accuracies
chosen so that the averages are known by hand (five of RULER's 13 tasks: no effective length); the effective
length on a tidy table of all 13 tasks built here; `compare` on it shows p-values adjusted for their number
(Holm) beside the raw ones."""

from __future__ import annotations

import hashlib
import html
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from ccq_eval.analysis import figures, ruler, stats, tables
from ccq_eval.analysis.formatting import display_task
from ccq_eval.harness import store

LENGTHS = (1024, 2048)
PER_LENGTH = 12
BASE, TWIN, SWEEP = "tiny-gla", "tiny-gla-ccq", "tiny-gla+ccq-lambda1"
# RULER's order: S-NIAH-1, multi-key 1, variable tracking, common words (no depth), SQuAD QA
TASKS = ("ccq_s_niah_1", "ccq_niah_multikey_1", "ccq_ruler_vt", "ccq_ruler_cwe", "ccq_ruler_qa_squad")
NO_DEPTH = {"ccq_ruler_cwe"}
# samples right out of PER_LENGTH, per model, task and length (the first k of each length are right)
RIGHT = {
    # 1K: 100 everywhere; 2K: 100, 75, 100, 50, 100 -> average 85.0, below 85.6: effective length 1K
    BASE: {1024: (12, 12, 12, 12, 12), 2048: (12, 9, 12, 6, 12)},
    # 95.0 at both lengths: at least 2K
    TWIN: {1024: (12, 12, 12, 12, 9), 2048: (12, 12, 12, 12, 9)},
    # 85.0 at 1K, 100 at 2K: below the threshold at 1K, so none, whatever 2K does
    SWEEP: {1024: (12, 12, 12, 3, 12), 2048: (12, 12, 12, 12, 12)},
}
AVERAGES = {BASE: {1024: 100.0, 2048: 85.0}, TWIN: {1024: 95.0, 2048: 95.0}, SWEEP: {1024: 85.0, 2048: 100.0}}


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _samples(task: str, right: dict[int, int]) -> list[dict[str, Any]]:
    """lm-eval's logged samples of one task: docs with length (and depth, but for cwe), acc and acc_<L>."""
    samples = []
    for length in LENGTHS:
        for index in range(PER_LENGTH):
            doc: dict[str, Any] = {"input": f"{task} haystack {length} {index}", "outputs": [f"answer {index}"],
                                   "length": length}
            if task not in NO_DEPTH:
                doc["depth"] = (0.0, 50.0, 100.0)[index % 3]
            score = 100.0 if index < right[length] else 0.0
            response = doc["outputs"][0] if score else "no"
            samples.append({
                "doc_id": len(samples), "doc": doc, "target": doc["outputs"][0], "filter": "none",
                "arguments": [[doc["input"], {"until": [], "max_gen_toks": 8}]],
                "resps": [[response]], "filtered_resps": [response],
                "metrics": ["acc", f"acc_{length}"], "acc": score, f"acc_{length}": score,
                "doc_hash": _hash(json.dumps(doc, indent=2)), "prompt_hash": _hash(doc["input"]),
                "target_hash": _hash(doc["outputs"][0]),
            })
    return samples


def _write_unit(output: Path, model: str, task: str, right: dict[int, int], attach: dict | None) -> None:
    samples = _samples(task, right)
    per_length = {length: 100.0 * right[length] / PER_LENGTH for length in LENGTHS}
    values = {"acc": sum(per_length.values()) / len(per_length)} | {f"acc_{L}": v for L, v in per_length.items()}
    metric_list = [{"metric": name, "aggregation": "mean", "higher_is_better": True} for name in values]
    results = {
        "results": {task: {"alias": task, **{f"{k},none": v for k, v in values.items()}}},
        "group_subtasks": {}, "configs": {task: {"task": task, "metric_list": metric_list}},
        "versions": {task: 1.0}, "n-shot": {task: 0}, "higher_is_better": {task: dict.fromkeys(values, True)},
        "n-samples": {task: {"original": len(samples), "effective": len(samples)}}, "config": {"model": "CUSTOM"},
    }
    meta = {"model": model, "task": task} | ({"spec": {"ccq_attach": attach}} if attach else {})
    store.write_unit(store.unit_dir(output, model, task), results, {task: samples}, meta)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("ruler") / "results"
    attach = {"sweep": "tiny-gla+ccq", "lambda": 1.0, "fields": {}, "baseline": BASE}
    for model, right in RIGHT.items():
        for position, task in enumerate(TASKS):
            _write_unit(output, model, task, {length: right[length][position] for length in LENGTHS},
                        attach if model == SWEEP else None)
    return output


@pytest.fixture(scope="module")
def tidy(results) -> pd.DataFrame:
    return tables.load_tidy(results)


# ------------------------------------------------------------------------------------- the RULER table


def test_blocks_hold_each_task_per_length_and_their_average(tidy):
    blocks = {block.model: block for block in ruler.ruler_blocks(tidy)}
    assert sorted(blocks) == sorted(RIGHT)
    for model, block in blocks.items():
        assert block.tasks == list(TASKS) and block.lengths == list(LENGTHS)
        for position, task in enumerate(TASKS):
            for length in LENGTHS:
                assert block.values.at[task, length] == pytest.approx(100 * RIGHT[model][length][position] / 12)
        assert block.averages == pytest.approx(AVERAGES[model], abs=1e-12)
        assert block.ruler_task_count == 5 and block.average_label == "average (5 of 13 tasks)"


def test_every_ruler_task_has_its_own_name_under_its_family_label():
    from ccq_eval.harness.task_registry import RULER_TASKS
    from ccq_eval.task_families import family_of

    names = [display_task(task) for task in RULER_TASKS]
    assert len(set(names)) == 13
    for task, name in zip(RULER_TASKS, names):
        label = family_of(task).display_label
        assert name.startswith(label) and len(name) > len(label) and "ccq" not in name, (task, name)


def _full_tidy(averages: dict[str, dict[int, float]], drop: tuple[str, ...] = ()) -> pd.DataFrame:
    """A tidy table of RULER's 13 tasks (less `drop`) per model, every task at each length scoring the
    model's average there, so the average is known exactly."""
    from ccq_eval.analysis.tidy import task_family
    from ccq_eval.harness.task_registry import RULER_TASKS

    rows = [{"model": model, "task": task, "family": task_family(task), "length": length, "value": value,
             "primary": True, "depth": math.nan, "bucket": None}
            for model, per_length in averages.items() for task in RULER_TASKS if task not in drop
            for length, value in per_length.items()]
    return pd.DataFrame(rows)


FULL = {BASE: {1024: 100.0, 2048: 85.0}, TWIN: {1024: 95.0, 2048: 95.0}, SWEEP: {1024: 85.0, 2048: 100.0}}


@pytest.mark.parametrize(("threshold", "expected"), [
    (ruler.DEFAULT_THRESHOLD, {BASE: 1024, TWIN: 2048, SWEEP: None}),  # SWEEP: 85.0 at 1K, so none
    (85.0, {BASE: 2048, TWIN: 2048, SWEEP: 2048}),  # an average equal to the threshold passes
    (95.0, {BASE: 1024, TWIN: 2048, SWEEP: None}),
    (100.0, {BASE: 1024, TWIN: None, SWEEP: None}),
])
def test_effective_length_at_thresholds_over_rulers_thirteen_tasks(threshold, expected):
    blocks = ruler.ruler_blocks(_full_tidy(FULL), threshold)
    assert all(block.complete and block.ruler_task_count == 13 for block in blocks)
    assert {block.model: block.effective for block in blocks} == expected


def test_no_effective_length_without_rulers_full_task_set(tidy):
    """An average over fewer than RULER's 13 tasks is not RULER's: it is printed with its task count, and no
    effective length is, however high it is (here every one of these blocks would pass at 85.0)."""
    from ccq_eval.harness.task_registry import RULER_QA_TASKS

    for frame, count in ((tidy, 5), (_full_tidy(FULL, drop=RULER_QA_TASKS), 11)):
        for block in ruler.ruler_blocks(frame, 85.0):
            assert not block.complete and block.ruler_task_count == count
            assert block.effective is None and block.effective_label == "n/a"
        summary = ruler.summary_frame(ruler.ruler_blocks(frame, 85.0))
        assert set(summary["effective length"]) == {"n/a"}
    full = tables.render_tables(_full_tidy(FULL), "markdown", "ruler")
    assert f"| {TWIN} | 13 of 13 | 95.00 | 95.00 | at least 2K |" in full
    assert f"| {SWEEP} | 13 of 13 | 85.00 | 100.00 | below 1K |" in full


def test_effective_length_stops_at_a_failed_or_undefined_average():
    lengths = [1024, 2048, 4096]
    assert ruler.effective_length(lengths, {1024: 90.0, 2048: 90.0, 4096: 90.0}, 85.6) == 4096
    assert ruler.effective_length(lengths, {1024: 90.0, 4096: 90.0}, 85.6) == 1024  # 2K undefined
    assert ruler.effective_length(lengths, {1024: 90.0, 2048: math.nan, 4096: 90.0}, 85.6) == 1024
    assert ruler.effective_length(lengths, {1024: 85.5, 2048: 99.0, 4096: 99.0}, 85.6) is None
    assert ruler.effective_length_label(None, lengths) == "below 1K"
    assert ruler.effective_length_label(2048, lengths) == "2K"
    assert ruler.effective_length_label(4096, lengths) == "at least 4K"


def test_table_view_ruler_prints_the_summary_and_a_block_per_model(tidy):
    text = tables.render_tables(tidy, "markdown", "ruler")
    assert "### RULER average per length and effective length (threshold 85.6)" in text
    assert "| model | tasks | 1K | 2K | effective length |" in text
    assert f"| {BASE} | 5 of 13 | 100.00 | 85.00 | n/a |" in text
    assert f"| {TWIN} | 5 of 13 | 95.00 | 95.00 | n/a |" in text
    assert f"| {SWEEP} | 5 of 13 | 85.00 | 100.00 | n/a |" in text
    assert "effective length: only for a model with all 13 of RULER's tasks" in text
    block = text.split(f"### RULER accuracy per task and length: {BASE}\n\n")[1].split("\n\n")[0].splitlines()
    names = [display_task(task) for task in TASKS]  # in RULER's order
    assert block[2:] == [f"| {names[0]} | 100.00 | 100.00 |", f"| {names[1]} | 100.00 | 75.00 |",
                         f"| {names[2]} | 100.00 | 100.00 |", f"| {names[3]} | 100.00 | 50.00 |",
                         f"| {names[4]} | 100.00 | 100.00 |", "| average (5 of 13 tasks) | 100.00 | 85.00 |"]
    higher = tables.render_tables(_full_tidy(FULL), "markdown", "ruler", threshold=100.0)
    assert f"| {BASE} | 13 of 13 | 100.00 | 85.00 | 1K |" in higher
    assert f"| {TWIN} | 13 of 13 | 95.00 | 95.00 | below 1K |" in higher


def test_table_view_ruler_csv_and_bad_input(tidy):
    text = tables.render_tables(tidy, "csv", "ruler")
    summary = text.split("\n\n")[0].split("\n", 1)[1]
    frame = pd.read_csv(pd.io.common.StringIO(summary), index_col="model")
    assert frame.loc[BASE, "2K"] == pytest.approx(85.0)
    assert pd.isna(frame.loc[TWIN, "effective length"])  # "n/a": not defined over 5 of RULER's 13 tasks
    assert summary.splitlines()[1].endswith(",n/a")
    with pytest.raises(ValueError, match="--threshold 101"):
        tables.render_tables(tidy, "markdown", "ruler", threshold=101)
    with pytest.raises(ValueError, match="no per-length value of a RULER task"):
        tables.render_tables(tidy[tidy["family"] == "ppl"], "markdown", "ruler")


# ------------------------------------------------------------------------------------------- figures


@pytest.fixture
def drawn(monkeypatch):
    """(stem, figure) of every figure a drawing function saves, kept open."""
    kept = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, out, stem: kept.append((stem, fig)) or [out / stem])
    yield kept
    for _, fig in kept:
        figures.plt.close(fig)


def test_figures_per_family_and_heatmaps_per_model(drawn, tidy, tmp_path):
    figures.draw_all(tidy, tmp_path)
    stems = {stem: fig for stem, fig in drawn}
    for stem in ("sniah_accuracy_vs_length", "niah_accuracy_vs_length", "ruler_vt_accuracy_vs_length",
                 "ruler_aggregation_accuracy_vs_length", "ruler_qa_accuracy_vs_length",
                 *(f"ruler_heatmap_{figures.safe_name(model)}" for model in RIGHT)):
        assert stem in stems, (stem, sorted(stems))
    # the heatmap's rows: the tasks, then the average; its values are the table's
    image = stems[f"ruler_heatmap_{figures.safe_name(BASE)}"].axes[0].get_images()[0].get_array()
    assert np.asarray(image)[-1].tolist() == [100.0, 85.0]
    assert np.asarray(image)[3].tolist() == [100.0, 50.0]  # RULER cwe
    title = stems[f"ruler_heatmap_{figures.safe_name(BASE)}"].axes[0].get_title()
    assert "no effective length: 5 of 13 RULER tasks" in title and "effective length 1K" not in title


def test_line_plot_legends_lie_outside_every_axes(drawn, tidy, tmp_path):
    figures.draw_all(tidy, tmp_path)
    checked = 0
    for stem, fig in drawn:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        for legend in legends:
            box = legend.get_window_extent(renderer)
            for ax in fig.axes:
                if ax.get_visible() and ax.get_lines():
                    assert not box.overlaps(ax.get_window_extent(renderer)), stem
            checked += 1
    assert checked >= 6  # five families' curves and the sweep's curves


def test_figures_are_written(tidy, tmp_path):
    one_model = tidy[tidy["model"] == BASE]
    paths = figures.accuracy_curves(one_model[one_model["family"] == "niah"], tmp_path, figures.model_colors([BASE]))
    paths += figures.ruler_heatmaps(one_model, tmp_path)
    stems = ("niah_accuracy_vs_length", f"ruler_heatmap_{BASE}")
    assert sorted(path.name for path in paths) == sorted(f"{stem}.{kind}" for stem in stems for kind in ("png", "pdf"))
    assert all(path.read_bytes()[:4] in (b"\x89PNG", b"%PDF") for path in paths)


# ------------------------------------------------------------------------------------------- compare


@pytest.fixture(scope="module")
def compared(results) -> list[tuple[str, str, pd.DataFrame]]:
    units = store.load_results(results)
    pairs = stats.comparison_pairs(units)
    assert pairs == [(BASE, TWIN), (BASE, SWEEP)]  # the twin, then the --ccq-attach sweep's lambda 1
    return [(base, var, stats.compare_models(units, base, var, n_boot=200)) for base, var in pairs]


def test_compare_pairs_every_ruler_task_sample_by_sample(compared):
    for _, _, frame in compared:
        assert set(frame["task"]) == set(TASKS)
        for task in TASKS:
            rows = frame[frame["task"] == task].set_index("length")
            assert list(rows.index) == ["all", 1024, 2048]
            assert rows["n"].tolist() == [24, 12, 12] and set(rows["pairing"]) == {"doc_hash"}
            assert (rows["unpaired"] == 0).all()
    twin = compared[0][2].set_index(["task", "length"])
    # cwe at 2K: the baseline answers 6 of 12, the twin all 12: b = 0, c = 6, p = 2 / 2^6
    assert twin.loc[("ccq_ruler_cwe", 2048), "delta"] == pytest.approx(50.0)
    assert twin.loc[("ccq_ruler_cwe", 2048), "test"] == "McNemar exact (b=0, c=6)"
    assert twin.loc[("ccq_ruler_cwe", 2048), "p_value"] == pytest.approx(2 / 2**6)


def _markdown_row(text: str, task: str, length: str) -> dict[str, str]:
    """The first row of `task` at `length` in a markdown comparison, by column head."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"| {display_task(task)} | {length} |"))
    header = next(lines[i] for i in range(at, -1, -1) if lines[i].startswith("| task |"))
    def cells(line: str) -> list[str]:
        return [cell.strip() for cell in line.strip("|").split("|")]

    return dict(zip(cells(header), cells(lines[at])))


def test_compare_output_shows_holm_adjusted_and_raw_p_values(compared):
    text = stats.render_comparisons(compared, "markdown")
    assert text.count("| p (Holm) | p (raw) |") == 2 and "over a family of 30 p-values" in text
    row = _markdown_row(text, "ccq_ruler_cwe", "2048")  # the twin's, printed first
    # the 30 rows' p-values: 0.0039 (lambda 1 loses 9 cwe answers at 1K), then twice 0.03125 (the twin's cwe,
    # at 2K and pooled): Holm gives the second smallest max(30 * 0.0039, 29 * 0.03125) = 0.90625
    assert float(row["p (Holm)"]) == pytest.approx(0.90625, abs=5e-4)
    assert float(row["p (raw)"]) == pytest.approx(2 / 2**6, abs=5e-4)
    assert row["sig"] == "" and row["verdict"] == "not significant"  # raw p < 0.05, adjusted not: no star
    raw = stats.render_comparisons(compared, "markdown", p_adjust="none")
    row = _markdown_row(raw, "ccq_ruler_cwe", "2048")
    assert float(row["p_value"]) == pytest.approx(2 / 2**6, abs=5e-4)
    assert row["sig"] == "*" and row["verdict"] == "variant better" and "p (raw)" not in raw


def test_compare_summary_has_a_column_per_ruler_task_in_ruler_order(compared):
    text = stats.render_summary(compared)
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines[0] == "| comparison | " + " | ".join(display_task(task) for task in TASKS) + " |"
    twin = next(line for line in lines if line.startswith(f"| {TWIN} vs {BASE} |"))
    # 10 cells; the smallest raw p is the twin's pooled cwe, 0.03125: Holm 10 * 0.03125
    assert "p = 0.31 (Holm; raw 0.031)" in twin
    assert "S-NIAH and RULER tasks: all lengths pooled" in text and "over a family of 10 p-values" in text


# -------------------------------------------------------------------------------------------- report


def test_report_shows_the_ruler_view_adjusted_comparisons_and_ruler_samples(results):
    from ccq_eval.analysis import report

    page = report.build_report(results, figure_paths=[], n_boot=200)
    assert "<h3>RULER average per length and effective length (threshold 85.6)</h3>" in page
    for model in RIGHT:
        assert f"<h3>RULER accuracy per task and length: {html.escape(model)}</h3>" in page
    assert "<td>at least 2K</td>" not in page and "<td>below 1K</td>" not in page  # 5 of 13 tasks: none
    assert "<th>p (Holm)</th><th>p (raw)</th>" in page and "Holm&#x27;s step-down method over a family of 30" in page
    # the sample browser lists the failures of every RULER family, not S-NIAH's alone: cwe (no depth) one
    # cell per length, the others one per (length, depth) (samples 9, 10 and 11 fail: one per depth)
    cwe = f'data-model="{BASE}" data-task="ccq_ruler_cwe" data-length="2048" data-depth="">'
    assert cwe in page
    assert f"{display_task('ccq_ruler_cwe')} · 2K: 6 of 12 failed" in page.split(cwe)[1].split("</summary>")[0]
    for model, task, length in ((BASE, "ccq_niah_multikey_1", 2048), (TWIN, "ccq_ruler_qa_squad", 1024)):
        for depth in ("0", "50", "100"):
            cell = f'data-model="{model}" data-task="{task}" data-length="{length}" data-depth="{depth}">'
            assert "1 of 4 failed" in page.split(cell)[1].split("</summary>")[0], (model, task, depth)


# ------------------------------------------------------------------------------------- the command line
def test_cli_table_ruler_threshold_and_compare_p_adjust(results):
    """`table --view ruler --threshold` and `compare --p-adjust` reach the analysis functions."""
    from typer.testing import CliRunner

    from ccq_eval import cli

    runner = CliRunner()
    default = runner.invoke(cli.app, ["table", str(results), "--view", "ruler"])
    strict = runner.invoke(cli.app, ["table", str(results), "--view", "ruler", "--threshold", "100"])
    assert default.exit_code == strict.exit_code == 0, default.output + strict.output
    assert "(threshold 85.6)" in default.output and "(threshold 100)" in strict.output
    assert default.output != strict.output  # the title and the note name the threshold
    bad = runner.invoke(cli.app, ["table", str(results), "--view", "ruler", "--threshold", "101"])
    assert bad.exit_code == 2 and "--threshold 101" in bad.output
    holm = runner.invoke(cli.app, ["compare", str(results), "--baseline", BASE, "--variant", TWIN])
    raw = runner.invoke(cli.app, ["compare", str(results), "--baseline", BASE, "--variant", TWIN, "--p-adjust", "none"])
    assert holm.exit_code == raw.exit_code == 0, holm.output + raw.output
    assert "p (Holm)" in holm.output and "p (Holm)" not in raw.output
