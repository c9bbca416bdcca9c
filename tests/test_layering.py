"""The package's floors: model/ and the modules below it never import the harness or the analysis."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ccq_eval"
UPPER = ("ccq_eval.harness", "ccq_eval.analysis", "ccq_eval.inspection", "ccq_eval.cli")


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


LOWER_FILES = sorted(PACKAGE.glob("model/**/*.py")) + [PACKAGE / "atomic_io.py", PACKAGE / "task_families.py"]


@pytest.mark.parametrize("path", LOWER_FILES, ids=lambda path: str(path.relative_to(PACKAGE)))
def test_lower_modules_import_nothing_above_them(path):
    upward = sorted(name for name in _imported(path) if name.startswith(UPPER))
    assert not upward, f"{path.relative_to(PACKAGE.parent)} imports {upward}: an arrow that runs back up"
