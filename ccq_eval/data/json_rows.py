"""Users' JSON-lines data files, read row by row with each row checked, so that a bad row stops the run in one
line naming the file, the line and what is wrong (the zero-shot and recall tasks' local data)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def checked_rows(path: str | Path, row_problem: Callable[[Any], str | None], error: Callable[[str], Exception],
                 fix: str) -> list[Any]:
    """The JSON rows of `path` (blank lines skipped). The first line that is not JSON, or whose row
    `row_problem` finds a problem in, raises error("<path> line <n>: <what>; <fix>")."""
    rows = []
    with open(path, encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path} line {line_number}: not valid JSON ({exc}); {fix}") from None
            problem = row_problem(row)
            if problem is not None:
                raise error(f"{path} line {line_number}: {problem}; {fix}")
            rows.append(row)
    return rows
