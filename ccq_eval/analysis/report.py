"""One self-contained HTML page per results folder: the verdict first, then the tables, the comparisons,
the figures and the samples behind them, and what ran last.

The page needs nothing but a browser: figures are PNG data URIs, the style sheet and the few lines
of script are inline, and nothing is fetched. It holds, in this order,

- the verdict: `ccq-eval compare --summary`'s table of every comparison pair, from the same function
  (stats.verdict_table), so its p-values are those `compare --summary` and the README print;
- what is missing (unfinished units, units without a per-sample log, tasks some models lack);
- the paper tables (`ccq-eval table`; the zero-shot suite in the GLA / Gated DeltaNet papers' layout),
  RULER's view (`ccq-eval table --view ruler`: average and effective length, when the results hold RULER
  tasks beyond S-NIAH) and each pair's statistics per task and length (`ccq-eval compare`), their
  p-values adjusted together for their number;
- every figure (`ccq-eval figures`);
- a sample browser (ccq_eval.analysis.report_samples): one collapsible block per cell of S-NIAH and
  the other RULER tasks (model, task, length, depth) with its failures, and one per perplexity (model,
  task, length) with its worst documents. Selects filter the blocks by model, task, length and depth;
  with scripts off every block is shown and the selects stay hidden;
- the run (provenance): models with their checkpoint fingerprints, tasks with their grid, device, dtype,
  package versions, commit and command line, as the units' meta.json / unit.json / results.json
  record them.

This module gathers that as plain data (tables as Table and Cell); the jinja2 templates in templates/
(package data) lay it out, report.html.j2 being the page. The template engine escapes every value it
writes, so sample text cannot become markup. Nothing here imports torch or fla.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import re
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd
from markupsafe import Markup

from ccq_eval.analysis import figures as figure_module
from ccq_eval.analysis import ruler, stats, tables
from ccq_eval.analysis.formatting import NON_FINITE_NOTE, display_task, flat, format_cell, length_text
from ccq_eval.analysis.report_samples import sample_cells, sample_selects
from ccq_eval.harness import store
from ccq_eval.harness.store import RESULTS_FILE, UNIT_SPEC_FILE, ResultsError, StoredUnit

REPORT_FILE = "report.html"
PAGE_TEMPLATE = "report.html.j2"
# Perplexity documents listed per (model, task, length), highest perplexity first.
WORST_DOCUMENTS = 5
# Failures listed per cell of a task that generates answers (the rest are counted): keeps a large grid's
# page small enough to open.
FAILURES_PER_CELL = 10

# --------------------------------------------------------------------------------------------
# What the templates show


@dataclass(frozen=True)
class Cell:
    """One table cell: its text, right-aligned when `numeric`, shown as <code> when `code` (with
    `hover` as its title, when given)."""

    text: str
    numeric: bool = False
    code: bool = False
    hover: str | None = None


@dataclass(frozen=True)
class Table:
    headers: list[str]
    rows: list[list[Cell]]


# --------------------------------------------------------------------------------------------
# Reading: what the folder holds and what it lacks


def missing_parts(root: Path, units: Sequence[StoredUnit]) -> list[str]:
    """What a reader of this folder should know is absent, one sentence each: units that were asked for
    and are not there (started but unfinished; or named by a run's meta.json run_units and absent), failed
    units, and lost sample logs. A grid that leaves pairs out on purpose has nothing missing."""
    notes = []
    finished = {unit.folder.resolve() for unit in units}
    started = set()
    for spec in sorted(Path(root).rglob(UNIT_SPEC_FILE)):
        if spec.parent.resolve() not in finished:
            started.add(spec.parent.resolve())
            notes.append(f"{spec.parent.relative_to(root)}: unit started but not finished (no results.json); "
                         f"rerun the `ccq-eval run` command to finish it")
    asked: dict[Path, tuple[str, str, str]] = {}
    for unit in units:
        non_finite = store.non_finite_values(unit.results)
        if non_finite:
            notes.append(f"failed unit: {store.non_finite_message(unit.model, non_finite)}")
        for task in unit.leaf_tasks():
            if task not in unit.samples_paths:
                notes.append(f"{unit.model} / {task}: no per-sample log (samples_{task}.jsonl); its samples "
                             "and comparisons are missing here")
        for model, task in unit.meta.get("run_units") or []:
            folder = (unit.folder.parent.parent / store.slugify(model) / store.slugify(task)).resolve()
            asked.setdefault(folder, (model, task, unit.meta.get("command_line") or "its run"))
    for folder, (model, task, command) in sorted(asked.items()):
        if folder not in finished and folder not in started:
            notes.append(f"{model} / {task}: asked for by `{command}` but not in this folder; rerun that "
                         "command to evaluate it")
    return notes


def _unfinished_error(root: Path) -> ResultsError | None:
    """The error for a folder whose units all started but none finished (None when that is not so: a
    folder with a results.json has its own error, a corrupt file named)."""
    started = sorted(Path(root).rglob(UNIT_SPEC_FILE)) if Path(root).is_dir() else []
    if not started or any(Path(root).rglob(RESULTS_FILE)):
        return None
    names = ", ".join(str(spec.parent.relative_to(root)) for spec in started[:4])
    more = f" and {len(started) - 4} more" if len(started) > 4 else ""
    return ResultsError(f"{root} holds {len(started)} started units ({names}{more}) but none finished "
                        f"(no results.json); rerun the `ccq-eval run` command to finish them")


# --------------------------------------------------------------------------------------------
# Tables


def _cell(value: Any, digits: int = 2) -> Cell:
    """A table's value as a Cell: numbers right-aligned, as `ccq-eval table` formats them."""
    if isinstance(value, Cell):
        return value
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return Cell(format_cell(value, digits), numeric=numeric)


def _table(headers: Sequence[Any], rows: Iterable[Sequence[Any]], digits: int = 2) -> Table:
    return Table([str(header) for header in headers], [[_cell(v, digits) for v in row] for row in rows])


def _frame_table(frame: pd.DataFrame, digits: int) -> Table:
    return _table(*flat(frame), digits)


def _distinct(values: Iterable[Any]) -> str:
    """The different values, in order of appearance ('-' when none)."""
    seen = list(dict.fromkeys(json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v)
                              for v in values if v not in (None, "")))
    return "; ".join(seen) if seen else "-"


