"""The numbers the README and docs/results.md quote from the default run are those `ccq-eval compare
results/reference --summary` prints (the report's first table is the same: test_report.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ccq_eval import cli

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "results" / "reference"
KDA_SWEEP = ROOT / "results" / "ccq-attach-kda"  # the --ccq-attach sweep on tiny-kda (docs/results.md)


def _one_line(path: Path) -> str:
    """The file's text with every run of whitespace (line breaks included) as one space."""
    return " ".join(path.read_text(encoding="utf-8").split())


@pytest.fixture(scope="module")
def summary() -> str:
    result = CliRunner().invoke(cli.app, ["compare", str(REFERENCE), "--summary"])
    assert result.exit_code == 0, result.output
    return result.output


def _cell(summary: str, row: str, column: str) -> tuple[str, str, str]:
    """(delta, Holm-adjusted p, raw p) of one cell of the summary, as printed."""
    lines = [line.strip().strip("|").split(" | ") for line in summary.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0]]
    cells = next(cells for cells in lines if cells[0].strip() == row)
    text = cells[header.index(column)].strip()
    match = re.fullmatch(r"(\S+) \[.*\], p = ([\d.e+-]+)\**? \(Holm; raw ([\d.e+-]+)\)", text)
    assert match, text
    return match.groups()


def test_results_doc_holds_compare_summary_s_table_as_printed(summary):
    table = summary.split("\n\n")[0]
    assert table in (ROOT / "docs" / "results.md").read_text(encoding="utf-8")


def test_readme_and_results_doc_quote_compare_summary_s_numbers(summary):
    readme, doc = _one_line(ROOT / "README.md"), _one_line(ROOT / "docs" / "results.md")
    family = re.search(r"over a family of (\d+) p-values", summary).group(1)
    assert f"Holm over the {family} comparisons `ccq-eval compare results/reference --summary`" in readme
    assert f"over the {family} p-values of the table" in doc
    delta, p, _ = _cell(summary, "tiny-gdn+ccq-lambda2 vs tiny-gdn", "S-NIAH-2")
    assert f"(S-NIAH-2 {delta} points, p = {p})" in readme and f"(S-NIAH-2 {delta}, p = {p})" in doc
    _, p, raw = _cell(summary, "tiny-gdn+ccq-lambda1 vs tiny-gdn", "S-NIAH-1")
    assert f"(raw p = {raw}, {p} after Holm)" in readme and f"(raw p = {raw}, {p} after Holm)" in doc


def test_results_doc_quotes_the_kda_sweep_as_compare_summary_prints_it():
    result = CliRunner().invoke(cli.app, ["compare", str(KDA_SWEEP), "--summary"])
    assert result.exit_code == 0, result.output
    summary = result.output
    assert summary.split("\n\n")[0] in (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    doc = _one_line(ROOT / "docs" / "results.md")
    family = re.search(r"over a family of (\d+) p-values", summary).group(1)
    assert f"over the table's {family} p-values" in doc
    delta, p, _ = _cell(summary, "tiny-kda+ccq-lambda2 vs tiny-kda", "S-NIAH-2")
    assert f"({delta} points, p = {p})" in doc
    for task in ("S-NIAH-1", "S-NIAH-2"):
        _, p, raw = _cell(summary, "tiny-kda+ccq-lambda1 vs tiny-kda", task)
        assert f"(raw p = {raw}, {p} after Holm)" in doc


@pytest.mark.parametrize("backbone", ["deltanet", "precond-gdn", "mamba2"])
def test_results_doc_and_readme_quote_each_backbone_sweep_as_compare_summary_prints_it(backbone):
    result = CliRunner().invoke(cli.app, ["compare", str(ROOT / "results" / f"ccq-attach-{backbone}"), "--summary"])
    assert result.exit_code == 0, result.output
    assert result.output.split("\n\n")[0] in (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    readme = _one_line(ROOT / "README.md")
    if backbone == "deltanet":
        _, p, _ = _cell(result.output, "tiny-deltanet+ccq-lambda0.5 vs tiny-deltanet", "ppl_sweep @2048")
        assert f"lambda 0.5 (p = {p})" in readme
