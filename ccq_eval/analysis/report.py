"""One self-contained HTML page per results folder: what ran, the tables, the comparisons, the
figures and the samples behind them.

The page needs nothing but a browser: figures are PNG data URIs, the style sheet and the few lines
of script are inline, and nothing is fetched. It holds

- what is missing (unfinished units, units without a per-sample log, tasks some models lack);
- the run: models with their checkpoint fingerprints, tasks with their grid, device, dtype,
  package versions, commit and command line, as the units' meta.json / unit.json / results.json
  record them;
- the paper tables (`ccq-eval table`) and the paired statistics of every NAME / NAME-ccq pair
  (`ccq-eval compare`);
- every figure (`ccq-eval figures`);
- a sample browser: one collapsible block per S-NIAH cell (model, task, length, depth) with its
  failures (expected answer, generated text, the context around the needle), and one per
  perplexity (model, task, length) with its worst documents. Selects filter the blocks by model,
  task, length and depth; with scripts off every block is shown and the selects stay hidden.

This module gathers that as plain data (tables as Table and Cell, sample blocks as SampleCell);
the jinja2 templates in templates/ (package data) lay it out, report.html.j2 being the page. The
template engine escapes every value it writes, so sample text cannot become markup. Nothing here
imports torch or fla.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import math
import re
import tempfile
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import pandas as pd
from markupsafe import Markup

from ccq_eval.analysis import figures as figure_module
from ccq_eval.analysis import stats, tables
from ccq_eval.harness import results_store
from ccq_eval.harness.results_store import UNIT_SPEC_FILE, ResultsError, StoredUnit
from ccq_eval.task_families import PERPLEXITY, S_NIAH, family_of

REPORT_FILE = "report.html"
PAGE_TEMPLATE = "report.html.j2"
# Characters of the prompt shown on each side of the needle, and of a document's start.
CONTEXT_CHARS = 240
EXCERPT_CHARS = 400
# Perplexity documents listed per (model, task, length), highest perplexity first.
WORST_DOCUMENTS = 5
# Generated text longer than this is cut (S-NIAH budgets are a few dozen tokens; a runaway model's
# output would bloat the page).
GENERATED_CHARS = 600
# Failures listed per S-NIAH cell (the rest are counted): keeps a large grid's page small enough to open.
FAILURES_PER_CELL = 10
_NOT_ARCHIVED = "; not archived>"


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


@dataclass(frozen=True)
class PromptWindow:
    """Characters `low` to `high` of a prompt of `length` characters, as (text, is an answer) pieces."""

    pieces: list[tuple[str, bool]]
    low: int
    high: int
    length: int


@dataclass(frozen=True)
class SniahFailure:
    """An S-NIAH sample scored below full marks. `window` is the prompt around the needle (None when
    the prompt was not logged or was archived; `archived_prompt` is then the archive's placeholder)."""

    doc_id: Any
    score: float
    expected: str  # every accepted answer, " / " between them
    generated: str  # cut at GENERATED_CHARS
    window: PromptWindow | None
    archived_prompt: str | None = None


@dataclass(frozen=True)
class PerplexityDocument:
    """A document of a perplexity cell; `excerpt` is the start of its text (None when archived)."""

    doc_id: Any
    label: str
    perplexity: float
    tokens: int
    excerpt: str | None


@dataclass
class SampleCell:
    """One block of the sample browser: an S-NIAH cell (its failures, the first FAILURES_PER_CELL
    listed) or a perplexity (model, task, length) with its worst documents."""

    model: str
    task: str
    length: int | None
    depth: float | None
    summary: str
    failures: list[SniahFailure] = field(default_factory=list)
    unlisted_failures: int = 0
    documents: list[PerplexityDocument] = field(default_factory=list)

    @property
    def filter_values(self) -> dict[str, str]:
        """The block's value for each select of the browser (its data-* attributes)."""
        return {"model": self.model, "task": self.task,
                "length": "" if self.length is None else str(self.length),
                "depth": "" if self.depth is None else f"{self.depth:g}"}


@dataclass(frozen=True)
class Select:
    """A select of the sample browser: `name` is the filter_values key it matches; options are
    (value, text) pairs."""

    name: str
    options: list[tuple[str, str]]


# --------------------------------------------------------------------------------------------
# Reading: what the folder holds and what it lacks


def missing_parts(root: Path, units: Sequence[StoredUnit]) -> list[str]:
    """What a reader of this folder should know is absent, one sentence each."""
    notes = []
    finished = {unit.folder.resolve() for unit in units}
    for spec in sorted(Path(root).rglob(UNIT_SPEC_FILE)):
        if spec.parent.resolve() not in finished:
            notes.append(f"{spec.parent.relative_to(root)}: unit started but not finished (no results.json); "
                         f"rerun the `ccq-eval run` command to finish it")
    tasks_of: dict[str, set[str]] = defaultdict(set)
    for unit in units:
        non_finite = results_store.non_finite_values(unit.results)
        if non_finite:
            notes.append(f"failed unit: {results_store.non_finite_message(unit.model, non_finite)}")
        for task in unit.leaf_tasks():
            tasks_of[unit.model].add(task)
            if task not in unit.samples_paths:
                notes.append(f"{unit.model} / {task}: no per-sample log (samples_{task}.jsonl); its samples "
                             "and comparisons are missing here")
    every_task = set().union(*tasks_of.values()) if tasks_of else set()
    for model in sorted(tasks_of):
        lacking = sorted(every_task - tasks_of[model])
        if lacking:
            notes.append(f"{model}: no results for {', '.join(lacking)} (other models have them)")
    return notes


def _unfinished_error(root: Path) -> ResultsError | None:
    """The error for a folder whose units all started but none finished (None when that is not so)."""
    started = sorted(Path(root).rglob(UNIT_SPEC_FILE)) if Path(root).is_dir() else []
    if not started:
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
    return Cell(tables._format_cell(value, digits), numeric=numeric)


def _table(headers: Sequence[Any], rows: Iterable[Sequence[Any]], digits: int = 2) -> Table:
    return Table([str(header) for header in headers], [[_cell(v, digits) for v in row] for row in rows])


def _frame_table(frame: pd.DataFrame, digits: int) -> Table:
    return _table(*tables._flat(frame), digits)


def _distinct(values: Iterable[Any]) -> str:
    """The different values, in order of appearance ('-' when none)."""
    seen = list(dict.fromkeys(json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v)
                              for v in values if v not in (None, "")))
    return "; ".join(seen) if seen else "-"