# --------------------------------------------------------------------------------------------
# The run, the paper tables, the comparisons, the figures


def _unit_spec(unit: StoredUnit) -> dict[str, Any]:
    """The unit's settings (its unit.json, in the current format; {} when it records none)."""
    spec = unit.spec
    return spec if isinstance(spec, dict) else {}


def _fingerprint(spec: dict[str, Any]) -> tuple[str, str]:
    """(short fingerprint, every file's digest) of a unit's checkpoint: the weights' sha256."""
    checkpoint = spec.get("checkpoint")
    digests = (checkpoint.get("sha256") or {}) if isinstance(checkpoint, dict) else {}
    if not digests:
        return "-", ""
    weights = digests.get("model.safetensors") or next(iter(digests.values()))
    every = "; ".join(f"{name} {digest}" for name, digest in sorted(digests.items()))
    return f"sha256 {str(weights)[:16]}", every


def models_table(units: Sequence[StoredUnit]) -> Table:
    by_model: dict[str, list[StoredUnit]] = defaultdict(list)
    for unit in units:
        by_model[unit.model].append(unit)
    rows = []
    for model, own in sorted(by_model.items()):
        prints = [_fingerprint(_unit_spec(u)) for u in own]
        short, every = _distinct(p[0] for p in prints), _distinct(p[1] for p in prints)
        batch = (u.meta.get("batch_size") or (u.results.get("config") or {}).get("batch_size") for u in own)
        rows.append([model, Cell(short, code=True, hover=every), _distinct(u.meta.get("model_source") for u in own),
                     _distinct(u.meta.get("dtype") for u in own), _distinct(batch), len(own)])
    headers = ["model", "checkpoint (hover: every file)", "source", "dtype", "batch size", "units"]
    return _table(headers, rows)


def tasks_table(units: Sequence[StoredUnit]) -> Table:
    by_task: dict[str, list[StoredUnit]] = defaultdict(list)
    for unit in units:
        for task in unit.leaf_tasks():
            by_task[task].append(unit)
    rows = []
    for task, own in sorted(by_task.items()):
        specs = [_unit_spec(u) for u in own]
        grids = [s.get("task_metadata") or {} for s in specs]
        lengths = (", ".join(length_text(x) for x in g["lengths"]) for g in grids if g.get("lengths"))
        depths = (", ".join(f"{d:g}%" for d in g["depths"]) for g in grids if g.get("depths"))
        rows.append([display_task(task), Cell(task, code=True),
                     _distinct(u.meta.get("requested_as") for u in own), _distinct(lengths),
                     _distinct(depths), _distinct(g.get("samples_per_cell") for g in grids),
                     _distinct(s.get("limit") for s in specs), _distinct(s.get("max_length") for s in specs),
                     ", ".join(sorted({u.model for u in own}))])
    headers = ["task", "lm-eval name", "requested as", "lengths", "depths", "samples per cell", "limit",
               "max length", "models"]
    return _table(headers, rows)


