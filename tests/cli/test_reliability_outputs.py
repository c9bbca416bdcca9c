"""Fault injection, round two (issue 29, cases 8-14): what the readers show and what archive writes.

Each test breaks one thing (a non-finite result, a folder of several runs, samples of other
documents, a name with markdown in it, a bad option, a prompt budget of a few tokens, an archive
over another run's archive) and checks the one-line error or the correct output, and that the stored
units are byte for byte what they were.
"""

from __future__ import annotations

from pathlib import Path

from test_cli_fakes import (
    SNIAH_TASK,
    baseline_correct,
    variant_correct,
    write_sniah,
)
from test_cli_run import invoke
from test_reliability import assert_one_line_error, snapshot

# 9 -------------------------------------------------------------------------------------------


def test_compare_on_a_folder_of_several_runs_names_them(tmp_path):
    for run in ("reference", "gpu-grid"):
        write_sniah(tmp_path / run, "tiny-gla", baseline_correct)
        write_sniah(tmp_path / run, "tiny-gla-ccq", variant_correct if run == "reference" else baseline_correct)
    before = snapshot(tmp_path)
    for command in (["compare", str(tmp_path)], ["table", str(tmp_path)], ["report", str(tmp_path)]):
        line = assert_one_line_error(invoke(*command), "holds 2 result folders", str(tmp_path / "gpu-grid"),
                                     str(tmp_path / "reference"), "point the command at one result folder")
        assert SNIAH_TASK in line
    result = invoke("compare", str(tmp_path / "reference"))  # one of them: compared as before
    assert result.exit_code == 0, result.output
    assert snapshot(tmp_path) == before
