"""An archive names no path of the machine that ran: the run's working folder becomes '.', its output
folder the archive's, whole path components only, and every other string stays as it was."""

from __future__ import annotations

from pathlib import Path

from ccq_eval.harness.portable import PathRewrite


def test_roots_become_relative_and_nothing_else_changes(tmp_path):
    cwd = tmp_path / "checkout"
    run = tmp_path / "scratch" / "run1"
    rewrite = PathRewrite.for_unit({"cwd": str(cwd)}, source=run, destination=cwd / "results" / "ruler")
    meta = {
        "cwd": str(cwd),
        "model_source": f"{cwd}/models/tiny-gdn",
        "command_line": f"ccq-eval run -m tiny-gdn -o {run} --seed 0",
        "argv": [f"{cwd}/.venv/bin/ccq-eval", "run", "-o", str(run)],
        "config_source": f"{cwd}/tasks/s_niah/ccq_s_niah_1.yaml",
        "unit": f"{run}/tiny-gdn/ccq_s_niah_1",
        "near_misses": [f"{cwd}x/models", f"{run}0", "sha256 0123abcd", 0.5, None],
    }
    assert rewrite(meta) == {
        "cwd": ".",
        "model_source": "models/tiny-gdn",
        "command_line": "ccq-eval run -m tiny-gdn -o results/ruler --seed 0",
        "argv": [".venv/bin/ccq-eval", "run", "-o", "results/ruler"],
        "config_source": "tasks/s_niah/ccq_s_niah_1.yaml",
        "unit": "results/ruler/tiny-gdn/ccq_s_niah_1",
        "near_misses": [f"{cwd}x/models", f"{run}0", "sha256 0123abcd", 0.5, None],
    }


def test_an_output_inside_the_working_folder_is_rewritten_before_it(tmp_path):
    cwd = tmp_path / "checkout"
    rewrite = PathRewrite.for_unit({"cwd": str(cwd)}, source=cwd / "results" / "work", destination=Path(cwd / "out"))
    assert rewrite(f"{cwd}/results/work/m/t") == "out/m/t"
    assert rewrite(f"{cwd}/results/other") == "results/other"


def test_a_destination_outside_the_working_folder_stays_absolute(tmp_path):
    rewrite = PathRewrite.for_unit({"cwd": str(tmp_path / "a")}, source=tmp_path / "run", destination=tmp_path / "b")
    assert rewrite(str(tmp_path / "run" / "x")) == str(tmp_path / "b" / "x")
