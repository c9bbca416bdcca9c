"""ccq-eval: evaluate linear-attention LMs with and without CCQ on long-context tasks.

Thin typer front end; the work happens in ccq_eval.harness (plan, runner, results_store) and
ccq_eval.analysis (tables, stats, figures). Imports are lazy: `tasks`, `models`, `table`, `compare`,
`figures` and `report` read files and never load torch, fla or a model, and argument errors appear at once.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ccq_eval import logs

if TYPE_CHECKING:  # the harness is imported lazily (see the module docstring)
    from ccq_eval.harness.plan import RunPlan
    from ccq_eval.harness.runner import RunSummary


def _debugging() -> bool:
    """CCQ_EVAL_DEBUG=1 or --verbosity DEBUG: unexpected errors show their traceback."""
    import logging
    import os

    return os.environ.get("CCQ_EVAL_DEBUG", "") not in ("", "0") or logging.getLogger("ccq_eval").isEnabledFor(
        logging.DEBUG)


def one_line(exc: BaseException) -> str:
    """An exception as one line: our own errors by their message, others with their type."""
    known = {"PlanError", "ResultsError", "CheckpointError", "ModelLoadError", "RegistryError"}
    text = " ".join(str(exc).split())
    return text if type(exc).__name__ in known else f"{type(exc).__name__}: {text}"


def _one_line_errors(command):
    """Wraps a command so that an exception it does not handle becomes one line on stderr (exit 1),
    not a traceback; with CCQ_EVAL_DEBUG=1 or --verbosity DEBUG the traceback is shown."""
    import functools

    import click

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            _fail("interrupted; rerun the command to finish (a run resumes where it stopped)", code=130)
        except BrokenPipeError:
            _stdout_closed()
        except Exception as exc:  # the point: no traceback for the user
            if _debugging():
                raise
            _fail(f"{one_line(exc)} (CCQ_EVAL_DEBUG=1 shows the traceback; report it if the cause is unclear)",
                  code=1)

    return wrapper


def _stdout_closed() -> None:
    """The reader of stdout went away (`ccq-eval lm-eval ls | head`): stop quietly, as command-line tools
    do; stdout goes to /dev/null so that Python's last flush does not report the closed pipe either."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise typer.Exit(1)


def _path_option(text: str | Path) -> Path | str:
    """The value of a path option (typer passes the default as it is); an empty one stays "" (Path("")
    would be the current folder), which _given_path refuses."""
    return Path(text) if isinstance(text, Path) or text.strip() else ""


def _given_path(value: Path | str | None) -> Path | None:
    if isinstance(value, str):
        _fail("--output is empty; give a path, or leave the option out for its default")
    return value


class _App(typer.Typer):
    """typer.Typer whose commands report unexpected errors in one line (_one_line_errors)."""

    def command(self, *args, **kwargs):
        register = super().command(*args, **kwargs)
        return lambda function: register(_one_line_errors(function))


app = _App(
    name="ccq-eval",
    help="Long-context evaluation of linear-attention LMs (GLA, Gated DeltaNet) with and without CCQ.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wraps long option names instead of cutting them off
)


class TableFormat(str, Enum):
    markdown = "markdown"
    csv = "csv"
    latex = "latex"


class TableView(str, Enum):
    paper = "paper"
    tidy = "tidy"


# Values of --dtype (ccq_eval.harness.plan.DTYPE_CHOICES, listed here so that --help needs no import).
Dtype = Enum("Dtype", {name: name for name in (
    "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64", "fp64", "auto")}, type=str)
Verbosity = Enum("Verbosity", {name: name for name in logs.VERBOSITY_LEVELS}, type=str)
# Values of --suite (ccq_eval.harness.plan.SUITES, listed here so that --help needs no import).
SuiteName = Enum("SuiteName", {"paper": "paper"}, type=str)

