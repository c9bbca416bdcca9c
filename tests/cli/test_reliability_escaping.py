"""Every text output escapes what comes from checkpoints and data for its format: a model named like a
spreadsheet formula, a markdown link or LaTeX markup is printed as that text, never as what it would do."""

from __future__ import annotations

import csv
import io

import pytest
from test_cli_fakes import baseline_correct, variant_correct, write_sniah
from test_cli_run import invoke

FORMULA = "=1+2"
AT_FORMULA = "@SUM(A1:A9)"
LINK = "[click](http://example.invalid)"


def _cells(text: str) -> list[str]:
    return [cell for row in csv.reader(io.StringIO(text)) for cell in row]


@pytest.mark.parametrize("args", [["table", "--format", "csv"], ["table", "--format", "csv", "--view", "tidy"],
                                  ["compare", "--format", "csv", "--baseline", FORMULA, "--variant", AT_FORMULA,
                                   "--n-boot", "100"]])
def test_csv_cells_never_start_a_formula(tmp_path, args):
    write_sniah(tmp_path / "out", FORMULA, baseline_correct)
    write_sniah(tmp_path / "out", AT_FORMULA, variant_correct)
    result = invoke(args[0], str(tmp_path / "out"), *args[1:])
    assert result.exit_code == 0, result.output
    cells = _cells(result.output)
    for cell in cells:
        if cell.startswith(("=", "+", "-", "@")):
            float(cell)  # only numbers (a negative delta) may start so
    if args[0] == "table":
        assert "'" + FORMULA in cells and "'" + AT_FORMULA in cells


def test_markdown_never_makes_a_link_or_code_of_a_name(tmp_path):
    write_sniah(tmp_path / "out", LINK, baseline_correct)
    write_sniah(tmp_path / "out", "`code` *bold*", variant_correct)
    for args in (["table"], ["table", "--view", "tidy"],
                 ["compare", "--baseline", LINK, "--variant", "`code` *bold*", "--n-boot", "100"]):
        result = invoke(args[0], str(tmp_path / "out"), *args[1:])
        assert result.exit_code == 0, result.output
        assert "[click](" not in result.output and "\\[click\\](http\\://example.invalid)" in result.output
        assert "`code`" not in result.output and "\\`code\\` \\*bold\\*" in result.output


def test_markdown_never_links_a_bare_address(tmp_path):
    write_sniah(tmp_path / "out", "www.example.invalid", baseline_correct)
    result = invoke("table", str(tmp_path / "out"))
    assert result.exit_code == 0 and "www\\.example.invalid" in result.output, result.output


def test_latex_escapes_names(tmp_path):
    write_sniah(tmp_path / "out", "a&b$c#d", baseline_correct)
    result = invoke("table", str(tmp_path / "out"), "--format", "latex")
    assert result.exit_code == 0, result.output
    assert "a\\&b\\$c\\#d" in result.output and "a&b$c#d" not in result.output


def test_figures_show_a_name_with_tex_markup_as_written(tmp_path):
    write_sniah(tmp_path / "out", "$\\notacommand{x}$", baseline_correct)
    result = invoke("figures", str(tmp_path / "out"), "-o", str(tmp_path / "figures"))
    assert result.exit_code == 0, result.output
    assert list((tmp_path / "figures").glob("*.png"))
