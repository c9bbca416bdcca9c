"""The commands that read results on disk (`table`, `compare`, `figures`, `report`) and `archive`, which
copies them compactly. None of them loads torch, fla or a model."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from ccq_eval.cli.common import given_path, path_option
from ccq_eval.cli.errors import fail
from ccq_eval.errors import UserError


class TableFormat(StrEnum):
    markdown = "markdown"
    csv = "csv"
    latex = "latex"


class TableView(StrEnum):
    paper = "paper"
    tidy = "tidy"
    ruler = "ruler"
    recall = "recall"


class PAdjust(StrEnum):
    holm = "holm"
    bonferroni = "bonferroni"
    none = "none"


# RULER's effective-length threshold: the score of Llama-2-7B at 4K (NVIDIA/RULER README).
DEFAULT_RULER_THRESHOLD = 85.6
ThresholdOpt = Annotated[float, typer.Option(
    help="RULER view: the effective length is the longest length up to which the average over the RULER "
    "tasks stays at or above this accuracy (%); RULER's is 85.6.")]
PAdjustOpt = Annotated[PAdjust, typer.Option(
    "--p-adjust", help="Adjust the p-values for the number of comparisons printed: holm (default), "
    "bonferroni, or none (raw p-values are shown beside the adjusted ones).")]
ResultsArg = Annotated[Path, typer.Argument(help="Results folder written by `ccq-eval run` (or lm-eval).")]
FormatOpt = Annotated[TableFormat, typer.Option("--format", "-f", help="Output format.")]
OutputFileOpt = Annotated[Path | None, typer.Option(
    "--output", "-o", parser=path_option, metavar="PATH", help="Write to this file (default: stdout).")]


def emit(text: str, output: Path | None) -> None:
    """`text` on stdout, or written to the file `output` (atomically) with a note on stderr."""
    if output is None:
        typer.echo(text, nl=False)
        return
    from ccq_eval.atomic_io import atomic_write_text

    if output.is_dir():
        fail(f"--output {output} is a folder; give the path of a file to write")
    atomic_write_text(output, text)
    typer.echo(f"wrote {output}", err=True)


def _check_threshold(threshold: float) -> None:
    if not 0 <= threshold <= 100:
        fail(f"--threshold {threshold:g}: give an accuracy in percent, from 0 to 100 (RULER's is 85.6)")


def table(
    results: ResultsArg,
    format: Annotated[TableFormat, typer.Option(
        "--format", "-f", help="Output format. csv of the paper and ruler views: one block per table under a "
        "'# title' line; --view tidy --format csv is one frame.")] = TableFormat.markdown,
    view: Annotated[TableView, typer.Option(
        help="paper: the papers' pivots; tidy: one row per value; ruler: RULER's task x length table with the "
        "average per length and the effective length; recall: the Based / JRT recall table (SWDE, SQD, FDA, TQA, "
        "NQ, DROP, Avg.).")] = TableView.paper,
    digits: Annotated[int, typer.Option(help="Decimals shown (markdown / latex).")] = 2,
    threshold: ThresholdOpt = DEFAULT_RULER_THRESHOLD,
    output: OutputFileOpt = None,
) -> None:
    """Tables from results on disk: RULER / S-NIAH accuracy and perplexity per length, LongBench per dataset,
    the zero-shot suite in the GLA / Gated DeltaNet papers' layout."""
    output = given_path(output)
    if not 0 <= digits <= 15:
        fail(f"--digits {digits}: give a number of decimals from 0 to 15")
    _check_threshold(threshold)
    from ccq_eval.analysis import tables

    try:
        tidy = tables.load_tidy(results)
        text = tables.render_tables(tidy, format.value, view.value, digits, threshold=threshold)
    except UserError as exc:
        fail(str(exc))
    emit(text, output)