def environment_pairs(units: Sequence[StoredUnit]) -> list[tuple[str, str]]:
    """(what, value) of the run's environment: commit, device, times, seed, command line, versions."""
    metas = [u.meta for u in units]
    versions: dict[str, list[Any]] = defaultdict(list)
    for unit in units:
        for package, version in (unit.meta.get("versions") or {}).items():
            versions[package].append(version)
        if not unit.meta:  # results of lm-eval's own CLI: its record of itself
            versions["lm_eval"].append(unit.results.get("lm_eval_version"))
    wall = [m["wall_time_s"] for m in metas if isinstance(m.get("wall_time_s"), (int, float))]
    device = (u.meta.get("device") or (u.results.get("config") or {}).get("device") for u in units)
    started = min((m["started_at"] for m in metas if m.get("started_at")), default="-")
    finished = max((m["finished_at"] for m in metas if m.get("finished_at")), default="-")
    return [
        ("commit (lm-eval's git_hash)", _distinct(u.results.get("git_hash") for u in units)),
        ("device", _distinct(device)),
        ("platform", _distinct(m.get("platform") for m in metas)),
        ("started", started),
        ("finished", finished),
        ("elapsed, first unit's start to last unit's finish", _elapsed(started, finished)),
        ("unit time, summed over the units", f"{sum(wall):.1f} s" if wall else "-"),
        ("seed", _distinct(m.get("seed") for m in metas)),
        ("processes that stored the units", _process_count(metas)),
        ("data-parallel ranks of a unit", _distinct(m.get("world_size") for m in metas)),
        ("command line", _distinct(m.get("command_line") for m in metas)),
    ] + [(f"version of {package}", _distinct(values)) for package, values in versions.items()]


def _elapsed(started: str, finished: str) -> str:
    """Seconds between two of meta.json's timestamps (store.TIMESTAMP_FORMAT); "-" when either is absent."""
    import datetime

    try:
        seconds = (datetime.datetime.strptime(finished, store.TIMESTAMP_FORMAT)
                   - datetime.datetime.strptime(started, store.TIMESTAMP_FORMAT)).total_seconds()
    except (TypeError, ValueError):
        return "-"
    return f"{seconds:.0f} s"


def _process_count(metas: Sequence[dict[str, Any]]) -> str:
    """How many processes stored the units: distinct (machine, working folder, pid) of their meta.json."""
    writers = {(m.get("platform"), m.get("cwd"), m["pid"]) for m in metas if m.get("pid") is not None}
    return str(len(writers)) if writers else "-"


def paper_tables(tidy: pd.DataFrame, digits: int = 2) -> list[dict[str, Any]]:
    """The paper tables (`ccq-eval table`): title, Table and markdown note of each."""
    return [{"title": pivot.title, "table": _frame_table(pivot.frame, digits), "note": pivot.note}
            for pivot in tables.paper_pivots(tidy)]


def ruler_view(tidy: pd.DataFrame, threshold: float, digits: int = 2) -> dict[str, Any]:
    """RULER's view (`ccq-eval table --view ruler`) as (title, Table) pairs and its note; no table when the
    results hold no RULER task beyond S-NIAH (S-NIAH alone has its own table)."""
    families = set(ruler.ruler_values(tidy)["family"])
    if not families - {"s-niah"}:
        return {"tables": [], "note": ""}
    shown = [(title, _frame_table(frame, digits)) for title, frame in ruler.ruler_tables(tidy, threshold)]
    return {"tables": shown, "note": ruler.ruler_note(threshold)}


def comparisons(units: Sequence[StoredUnit], notes: list[str], n_boot: int, seed: int, alpha: float,
                p_adjust: str = stats.DEFAULT_P_ADJUST) -> dict[str, Any]:
    """The paired statistics of every comparison pair: the verdict table and its note as `ccq-eval compare
    --summary` prints them (stats.verdict_table: p-values adjusted over its cells), and per pair, (title,
    Table) as `ccq-eval compare` prints them (p-values adjusted by `p_adjust` over all their rows as one
    family); a pair that cannot be compared adds its reason to `notes`."""
    pairs = stats.comparison_pairs(units)
    compared = []
    for baseline, variant in pairs:
        try:
            frame = stats.compare_models(list(units), baseline, variant, n_boot=n_boot, seed=seed, alpha=alpha,
                                         p_adjust=p_adjust)
        except ResultsError as exc:
            notes.append(f"{variant} vs {baseline}: no comparison ({exc})")
            continue
        compared.append((baseline, variant, frame))
    frames = stats.adjust_comparisons([frame for _, _, frame in compared], p_adjust, alpha)
    shown = []
    for (baseline, variant, _), frame in zip(compared, frames):
        shown.append((f"{variant} vs {baseline}", _frame_table(stats.comparison_display(frame, baseline, variant), 3)))
        if (frame["verdict"] == "failed").any():
            notes.append(f"{variant} vs {baseline}: {NON_FINITE_NOTE}")
    family = int(frames[0]["p_family"].iloc[0]) if frames else 0
    verdict, verdict_note = stats.verdict_table(units, compared, alpha=alpha, p_adjust=p_adjust) if compared \
        else (None, "")
    return {"has_pairs": bool(pairs), "verdict": _frame_table(verdict, 3) if verdict is not None else None,
            "verdict_note": verdict_note, "tables": shown, "note": stats.comparison_note(alpha, p_adjust, family),
            "n_boot": n_boot, "seed": seed}


