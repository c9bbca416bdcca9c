"""The names of a unit folder's files, the error of a results folder, and reading one JSON file."""

from __future__ import annotations

import json
import lzma
import re
from pathlib import Path
from typing import Any

from ccq_eval.errors import UserError

RESULTS_FILE = "results.json"
# An archive (`ccq-eval archive`) keeps a unit's results xz-compressed: lm-eval's results of our tasks are
# mostly their declared metric lists, which compress about twentyfold.
ARCHIVED_RESULTS_FILE = RESULTS_FILE + ".xz"
META_FILE = "meta.json"
UNIT_SPEC_FILE = "unit.json"
RESPONSES_DB = "responses.sqlite"


class ResultsError(UserError):
    """A problem with results on disk that the user can fix (message says what and where)."""


def slugify(name: str) -> str:
    """A folder-safe version of a model or task name ('models/tiny-gla' -> 'models_tiny-gla'; '+' is kept,
    so a --ccq-attach model 'tiny-gla+ccq-lambda2' is stored under that name)."""
    slug = re.sub(r"[^A-Za-z0-9._+-]+", "_", name.strip()).strip("._")
    if not slug:
        raise ValueError(f"cannot make a folder name from {name!r}")
    return slug


def is_unit_results(path: Path) -> bool:
    """Whether `path` is a unit folder's results file (a run's results.json, an archive's results.json.xz)
    rather than lm-eval's results_<stamp>.json."""
    return Path(path).name in (RESULTS_FILE, ARCHIVED_RESULTS_FILE)


def read_json(path: Path) -> Any:
    """Read a JSON file (xz-compressed when its name ends in .xz); a corrupt file raises ResultsError naming
    it and is left untouched."""
    path = Path(path)
    try:
        data = path.read_bytes()
        text = (lzma.decompress(data) if path.suffix == ".xz" else data).decode("utf-8")
    except FileNotFoundError:
        raise ResultsError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, lzma.LZMAError) as exc:
        raise ResultsError(f"cannot read {path}: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}). "
            "The file was left as it is: fix or delete it (deleting results.json makes "
            "`ccq-eval run` redo that unit)."
        ) from None
