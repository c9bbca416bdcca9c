"""How every analysis output writes its values: task and length labels, failed (non-finite) values, and
tables as markdown, LaTeX or csv. Shared by the tables, the comparisons, the figures and the report.

Markdown is written by hand, because pytablewriter and tabulate pad every cell to its column's width,
which would change every committed table.md; LaTeX goes through pandas' Styler.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd

from ccq_eval.errors import UserError
from ccq_eval.harness.task_registry import RULER_TASKS
from ccq_eval.task_families import FAMILIES, OUR_TASK_PREFIX

FORMATS = ("markdown", "csv", "latex")


class AnalysisOptionError(UserError, ValueError):
    """An option of `table`, `compare`, `figures` or `report` with a value they cannot take."""


# --------------------------------------------------------------------------------------------
# Labels

# (family prefix, its display label), longest prefix first
_DISPLAY_PREFIXES = sorted(((prefix, family.display_label) for family in FAMILIES if family.display_label
                            for prefix in family.task_prefixes), key=lambda pair: -len(pair[0]))


def display_task(task: str) -> str:
    """A task as tables and figures name it: its family's display_label, then what follows the family prefix
    ('ccq_s_niah_1' -> 'S-NIAH-1', 'ccq_longbench_e_qasper' -> 'LongBench-E qasper', 'ccq_niah_multikey_1'
    -> 'NIAH multikey_1'), or, for a RULER task named as its family's prefix, the prefix's last word
    ('ccq_ruler_vt' -> 'RULER vt'); a group or a task of a family without a label loses our prefix
    ('ccq_longbench' -> 'longbench', 'ccq_ppl_sweep' -> 'ppl_sweep'), other names stay as they are."""
    for prefix, label in _DISPLAY_PREFIXES:
        if task == prefix and task in RULER_TASKS:
            return label + prefix.rpartition("_")[2]
        rest = task.removeprefix(prefix)
        if rest != task and (prefix.endswith("_") or rest.startswith("_")):
            return label + rest.removeprefix("_")
    return task.removeprefix(OUR_TASK_PREFIX)


def length_label(length: Any) -> str:
    """A length in tokens as tables and figures head it: 1024 -> '1K', 1000 -> '1000'."""
    length = int(length)
    if length % 1024 == 0:
        return f"{length // 1024}K"
    return str(length)


def length_text(length: Any) -> str:
    """length_label, or '-' for no length."""
    return "-" if length is None else length_label(length)


# --------------------------------------------------------------------------------------------
# Non-finite values: an evaluation that gave NaN or inf (a NaN weight, a lambda the model cannot take)
# failed there; tables show such a value as failed, they never drop it.

NON_FINITE_NOTE = ("NaN / inf (failed): the evaluation gave a non-finite value; `ccq-eval run` counts such a "
                   "unit as failed")


def failed_label(value: float) -> str:
    """How tables show a non-finite value: 'NaN (failed)', 'inf (failed)' or '-inf (failed)'."""
    return ("NaN" if math.isnan(value) else f"{value:g}") + " (failed)"


def with_failures_shown(rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` with each non-finite value replaced by its failed_label (the column becomes object)."""
    return rows.assign(value=pd.Series([v if math.isfinite(v) else failed_label(v) for v in rows["value"]],
                                       index=rows.index, dtype=object))


def has_failures(frame: pd.DataFrame) -> bool:
    return any(isinstance(v, str) and v.endswith(" (failed)") for v in frame.to_numpy().ravel())


# --------------------------------------------------------------------------------------------
# Tables as text


def format_cell(value: Any, digits: int) -> str:
    """One table value as text: '-' for a missing one, floats with `digits` decimals."""
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _has_named_index(frame: pd.DataFrame) -> bool:
    return any(name is not None for name in frame.index.names)


def flat(frame: pd.DataFrame) -> tuple[list[str], list[list[Any]]]:
    """(headers, rows) of `frame` with its named index levels as leading columns."""
    flattened = frame.reset_index() if _has_named_index(frame) else frame
    headers = [str(c) for c in flattened.columns]
    return headers, flattened.astype(object).values.tolist()


