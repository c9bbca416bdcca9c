"""pyproject.toml's dependencies match what the installed code (ccq_eval, tasks, cli.py) imports: every
third-party module it imports comes from a declared distribution, and every declared one is imported or
named here with the reason it is needed without an import."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_CODE = ("ccq_eval", "tasks", "cli.py")
# ccq_eval/data/build_corpora.py rebuilds the embedded corpora and pip-installs rdata into a scratch folder
NOT_SHIPPED = {ROOT / "ccq_eval" / "data" / "build_corpora.py"}
NEEDED_WITHOUT_IMPORT = {"jinja2": "pandas' Styler.to_latex imports it (tables.to_latex)"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {_canonical(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)) for requirement in project["dependencies"]}


def _imported_modules() -> dict[str, set[str]]:
    """Top-level third-party module -> the files that import it."""
    modules: dict[str, set[str]] = {}
    for root in INSTALLED_CODE:
        path = ROOT / root
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            if file in NOT_SHIPPED:
                continue
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "ccq_eval":
                        modules.setdefault(top, set()).add(str(file.relative_to(ROOT)))
    return modules


def test_every_imported_package_is_declared():
    declared = _declared()
    distributions = packages_distributions()
    undeclared = {module: sorted(files) for module, files in _imported_modules().items()
                  if not {_canonical(d) for d in distributions.get(module, [module])} & declared}
    assert not undeclared, f"imported but not in pyproject.toml's dependencies: {undeclared}"


def test_every_declared_package_is_imported_or_explained():
    distributions = packages_distributions()
    imported = {_canonical(d) for module in _imported_modules() for d in distributions.get(module, [module])}
    unused = _declared() - imported - {_canonical(name) for name in NEEDED_WITHOUT_IMPORT}
    assert not unused, f"declared in pyproject.toml but imported nowhere in {INSTALLED_CODE}: {sorted(unused)}"


def test_every_package_of_the_checkout_is_in_the_distribution():
    """setuptools installs only the packages pyproject lists: a package folder left out imports in the
    checkout (the editable install maps folders) but not from a wheel."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    folders = {"ccq_eval": ROOT / "ccq_eval", "ccq_eval.tasks": ROOT / "tasks", "ccq_eval.models": ROOT / "models"}
    found = set()
    for prefix, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                relative = init.parent.relative_to(folder).parts
                found.add(".".join((prefix, *relative)))
    assert found == set(setuptools["packages"]), found ^ set(setuptools["packages"])
