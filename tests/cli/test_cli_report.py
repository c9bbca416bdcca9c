"""`ccq-eval run` writes report.html beside table.md; a report that cannot be built only warns (fake
units through the real lm-eval evaluator, no model: test_cli_run's fake world)."""

from __future__ import annotations

from pathlib import Path

from test_cli_run import RUN_ARGS, fake_world, invoke  # noqa: F401  (fake_world is a fixture)

from ccq_eval.analysis import report


def test_run_writes_the_report_beside_the_table(fake_world):
    result = invoke(*RUN_ARGS, "-m", "tiny-strong", "-m", "tiny-weak", "--output", "out")
    assert result.exit_code == 0, result.output
    page = (Path("out") / "report.html").read_text()
    assert (Path("out") / "table.md").is_file() and "report: out/report.html" in result.output
    # the fake model forgets needles at depth 100: its answer is shown in that cell, which the filters find
    assert 'data-model="tiny-weak" data-task="ccq_s_niah_fake" data-length="1024" data-depth="100"' in page
    assert "I forgot" in page
    figures = sorted(p.stem for p in (Path("out") / "figures").glob("*.png"))
    assert figures and all(f'alt="{stem}"' in page for stem in figures)


def test_run_keeps_its_results_when_the_report_fails(fake_world, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("cannot draw")

    monkeypatch.setattr(report, "build_report", broken)
    result = invoke(*RUN_ARGS, "-m", "tiny-strong", "--output", "out")
    assert result.exit_code == 0, result.output
    assert "warning: report.html not written (ValueError: cannot draw)" in result.output
    assert "ccq-eval report out" in result.output
    assert (Path("out") / "table.md").is_file() and not (Path("out") / "report.html").exists()
