"""`ccq-eval compare` and the report without --baseline / --variant: every CCQ twin pair and every
--ccq-attach sweep's lambdas against the sweep's plain model, found from the units' specs (fake results)."""

from __future__ import annotations

import math
import re

import pytest
from test_cli_fakes import (
    BUCKETS_BASE,
    SWEEP_BASE,
    SWEEP_VAR,
    baseline_correct,
    revouch,
    variant_correct,
    write_ppl_buckets,
    write_ppl_sweep,
    write_sniah,
)
from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval.analysis import figures, report, stats, tables
from ccq_eval.harness import store


def _attach(folder, sweep: str, lam: float, baseline: str | None) -> None:
    """Record in a fake unit's meta.json the ccq_attach spec entry `ccq-eval run --ccq-attach` stores."""
    meta = store.read_json(folder / store.META_FILE)
    entry = {"sweep": sweep, "lambda": lam, "fields": {}} | ({"baseline": baseline} if baseline else {})
    store.atomic_write_json(folder / store.META_FILE, meta | {"spec": {"ccq_attach": entry}})
    revouch(folder)


def _never_right(length: int, depth: int, index: int) -> bool:
    return False


@pytest.fixture
def results(tmp_path):
    """tiny-gla and its twin; a sweep of tiny-gla at lambda 1 and 2 with the plain model as its lambda 0
    (what `run --ccq-attach` writes); a sweep of tiny-gdn laid out by older runs, its lambda 0 an attached
    model and no plain tiny-gdn."""
    out = tmp_path / "results"
    write_sniah(out, "tiny-gla", baseline_correct)
    write_ppl_sweep(out, "tiny-gla", SWEEP_BASE)
    write_ppl_buckets(out, "tiny-gla", BUCKETS_BASE)  # a task of the baseline only
    write_sniah(out, "tiny-gla-ccq", variant_correct)
    for lam, correct in ((1.0, variant_correct), (2.0, _never_right)):
        name = f"tiny-gla+ccq-lambda{lam:g}"
        _attach(write_sniah(out, name, correct), "tiny-gla+ccq", lam, "tiny-gla")
        _attach(write_ppl_sweep(out, name, SWEEP_VAR), "tiny-gla+ccq", lam, "tiny-gla")
    for lam, correct in ((0.0, baseline_correct), (4.0, variant_correct)):
        _attach(write_sniah(out, f"tiny-gdn+ccq-lambda{lam:g}", correct), "tiny-gdn+ccq", lam, None)
    return out


EXPECTED_PAIRS = [("tiny-gla", "tiny-gla-ccq"), ("tiny-gdn+ccq-lambda0", "tiny-gdn+ccq-lambda4"),
                  ("tiny-gla", "tiny-gla+ccq-lambda1"), ("tiny-gla", "tiny-gla+ccq-lambda2")]


def test_compare_without_names_finds_every_twin_and_sweep_pair(results):
    assert stats.comparison_pairs(store.load_results(results)) == EXPECTED_PAIRS
    result = CliRunner().invoke(cli.app, ["compare", str(results), "--n-boot", "200"])
    assert result.exit_code == 0, result.output
    headings = [line for line in result.output.splitlines() if line.startswith("### ")]
    assert headings == [f"### {variant} vs {baseline}" for baseline, variant in EXPECTED_PAIRS]
    sections = dict(zip(headings, re.split(r"^### .*$", result.output, flags=re.MULTILINE)[1:]))
    # lambda 2 answers nothing: at 2K the baseline's 4 of 12 right answers are lost (delta -33.333, McNemar
    # b = 4, c = 0, p = 2 * 0.5^4 = 0.125); lambda 1 gains 4 (+33.333); perplexity pairs document by document
    lambda2 = sections["### tiny-gla+ccq-lambda2 vs tiny-gla"]
    row = next(line for line in lambda2.splitlines() if line.startswith("| S-NIAH-1 | 2048 |"))
    assert "| -33.333 |" in row and "| 0.125 |" in row and "b=4, c=0" in row
    lambda1 = sections["### tiny-gla+ccq-lambda1 vs tiny-gla"]
    row = next(line for line in lambda1.splitlines() if line.startswith("| S-NIAH-1 | 2048 |"))
    assert "| 33.333 |" in row and "b=0, c=4" in row
    assert any(line.startswith("| ppl_sweep | 2048 |") for line in lambda1.splitlines())
    assert not any(line.startswith("| ppl_sweep") for line in sections["### tiny-gla-ccq vs tiny-gla"].splitlines())


def test_compare_summary_is_one_row_per_comparison(results):
    """`compare --summary`: the README's table, a row per pair and a column per task (S-NIAH pooled over
    lengths; the perplexity sweep at its longest length)."""
    result = CliRunner().invoke(cli.app, ["compare", str(results), "--summary", "--n-boot", "200"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("| ")]
    assert lines[0] == "| comparison | S-NIAH-1 | ppl_sweep @2048 |"
    cells = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines[1:]]
    rows = {row[0]: row[1:] for row in cells}
    assert list(rows) == [f"{variant} vs {baseline}" for baseline, variant in EXPECTED_PAIRS]
    # lambda 2 loses all 16 of the baseline's 24 right answers: McNemar b = 16, c = 0, p = 2 * 0.5^16
    niah, ppl = rows["tiny-gla+ccq-lambda2 vs tiny-gla"]
    # Holm over the table's 6 p-values: 6 * 3.1e-05, the raw p-value beside it
    assert niah.startswith("-66.7 [") and niah.endswith("p = 0.00018*** (Holm; raw 3.1e-05)")
    # perplexity at 2K: exp(mean NLL 2.3) - exp(2.7), lower is better
    assert ppl.startswith(f"{math.exp(2.3) - math.exp(2.7):+.3g} [")
    assert rows["tiny-gla-ccq vs tiny-gla"][1] == "-"  # the twin has no perplexity unit


def test_the_plain_model_is_each_sweep_s_lambda_zero_in_figures_and_report(results):
    points = tables.ccq_sweep_points(tables.load_tidy(results))
    assert sorted(map(tuple, points.itertuples(index=False))) == [
        ("tiny-gdn+ccq-lambda0", "tiny-gdn+ccq", 0.0), ("tiny-gdn+ccq-lambda4", "tiny-gdn+ccq", 4.0),
        ("tiny-gla", "tiny-gla+ccq", 0.0), ("tiny-gla+ccq-lambda1", "tiny-gla+ccq", 1.0),
        ("tiny-gla+ccq-lambda2", "tiny-gla+ccq", 2.0)]
    # tiny-gla's panels: the tasks run at two lambdas or more (its twin-only tasks draw none)
    tidy = tables.load_tidy(results)
    members = points[points["sweep"] == "tiny-gla+ccq"]
    assert sorted(figures.sweep_panels(tidy, members)) == ["ccq_ppl_sweep", "ccq_s_niah_1"]
    page = report.write_report(results).read_text()
    for baseline, variant in EXPECTED_PAIRS:
        assert f"<h3>{variant} vs {baseline}</h3>" in page


def test_a_sweep_whose_baseline_has_no_results_is_not_paired(results):
    import shutil

    shutil.rmtree(results / "tiny-gla")
    assert stats.comparison_pairs(store.load_results(results)) == [
        ("tiny-gdn+ccq-lambda0", "tiny-gdn+ccq-lambda4")]