def figure_images(tidy: pd.DataFrame, figure_paths: Sequence[Path] | None,
                  notes: list[str]) -> list[tuple[str, bytes]]:
    """(name, PNG bytes) of every figure: the given files, else drawn afresh into a temporary folder."""
    if figure_paths is not None:
        return [(Path(p).stem, Path(p).read_bytes()) for p in figure_paths if Path(p).suffix == ".png"]
    with tempfile.TemporaryDirectory(prefix="ccq-report-") as folder:
        try:
            paths = figure_module.draw_all(tidy, Path(folder))
        except ResultsError as exc:
            notes.append(f"figures: {exc}")
            return []
        return [(p.stem, p.read_bytes()) for p in paths if p.suffix == ".png"]


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


# --------------------------------------------------------------------------------------------
# Sample browser


# --------------------------------------------------------------------------------------------
# The page


def _escaped(value: Any) -> Markup:
    """What the templates write for every {{ value }}: Markup (made by a template) as it is, anything
    else escaped with html.escape, so that any text appears in the page as html.escape(text)."""
    return value if isinstance(value, Markup) else Markup(html.escape(str(value), quote=True))


def _code_spans(text: str) -> Markup:
    """Escaped `text` with its markdown `code` spans as <code> (the paper tables' notes are markdown)."""
    return Markup(re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text, quote=True)))


@functools.cache
def _templates() -> jinja2.Environment:
    """The report's templates (package data of ccq_eval.analysis), escaping every value they write."""
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("ccq_eval.analysis", "templates"), autoescape=True, finalize=_escaped,
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    environment.filters["code_spans"] = _code_spans
    return environment


def build_report(results: Path, *, figure_paths: Sequence[Path] | None = None,
                 n_boot: int = stats.DEFAULT_BOOTSTRAP, seed: int = stats.DEFAULT_SEED,
                 alpha: float = stats.DEFAULT_ALPHA, p_adjust: str = stats.DEFAULT_P_ADJUST,
                 threshold: float = ruler.DEFAULT_THRESHOLD) -> str:
    """The report of the results folder `results` as one HTML string.

    `figure_paths`: figures already drawn from these results (their PNGs are embedded); by default
    they are drawn afresh. `p_adjust`: how the comparisons' p-values are adjusted for their number
    (holm, bonferroni, none); `threshold`: the RULER view's effective-length threshold (% accuracy).
    Raises ResultsError when the folder holds no finished unit.
    """
    ruler.check_threshold(threshold)
    results = Path(results)
    try:
        units = store.load_results(results)
    except ResultsError as exc:
        raise (_unfinished_error(results) or exc) from None
    root = results if results.is_dir() else results.parent
    tidy = tables.tidy_table(units)
    notes = missing_parts(root, units)
    compared = comparisons(units, notes, n_boot, seed, alpha, p_adjust)
    images = figure_images(tidy, figure_paths, notes)
    cells = sample_cells(units, failures_per_cell=FAILURES_PER_CELL, worst_documents=WORST_DOCUMENTS)
    models = sorted({unit.model for unit in units})
    from ccq_eval import __version__

    return _templates().get_template(PAGE_TEMPLATE).render(
        title=f"ccq-eval report: {root.resolve().name}", unit_count=len(units), model_count=len(models),
        model_names=", ".join(models), version=__version__, root=str(root), missing=notes,
        models=models_table(units), tasks=tasks_table(units), environment=environment_pairs(units),
        paper_tables=paper_tables(tidy), ruler=ruler_view(tidy, threshold), comparisons=compared,
        figures=[(name, _data_uri(png)) for name, png in images],
        sample_cells=cells, sample_selects=sample_selects(cells))


def write_report(results: Path, output: Path | None = None, **options: Any) -> Path:
    """Build the report of `results` and write it (atomically) to `output`, by default
    RESULTS/report.html; returns the path written."""
    results = Path(results)
    if output is None:
        output = (results if results.is_dir() else results.parent) / REPORT_FILE
    if Path(output).is_dir():
        raise ResultsError(f"--output {output} is a folder; give the path of the HTML file to write, e.g. "
                           f"{Path(output) / REPORT_FILE}")
    for folder in Path(output).parents:
        if folder.exists() and not folder.is_dir():
            raise ResultsError(f"--output {output}: {folder} is a file, not a folder; give another path")
    text = build_report(results, **options)
    store.atomic_write_text(Path(output), text)
    return Path(output)