_MARKDOWN_SPECIAL = {"\\": "\\\\", "|": "\\|", "<": "&lt;", ">": "&gt;", "&": "&amp;", "\n": " ", "\r": " ",
                     "`": "\\`"}
# Markup that only some text can make: a link ([text](url), [text][ref]) and emphasis (an asterisk or an
# underscore that can open it: followed by a character that is no space). Escaped only where the text
# could make it, so that the cells this package writes ("[-1.0, +2.0]", "p = 0.001**") read as they are.
_MARKUP = ((re.compile(r"\]\s*[(\[]"), {"[": "\\[", "]": "\\]"}),
           (re.compile(r"\*[^\s*]"), {"*": "\\*"}),
           (re.compile(r"(?:^|[^\w])_[^\s_]"), {"_": "\\_"}))


def markdown_escape(text: str) -> str:
    """`text` as literal markdown table text: a `|` in a model folder named `gla|100.00` must not start
    a cell, and raw HTML, a link, code or emphasis in a name must not become markup."""
    special = dict(_MARKDOWN_SPECIAL)
    for pattern, escapes in _MARKUP:
        if pattern.search(text):
            special |= escapes
    escaped = "".join(special.get(ch, ch) for ch in text)
    # GitHub links bare addresses too (https://..., www....): an escaped character breaks the address
    return re.sub(r"(?i)(?<=[a-z])://", r"\\://", escaped).replace("www.", "www\\.")


def to_markdown(frame: pd.DataFrame, digits: int = 2) -> str:
    headers, body = flat(frame)
    lines = ["| " + " | ".join(markdown_escape(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    for row in body:
        lines.append("| " + " | ".join(markdown_escape(format_cell(v, digits)) for v in row) + " |")
    return "\n".join(lines)


_LATEX_SPECIAL = {"&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
                  "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "\\": r"\textbackslash{}"}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def to_latex(frame: pd.DataFrame, digits: int = 2, caption: str = "") -> str:
    """A booktabs table (pandas Styler.to_latex): index columns left-aligned, values right-aligned."""
    flattened = frame.reset_index() if _has_named_index(frame) else frame
    styler = (flattened.style.format(precision=digits, na_rep="-", escape="latex")
              .format_index(escape="latex", axis=1).hide(axis="index"))
    return styler.to_latex(
        hrules=True, position="t", position_float="centering",
        caption=latex_escape(caption) if caption else None,  # the Styler leaves captions unescaped
        column_format="l" * (flattened.shape[1] - frame.shape[1]) + "r" * frame.shape[1],
    ).rstrip("\n")


# A csv cell that begins with one of these is a formula to a spreadsheet (OWASP, "CSV Injection").
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> Any:
    """A text cell made inert for spreadsheets: one that begins like a formula (a checkpoint folder named
    `=1+2`) gets a leading `'`, as OWASP recommends; numbers, and text that reads as a number (`-0.5`),
    stay as they are."""
    if not isinstance(value, str) or not value.startswith(_FORMULA_START):
        return value
    try:
        float(value)
    except ValueError:
        return "'" + value
    return value


def csv_safe(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with every text cell, column name and index label passed through csv_cell."""
    safe = frame.map(csv_cell)
    safe.columns = safe.columns.map(lambda name: csv_cell(name) if isinstance(name, str) else name)
    if isinstance(safe.index, pd.MultiIndex):
        safe.index = safe.index.set_levels([level.map(csv_cell) if level.dtype == object else level
                                            for level in safe.index.levels])
    elif safe.index.dtype == object:
        safe.index = safe.index.map(csv_cell)
    return safe


def to_csv(frame: pd.DataFrame) -> str:
    flattened = frame.reset_index() if _has_named_index(frame) else frame
    return csv_safe(flattened).to_csv(index=False)


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise AnalysisOptionError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
