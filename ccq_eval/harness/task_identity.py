"""What of a task's definition decides its numbers, as a digest a unit's spec records.

A task of ours is defined by the files of its family folder as lm-eval loads them (the YAML configs and
templates, the hook modules they name with !function, the word lists and corpora beside them), by the
other family folders its modules import (RULER's families share S-NIAH's construction module) and by the
Python modules at the top of the tasks folder they import. The folder is the one the run loads
(CCQ_EVAL_TASKS_DIR, else the installed ccq_eval.tasks); when CCQ_EVAL_TASKS_DIR is set, the installed
family folder is hashed too, since hook modules may import it by package name. lm-eval's own tasks are
defined by the lm-eval version, which the spec records with the package versions.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
from pathlib import Path

# Files of a task folder that do not decide what it computes.
_NOT_DEFINITION = (".md", ".pyc")


def package_versions() -> dict[str, str | None]:
    """The versions of the packages whose code decides a unit's numbers besides the model's."""
    versions: dict[str, str | None] = {}
    for package in ("ccq-eval", "lm_eval"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _folder_digest(folder: Path, recursive: bool) -> str:
    digest = hashlib.sha256()
    files = folder.rglob("*") if recursive else folder.glob("*.py")
    for path in sorted(p for p in files if p.is_file() and "__pycache__" not in p.parts
                       and not p.name.endswith(_NOT_DEFINITION)):
        digest.update(str(path.relative_to(folder)).encode("utf-8") + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def task_definition(task: str) -> str | None:
    """sha256 of the definition of one of our tasks as the run loads it; None for lm-eval's own tasks."""
    from ccq_eval.harness import task_registry

    yaml_path = task_registry.our_task_yaml(task)
    if yaml_path is None:
        return None
    family = yaml_path.parent
    tasks_root = family.parent
    parts = _definition_parts(tasks_root, family.name)
    installed = _installed_tasks_dir()
    if installed is not None and installed.resolve() != tasks_root.resolve() and (installed / family.name).is_dir():
        imported = _definition_parts(installed, family.name)
        parts += imported if imported != parts else []  # a copy equal to the installed tasks is the same
    return hashlib.sha256("".join(parts).encode("ascii")).hexdigest()


# How a task module reads the embedded corpora: `ccq_eval.data...` or `from ccq_eval import data`.
_CORPORA_IMPORT = re.compile(r"\bccq_eval\.data\b|\bfrom\s+ccq_eval\s+import\s+data\b")


def reads_embedded_corpora(task: str) -> bool:
    """Whether one of our tasks may read the embedded corpora (ccq_eval/data): a Python file of its family, or
    of a family its modules import, imports ccq_eval.data. Counted by family, not by the corpus a task's YAML
    names: RULER's families import S-NIAH's construction module, so they count too. False for lm-eval's tasks."""
    from ccq_eval.harness import task_registry

    yaml_path = task_registry.our_task_yaml(task)
    if yaml_path is None:
        return False
    family = yaml_path.parent
    folders = [family, *_imported_families(family.parent, family.name)]
    return any(_CORPORA_IMPORT.search(path.read_text(encoding="utf-8"))
               for folder in folders for path in sorted(folder.rglob("*.py")))


def _definition_parts(tasks_root: Path, family: str) -> list[str]:
    """Digests of a family folder, of the other family folders its modules import (RULER's families build
    their prompts with S-NIAH's construction module), and of the top-level modules of `tasks_root`."""
    return ([_folder_digest(tasks_root / family, True)]
            + [_folder_digest(folder, True) for folder in _imported_families(tasks_root, family)]
            + [_folder_digest(tasks_root, False)])


# How a task module names another family of ours: `ccq_eval.tasks.<family>...` or `from ccq_eval.tasks import <family>`.
_FAMILY_IMPORT = re.compile(r"\bccq_eval\.tasks\.(\w+)|\bfrom\s+ccq_eval\.tasks\s+import\s+(\w+)")


def _imported_families(tasks_root: Path, family: str) -> list[Path]:
    """The family folders under `tasks_root` that `family`'s Python files import, directly or through another
    family, in name order (the family itself left out)."""
    seen, pending = {family}, [family]
    while pending:
        for path in sorted((tasks_root / pending.pop()).rglob("*.py")):
            for match in _FAMILY_IMPORT.finditer(path.read_text(encoding="utf-8")):
                name = match.group(1) or match.group(2)
                if name not in seen and (tasks_root / name).is_dir():
                    seen.add(name)
                    pending.append(name)
    return [tasks_root / name for name in sorted(seen - {family})]


def _installed_tasks_dir() -> Path | None:
    import importlib.resources

    from ccq_eval.harness.task_registry import TASKS_PACKAGE

    folder = importlib.resources.files(TASKS_PACKAGE)
    return folder if isinstance(folder, Path) else None