def compare(
    results: ResultsArg,
    baseline: Annotated[list[str] | None, typer.Option(
        help="Model name of the baseline (as in the results; repeat it to set each variant against several, e.g. "
        "the baselines of other families); default: every CCQ pair NAME / NAME-ccq and every "
        "`run --ccq-attach` lambda against its plain model.")] = None,
    variant: Annotated[list[str] | None, typer.Option(
        help="Model name of the variant (repeat it for several: each is set against each baseline).")] = None,
    metric: Annotated[str | None, typer.Option(
        help="Metric to compare (default: each task's primary one; a zero-shot task: each metric of the papers' "
        "table, LAMBADA's perplexity and acc).")] = None,
    format: FormatOpt = TableFormat.markdown,
    n_boot: Annotated[int, typer.Option(help="Bootstrap resamples.")] = 10_000,
    seed: Annotated[int, typer.Option(help="Bootstrap seed.")] = 0,
    alpha: Annotated[float, typer.Option(help="Significance level.")] = 0.05,
    p_adjust: PAdjustOpt = PAdjust.holm,
    summary: Annotated[bool, typer.Option(
        help="One table, a row per comparison and a column per task: delta [CI], p over all of a task's samples "
        "(perplexity: at the longest length); rows that set a model against another family's are grouped by "
        "backbone.")] = False,
    output: OutputFileOpt = None,
) -> None:
    """Variant vs baseline per task and length: delta, paired bootstrap CI, McNemar / sign-test p-value,
    adjusted (Holm by default) for every comparison printed."""
    output = given_path(output)
    from ccq_eval.analysis import stats
    from ccq_eval.harness import store

    if n_boot < 100:
        fail("--n-boot must be at least 100")
    if not 0 < alpha < 1:
        fail("--alpha must lie in (0, 1)")
    if (baseline is None) != (variant is None):
        fail("give both --baseline and --variant, or neither (then every CCQ pair NAME / NAME-ccq and every "
             "--ccq-attach lambda against its plain model is compared)")
    try:
        units = store.load_results(results)
        if baseline is None:
            pairs = stats.comparison_pairs(units)
            if not pairs:
                names = ", ".join(sorted({unit.model for unit in units}))
                fail(f"{results} holds no CCQ pair NAME / NAME-ccq and no --ccq-attach sweep with its plain model "
                     f"(models: {names}); name the two models with --baseline and --variant")
        else:
            pairs = [(base, var) for var in dict.fromkeys(variant) for base in dict.fromkeys(baseline)]
        compared_models = {name for pair in pairs for name in pair}
        missing = [unit.missing_samples() for unit in units if unit.model in compared_models]
        if any(missing):  # its rows would be left out without a word
            fail(next(line for line in missing if line))
        compared = [(base, var, stats.compare_models(units, base, var, metric=metric, n_boot=n_boot, seed=seed,
                                                     alpha=alpha, p_adjust=p_adjust.value)) for base, var in pairs]
    except UserError as exc:
        fail(str(exc))
    if summary:  # the report's first table comes from the same verdict_table
        emit(stats.render_verdict(*stats.verdict_table(units, compared, alpha=alpha, p_adjust=p_adjust.value),
                                  format.value), output)
    else:
        emit(stats.render_comparisons(compared, format.value, alpha=alpha, p_adjust=p_adjust.value), output)


def figures(
    results: ResultsArg,
    output: Annotated[Path, typer.Option("--output", "-o", parser=path_option, metavar="PATH",
                                         help="Folder for the PNG and PDF files.")]
    = Path("figures"),
    threshold: ThresholdOpt = DEFAULT_RULER_THRESHOLD,
) -> None:
    """Paper-style figures: S-NIAH heatmaps and curves, perplexity curves, LongBench bars, and score vs
    lambda of each `run --ccq-attach` sweep."""
    output = given_path(output)
    _check_threshold(threshold)
    from ccq_eval.analysis import figures as figure_module
    from ccq_eval.analysis import tables

    try:
        paths = figure_module.draw_all(tables.load_tidy(results), output, threshold=threshold)
    except UserError as exc:
        fail(str(exc))
    for path in paths:
        typer.echo(str(path))


def report(
    results: ResultsArg,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", parser=path_option, metavar="PATH",
        help="HTML file to write (default: RESULTS/report.html).")] = None,
    p_adjust: PAdjustOpt = PAdjust.holm,
    threshold: ThresholdOpt = DEFAULT_RULER_THRESHOLD,
) -> None:
    """One self-contained HTML page (opens offline in any browser): the run's metadata, tables, CCQ
    comparisons, figures and a filterable browser of failed S-NIAH samples and worst perplexity documents."""
    output = given_path(output)
    _check_threshold(threshold)
    from ccq_eval.analysis import report as report_module

    try:
        path = report_module.write_report(results, output, p_adjust=p_adjust.value, threshold=threshold)
    except UserError as exc:
        fail(str(exc))
    typer.echo(f"wrote {path}", err=True)


def archive(
    results: ResultsArg,
    destination: Annotated[Path, typer.Argument(help="Folder for the compact copy (e.g. results/<name>).")],
) -> None:
    """Compact copy of finished units for committing: xz results and samples without long prompt texts or
    machine paths, no resume cache, and the table of what was archived (table.md)."""
    from ccq_eval.harness import archive as archive_module

    if not results.is_dir():
        fail(f"results folder {results} does not exist; give the folder `ccq-eval run --output` wrote")
    source, destination = results.resolve(), destination.resolve()
    if source == destination or source in destination.parents:
        fail(f"{destination} lies inside {results}: choose a folder outside the results being archived")
    try:
        written = archive_module.archive_results(source, destination)
    except UserError as exc:
        fail(str(exc))
    if not written:
        fail(f"{results} holds no finished unit (results.json) to archive; give the folder of a finished run")
    from ccq_eval.analysis import tables
    from ccq_eval.harness.store import atomic_write_text

    try:  # the archive's table, as `run` writes one beside its results
        atomic_write_text(destination / "table.md", tables.render_tables(tables.load_tidy(destination)))
    except UserError as exc:
        fail(f"archived {len(written)} units into {destination}, but its table.md could not be written: {exc}")
    typer.echo(f"archived {len(written)} units into {destination} (table: {destination / 'table.md'})")