ResultsArg = Annotated[Path, typer.Argument(help="Results folder written by `ccq-eval run` (or lm-eval).")]
FormatOpt = Annotated[TableFormat, typer.Option("--format", "-f", help="Output format.")]
OutputFileOpt = Annotated[Path | None, typer.Option(
    "--output", "-o", parser=_path_option, metavar="PATH", help="Write to this file (default: stdout).")]
# The filter that shows each warning once in this process (set by the app's callback).
_warnings_once: logs.OncePerRun | None = None


def _version(show: bool) -> None:
    if show:
        from ccq_eval import __version__

        typer.echo(f"ccq-eval {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    verbosity: Annotated[Verbosity, typer.Option(
        "--verbosity", case_sensitive=False, help="Log level of ccq-eval and lm-eval messages (DEBUG also "
        "shows tracebacks).")] = Verbosity.WARNING,
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Show the version and exit.")] = False,
) -> None:
    """Long-context evaluation of linear-attention LMs (GLA, Gated DeltaNet) with and without CCQ."""
    global _warnings_once
    _warnings_once = logs.configure(verbosity.value)


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code)


def _emit(text: str, output: Path | None) -> None:
    if output is None:
        typer.echo(text, nl=False)
    else:
        from ccq_eval.harness.results_store import atomic_write_text

        if output.is_dir():
            _fail(f"--output {output} is a folder; give the path of a file to write")

        atomic_write_text(output, text)
        typer.echo(f"wrote {output}", err=True)


