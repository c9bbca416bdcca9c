"""Samples name no path of the machine that wrote them: the same run from two working folders writes
byte-identical samples files and unit settings (a registered model's tokenizer goes to the tasks by its
registered name, so documents and their hashes do not depend on where the checkout lies)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ccq_eval.cli import app

REPO = Path(__file__).resolve().parents[2]
RUN = ["run", "-m", "tiny-gla", "-t", "s-niah-1", "--lengths", "1k", "--depths", "50", "--samples-per-cell", "1",
       "--no-report", "-o", "out"]


@pytest.mark.slow
def test_two_working_folders_write_byte_identical_samples(tmp_path, monkeypatch):
    outputs = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        result = CliRunner().invoke(app, RUN)
        assert result.exit_code == 0, result.output
        outputs.append(tmp_path / name / "out")
    files = [sorted(path.relative_to(output) for path in output.glob("tiny-gla/*/*")
                    if path.name.startswith("samples_") or path.name == "unit.json") for output in outputs]
    assert files[0] == files[1] and len(files[0]) == 2
    for relative in files[0]:
        written = (outputs[0] / relative).read_bytes()
        assert written == (outputs[1] / relative).read_bytes(), relative
        assert str(tmp_path).encode() not in written and str(REPO).encode() not in written
    assert b'"tokenizer": "tiny-gla"' in (outputs[0] / "tiny-gla" / "ccq_s_niah_1" / "samples_ccq_s_niah_1.jsonl"
                                          ).read_bytes()
