"""`ccq-eval table / compare / report` on a real zero-shot run: tiny-gla, tiny-gla-ccq and tiny-gdn over the
suite's fixtures (tests/fixtures/zeroshot), run once for the module through the CLI, plus tiny-gla's wikitext
scored with the state carried. The paper table's cells equal the units' results.json values (accuracies in
%), its Avg. the mean of the averaged columns, its Wiki. ppl column names the protocol; compare's rows equal
McNemar / sign tests, bootstraps and Holm's adjustment computed here from the samples files."""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval.analysis import stats
from ccq_eval.task_families import ZEROSHOT_AVERAGED, ZEROSHOT_PAPER_COLUMNS, ZEROSHOT_TASKS

pytestmark = pytest.mark.slow  # the run scores the suite's fixtures with three models (about a minute)

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "zeroshot"
MODELS = ("tiny-gla", "tiny-gla-ccq", "tiny-gdn")
HFLM_WIKI, CARRY_WIKI = "Wiki. ppl (HFLM windows)", "Wiki. ppl (state carried)"
N_BOOT = 2000


def invoke(*args: object):
    return CliRunner().invoke(cli.app, [str(arg) for arg in args])


# lm-eval's standard errors off: they do not enter the tables, and LAMBADA's perplexity would bootstrap its
# standard error in a pool of forked processes.
NO_STDERR = ("--lm-eval-arg", "bootstrap_iters=0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """"suite": the three models over the whole suite (with the run's own table, figures and report);
    "mixed": tiny-gla's wikitext scored with the state carried beside tiny-gla-ccq's in HFLM windows;
    "sweep": tiny-gla with CCQ attached at lambda 1 (and its plain self), on wikitext and piqa."""
    root = tmp_path_factory.mktemp("zeroshot")
    models = [arg for model in MODELS for arg in ("-m", model)]
    result = invoke("run", *models, "-t", "zeroshot", "--zeroshot-dir", FIXTURES, "-o", root / "suite", *NO_STDERR)
    assert result.exit_code == 0, result.output  # includes the run's table, figures and report
    result = invoke("run", "-m", "tiny-gla", "-t", "wikitext", "--rolling-windows", "carry", "--zeroshot-dir",
                    FIXTURES, "-o", root / "carry", "--no-report", *NO_STDERR)
    assert result.exit_code == 0, result.output
    result = invoke("run", "-m", "tiny-gla", "--ccq-attach", "lambda=0,1", "-t", "wikitext", "-t", "piqa",
                    "--zeroshot-dir", FIXTURES, "-o", root / "sweep", "--no-report", *NO_STDERR)
    assert result.exit_code == 0, result.output
    mixed = root / "mixed"
    shutil.copytree(root / "carry" / "tiny-gla" / "wikitext", mixed / "tiny-gla" / "wikitext")
    shutil.copytree(root / "suite" / "tiny-gla-ccq" / "wikitext", mixed / "tiny-gla-ccq" / "wikitext")
    return {"suite": root / "suite", "mixed": mixed, "sweep": root / "sweep"}


def stored(run: Path, model: str, task: str, metric: str) -> float:
    results = json.loads((run / model / task / "results.json").read_text())
    return float(results["results"][task][f"{metric},none"])


def samples(run: Path, model: str, task: str) -> list[dict]:
    lines = (run / model / task / f"samples_{task}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def paper_csv(run: Path) -> pd.DataFrame:
    result = invoke("table", run, "--format", "csv")
    assert result.exit_code == 0, result.output
    [section] = [part for part in result.output.split("\n\n") if part.startswith("# Zero-shot")]
    return pd.read_csv(io.StringIO(section.split("\n", 1)[1]), index_col="model")


def test_paper_table_cells_are_the_units_results(runs):
    table = paper_csv(runs["suite"])
    expected_columns = [HFLM_WIKI if header == "Wiki. ppl" else header for _, _, header in ZEROSHOT_PAPER_COLUMNS]
    assert list(table.columns) == [*expected_columns, "Avg."] and sorted(table.index) == sorted(MODELS)
    for model in MODELS:
        for task, metric, header in ZEROSHOT_PAPER_COLUMNS:
            value = stored(runs["suite"], model, task, metric)
            shown = table.at[model, HFLM_WIKI if header == "Wiki. ppl" else header]
            assert shown == pytest.approx(100 * value if metric in ("acc", "acc_norm") else value, rel=1e-12)
        averaged = [100 * stored(runs["suite"], model, task, metric) for task, metric in ZEROSHOT_AVERAGED]
        assert table.at[model, "Avg."] == pytest.approx(math.fsum(averaged) / len(averaged), rel=1e-12)


def test_paper_table_says_the_protocol_in_markdown_and_latex(runs):
    markdown = invoke("table", runs["suite"]).output
    header = next(line for line in markdown.splitlines() if line.startswith("| model | Wiki."))
    assert f"| {HFLM_WIKI} | LMB. ppl | LMB. acc |" in header and header.endswith("| Avg. |")
    assert "HFLM windows: lm-eval HFLM's disjoint windows" in markdown and "Avg.: mean of the 8" in markdown
    line = next(line for line in markdown.splitlines() if line.startswith("| tiny-gla |"))
    assert f"| {100 * stored(runs['suite'], 'tiny-gla', 'piqa', 'acc'):.2f} |" in line
    latex = invoke("table", runs["suite"], "--format", "latex").output
    assert r"Hella. acc\_n" in latex and "Wiki. ppl (HFLM windows)" in latex


def test_models_scored_by_different_protocols_get_a_column_each(runs):
    table = paper_csv(runs["mixed"])
    assert list(table.columns) == [HFLM_WIKI, CARRY_WIKI, "Avg."]
    assert table.at["tiny-gla", CARRY_WIKI] == pytest.approx(stored(runs["mixed"], "tiny-gla", "wikitext",
                                                                    "word_perplexity"), rel=1e-12)
    assert table.at["tiny-gla-ccq", HFLM_WIKI] == pytest.approx(stored(runs["mixed"], "tiny-gla-ccq", "wikitext",
                                                                       "word_perplexity"), rel=1e-12)
    assert math.isnan(table.at["tiny-gla", HFLM_WIKI]) and math.isnan(table.at["tiny-gla-ccq", CARRY_WIKI])
    compared = invoke("compare", runs["mixed"], "--n-boot", 200).output
    assert "| word_perplexity (state carried vs HFLM windows) |" in compared


def _expected_row(run: Path, baseline: str, variant: str, task: str, metric: str) -> dict:
    """The row compare should print, computed from the two models' samples files: pairs by doc_hash, the
    statistic, the test's p-value (scipy), and the seeded paired bootstrap's interval."""
    from scipy.stats import binomtest

    by_hash = {s["doc_hash"]: s for s in samples(run, variant, task)}
    pairs = [(s, by_hash[s["doc_hash"]]) for s in samples(run, baseline, task)]
    base = np.array([b[metric] for b, _ in pairs], dtype=float)
    var = np.array([v[metric] for _, v in pairs], dtype=float)
    if metric in ("acc", "acc_norm"):
        def statistic(x):
            return x.mean(axis=-1)
        b, c = int(np.sum((base == 1) & (var == 0))), int(np.sum((base == 0) & (var == 1)))
        test = f"McNemar exact (b={b}, c={c})"
    elif metric == "perplexity":  # lambada: per-document log-likelihood, exp(-mean)
        def statistic(x):
            return np.exp(-x.mean(axis=-1))
        b, c = int(np.sum(var > base)), int(np.sum(var < base))
        test = f"sign test (+{b}/-{c})"
    else:  # wikitext's word_perplexity: per-document (log-likelihood, words), exp(-sum ll / sum words)
        def statistic(x):
            return np.exp(-x[..., 0].sum(axis=-1) / x[..., 1].sum(axis=-1))
        diffs = var[:, 0] / var[:, 1] - base[:, 0] / base[:, 1]
        b, c = int(np.sum(diffs > 0)), int(np.sum(diffs < 0))
        test = f"sign test (+{b}/-{c})"
    p_value = binomtest(min(b, c), b + c, 0.5).pvalue if b + c else 1.0
    rng = np.random.default_rng(stats._group_seed(0, task, "all", metric))
    index = rng.integers(0, len(pairs), size=(N_BOOT, len(pairs)))
    low, high = np.quantile(statistic(var[index]) - statistic(base[index]), [0.025, 0.975])
    return {"n": len(pairs), "baseline": float(statistic(base)), "variant": float(statistic(var)),
            "ci_low": low, "ci_high": high, "p_value": p_value, "test": test}


def _holm(p_values: list[float]) -> list[float]:
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def test_compare_rows_equal_tests_computed_from_the_samples(runs):
    result = invoke("compare", runs["suite"], "--baseline", "tiny-gla", "--variant", "tiny-gdn", "--format", "csv",
                    "--n-boot", N_BOOT)
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(io.StringIO(result.output))
    wanted = [(task, metric) for task, metric, _ in ZEROSHOT_PAPER_COLUMNS]
    assert sorted(zip(frame["task"], frame["metric"])) == sorted(wanted)  # LAMBADA twice, each task's metric
    assert (frame["length"] == "all").all() and (frame["pairing"] == "doc_hash").all()
    for row in frame.itertuples():
        expected = _expected_row(runs["suite"], "tiny-gla", "tiny-gdn", row.task, row.metric)
        assert row.n == expected["n"] and row.test == expected["test"], row
        for column in ("baseline", "variant", "ci_low", "ci_high", "p_value"):
            assert getattr(row, column) == pytest.approx(expected[column], rel=1e-9, abs=1e-12), (row, column)
        protocol = row.protocol if isinstance(row.protocol, str) else None  # csv: "" reads as NaN
        assert protocol == ("HFLM windows" if row.task == "wikitext" else None), row
    assert frame["p_adjusted"].tolist() == pytest.approx(_holm(frame["p_value"].tolist()), rel=1e-12)
    assert (frame["p_adjust"] == "holm").all() and (frame["p_family"] == len(frame)).all()
    assert any(test.startswith("McNemar") and test != "McNemar exact (b=0, c=0)" for test in frame["test"])


def test_compare_pairs_a_ccq_attach_sweep_with_its_plain_model(runs):
    result = invoke("compare", runs["sweep"], "--format", "csv", "--n-boot", N_BOOT)
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(io.StringIO(result.output))
    assert list(zip(frame["task"], frame["metric"])) == [("piqa", "acc"), ("wikitext", "word_perplexity")]
    for row in frame.itertuples():
        expected = _expected_row(runs["sweep"], "tiny-gla", "tiny-gla+ccq-lambda1", row.task, row.metric)
        assert row.n == expected["n"] and row.test == expected["test"], row
        for column in ("baseline", "variant", "ci_low", "ci_high", "p_value"):
            assert getattr(row, column) == pytest.approx(expected[column], rel=1e-9, abs=1e-12), (row, column)


def test_compare_defaults_to_the_twins_and_its_summary_uses_the_papers_headers(runs):
    result = invoke("compare", runs["suite"], "--n-boot", 200)
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("### ")] == \
        ["### tiny-gla-ccq vs tiny-gla"]
    rows = [line for line in result.output.splitlines() if line.startswith("| ") and "| all |" in line]
    assert len(rows) == len(ZEROSHOT_TASKS) + 1  # LAMBADA: perplexity and acc
    assert any(line.startswith("| hellaswag | all | acc_norm |") for line in rows)
    assert any(line.startswith("| wikitext | all | word_perplexity (HFLM windows) |") for line in rows)
    summary = invoke("compare", runs["suite"], "--n-boot", 200, "--summary").output
    header = summary.splitlines()[0]
    assert header.startswith(f"| comparison | {HFLM_WIKI} | LMB. ppl | LMB. acc | PIQA acc | Hella. acc_n |")
    note = summary.strip().splitlines()[-1]  # it explains only what this table holds
    assert "over a family of 13 p-values" in note and "S-NIAH" not in note and "@L" not in note


def test_the_report_shows_the_paper_table_and_the_compare_rows(runs, tmp_path):
    result = invoke("report", runs["suite"], "-o", tmp_path / "report.html")
    assert result.exit_code == 0, result.output
    for page in (runs["suite"] / "report.html", tmp_path / "report.html"):  # the run's own, and `report`'s
        text = page.read_text()
        assert "Zero-shot downstream" in text and f"<th>{HFLM_WIKI}</th>" in text and "<th>Avg.</th>" in text
        assert "tiny-gla-ccq vs tiny-gla" in text and "word_perplexity (HFLM windows)" in text
    assert sorted(path.name for path in (runs["suite"] / "figures").glob("zeroshot_*.png")) == \
        ["zeroshot_accuracy.png", "zeroshot_perplexity.png"]
