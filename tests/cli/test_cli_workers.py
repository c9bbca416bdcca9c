"""`ccq-eval run --workers 2`: a helper process shares the plan's units with the command's own process;
every unit is computed once, by one of them, with the same numbers as a single-process run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ccq_eval.cli import app

GRID = ["run", "-m", "tiny-gla", "-m", "tiny-gdn", "-t", "s-niah-1", "-t", "ppl-sweep", "--lengths", "1k",
        "--depths", "50", "--samples-per-cell", "1", "--no-report", "--quiet"]


def _metas(folder: Path) -> dict[str, dict]:
    return {str(meta.parent.relative_to(folder)): json.loads(meta.read_text())
            for meta in folder.glob("*/*/meta.json")}


def _results(folder: Path) -> dict[str, dict]:
    return {str(results.parent.relative_to(folder)): json.loads(results.read_text())["results"]
            for results in folder.glob("*/*/results.json")}


@pytest.mark.slow
def test_two_workers_compute_each_unit_once_with_single_process_numbers(tmp_path):
    runner = CliRunner()
    single = runner.invoke(app, [*GRID, "--workers", "1", "-o", str(tmp_path / "one")])
    assert single.exit_code == 0, single.output
    shared = runner.invoke(app, [*GRID, "--workers", "2", "-o", str(tmp_path / "two")])
    assert shared.exit_code == 0, shared.output
    assert "done: 4 evaluated, 0 skipped (already finished), 0 failed" in shared.output, shared.output

    metas = _metas(tmp_path / "two")
    assert len(metas) == 4
    assert len({meta["pid"] for meta in metas.values()}) == 2, "the helper process computed no unit"
    assert _results(tmp_path / "two") == _results(tmp_path / "one")
    for unit in metas:
        samples = sorted((tmp_path / "one" / unit).glob("samples_*"))
        assert samples and [s.read_bytes() for s in samples] == \
            [(tmp_path / "two" / unit / s.name).read_bytes() for s in samples]
