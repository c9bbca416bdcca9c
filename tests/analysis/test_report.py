"""`ccq-eval report`: the HTML page of a results folder, read as text (the browser test,
test_report_browser.py, opens it in Chromium). Checked against the committed reference run: every
paper table, comparison and figure is in the page, every failed S-NIAH sample is listed in its cell,
nothing is fetched, sample text is escaped, and empty or partial folders say what is missing."""

from __future__ import annotations

import html
import json
import lzma
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval.analysis import figures as figures_module
from ccq_eval.analysis import report, stats, tables
from ccq_eval.harness import store as results_store

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference"
MAX_REPORT_BYTES = 2 * 1024 * 1024


def invoke(*args):
    return CliRunner().invoke(cli.app, [str(a) for a in args])


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    output = tmp_path_factory.mktemp("report") / "report.html"
    result = invoke("report", REFERENCE, "-o", output)
    assert result.exit_code == 0, result.output
    assert output.stat().st_size <= MAX_REPORT_BYTES
    return output.read_text(encoding="utf-8")


def _cells(page: str) -> list[tuple[dict[str, str], str]]:
    """(data attributes, inner HTML) of each sample-browser block."""
    found = []
    for match in re.finditer(r'<details class="cell[^"]*" ([^>]*)>(.*?)</details>', page, re.DOTALL):
        attributes = dict(re.findall(r'data-(\w+)="([^"]*)"', match.group(1)))
        found.append((attributes, match.group(2)))
    return found


def test_reference_report_holds_every_table_comparison_and_figure(page, tmp_path):
    tidy = tables.load_tidy(REFERENCE)
    for pivot in tables.paper_pivots(tidy):
        assert f"<h3>{html.escape(pivot.title)}</h3>" in page
    # the S-NIAH table's values as `ccq-eval table` prints them (table.md of the same run)
    table_md = (REFERENCE / "table.md").read_text()
    first_row = next(line for line in table_md.splitlines() if line.startswith("| S-NIAH-1 | tiny-gla-ccq"))
    for value in first_row.strip("| ").split(" | ")[2:]:
        assert f">{value}</td>" in page
    units = results_store.load_results(REFERENCE)
    for baseline, variant in stats.comparison_pairs(units):
        assert f"<h3>{variant} vs {baseline}</h3>" in page
    figures = re.findall(r'<img src="data:image/png;base64,[A-Za-z0-9+/=]+" alt="([^"]+)"', page)
    drawn = figures_module.draw_all(tidy, tmp_path)  # what `ccq-eval figures` draws for the same run
    assert sorted(figures) == sorted(p.stem for p in drawn if p.suffix == ".png") and figures


def test_reference_report_records_the_run(page):
    for unit in results_store.load_results(REFERENCE):
        spec = json.loads((unit.folder / "unit.json").read_text())
        weights = spec["checkpoint"]["sha256"]["model.safetensors"]
        assert weights[:16] in page and weights in page  # short fingerprint shown, every digest on hover
        assert unit.results["git_hash"] in page
        assert unit.meta["versions"]["torch"] in page and unit.meta["device"] in page
    assert "1K, 2K" in page and "0%, 50%, 100%" in page  # the grid


def _markdown_rows(text: str) -> list[list[str]]:
    """The cells of a markdown table's header and body rows (its |---| line left out)."""
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")]
            for line in text.splitlines() if line.startswith("| ")]


