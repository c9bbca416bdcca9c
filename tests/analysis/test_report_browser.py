"""The report of the committed reference run in headless Chromium (Debian's `chromium`, which .ci/run
installs; playwright drives it, its own browser download is never used): tables, figures and a
filtered sample view are visible, the page reads with scripts off, and it makes no network request.
Skipped where /usr/bin/chromium or playwright is absent."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ccq_eval.analysis import figures, report, stats, tables
from ccq_eval.harness import store as results_store

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REFERENCE = Path(__file__).resolve().parents[2] / "results" / "reference"
MAX_REPORT_BYTES = 2 * 1024 * 1024

pytestmark = [
    pytest.mark.skipif(shutil.which(str(CHROMIUM)) is None,
                       reason=f"{CHROMIUM} is absent (Debian: apt-get install chromium; CI installs it)"),
    pytest.mark.slow,  # starting chromium and drawing the report: about 15 s on a 2-core CPU
]
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def report_file(tmp_path_factory) -> Path:
    path = report.write_report(REFERENCE, tmp_path_factory.mktemp("report") / "report.html")
    assert path.stat().st_size <= MAX_REPORT_BYTES
    return path


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _open(browser, report_file: Path, *, scripts: bool = True):
    """The page and the list of every URL it requested."""
    context = browser.new_context(viewport={"width": 1000, "height": 900}, java_script_enabled=scripts)
    page = context.new_page()
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(report_file.as_uri(), wait_until="load")
    return context, page, requests, errors


def _sniah_cell_failures(model: str, task: str, length: int, depth: float) -> tuple[int, list[str]]:
    units = results_store.load_results(REFERENCE)
    unit = next(u for u in units if u.model == model and task in u.leaf_tasks())
    samples = [s for s in unit.samples(task) if s["doc"]["length"] == length and s["doc"]["depth"] == depth]
    return len(samples), [s["target"] for s in samples if s["acc"] < 100]


def test_tables_figures_and_filtered_samples_are_visible_and_nothing_is_fetched(browser, report_file, tmp_path):
    context, page, requests, errors = _open(browser, report_file)
    try:
        # the first screen (1000 x 900) shows the verdict table, compare --summary's, from its first row on
        verdict = page.locator("#verdict table")
        assert verdict.is_visible() and verdict.locator("tbody tr").first.bounding_box()["y"] < 900
        # tables: one per paper pivot, with its rows
        pivots = tables.paper_pivots(tables.load_tidy(REFERENCE))
        paper_tables = page.locator("section.paper-table table")
        assert paper_tables.count() == len(pivots)
        for index, pivot in enumerate(pivots):
            assert paper_tables.nth(index).is_visible()
            assert paper_tables.nth(index).locator("tbody tr").count() == len(pivot.frame)
        pairs = stats.comparison_pairs(results_store.load_results(REFERENCE))  # twins and sweep lambdas
        assert page.locator("section.comparison table").count() == len(pairs) > 2
        # figures: every figure `ccq-eval figures` draws for the run, decoded
        images = page.locator("#figures img")
        drawn = [p for p in figures.draw_all(tables.load_tidy(REFERENCE), tmp_path) if p.suffix == ".png"]
        assert images.count() == len(drawn) > 0
        for index in range(images.count()):
            image = images.nth(index)
            image.scroll_into_view_if_needed()
            assert image.is_visible()
            assert image.evaluate("img => img.complete && img.naturalWidth > 300")
        # the sample browser filtered to one S-NIAH cell
        model, task, length, depth = "tiny-gla-ccq", "ccq_s_niah_1", 2048, 50.0
        total = page.locator("details.cell").count()
        page.select_option("#filters select[name=model]", model)
        page.select_option("#filters select[name=task]", task)
        page.select_option("#filters select[name=length]", str(length))
        page.select_option("#filters select[name=depth]", "50")
        visible = page.locator("details.cell:visible")
        assert visible.count() == 1 and page.locator("details.cell:not(:visible)").count() == total - 1
        assert page.locator("#shown").inner_text() == f"1 of {total} shown"
        cell = visible.first
        n_samples, expected = _sniah_cell_failures(model, task, length, depth)
        assert expected, "the chosen cell should hold failures"
        assert f"{len(expected)} of {n_samples} failed" in cell.locator("summary").inner_text()
        cell.locator("summary").click()
        answers = cell.locator("code.expected")
        assert [answers.nth(i).inner_text() for i in range(answers.count())] == expected
        for index in range(answers.count()):
            assert answers.nth(index).is_visible()
            assert cell.locator("pre.context mark").nth(index).inner_text() == expected[index]
            assert cell.locator("pre.generated").nth(index).is_visible()
        # a filter back to "all" shows every block again
        for name in ("model", "task", "length", "depth"):
            page.select_option(f"#filters select[name={name}]", "")
        assert page.locator("details.cell:visible").count() == total
        assert errors == []
    finally:
        context.close()
    assert requests and all(url.startswith(("file:", "data:")) for url in requests), requests


def test_page_reads_with_scripts_off(browser, report_file):
    context, page, requests, _ = _open(browser, report_file, scripts=False)
    try:
        assert not page.locator("#filters").is_visible()  # the filters need the script; nothing else does
        cells = page.locator("details.cell")
        assert cells.count() > 0 and page.locator("details.cell:visible").count() == cells.count()
        assert page.locator("section.paper-table table").first.is_visible()
        cells.first.locator("summary").click()
        assert cells.first.locator(".sample, p").first.is_visible()
    finally:
        context.close()
    assert all(url.startswith(("file:", "data:")) for url in requests), requests
