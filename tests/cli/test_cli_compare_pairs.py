"""`ccq-eval compare` without --baseline / --variant compares every CCQ twin pair in the results."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from ccq_eval import cli

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference"


def test_every_ccq_pair_is_compared_per_task_and_length():
    result = CliRunner().invoke(cli.app, ["compare", str(REFERENCE), "--n-boot", "200"])
    assert result.exit_code == 0, result.output
    headings = [line for line in result.output.splitlines() if line.startswith("### ")]
    twins = ["### tiny-gdn-ccq vs tiny-gdn", "### tiny-gla-ccq vs tiny-gla"]
    assert headings[:2] == twins  # then the default run's training-free sweeps, if the run has them
    sections = dict(zip(headings, re.split(r"^### .*$", result.output, flags=re.MULTILINE)[1:]))
    for task in ("S-NIAH-1", "S-NIAH-2", "S-NIAH-3", "ppl_sweep"):
        for length in ("1024", "2048"):
            rows = [line for twin in twins for line in sections[twin].splitlines()
                    if line.startswith(f"| {task} | {length} |")]
            assert len(rows) == 2, (task, length)  # one per family, with CI and p-value columns
            assert all("[" in row and "]" in row for row in rows)
    assert "McNemar" in result.output


def test_one_of_baseline_and_variant_alone_is_an_error():
    result = CliRunner().invoke(cli.app, ["compare", str(REFERENCE), "--baseline", "tiny-gla"])
    assert result.exit_code == 2 and "--variant" in result.output