def _html_rows(table: str) -> list[list[str]]:
    """The cells of an HTML table's header and body rows, as text."""
    return [[html.unescape(cell) for cell in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", table, re.DOTALL)]


def test_report_opens_with_compare_summary_s_table_and_ends_with_the_run(page):
    result = invoke("compare", REFERENCE, "--summary")
    assert result.exit_code == 0, result.output
    table_text, note = result.output.strip().split("\n\n")
    first_table = re.search(r"<table class=\"data\">.*?</table>", page, re.DOTALL).group(0)
    # every delta, interval and Holm-adjusted p-value, cell for cell, and the family the note names
    assert _html_rows(first_table) == _markdown_rows(table_text)
    assert "over a family of 22 p-values" in note and html.escape(note.strip("_")) in page
    first_digest = min(page.index(json.loads((unit.folder / "unit.json").read_text())["checkpoint"]["sha256"]
                                  ["model.safetensors"][:16]) for unit in results_store.load_results(REFERENCE))
    assert page.index('<section id="samples">') < page.index('<section id="run">') < first_digest
    assert page.index(str(REFERENCE)) > page.index('<section id="run">')  # the machine's path, last too


def test_every_failed_sniah_sample_is_listed_in_its_cell(page):
    expected: Counter = Counter()
    cells_expected: Counter = Counter()
    for unit in results_store.load_results(REFERENCE):
        for task in unit.leaf_tasks():
            if tables.task_family(task) != "s-niah":
                continue
            for sample in unit.samples(task):
                key = (unit.model, task, str(sample["doc"]["length"]), f"{sample['doc']['depth']:g}")
                cells_expected[key] += 0
                if sample["acc"] < 100:
                    expected[key] += 1
    shown = {}
    for attributes, inner in _cells(page):
        if tables.task_family(attributes["task"]) == "s-niah":
            key = (attributes["model"], attributes["task"], attributes["length"], attributes["depth"])
            shown[key] = inner.count('<div class="sample">')
    assert set(shown) == set(cells_expected)
    assert shown == {key: expected[key] for key in cells_expected}
    # a failure shows its expected answer, marked in the context around the needle
    failed = next(inner for attributes, inner in _cells(page) if '<div class="sample">' in inner
                  and attributes["task"] == "ccq_s_niah_1")
    answer = re.search(r'<code class="expected">([^<]+)</code>', failed).group(1)
    assert f"<mark>{answer}</mark>" in failed


def test_perplexity_cells_list_the_worst_documents_first(page):
    ppl_cells = [(a, inner) for a, inner in _cells(page) if tables.task_family(a["task"]) == "ppl"]
    assert ppl_cells
    for _, inner in ppl_cells:
        values = [float(v) for v in re.findall(r"perplexity <b>([\d.]+)</b>", inner)]
        assert 0 < len(values) <= report.WORST_DOCUMENTS and values == sorted(values, reverse=True)


def test_page_fetches_nothing(page):
    for attribute, value in re.findall(r'\b(src|href|action|srcset|poster)="([^"]*)"', page):
        assert value.startswith(("data:", "#")), (attribute, value[:80])
    assert not re.search(r"url\(|@import|<link\b|<iframe\b", page)


def _copy_reference(tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(REFERENCE, copy, ignore=shutil.ignore_patterns("figures", "*.md"))
    return copy


def test_sample_text_is_escaped(tmp_path):
    run = _copy_reference(tmp_path)
    samples_path = run / "tiny-gla" / "ccq_s_niah_1" / "samples_ccq_s_niah_1.jsonl.xz"
    records = list(results_store.iter_jsonl(samples_path))
    failed = next(r for r in records if r["acc"] < 100)
    attack = '</pre><script>window.hacked = 1</script><img src="http://example.com/x.png">'
    failed["filtered_resps"] = [attack]
    samples_path.write_bytes(lzma.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    text = report.build_report(run, figure_paths=[])
    assert attack not in text and html.escape(attack) in text
    assert text.count("<script>") == 1  # the page's own filter script only



def _rewrite_samples(path: Path, change) -> None:
    records = list(results_store.iter_jsonl(path))
    change(records)
    path.write_bytes(lzma.compress("".join(json.dumps(r) + "\n" for r in records).encode()))


def test_script_and_ampersand_in_prompts_and_documents_are_escaped(tmp_path):
    run = _copy_reference(tmp_path)
    attack = "<script>window.hacked = 1</script> Q&A &amp; more"

    def into_prompt(records):  # beside the needle: in the context shown around it
        failed = next(r for r in records if r["acc"] < 100)
        answer = failed["doc"]["outputs"][0]
        failed["doc"]["input"] = failed["doc"]["input"].replace(answer, f"{attack} {answer}", 1)

    def into_documents(records):  # the start of every document: the worst ones are listed
        for record in records:
            record["doc"]["text"] = f"{attack} {record['doc']['text']}"

    _rewrite_samples(run / "tiny-gla" / "ccq_s_niah_1" / "samples_ccq_s_niah_1.jsonl.xz", into_prompt)
    _rewrite_samples(run / "tiny-gla" / "ccq_ppl_sweep" / "samples_ccq_ppl_sweep.jsonl.xz", into_documents)
    text = report.build_report(run, figure_paths=[])
    escaped = "&lt;script&gt;window.hacked = 1&lt;/script&gt; Q&amp;A &amp;amp; more"
    assert attack not in text and "window.hacked = 1</script>" not in text
    contexts = re.findall(r'<pre class="context"[^>]*>(.*?)</pre>', text, re.DOTALL)
    assert any(escaped in context and "<mark>" in context for context in contexts)  # the prompt
    assert any(context.startswith(escaped) for context in contexts)  # a document's start
    assert text.count("<script>") == 1  # the page's own filter script only


def test_empty_folder_is_a_one_line_error(tmp_path):
    (tmp_path / "empty").mkdir()
    result = invoke("report", tmp_path / "empty")
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "holds no results" in result.output
    result = invoke("report", tmp_path / "nowhere")
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not (tmp_path / "empty" / "report.html").exists()


def test_folder_of_unfinished_units_is_a_one_line_error(tmp_path):
    run = _copy_reference(tmp_path)
    started = 0
    for results_file in run.rglob("results.json.xz"):  # the reference is an archive
        results_file.unlink()
        started += 1
    result = invoke("report", run)
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert f"{started} started units" in result.output and "none finished" in result.output


def test_partial_folder_report_says_what_is_missing(tmp_path):
    run = _copy_reference(tmp_path)
    (run / "tiny-gdn" / "ccq_s_niah_2" / "results.json.xz").unlink()  # a unit that did not finish
    (run / "tiny-gla" / "ccq_ppl_sweep" / "samples_ccq_ppl_sweep.jsonl.xz").unlink()  # a lost sample log
    shutil.rmtree(run / "tiny-transformer" / "ccq_s_niah_3")  # a unit that never started
    meta_path = run / "tiny-gla" / "ccq_s_niah_1" / "meta.json"  # what the run asked for, as a run records it
    meta = json.loads(meta_path.read_text())
    asked = [[model.name, task.name] for model in sorted(run.iterdir()) if model.is_dir()
             for task in sorted(model.iterdir()) if task.is_dir()]
    meta_path.write_text(json.dumps(dict(meta, run_units=[*asked, ["tiny-transformer", "ccq_s_niah_3"]])))
    result = invoke("report", run)
    assert result.exit_code == 0, result.output
    text = (run / "report.html").read_text()
    missing = re.search(r'<section id="missing".*?</section>', text, re.DOTALL).group(0)
    notes = re.findall(r"<li>(.*?)</li>", missing, re.DOTALL)
    assert len(notes) == 3, notes  # the sweep models' tasks left out on purpose are not missing
    assert "tiny-gdn/ccq_s_niah_2: unit started but not finished" in notes[0]
    assert "tiny-gla / ccq_ppl_sweep: no per-sample log" in notes[1]
    assert html.unescape(notes[2]).startswith("tiny-transformer / ccq_s_niah_3: asked for by `ccq-eval run")
    # what is there is still shown: the other pair's comparison, the remaining cells
    assert "<h3>tiny-gla-ccq vs tiny-gla</h3>" in text
    cells = _cells(text)
    assert not [a for a, _ in cells if a["model"] == "tiny-gdn" and a["task"] == "ccq_s_niah_2"]
    assert [a for a, _ in cells if a["model"] == "tiny-gdn" and a["task"] == "ccq_s_niah_1"]


def test_long_failure_lists_are_cut_and_counted(monkeypatch):
    monkeypatch.setattr(report, "FAILURES_PER_CELL", 1)
    cut = 0
    for attributes, inner in _cells(report.build_report(REFERENCE, figure_paths=[])):
        failed = re.search(r"(\d+) of \d+ failed", inner)
        if tables.task_family(attributes["task"]) != "s-niah" or not failed:
            continue
        assert inner.count('<div class="sample">') == 1
        if int(failed.group(1)) > 1:
            assert f"{int(failed.group(1)) - 1} more failures in this cell are not listed" in inner
            cut += 1
    assert cut > 0


def test_environment_counts_the_processes_and_the_elapsed_time_of_the_run():
    """Two worker processes that ran units side by side: two processes, the elapsed time from the first
    start to the last finish, and the units' summed time under its own name."""
    def unit(pid: int, started: str, finished: str, wall: float) -> results_store.StoredUnit:
        meta = {"pid": pid, "cwd": "/w", "platform": "p", "started_at": started, "finished_at": finished,
                "wall_time_s": wall, "world_size": 1}
        return results_store.StoredUnit(results_path=Path("r/m/t/results.json"), results={"results": {}}, meta=meta)

    units = [unit(11, "2026-01-01T10:00:00+0000", "2026-01-01T10:01:40+0000", 100.0),
             unit(12, "2026-01-01T10:00:05+0000", "2026-01-01T10:02:00+0000", 115.0),
             unit(11, "2026-01-01T10:01:40+0000", "2026-01-01T10:02:30+0000", 50.0)]
    rows = dict(report.environment_pairs(units))
    assert rows["processes that stored the units"] == "2"
    assert rows["elapsed, first unit's start to last unit's finish"] == "150 s"
    assert rows["unit time, summed over the units"] == "265.0 s"
    assert rows["data-parallel ranks of a unit"] == "1"