@app.command()
def run(
    model: Annotated[list[str], typer.Option(
        "--model", "-m", help="Registered model name or checkpoint folder; repeat for several. "
        "Default: the registry's default models.")] = [],  # noqa: B006 (typer needs a literal default)
    task: Annotated[list[str], typer.Option(
        "--task", "-t", help="Task alias (s-niah, s-niah-1/2/3, ppl, longbench, longbench-e) or lm-eval task "
        "name; repeat for several. Default: s-niah and ppl.")] = [],  # noqa: B006
    suite: Annotated[SuiteName | None, typer.Option(
        help="A fixed grid instead of --task / --lengths (`ccq-eval tasks` lists it): paper = "
        "S-NIAH-1/2/3 at 1K-8K (and past the training context), perplexity (both protocols) at 4K-20K, "
        "LongBench / LongBench-E where --longbench-dir holds their data.")] = None,
    lengths: Annotated[str | None, typer.Option(help="Context lengths in tokens, e.g. 1k,2k,4k (k = 1024).")] = None,
    depths: Annotated[str | None, typer.Option(help="S-NIAH needle depths in percent, e.g. 0,25,50,75,100.")] = None,
    samples_per_cell: Annotated[int | None, typer.Option(
        help="Samples per (length, depth) cell (perplexity: documents per length). Default: 4 on the default "
        "grid (no --task); with --task, every document the task has.")] = None,
    limit: Annotated[float | None, typer.Option(
        help="lm-eval limit: first N documents of each task (a fraction if < 1). Not with --samples-per-cell.")]
    = None,
    device: Annotated[str, typer.Option(
        help="Torch device: auto (CUDA when present, else CPU), cpu, cuda, cuda:1.")] = "auto",
    dtype: Annotated[Dtype, typer.Option(
        help="Weights and compute dtype; auto: bfloat16 on CUDA, float32 on CPU.")] = Dtype.auto,
    batch_size: Annotated[int | None, typer.Option(
        help="Requests per forward: scoring batches equal-length texts; generation with recurrent fla models "
        "decodes prompts of any length together. Default: for those on CUDA with CUDA graphs, each batch "
        "as many as free GPU memory holds for its longest (a power of two up to 64), else 1.")] = None,
    max_length: Annotated[int | None, typer.Option(
        help="Context budget of the adapter in tokens (default: the longest of --lengths).")] = None,
    seed: Annotated[int, typer.Option(help="Seed for data generation, sampling and lm-eval.")] = 0,
    output: Annotated[Path, typer.Option("--output", "-o", parser=_path_option, metavar="PATH",
                                         help="Results folder.")] = Path("results/latest"),
    lm_eval_arg: Annotated[list[str], typer.Option(
        "--lm-eval-arg", help="Extra lm_eval.simple_evaluate argument as key=value (repeatable), "
        "e.g. bootstrap_iters=0.")] = [],  # noqa: B006
    longbench_dir: Annotated[Path | None, typer.Option(
        help="Folder with LongBench jsonl files (<dataset>.jsonl, the original format).")] = None,
    keep_going: Annotated[bool, typer.Option(
        help="Continue with the next unit when one fails (default: stop).")] = False,
    cuda_graphs: Annotated[bool | None, typer.Option(
        "--cuda-graphs/--no-cuda-graphs",
        help="Replay decode steps and scoring forwards from CUDA graphs: removes the host-side cost that "
        "bounds mid-size models on a fast GPU; scores differ from eager ones by rounding. Default: on for "
        "recurrent fla models on CUDA, off elsewhere; --no-cuda-graphs runs eagerly.")] = None,
    shard: Annotated[str | None, typer.Option(
        help="K/N: run only the K-th of N deterministic parts of the units (a Slurm array task); workers "
        "into one --output also share units through per-unit locks without it.")] = None,
    ccq_attach: Annotated[str | None, typer.Option(
        help="Attach CCQ training-free to each plain GLA / Gated DeltaNet --model with the constant gate: every "
        "lambda is evaluated as its own model <model>+ccq-lambda<L>; other CCQ config fields fixed after ';', "
        "e.g. \"lambda=0,0.5,1,2,4;order=2\". `figures` draws score vs lambda.")] = None,
    workers: Annotated[int | None, typer.Option(
        min=1, help="Processes that share the units (each under its lock). Default: on a CPU, one per core "
        "the evaluation's torch threads leave free (2 on a 2-core machine); on a GPU, 1.")] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bars.")] = False,
    report: Annotated[bool, typer.Option(
        help="After the run, write the paper-style table (table.md), figures (figures/) and an HTML "
        "report (report.html) into the results folder.")] = True,
) -> None:
    """Evaluate models on tasks; each (model, task) unit is stored as soon as it finishes.

    Re-running the same command skips finished units and resumes an interrupted one without re-asking the model what it already answered.
    """
    output = _given_path(output)
    if quiet:
        logs.silence_progress_bars()  # before lm-eval and transformers are imported
    from ccq_eval.harness import plan as run_plan

    options = run_plan.RunOptions(
        models=list(model), tasks=list(task), suite=suite.value if suite else None, lengths=lengths, depths=depths,
        samples_per_cell=samples_per_cell, limit=limit, device=device, dtype=dtype.value,
        batch_size=batch_size, max_length=max_length, seed=seed, output=output,
        lm_eval_args=list(lm_eval_arg), longbench_dir=longbench_dir, keep_going=keep_going,
        cuda_graphs=cuda_graphs, shard=shard, ccq_attach=ccq_attach,
    )
    try:
        plan = run_plan.plan_run(options)
    except run_plan.PlanError as exc:
        _fail(str(exc))
    _echo_plan(plan, output, shard)
    summary, leader = _execute(plan, quiet, workers)
    _echo_run_summary(summary, output)
    if report and leader:
        _report_when_complete(plan, summary, output)
    if summary.failed:
        raise typer.Exit(1)


def _echo_plan(plan: RunPlan, output: Path, shard: str | None) -> None:
    """What the run holds: units, models x tasks, how many are finished, and the planning notes."""
    done = sum(unit.finished for unit in plan.units)  # with --shard, pending holds this shard's units only
    typer.echo(
        f"{len(plan.units)} units ({len({u.model for u in plan.units})} models x "
        f"{len({u.task for u in plan.units})} tasks), {done} already finished, output {output}"
        + (f"; shard {shard}: {len(plan.pending)} to run here" if shard else ""), err=True
    )
    for note in plan.notes:
        typer.echo(note, err=True)


