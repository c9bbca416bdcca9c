"""`ccq-eval run`: plan the (model, task) units, evaluate the unfinished ones, print one line per unit and
a summary, then write the table, figures and HTML report once the grid is complete."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ccq_eval import logs
from ccq_eval.cli.common import Dtype, given_path, path_option
from ccq_eval.cli.errors import debugging, fail, one_line
from ccq_eval.errors import UserError
from ccq_eval.harness.run_options import DEFAULT_SEED

if TYPE_CHECKING:  # the harness is imported lazily (argument errors appear at once)
    from ccq_eval.harness.plan import RunPlan
    from ccq_eval.harness.reporting import Reporter
    from ccq_eval.harness.runner import RunSummary

ModelOpt = Annotated[list[str], typer.Option(
    "--model", "-m", metavar="<model>", help="Registered model name or checkpoint folder; repeat for several. "
    "Default: the registry's default models, and the training-free CCQ sweep of the twins' baselines.")]
TaskOpt = Annotated[list[str], typer.Option(
    "--task", "-t", metavar="<task>",
    help="Task alias (s-niah, s-niah-1/2/3, ppl, longbench, longbench-e, ruler, zeroshot, recall; "
    "`ccq-eval tasks` lists them) or lm-eval task name, but for those of lm-eval's RULER port (ruler_vt, "
    "niah_single_1, ...: use ours); repeat for several. Default: s-niah and ppl.")]
# Values of --suite (ccq_eval.harness.suites.SUITES, listed here so that --help needs no import).
SuiteName = Enum("SuiteName", {name: name for name in ("paper", "ruler", "zeroshot", "recall")}, type=str)
# Values of --rolling-windows (ccq_eval.harness.zeroshot.ROLLING_PROTOCOLS).
RollingWindows = Enum("RollingWindows", {name: name for name in ("hflm", "carry")}, type=str)
SuiteOpt = Annotated[SuiteName | None, typer.Option(
    help="A fixed grid instead of --task / --lengths (`ccq-eval tasks` lists them): paper = "
    "S-NIAH-1/2/3 at 1K-8K (and past the training context), perplexity (both protocols) at 4K-20K, "
    "LongBench / LongBench-E where --longbench-dir holds their data, and the zero-shot table where its data "
    "is found; ruler = RULER's 13 tasks at 4K-32K; zeroshot = the GLA / Gated DeltaNet papers' zero-shot "
    "table (lm-eval's wikitext ... social_iqa); recall = the Based / JRT recall table (SWDE ... DROP).")]
LengthsOpt = Annotated[str | None, typer.Option(help="Context lengths in tokens, e.g. 1k,2k,4k (k = 1024).")]
DepthsOpt = Annotated[str | None, typer.Option(
    help="Needle depths in percent, e.g. 0,25,50,75,100 (S-NIAH and RULER NIAH, QA and VT; the other families "
    "have none). Default: 0,50,100 on the default grid (no --task); with --task or --suite, those tasks' own "
    "10 depths, 0,11,22,...,100, so that each length has 10 cells of --samples-per-cell each.")]
SamplesOpt = Annotated[int | None, typer.Option(
    help="Samples per (length, depth) cell (perplexity: documents per length). Default: 4 on the default "
    "grid (no --task); with --task, the task's own (S-NIAH and RULER: 1 per cell; perplexity: every "
    "document).")]
LimitOpt = Annotated[float | None, typer.Option(
    help="lm-eval limit: first N documents of each task (a fraction if < 1). Not with --samples-per-cell.")]
DeviceOpt = Annotated[str, typer.Option(
    help="Torch device: auto (CUDA when present, else CPU), cpu, cuda, cuda:1.")]
DtypeOpt = Annotated[Dtype, typer.Option(
    help="Weights and compute dtype; auto: bfloat16 on CUDA, float32 on CPU.")]
BatchSizeOpt = Annotated[int | None, typer.Option(
    help="Requests per forward: scoring batches equal-length texts; generation with recurrent fla models "
    "decodes prompts of any length together. Default: for those on CUDA with CUDA graphs, each batch "
    "as many as free GPU memory holds for its longest (a power of two up to 64), else 1.")]
MaxLengthOpt = Annotated[int | None, typer.Option(
    help="Context budget of the adapter in tokens (default: the longest of --lengths). Zero-shot units: lm-eval "
    "HFLM's max length (default: the model config's), longer contexts cut from the left as HFLM cuts them.")]
SeedOpt = Annotated[int, typer.Option(help="Seed for data generation, sampling and lm-eval.")]
OutputOpt = Annotated[Path, typer.Option("--output", "-o", parser=path_option, metavar="PATH",
                                         help="Results folder.")]
LmEvalArgOpt = Annotated[list[str], typer.Option(
    "--lm-eval-arg", metavar="<key=value>", help="Extra lm_eval.simple_evaluate argument as key=value (repeatable), "
    "e.g. bootstrap_iters=0.")]
LongBenchDirOpt = Annotated[Path | None, typer.Option(
    help="Folder with LongBench jsonl files (<dataset>.jsonl, the original format).")]
QaDirOpt = Annotated[Path | None, typer.Option(
    help="Folder with the data of the RULER QA tasks (SQuAD v2 dev-v2.0.json, HotpotQA "
    "hotpot_dev_distractor_v1.json); default: the Hugging Face hub.")]
ZeroshotDirOpt = Annotated[Path | None, typer.Option(
    help="Folder with the zero-shot suite's data as <task>/<split>.jsonl in each dataset's schema; "
    "default: the Hugging Face hub, else the datasets cache.")]
RollingWindowsOpt = Annotated[RollingWindows | None, typer.Option(
    help="How the zero-shot suite scores wikitext: hflm (default, lm-eval HFLM's disjoint windows, as the "
    "papers report it) or carry (one recurrent pass over each text).")]
RecallDirOpt = Annotated[Path | None, typer.Option(
    help="Folder with the recall tasks' data as <dataset>/validation.jsonl (swde, fda, squad, triviaqa, drop, "
    "nq_2048 / nq_1024 / nq_512) in each dataset's field layout; default: the Hugging Face hub, else the "
    "datasets cache.")]
# Values of --recall-protocol and --recall-prompt (ccq_eval.harness.options.RECALL_PROTOCOLS / RECALL_PROMPTS).
RecallProtocol = Enum("RecallProtocol", {name: name for name in ("jrt", "lm-eval")}, type=str)
RecallPrompt = Enum("RecallPrompt", {name: name for name in ("once", "twice")}, type=str)
RecallProtocolOpt = Annotated[RecallProtocol | None, typer.Option(
    help="Rules of the recall table: jrt (default; the JRT harness's cut around the answer, per-task prompts, "
    "as the papers report it) or lm-eval (lm-eval's own swde, fda, squad_completion, uncut).")]
RecallLengthOpt = Annotated[int | None, typer.Option(
    help="jrt: tokens each document is cut to, in the evaluated model's tokens (default 2048; NQ has datasets "
    "for 512, 1024, 2048).")]
RecallPromptOpt = Annotated[RecallPrompt | None, typer.Option(
    help="jrt: once (default) or twice (JRT's read-twice prompt: the document repeated before the question).")]
KeepGoingOpt = Annotated[bool, typer.Option(help="Continue with the next unit when one fails (default: stop).")]
CudaGraphsOpt = Annotated[bool | None, typer.Option(
    "--cuda-graphs/--no-cuda-graphs",
    help="Replay decode steps and scoring forwards from CUDA graphs: removes the host-side cost that "
    "bounds mid-size models on a fast GPU; scores differ from eager ones by rounding. Default: on for "
    "recurrent fla models on CUDA, off elsewhere; --no-cuda-graphs runs eagerly.")]
ShardOpt = Annotated[str | None, typer.Option(
    help="K/N: run only the K-th of N deterministic parts of the units (a Slurm array task); workers "
    "into one --output also share units through per-unit locks without it.")]
CcqAttachOpt = Annotated[str | None, typer.Option(
    help="Attach CCQ training-free to each plain --model (GLA, Gated DeltaNet, DeltaNet, KDA, RetNet, Mamba2 or "
    "Preconditioned Gated DeltaNet) with the constant gate: every "
    "lambda is evaluated as its own model <model>+ccq-lambda<L>; other CCQ config fields fixed after ';', "
    "e.g. \"lambda=0,0.5,1,2,4;order=2\". `figures` draws score vs lambda.")]
WorkersOpt = Annotated[int | None, typer.Option(
    min=1, metavar="<int>", help="Processes that share the units (each under its lock). Default: on a CPU, one "
    "per core the evaluation's torch threads leave free (2 on a 2-core machine); on a GPU, 1.")]
QuietOpt = Annotated[bool, typer.Option(help="No line per unit (only the plan, failures and the summary).")]
ProgressOpt = Annotated[bool, typer.Option(
    help="Progress bars: the run's units and the current unit's requests, and those of lm-eval and "
    "transformers (default: one line per unit as it ends).")]
ReportOpt = Annotated[bool, typer.Option(
    help="After the run, write the paper-style table (table.md), figures (figures/) and an HTML "
    "report (report.html) into the results folder.")]


def run(
    model: ModelOpt = [],  # noqa: B006 (typer needs a literal default)
    task: TaskOpt = [],  # noqa: B006
    suite: SuiteOpt = None,
    lengths: LengthsOpt = None,
    depths: DepthsOpt = None,
    samples_per_cell: SamplesOpt = None,
    limit: LimitOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = Dtype.auto,
    batch_size: BatchSizeOpt = None,
    max_length: MaxLengthOpt = None,
    seed: SeedOpt = DEFAULT_SEED,
    output: OutputOpt = Path("results/latest"),
    lm_eval_arg: LmEvalArgOpt = [],  # noqa: B006
    longbench_dir: LongBenchDirOpt = None,
    qa_dir: QaDirOpt = None,
    zeroshot_dir: ZeroshotDirOpt = None,
    rolling_windows: RollingWindowsOpt = None,
    recall_dir: RecallDirOpt = None,
    recall_protocol: RecallProtocolOpt = None,
    recall_length: RecallLengthOpt = None,
    recall_prompt: RecallPromptOpt = None,
    keep_going: KeepGoingOpt = False,
    cuda_graphs: CudaGraphsOpt = None,
    shard: ShardOpt = None,
    ccq_attach: CcqAttachOpt = None,
    workers: WorkersOpt = None,
    quiet: QuietOpt = False,
    progress: ProgressOpt = False,
    report: ReportOpt = True,
) -> None:
    """Evaluate models on tasks; each (model, task) unit is stored as soon as it finishes.

    Re-running the same command skips finished units and resumes an interrupted one without re-asking the
    model what it already answered.
    """
    output = given_path(output)
    if quiet and progress:
        fail("--quiet and --progress: choose one")
    if not progress:
        logs.hide_progress_bars()  # before lm-eval and transformers are imported
    from ccq_eval.harness import plan as run_plan

    options = run_plan.RunOptions(
        models=list(model), tasks=list(task), suite=suite.value if suite else None, lengths=lengths, depths=depths,
        samples_per_cell=samples_per_cell, limit=limit, device=device, dtype=dtype.value,
        batch_size=batch_size, max_length=max_length, seed=seed, output=output,
        lm_eval_args=list(lm_eval_arg), longbench_dir=longbench_dir, qa_dir=qa_dir, keep_going=keep_going,
        zeroshot_dir=zeroshot_dir, rolling_windows=rolling_windows.value if rolling_windows else None,
        recall_dir=recall_dir, recall_protocol=recall_protocol.value if recall_protocol else None,
        recall_length=recall_length, recall_prompt=recall_prompt.value if recall_prompt else None,
        cuda_graphs=cuda_graphs, shard=shard, ccq_attach=ccq_attach,
    )
    try:
        plan = run_plan.plan_run(options)
        from ccq_eval.harness import runner, shard_split

        if runner.process_rank() == 0:  # --shard: the same split as the folder's other workers, or stop
            shard_split.claim_split(plan)
    except UserError as exc:  # PlanError, and what resolving models and tasks raises (one line each)
        fail(one_line(exc))
    _echo_plan(plan, output, shard)
    summary, leader = _execute(plan, _reporter(quiet, progress), workers)
    _echo_run_summary(summary, output)
    if report and leader:
        _report_when_complete(plan, summary, output)
    if summary.failed:
        raise typer.Exit(1)


def _reporter(quiet: bool, progress: bool) -> Reporter | None:
    """The reporter of this process: a line per unit, progress bars, or (quiet, or a data-parallel rank
    other than 0, which reports nothing) none."""
    from ccq_eval.harness import reporting, runner

    if quiet or runner.process_rank() != 0:
        return reporting.SilentReporter()
    return reporting.RichReporter() if progress else reporting.LineReporter()


def _count(number: int, noun: str) -> str:
    """"1 unit", "2 units"."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _echo_plan(plan: RunPlan, output: Path, shard: str | None) -> None:
    """What the run holds: units, models and tasks, how many are finished, and the planning notes."""
    done = sum(unit.finished for unit in plan.units)  # with --shard, pending holds this shard's units only
    units, models, tasks = len(plan.units), len({u.model for u in plan.units}), len({u.task for u in plan.units})
    typer.echo(
        f"{_count(units, 'unit')} ({_count(models, 'model')}, {_count(tasks, 'task')}), {done} already finished, "
        f"output {output}"
        + (f"; shard {shard}: {len(plan.pending)} to run here" if shard else ""), err=True
    )
    for note in plan.notes:
        typer.echo(note, err=True)