def _length_text(length: Any) -> str:
    return "-" if length is None else tables._length_label(length)


# --------------------------------------------------------------------------------------------
# The run, the paper tables, the comparisons, the figures


def _unit_spec(unit: StoredUnit) -> dict[str, Any]:
    path = unit.folder / UNIT_SPEC_FILE
    spec = results_store.read_json(path) if path.is_file() else unit.meta.get("spec")
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
        lengths = (", ".join(_length_text(x) for x in g["lengths"]) for g in grids if g.get("lengths"))
        depths = (", ".join(f"{d:g}%" for d in g["depths"]) for g in grids if g.get("depths"))
        rows.append([tables.display_task(task), Cell(task, code=True),
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
    return [
        ("commit (lm-eval's git_hash)", _distinct(u.results.get("git_hash") for u in units)),
        ("device", _distinct(device)),
        ("platform", _distinct(m.get("platform") for m in metas)),
        ("started", min((m["started_at"] for m in metas if m.get("started_at")), default="-")),
        ("finished", max((m["finished_at"] for m in metas if m.get("finished_at")), default="-")),
        ("wall time of the units", f"{sum(wall):.1f} s" if wall else "-"),
        ("seed", _distinct(m.get("seed") for m in metas)),
        ("processes", _distinct(m.get("world_size") for m in metas)),
        ("command line", _distinct(m.get("command_line") for m in metas)),
    ] + [(f"version of {package}", _distinct(values)) for package, values in versions.items()]


def paper_tables(tidy: pd.DataFrame, digits: int = 2) -> list[dict[str, Any]]:
    """The paper tables (`ccq-eval table`): title, Table and markdown note of each."""
    return [{"title": pivot.title, "table": _frame_table(pivot.frame, digits), "note": pivot.note}
            for pivot in tables.paper_pivots(tidy)]


def comparisons(units: Sequence[StoredUnit], notes: list[str], n_boot: int, seed: int,
                alpha: float) -> dict[str, Any]:
    """The paired statistics of every comparison pair (`ccq-eval compare`) as (title, Table); a pair
    that cannot be compared adds its reason to `notes`."""
    pairs = stats.comparison_pairs(units)
    shown = []
    for baseline, variant in pairs:
        try:
            frame = stats.compare_models(list(units), baseline, variant, n_boot=n_boot, seed=seed,
                                         alpha=alpha)
        except ResultsError as exc:
            notes.append(f"{variant} vs {baseline}: no comparison ({exc})")
            continue
        shown.append((f"{variant} vs {baseline}",
                      _frame_table(stats.comparison_display(frame, baseline, variant), 3)))
        if (frame["verdict"] == "failed").any():
            notes.append(f"{variant} vs {baseline}: {tables.NON_FINITE_NOTE}")
    return {"has_pairs": bool(pairs), "tables": shown, "note": stats.comparison_note(alpha),
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


def _generated(sample: dict[str, Any]) -> str:
    for key in ("filtered_resps", "resps"):
        value = sample.get(key)
        while isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, str):
            return value
    return ""


def _archived(text: str) -> bool:
    return text.startswith("<") and text.endswith(_NOT_ARCHIVED)


def needle_context(prompt: str, answers: Sequence[str], offset: Any = None) -> PromptWindow:
    """The prompt around the needle: CONTEXT_CHARS on each side of the first answer found (from the
    needle's offset on, when the document records it), every answer marked."""
    start_at = int(offset) if isinstance(offset, (int, float)) and 0 <= offset < len(prompt) else 0
    positions = [prompt.find(a, start_at) for a in answers if a]
    positions = [p for p in positions if p >= 0] or [start_at]
    centre = min(positions)
    low, high = max(0, centre - CONTEXT_CHARS), min(len(prompt), centre + CONTEXT_CHARS)
    window = prompt[low:high]
    marks: list[tuple[int, int]] = []
    for answer in answers:
        found = window.find(answer) if answer else -1
        while found >= 0:
            marks.append((found, found + len(answer)))
            found = window.find(answer, found + len(answer))
    pieces, cursor = [], 0
    for begin, end in sorted(marks):
        if begin < cursor:
            continue
        pieces += [(window[cursor:begin], False), (window[begin:end], True)]
        cursor = end
    pieces.append((window[cursor:], False))
    return PromptWindow(pieces, low, high, len(prompt))


def _sniah_failure(sample: dict[str, Any], score: float) -> SniahFailure:
    doc = sample.get("doc") or {}
    answers = [str(a) for a in doc.get("outputs") or [sample.get("target", "")]]
    generated = _generated(sample)
    shown = generated if len(generated) <= GENERATED_CHARS else generated[:GENERATED_CHARS] + "…"
    prompt = str(doc.get("input", ""))
    archived = _archived(prompt)
    window = needle_context(prompt, answers, doc.get("needle_char_offset")) if prompt and not archived else None
    return SniahFailure(sample.get("doc_id"), score, " / ".join(answers), shown, window,
                        prompt if archived else None)


def _full_marks(values: Iterable[float]) -> float:
    return 100.0 if any(v > 1.0 for v in values) else 1.0


def sniah_cells(unit: StoredUnit, task: str) -> list[SampleCell]:
    """One cell per (length, depth): its failures with expected answer, generated text and context."""
    name = tables.primary_metric(task, tables.metric_infos(unit, task))
    samples = unit.samples(task)
    first_filter = samples[0].get("filter", "none") if samples else "none"
    scored = []
    for sample in samples:
        value = tables._stored_value(sample.get(name))
        length, depth = tables.doc_cell(sample.get("doc"))
        if sample.get("filter", "none") == first_filter and isinstance(value, float) and length is not None:
            scored.append((int(length), depth, value, sample))
    full = _full_marks(v for _, _, v, _ in scored)
    by_cell: dict[tuple[int, float | None], list[tuple[float, dict]]] = defaultdict(list)
    for length, depth, value, sample in scored:
        by_cell[(length, depth)].append((value, sample))
    cells = []
    for (length, depth), entries in sorted(by_cell.items(), key=lambda item: (item[0][0], item[0][1] or 0.0)):
        failures = [(v, s) for v, s in entries if v < full]
        where = f"{_length_text(length)}" + ("" if depth is None else f", depth {depth:g}%")
        outcome = f"{len(failures)} of {len(entries)} failed" if failures else f"all {len(entries)} right"
        summary = f"{unit.model} · {tables.display_task(task)} · {where}: {outcome}"
        cells.append(SampleCell(unit.model, task, length, depth, summary,
                                failures=[_sniah_failure(s, v) for v, s in failures[:FAILURES_PER_CELL]],
                                unlisted_failures=max(0, len(failures) - FAILURES_PER_CELL)))
    return cells


def _perplexity_document(sample: dict[str, Any], perplexity: float, tokens: int) -> PerplexityDocument:
    doc = sample.get("doc") or {}
    label = doc.get("document") or (f"block {doc['block_index']}" if "block_index" in doc else "")
    text = str(doc.get("text", ""))
    excerpt = None if _archived(text) else text[:EXCERPT_CHARS] + ("…" if len(text) > EXCERPT_CHARS else "")
    return PerplexityDocument(sample.get("doc_id"), str(label), perplexity, tokens, excerpt)


def perplexity_cells(unit: StoredUnit, task: str) -> list[SampleCell]:
    """One cell per evaluated length: the WORST_DOCUMENTS documents of highest perplexity."""
    name = tables.primary_metric(task, tables.metric_infos(unit, task))
    by_length: dict[int, list[tuple[float, int, dict]]] = defaultdict(list)
    for sample in unit.samples(task):
        for key in sample.get("metrics") or [k for k in sample if k == name or k.startswith(f"{name}@")]:
            base, suffix_length, bucket = tables.split_metric(key)
            value = tables._stored_value(sample.get(key))
            if base != name or bucket is not None or not isinstance(value, tuple) or value[1] <= 0:
                continue
            length = suffix_length or tables.doc_cell(sample.get("doc"))[0]
            if length is None:
                continue
            nll, tokens = value
            by_length[int(length)].append((math.exp(nll / tokens), int(tokens), sample))
    cells = []
    for length, documents in sorted(by_length.items()):
        documents.sort(key=lambda entry: -entry[0])
        summary = (f"{unit.model} · {tables.display_task(task)} · {_length_text(length)}: worst "
                   f"{min(WORST_DOCUMENTS, len(documents))} of {len(documents)} documents "
                   f"(perplexity {documents[0][0]:.2f} to {documents[-1][0]:.2f})")
        worst = [_perplexity_document(sample, perplexity, tokens)
                 for perplexity, tokens, sample in documents[:WORST_DOCUMENTS]]
        cells.append(SampleCell(unit.model, task, length, None, summary, documents=worst))
    return cells


def sample_cells(units: Sequence[StoredUnit]) -> list[SampleCell]:
    cells = []
    for unit in sorted(units, key=lambda u: u.model):
        for task in sorted(unit.leaf_tasks()):
            if task not in unit.samples_paths:
                continue
            family = family_of(task)
            if family is S_NIAH:
                cells += sniah_cells(unit, task)
            elif family is PERPLEXITY:
                cells += perplexity_cells(unit, task)
    return cells


def sample_selects(cells: Sequence[SampleCell]) -> list[Select]:
    """The browser's selects: every model, task, length and depth of the cells."""
    lengths = sorted({c.length for c in cells if c.length is not None})
    depths = sorted({c.depth for c in cells if c.depth is not None})
    return [
        Select("model", [(m, m) for m in sorted({c.model for c in cells})]),
        Select("task", [(t, tables.display_task(t)) for t in sorted({c.task for c in cells})]),
        Select("length", [(str(x), _length_text(x)) for x in lengths]),
        Select("depth", [(f"{d:g}", f"{d:g}%") for d in depths]),
    ]


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
                 alpha: float = stats.DEFAULT_ALPHA) -> str:
    """The report of the results folder `results` as one HTML string.

    `figure_paths`: figures already drawn from these results (their PNGs are embedded); by default
    they are drawn afresh. Raises ResultsError when the folder holds no finished unit.
    """
    results = Path(results)
    try:
        units = results_store.load_results(results)
    except ResultsError as exc:
        raise (_unfinished_error(results) or exc) from None
    root = results if results.is_dir() else results.parent
    tidy = tables.tidy_table(units)
    notes = missing_parts(root, units)
    compared = comparisons(units, notes, n_boot, seed, alpha)
    images = figure_images(tidy, figure_paths, notes)
    cells = sample_cells(units)
    models = sorted({unit.model for unit in units})
    from ccq_eval import __version__

    return _templates().get_template(PAGE_TEMPLATE).render(
        title=f"ccq-eval report: {root.resolve().name}", unit_count=len(units), model_count=len(models),
        model_names=", ".join(models), version=__version__, root=str(root), missing=notes,
        models=models_table(units), tasks=tasks_table(units), environment=environment_pairs(units),
        paper_tables=paper_tables(tidy), comparisons=compared,
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
    results_store.atomic_write_text(Path(output), text)
    return Path(output)