def _execute(plan: RunPlan, quiet: bool, workers: int | None) -> tuple[RunSummary, bool]:
    """(summary, whether this process leads: rank 0 of a data-parallel launch shows progress unless quiet);
    a failure ends the command with a line that says the finished units are kept. workers None: "auto"."""
    from ccq_eval.harness import reporting, runner

    if _warnings_once is not None:
        _warnings_once.drop_metadata_hint = True  # the runner passes every task its metadata
    leader = runner.process_rank() == 0  # data-parallel (torchrun): rank 0 reports and writes
    reporter = reporting.SilentReporter() if quiet or not leader else reporting.RichReporter()
    try:
        return runner.execute_plan(plan, reporter=reporter, workers=workers), leader
    except KeyboardInterrupt:
        _fail("interrupted. Finished units and every answered request are saved; rerun the same command "
              "to resume.", code=130)
    except Exception as exc:  # any failure of a unit: say which, and that nothing is lost
        if _debugging():
            raise
        _fail(f"{one_line(exc)}; finished units are saved: fix the cause and rerun the same command to resume",
              code=1)


def _echo_run_summary(summary: RunSummary, output: Path) -> None:
    """Each failed unit, then the counts of evaluated, skipped and failed units."""
    for unit, detail in summary.failed:
        typer.echo(f"failed: {unit.model} / {unit.task}: {detail}", err=True)
    elsewhere = f", {len(summary.elsewhere)} finished by another worker" if summary.elsewhere else ""
    typer.echo(f"done: {len(summary.done)} evaluated, {len(summary.skipped)} skipped (already finished)"
               f"{elsewhere}, {len(summary.failed)} failed. Results in {output}", err=True)


def _report_when_complete(plan: RunPlan, summary: RunSummary, output: Path) -> None:
    """The table, figures and HTML report once every unit of the grid is finished; else why not."""
    unfinished = [unit for unit in plan.units if not unit.dir.is_finished()]
    if not unfinished:  # a failed unit that stored a non-finite result is shown as failed
        _write_report(output)
    elif summary.failed:
        typer.echo(f"table.md not written: {len(unfinished)} units of this grid are not finished; fix "
                   f"the failures above and rerun the same command, or run `ccq-eval table {output}` for "
                   "a table of the finished units", err=True)
    else:
        typer.echo(f"table.md not written: {len(unfinished)} units of this grid are not finished yet (other "
                   f"shards); the worker that finishes last writes it, or run `ccq-eval table {output}`",
                   err=True)


def _write_report(results: Path) -> None:
    """The table and figures of everything in `results`, as `table` and `figures` would write them."""
    import filelock

    from ccq_eval.analysis import figures as figure_module
    from ccq_eval.analysis import tables
    from ccq_eval.harness.results_store import ResultsError, atomic_write_text

    try:
        with filelock.FileLock(str(results / ".report.lock")):  # workers sharing the folder write it in turn
            tidy = tables.load_tidy(results)
            atomic_write_text(results / "table.md", tables.render_tables(tidy, "markdown", "paper", 2))
            paths = figure_module.draw_all(tidy, results / "figures")
            page = _write_html_report(results, paths)
    except (ResultsError, OSError) as exc:
        _fail(f"the units are stored, but the report was not written: {one_line(exc)}; fix that, then run "
              f"`ccq-eval table {results}` (or rerun this command)", code=1)
    typer.echo(f"table: {results / 'table.md'}; figures: {results / 'figures'} ({len(paths)} files)"
               + (f"; report: {page}" if page else ""), err=True)


def _write_html_report(results: Path, figure_paths: list[Path]) -> Path | None:
    """report.html beside table.md; a failure only warns (the units, table and figures are written)."""
    from ccq_eval.analysis import report as report_module

    try:
        return report_module.write_report(results, figure_paths=figure_paths)
    except Exception as exc:  # whatever breaks the page must not fail a finished run
        if _debugging():
            raise
        typer.echo(f"warning: report.html not written ({one_line(exc)}); run `ccq-eval report {results}` "
                   "once the cause is fixed", err=True)
        return None