def _execute(plan: RunPlan, reporter: Reporter, workers: int | None) -> tuple[RunSummary, bool]:
    """(summary, whether this process leads: rank 0 of a data-parallel launch reports and writes);
    a failure ends the command with a line that says the finished units are kept. workers None: "auto"."""
    from ccq_eval.harness import runner
    from ccq_eval.harness import workers as workers_module

    logs.drop_metadata_hint()  # the runner passes every task its metadata
    leader = runner.process_rank() == 0
    try:
        return runner.execute_plan(plan, reporter=reporter, workers=workers), leader
    except KeyboardInterrupt:
        fail("interrupted. Finished units and every answered request are saved; rerun the same command "
             "to resume.", code=130)
    except workers_module.Terminated as stop:
        if stop.signal_name == "SIGHUP":
            fail("hung up (SIGHUP: the terminal or SSH session closed). Finished units and every answered "
                 "request are saved; rerun the same command to resume, under nohup, tmux or screen so that it "
                 "outlives the terminal.", code=stop.code)
        fail(f"terminated ({stop.signal_name}). Finished units and every answered request are saved; rerun the "
             "same command to resume.", code=stop.code)
    except Exception as exc:  # any failure of a unit: say which, and that nothing is lost
        if debugging():
            raise
        message = one_line(exc)
        fix = "" if "rerun the same command" in message else ": fix the cause and rerun the same command to resume"
        fail(f"{message}; finished units are saved{fix}", code=1)


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
    from ccq_eval.atomic_io import atomic_write_text

    try:
        with filelock.FileLock(str(results / ".report.lock")):  # workers sharing the folder write it in turn
            tidy = tables.load_tidy(results)
            atomic_write_text(results / "table.md", tables.render_tables(tidy, "markdown", "paper", 2))
            paths = figure_module.draw_all(tidy, results / "figures")
            page = _write_html_report(results, paths)
    except (UserError, OSError) as exc:
        fail(f"the units are stored, but the report was not written: {one_line(exc)}; fix that, then run "
             f"`ccq-eval table {results}` (or rerun this command)", code=1)
    typer.echo(f"table: {results / 'table.md'}; figures: {results / 'figures'} ({len(paths)} files)"
               + (f"; report: {page}" if page else ""), err=True)


def _write_html_report(results: Path, figure_paths: list[Path]) -> Path | None:
    """report.html beside table.md; a failure only warns (the units, table and figures are written)."""
    from ccq_eval.analysis import report as report_module

    try:
        return report_module.write_report(results, figure_paths=figure_paths)
    except Exception as exc:  # whatever breaks the page must not fail a finished run
        if debugging():
            raise
        typer.echo(f"warning: report.html not written ({one_line(exc)}); run `ccq-eval report {results}` "
                   "once the cause is fixed", err=True)
        return None
