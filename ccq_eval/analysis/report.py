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

All sample text is escaped. Nothing here imports torch or fla.
"""

from __future__ import annotations

import base64
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

import pandas as pd
from markupsafe import Markup  # HTML built here from escaped parts: table cells take it as it is

from ccq_eval.analysis import figures as figure_module
from ccq_eval.analysis import stats, tables
from ccq_eval.harness import results_store
from ccq_eval.harness.results_store import UNIT_SPEC_FILE, ResultsError, StoredUnit
from ccq_eval.task_families import PERPLEXITY, S_NIAH, family_of

REPORT_FILE = "report.html"
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
# Reading: what the folder holds and what it lacks


@dataclass
class SampleCell:
    """One block of the sample browser: an S-NIAH cell or a perplexity (model, task, length)."""

    model: str
    task: str
    length: int | None
    depth: float | None
    summary: str
    entries: list[str] = field(default_factory=list)  # HTML of each failure / document


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
# HTML pieces


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _cell(value: Any, digits: int = 2) -> str:
    """One <td>: numbers right-aligned; markup is escaped unless `value` is Markup (built here)."""
    if isinstance(value, Markup):
        return f"<td>{value}</td>"
    text = _e(tables._format_cell(value, digits))
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return f'<td class="num">{text}</td>' if numeric else f"<td>{text}</td>"


def _rows_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], digits: int = 2) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(v, digits) for v in row) + "</tr>" for row in rows)
    return f'<table class="data"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _html_table(frame: pd.DataFrame, digits: int) -> str:
    headers, body = tables._flat(frame)
    return _rows_table(headers, body, digits)


def _key_value_table(pairs: Iterable[tuple[str, str]]) -> str:
    rows = "".join(f"<tr><th>{_e(key)}</th><td>{_e(value)}</td></tr>" for key, value in pairs)
    return f'<table class="kv"><tbody>{rows}</tbody></table>'


def _distinct(values: Iterable[Any]) -> str:
    """The different values, in order of appearance ('-' when none)."""
    seen = list(dict.fromkeys(json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v)
                              for v in values if v not in (None, "")))
    return "; ".join(seen) if seen else "-"


def _length_text(length: Any) -> str:
    return "-" if length is None else tables._length_label(length)


# --------------------------------------------------------------------------------------------
# Sections


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


def _models_table(units: Sequence[StoredUnit]) -> str:
    by_model: dict[str, list[StoredUnit]] = defaultdict(list)
    for unit in units:
        by_model[unit.model].append(unit)
    rows = []
    for model, own in sorted(by_model.items()):
        prints = [_fingerprint(_unit_spec(u)) for u in own]
        short, every = _distinct(p[0] for p in prints), _distinct(p[1] for p in prints)
        batch = (u.meta.get("batch_size") or (u.results.get("config") or {}).get("batch_size") for u in own)
        rows.append([model, Markup(f'<code title="{_e(every)}">{_e(short)}</code>'),
                     _distinct(u.meta.get("model_source") for u in own),
                     _distinct(u.meta.get("dtype") for u in own), _distinct(batch), len(own)])
    headers = ["model", "checkpoint (hover: every file)", "source", "dtype", "batch size", "units"]
    return _rows_table(headers, rows)


def _tasks_table(units: Sequence[StoredUnit]) -> str:
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
        rows.append([tables.display_task(task), Markup(f"<code>{_e(task)}</code>"),
                     _distinct(u.meta.get("requested_as") for u in own), _distinct(lengths),
                     _distinct(depths), _distinct(g.get("samples_per_cell") for g in grids),
                     _distinct(s.get("limit") for s in specs), _distinct(s.get("max_length") for s in specs),
                     ", ".join(sorted({u.model for u in own}))])
    headers = ["task", "lm-eval name", "requested as", "lengths", "depths", "samples per cell", "limit",
               "max length", "models"]
    return _rows_table(headers, rows)


def _environment_table(units: Sequence[StoredUnit]) -> str:
    metas = [u.meta for u in units]
    versions: dict[str, list[Any]] = defaultdict(list)
    for unit in units:
        for package, version in (unit.meta.get("versions") or {}).items():
            versions[package].append(version)
        if not unit.meta:  # results of lm-eval's own CLI: its record of itself
            versions["lm_eval"].append(unit.results.get("lm_eval_version"))
    wall = [m["wall_time_s"] for m in metas if isinstance(m.get("wall_time_s"), (int, float))]
    device = (u.meta.get("device") or (u.results.get("config") or {}).get("device") for u in units)
    return _key_value_table([
        ("commit (lm-eval's git_hash)", _distinct(u.results.get("git_hash") for u in units)),
        ("device", _distinct(device)),
        ("platform", _distinct(m.get("platform") for m in metas)),
        ("started", min((m["started_at"] for m in metas if m.get("started_at")), default="-")),
        ("finished", max((m["finished_at"] for m in metas if m.get("finished_at")), default="-")),
        ("wall time of the units", f"{sum(wall):.1f} s" if wall else "-"),
        ("seed", _distinct(m.get("seed") for m in metas)),
        ("processes", _distinct(m.get("world_size") for m in metas)),
        ("command line", _distinct(m.get("command_line") for m in metas)),
    ] + [(f"version of {package}", _distinct(values)) for package, values in versions.items()])


def run_section(units: Sequence[StoredUnit]) -> str:
    return ("<h3>Models</h3>" + _models_table(units) + "<h3>Tasks and grid</h3>" + _tasks_table(units)
            + "<h3>Environment</h3>" + _environment_table(units))


def tables_section(tidy: pd.DataFrame, digits: int = 2) -> str:
    parts = []
    for pivot in tables.paper_pivots(tidy):
        note = f'<p class="note">{_markdown_code(pivot.note)}</p>' if pivot.note else ""
        parts.append(f'<section class="paper-table"><h3>{_e(pivot.title)}</h3>'
                     f"{_html_table(pivot.frame, digits)}{note}</section>")
    return "".join(parts) or "<p>No table: the results hold no values the paper tables show.</p>"


def _markdown_code(text: str) -> str:
    """Escaped `text` with its markdown `code` spans as <code> (the tables' notes are markdown)."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", _e(text))


def comparisons_section(units: Sequence[StoredUnit], notes: list[str], n_boot: int, seed: int,
                        alpha: float) -> str:
    pairs = stats.comparison_pairs(units)
    if not pairs:
        models = ", ".join(sorted({unit.model for unit in units}))
        return (f"<p>No CCQ pair NAME / NAME-ccq and no <code>--ccq-attach</code> sweep with its baseline among "
                f"the models ({_e(models)}); <code>ccq-eval compare --baseline A --variant B</code> compares any "
                "two.</p>")
    parts = []
    for baseline, variant in pairs:
        try:
            frame = stats.compare_models(list(units), baseline, variant, n_boot=n_boot, seed=seed,
                                         alpha=alpha)
        except ResultsError as exc:
            notes.append(f"{variant} vs {baseline}: no comparison ({exc})")
            continue
        parts.append(f'<section class="comparison"><h3>{_e(variant)} vs {_e(baseline)}</h3>'
                     f"{_html_table(stats.comparison_display(frame, baseline, variant), 3)}</section>")
        if (frame["verdict"] == "failed").any():
            notes.append(f"{variant} vs {baseline}: {tables.NON_FINITE_NOTE}")
    return ("".join(parts) + f'<p class="note">{_e(stats.comparison_note(alpha))}; '
            f"{n_boot} bootstrap resamples, seed {seed}.</p>")


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


def figures_section(images: Sequence[tuple[str, bytes]]) -> str:
    if not images:
        return "<p>No figure for these results.</p>"
    parts = []
    for name, data in images:
        encoded = base64.b64encode(data).decode("ascii")
        parts.append(f'<figure><img src="data:image/png;base64,{encoded}" alt="{_e(name)}">'
                     f"<figcaption>{_e(name)}</figcaption></figure>")
    return "".join(parts)


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


def needle_context(prompt: str, answers: Sequence[str], offset: Any = None) -> str:
    """HTML of the prompt around the needle: CONTEXT_CHARS on each side of the first answer found
    (from the needle's offset on, when the document records it), every answer marked."""
    if not prompt:
        return '<p class="muted">The prompt was not logged.</p>'
    if _archived(prompt):
        return (f'<p class="muted">The prompt is not in this folder ({_e(prompt)}): archived results keep '
                "only its digest.</p>")
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
        pieces.append(_e(window[cursor:begin]) + f"<mark>{_e(window[begin:end])}</mark>")
        cursor = end
    pieces.append(_e(window[cursor:]))
    before = "…" if low > 0 else ""
    after = "…" if high < len(prompt) else ""
    return (f'<pre class="context" title="characters {low}-{high} of {len(prompt)}">{before}{"".join(pieces)}'
            f"{after}</pre>")


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
        cell = SampleCell(unit.model, task, length, depth, summary)
        for value, sample in failures[:FAILURES_PER_CELL]:
            doc = sample.get("doc") or {}
            answers = [str(a) for a in doc.get("outputs") or [sample.get("target", "")]]
            generated = _generated(sample)
            shown = generated if len(generated) <= GENERATED_CHARS else generated[:GENERATED_CHARS] + "…"
            context = needle_context(str(doc.get("input", "")), answers, doc.get("needle_char_offset"))
            cell.entries.append(
                f'<div class="sample"><span>doc {_e(sample.get("doc_id"))}</span><span>score {value:g}</span>'
                f'<span>expected</span><span><code class="expected">{_e(" / ".join(answers))}</code></span>'
                f'<span>generated</span><pre class="generated">{_e(shown) or "(nothing)"}</pre>'
                f"<span>around the needle</span>{context}</div>")
        if len(failures) > FAILURES_PER_CELL:
            cell.entries.append(f'<p class="muted">{len(failures) - FAILURES_PER_CELL} more failures in this '
                                "cell are not listed.</p>")
        cells.append(cell)
    return cells


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
        cell = SampleCell(unit.model, task, length, None, summary)
        for perplexity, tokens, sample in documents[:WORST_DOCUMENTS]:
            doc = sample.get("doc") or {}
            label = doc.get("document") or (f"block {doc['block_index']}" if "block_index" in doc else "")
            text = str(doc.get("text", ""))
            if _archived(text):
                excerpt = ('<p class="muted">The text is not in this folder: archived results keep only its '
                           "digest.</p>")
            else:
                cut = text[:EXCERPT_CHARS] + ("…" if len(text) > EXCERPT_CHARS else "")
                excerpt = f'<pre class="context">{_e(cut)}</pre>'
            cell.entries.append(
                f'<div class="sample"><span>doc {_e(sample.get("doc_id"))} {_e(label)}</span>'
                f"<span>perplexity <b>{perplexity:.3f}</b> over {tokens} tokens</span>"
                f"<span>start of the text</span>{excerpt}</div>")
        cells.append(cell)
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


def _options(name: str, label: str, values: Iterable[tuple[str, str]]) -> str:
    options = "".join(f'<option value="{_e(value)}">{_e(text)}</option>' for value, text in values)
    return (f'<label>{_e(label)} <select name="{_e(name)}"><option value="">all</option>{options}'
            "</select></label>")


def samples_section(cells: Sequence[SampleCell]) -> str:
    if not cells:
        return "<p>No S-NIAH or perplexity sample log in this folder.</p>"
    lengths = sorted({c.length for c in cells if c.length is not None})
    depths = sorted({c.depth for c in cells if c.depth is not None})
    filters = "".join([
        _options("model", "model", ((m, m) for m in sorted({c.model for c in cells}))),
        _options("task", "task", ((t, tables.display_task(t)) for t in sorted({c.task for c in cells}))),
        _options("length", "length", ((str(x), _length_text(x)) for x in lengths)),
        _options("depth", "depth", ((f"{d:g}", f"{d:g}%") for d in depths)),
    ])
    blocks = []
    for cell in cells:
        data = (f'data-model="{_e(cell.model)}" data-task="{_e(cell.task)}" '
                f'data-length="{"" if cell.length is None else cell.length}" '
                f'data-depth="{"" if cell.depth is None else f"{cell.depth:g}"}"')
        failed = " failed" if cell.entries and family_of(cell.task) is S_NIAH else ""
        inner = "".join(cell.entries) or '<p class="muted">Nothing to show: every sample is right.</p>'
        blocks.append(f'<details class="cell{failed}" {data}><summary>{_e(cell.summary)}</summary>'
                      f"{inner}</details>")
    return (f'<form id="filters" hidden>{filters} <span id="shown" aria-live="polite"></span></form>'
            f'<div id="cells">{"".join(blocks)}</div>')


# --------------------------------------------------------------------------------------------
# The page

STYLE = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1b1b1b;margin:0 auto;
max-width:1100px;padding:0 1.2em 3em}
h1{font-size:1.6em;margin:.8em 0 .2em}
h2{border-bottom:2px solid #0072B2;padding-bottom:.15em;margin-top:1.8em}
h3{margin:1.2em 0 .4em}nav a{margin-right:1em}
table{border-collapse:collapse;margin:.3em 0 .6em;font-size:.92em}
th,td{border:1px solid #d0d7de;padding:.2em .55em;text-align:left;vertical-align:top}
thead th{background:#eef3f8}td.num{text-align:right;font-variant-numeric:tabular-nums}
table.kv th{background:#f6f8fa;white-space:nowrap}
.note,.muted{color:#555;font-size:.9em}
.missing{background:#fff4e5;border-left:4px solid #E69F00;padding:.4em 1em}
figure{margin:1em 0}figure img{max-width:100%;height:auto;border:1px solid #e5e5e5}
figcaption{color:#555;font-size:.85em}.comparison td{white-space:nowrap}
#filters{position:sticky;top:0;background:#fff;padding:.5em 0;border-bottom:1px solid #d0d7de;z-index:1}
#filters label{margin-right:1em}
details.cell{border:1px solid #d0d7de;border-radius:4px;margin:.3em 0;padding:.2em .6em}
details.cell.failed>summary{color:#a33b00}summary{cursor:pointer}
.sample{border-top:1px dashed #d0d7de;padding:.3em 0;display:grid;grid-template-columns:9em 1fr;gap:.15em .6em}
.sample>span:nth-child(odd){color:#555}.sample>p,.sample>pre{margin:0}
pre{white-space:pre-wrap;word-break:break-word;background:#f6f8fa;padding:.4em .6em;margin:.2em 0;
font-size:.88em}
mark{background:#ffd66b}code.expected{background:#e6f4ea;padding:0 .3em}
"""

SCRIPT = """
(function () {
  var form = document.getElementById("filters");
  if (!form) return;
  form.hidden = false;
  var cells = document.querySelectorAll("details.cell");
  var selects = form.querySelectorAll("select");
  function apply() {
    var shown = 0;
    cells.forEach(function (cell) {
      var match = true;
      selects.forEach(function (select) {
        if (select.value && cell.dataset[select.name] !== select.value) match = false;
      });
      cell.hidden = !match;
      if (match) shown += 1;
    });
    document.getElementById("shown").textContent = shown + " of " + cells.length + " shown";
  }
  selects.forEach(function (select) { select.addEventListener("change", apply); });
  apply();
})();
"""


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
    comparisons = comparisons_section(units, notes, n_boot, seed, alpha)
    images = figure_images(tidy, figure_paths, notes)
    samples = samples_section(sample_cells(units))
    from ccq_eval import __version__

    missing = ("<section id=\"missing\" class=\"missing\"><h2>What is missing</h2><ul>"
               + "".join(f"<li>{_e(note)}</li>" for note in notes) + "</ul></section>") if notes else ""
    title = f"ccq-eval report: {root.resolve().name}"
    sections = [("run", "Run", run_section(units)), ("tables", "Tables", tables_section(tidy)),
                ("comparisons", "CCQ vs baseline", comparisons),
                ("figures", "Figures", figures_section(images)), ("samples", "Samples", samples)]
    nav = "".join(f'<a href="#{key}">{_e(label)}</a>' for key, label, _ in sections)
    body = "".join(f'<section id="{key}"><h2>{_e(label)}</h2>{content}</section>'
                   for key, label, content in sections)
    models = sorted({unit.model for unit in units})
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{_e(title)}</h1><p class=\"note\">{len(units)} finished units, {len(models)} models "
        f"({_e(', '.join(models))}); made by ccq-eval {_e(__version__)} from <code>{_e(root)}</code>.</p>"
        f"<nav>{nav}</nav>{missing}{body}<script>{SCRIPT}</script></body></html>\n"
    )


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