@app.command()
def table(
    results: ResultsArg,
    format: FormatOpt = TableFormat.markdown,
    view: Annotated[TableView, typer.Option(
        help="paper: the papers' pivots; tidy: one row per value.")] = TableView.paper,
    digits: Annotated[int, typer.Option(help="Decimals shown (markdown / latex).")] = 2,
    output: OutputFileOpt = None,
) -> None:
    """Tables from results on disk: S-NIAH accuracy and perplexity per length, LongBench per dataset."""
    output = _given_path(output)
    if not 0 <= digits <= 15:
        _fail(f"--digits {digits}: give a number of decimals from 0 to 15")
    from ccq_eval.analysis import tables
    from ccq_eval.harness.results_store import ResultsError

    try:
        tidy = tables.load_tidy(results)
        text = tables.render_tables(tidy, format.value, view.value, digits)
    except ResultsError as exc:
        _fail(str(exc))
    _emit(text, output)


@app.command()
def compare(
    results: ResultsArg,
    baseline: Annotated[str | None, typer.Option(
        help="Model name of the baseline (as in the results); default: every CCQ pair NAME / NAME-ccq and every "
        "`run --ccq-attach` lambda against its plain model.")] = None,
    variant: Annotated[str | None, typer.Option(help="Model name of the variant.")] = None,
    metric: Annotated[str | None, typer.Option(help="Metric to compare (default: each task's first).")] = None,
    format: FormatOpt = TableFormat.markdown,
    n_boot: Annotated[int, typer.Option(help="Bootstrap resamples.")] = 10_000,
    seed: Annotated[int, typer.Option(help="Bootstrap seed.")] = 0,
    alpha: Annotated[float, typer.Option(help="Significance level.")] = 0.05,
    summary: Annotated[bool, typer.Option(
        help="One table, a row per comparison and a column per task: delta [CI], p over all of a task's samples "
        "(perplexity: at the longest length).")] = False,
    output: OutputFileOpt = None,
) -> None:
    """Variant vs baseline per task and length: delta, paired bootstrap CI, McNemar / sign-test p-value."""
    output = _given_path(output)
    from ccq_eval.analysis import stats
    from ccq_eval.harness import results_store

    if n_boot < 100:
        _fail("--n-boot must be at least 100")
    if not 0 < alpha < 1:
        _fail("--alpha must lie in (0, 1)")
    if (baseline is None) != (variant is None):
        _fail("give both --baseline and --variant, or neither (then every CCQ pair NAME / NAME-ccq and every "
              "--ccq-attach lambda against its plain model is compared)")
    try:
        units = results_store.load_results(results)
        if baseline is None:
            pairs = stats.comparison_pairs(units)
            if not pairs:
                names = ", ".join(sorted({unit.model for unit in units}))
                _fail(f"{results} holds no CCQ pair NAME / NAME-ccq and no --ccq-attach sweep with its plain model "
                      f"(models: {names}); name the two models with --baseline and --variant")
        else:
            pairs = [(baseline, variant)]
        compared = [(base, var, stats.compare_models(units, base, var, metric=metric, n_boot=n_boot, seed=seed,
                                                     alpha=alpha)) for base, var in pairs]
    except results_store.ResultsError as exc:
        _fail(str(exc))
    if summary:
        _emit(stats.render_summary(compared, format.value, alpha=alpha), output)
    else:
        _emit("\n".join(stats.render_comparison(frame, base, var, format.value, alpha=alpha)
                         for base, var, frame in compared), output)


@app.command()
def figures(
    results: ResultsArg,
    output: Annotated[Path, typer.Option("--output", "-o", parser=_path_option, metavar="PATH",
                                         help="Folder for the PNG and PDF files.")]
    = Path("figures"),
) -> None:
    """Paper-style figures: S-NIAH heatmaps and curves, perplexity curves, LongBench bars, and score vs
    lambda of each `run --ccq-attach` sweep."""
    output = _given_path(output)
    from ccq_eval.analysis import figures as figure_module
    from ccq_eval.analysis import tables
    from ccq_eval.harness.results_store import ResultsError

    try:
        paths = figure_module.draw_all(tables.load_tidy(results), output)
    except ResultsError as exc:
        _fail(str(exc))
    for path in paths:
        typer.echo(str(path))


@app.command("report")
def report_command(
    results: ResultsArg,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", parser=_path_option, metavar="PATH",
        help="HTML file to write (default: RESULTS/report.html).")] = None,
) -> None:
    """One self-contained HTML page (opens offline in any browser): the run's metadata, tables, CCQ
    comparisons, figures and a filterable browser of failed S-NIAH samples and worst perplexity documents."""
    output = _given_path(output)
    from ccq_eval.analysis import report as report_module
    from ccq_eval.harness.results_store import ResultsError

    try:
        path = report_module.write_report(results, output)
    except ResultsError as exc:
        _fail(str(exc))
    typer.echo(f"wrote {path}", err=True)


@app.command()
def archive(
    results: ResultsArg,
    destination: Annotated[Path, typer.Argument(help="Folder for the compact copy (e.g. results/<name>).")],
) -> None:
    """Compact copy of finished units for committing: xz samples without long prompt texts, no resume cache."""
    from ccq_eval.harness import archive, results_store

    if not results.is_dir():
        _fail(f"results folder {results} does not exist; give the folder `ccq-eval run --output` wrote")
    source, destination = results.resolve(), destination.resolve()
    if source == destination or source in destination.parents:
        _fail(f"{destination} lies inside {results}: choose a folder outside the results being archived")
    try:
        written = archive.archive_results(source, destination)
    except results_store.ResultsError as exc:
        _fail(str(exc))
    if not written:
        _fail(f"{results} holds no finished unit (results.json) to archive; give the folder of a finished run")
    typer.echo(f"archived {len(written)} units into {destination}")


@app.command("inspect")
def inspect_command(
    model: Annotated[list[str], typer.Option(
        "--model", "-m", help="GLA / Gated DeltaNet model (registered name or checkpoint folder), with or without "
        "CCQ; repeat for several.")],
    task: Annotated[str, typer.Option("--task", "-t", help="s-niah-1, s-niah-2 or s-niah-3.")] = "s-niah-1",
    lengths: Annotated[str, typer.Option(help="Prompt lengths in tokens, e.g. 1k,4k (k = 1024).")] = "1k",
    depths: Annotated[str, typer.Option(help="Needle depths in percent, e.g. 0,50,100.")] = "0,50,100",
    output: Annotated[Path, typer.Option("--output", "-o", parser=_path_option, metavar="PATH",
                                         help="Folder for the tables and figures.")]
    = Path("inspect"),
    device: Annotated[str, typer.Option(help="Torch device: auto (CUDA when present), cpu, cuda.")] = "auto",
    dtype: Annotated[Dtype, typer.Option(help="Weights and compute dtype (auto: float32).")] = Dtype.auto,
    positions: Annotated[int, typer.Option(
        help="Positions per prompt sampled for positions.csv (plus the needle's ends and the answer).")] = 64,
    baseline_lambda: Annotated[float | None, typer.Option(
        help="Constant lambda of the CCQ read computed for baselines (default: the gate's initial value, "
        "ccq_lambda_max * sigmoid(ccq_gate_bias_init) = 2 for the default config).")] = None,
    seed: Annotated[int, typer.Option(help="S-NIAH seed (the task's default: 42).")] = 42,
    mechanism_figure: Annotated[Path | None, typer.Option(
        help="Also write one small PNG here (e.g. docs/ccq-mechanism.png): the needle share of the read per "
        "layer, CCQ's read against the plain one (lambda = 0), one panel per model.")] = None,
) -> None:
    """What the read does on S-NIAH prompts, per layer and head: the gate lambda_t, the key covariance's
    spectrum, how far CCQ moves the query, and the needle's share of the read with CCQ on and off.

    Writes reads.csv, spectra.csv, positions.csv, inspect.json and figures into --output.
    """
    output = _given_path(output)
    from ccq_eval.harness.options import PlanError, parse_depths, parse_lengths
    from ccq_eval.inspection import InspectError

    try:
        options_lengths, options_depths = parse_lengths(lengths), parse_depths(depths)
    except PlanError as exc:
        _fail(str(exc))
    from ccq_eval.inspection.run import InspectOptions, run_inspect
    from ccq_eval.model.loading import ModelLoadError

    options = InspectOptions(
        models=list(model), task=task, lengths=options_lengths, depths=options_depths, output=output,
        device=device, dtype="float32" if dtype.value == "auto" else dtype.value, positions=positions,
        baseline_lambda=baseline_lambda, seed=seed, mechanism_figure=mechanism_figure)
    try:
        written = run_inspect(options, progress=lambda message: typer.echo(message, err=True))
    except (InspectError, ModelLoadError) as exc:
        _fail(str(exc))
    typer.echo(f"wrote {len(written)} files into {output}", err=True)


@app.command()
def tasks() -> None:
    """List the tasks `run --task` accepts, and the suites `run --suite` runs."""
    from ccq_eval.harness import plan as run_plan

    try:
        listing = run_plan.default_task_catalog().aliases()
    except run_plan.PlanError as exc:
        _fail(str(exc))
    width = max((len(name) for name in listing), default=0)
    for name, description in listing.items():
        typer.echo(f"{name:<{width}}  {description}")
    typer.echo("\nSuites (run --suite NAME):")
    for name, suite in run_plan.SUITES.items():
        typer.echo(f"{name:<{width}}  {suite.description}")
    typer.echo("\nAny lm-eval task name is accepted as well.", err=True)


@app.command()
def models() -> None:
    """List the registered models `run --model` accepts (checkpoint folders work too)."""
    from ccq_eval.model import registry as model_registry

    try:
        registry = model_registry.load_model_registry()
    except model_registry.RegistryError as exc:
        _fail(str(exc))
    if not registry:
        _fail(f"no models registered in {model_registry.MODEL_REGISTRY_PATH}; pass a checkpoint folder to --model", 1)
    width = max(len(name) for name in registry)
    for entry in registry.values():
        mark = " (default)" if entry.default else ""
        typer.echo(f"{entry.name:<{width}}  {entry.description}{mark}")


@app.command("lm-eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                          "help_option_names": []})
def lm_eval_cli(ctx: typer.Context) -> None:
    """lm-eval's own CLI with the `ccq` model registered, e.g. `ccq-eval lm-eval run --model ccq
    --model_args pretrained=tiny-gla-ccq,max_length=2048 --tasks ccq_s_niah_1 --include_path FOLDER
    --metadata '{"tokenizer": "byt5", "lengths": [1024, 2048]}'`, FOLDER being that of the installed
    package ccq_eval.tasks (`python -c 'import ccq_eval.tasks as t; print(t.__path__[0])'`).

    lm-eval has no plugin discovery, so its plain `lm-eval` command does not know the `ccq` model.
    """
    from lm_eval.__main__ import cli_evaluate

    import ccq_eval.harness.adapter  # noqa: F401  (registers the "ccq" model with lm-eval)

    args = list(ctx.args)
    if _warnings_once is not None:
        _warnings_once.drop_metadata_hint = any(arg.startswith("--metadata") for arg in args)
        logs.hand_over_to_lm_eval(_warnings_once)
    if args[:1] == ["run"] and not any(arg.split("=")[0] == "--device" for arg in args):
        import torch

        if not torch.cuda.is_available():  # lm-eval's default device is CUDA, also without one
            args += ["--device", "cpu"]
    sys.argv = ["lm-eval", *args]
    cli_evaluate()

