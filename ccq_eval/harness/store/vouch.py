"""A finished unit's record of itself, and the checks every reader makes against it.

checksums.json, written atomically once every other file is in place (results.json, the mark of a finished
unit, follows it from format 4 on; before, it came last), holds the sha256 of every other file of the unit
folder and who the unit is (model, digest of its checkpoint fingerprint, task, digest of its unit.json). A
reader that finds it checks each file against it; an edited, truncated or swapped file, or a unit folder
moved under another model or task, is refused in one line naming the file. From format 4 on, the record must
also name every file the format requires (required_files): a record thinned out, with a file deleted or its
entry dropped, is refused too.

The record guards against accidents (a file edited, cut short, lost or swapped from another unit); it is no
signature, and whoever edits a file on purpose can write the record again (docs/reliability.md).

The aggregates a unit's samples decide are recomputed by the readers with or without a record
(aggregates.py): results written before the record existed are checked that way, and a swap that changes
a number is caught even there.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from ccq_eval import atomic_io
from ccq_eval.harness.store.files import (
    ARCHIVED_RESULTS_FILE,
    META_FILE,
    RESPONSES_DB,
    RESULTS_FILE,
    UNIT_SPEC_FILE,
    ResultsError,
    read_json,
    slugify,
)

CHECKSUMS_FILE = "checksums.json"
# Files of a unit folder that are not part of its results: the resume cache and its journal, the lock.
_NOT_RECORDED = re.compile(rf"^({re.escape(RESPONSES_DB)}.*|\..*)$")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def json_sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def recorded_files(folder: Path) -> list[Path]:
    """The files of a unit folder its record covers: all but the record, the resume cache and locks."""
    return sorted(path for path in folder.iterdir() if path.is_file() and path.name != CHECKSUMS_FILE
                  and not _NOT_RECORDED.match(path.name))


def identity(spec: dict[str, Any]) -> dict[str, Any]:
    """Who a unit is: its model, a digest of its checkpoint's fingerprint, its task and a digest of its spec."""
    return {"model": spec.get("model"), "checkpoint_sha256": json_sha256(spec.get("checkpoint")),
            "task": spec.get("task"), "spec_sha256": json_sha256(spec)}


def write_record(folder: Path, spec: dict[str, Any], pending: dict[str, bytes] | None = None) -> None:
    """checksums.json of a finished unit folder, once every other file is in place; `pending` holds files
    (name: bytes) written after the record, recorded by the digest of those bytes (results.json of format 4)."""
    files = {path.name: sha256_file(path) for path in recorded_files(folder)}
    files |= {name: hashlib.sha256(data).hexdigest() for name, data in (pending or {}).items()}
    record = {"identity": identity(spec), "files": dict(sorted(files.items()))}
    atomic_io.atomic_write_json(folder / CHECKSUMS_FILE, record)


def required_files(results_path: Path, results: dict[str, Any]) -> list[str]:
    """The files a finished unit of format 4 holds, which its record must name: meta.json, its results file,
    the samples file of every task results.json's task_hashes names (compressed in an archive) and unit.json
    where it is present (meta.json's "spec" holds the same settings, so a unit may lack it)."""
    suffix = ".jsonl.xz" if results_path.name == ARCHIVED_RESULTS_FILE else ".jsonl"
    hashes = results.get("task_hashes")
    samples = [f"samples_{slugify(str(task))}{suffix}" for task in hashes] if isinstance(hashes, dict) else []
    spec = [UNIT_SPEC_FILE] if (results_path.parent / UNIT_SPEC_FILE).is_file() else []
    return sorted({META_FILE, results_path.name, *samples, *spec})


def _redo(folder: Path) -> str:
    return f"restore the unit's files as they were written, or delete {folder / RESULTS_FILE} to redo the unit"


def verify_record(folder: Path, spec: dict[str, Any] | None,
                  explain: Callable[[str], None] | None = None, required: Collection[str] = ()) -> bool:
    """Check a unit folder against its checksums.json; False when it has none (results written before
    the record existed), ResultsError naming the first file that does not agree (`explain`, given the
    name of such a file, may raise a more telling one first: a samples file cut short) or the first of
    `required` (required_files) that the record does not name."""
    path = folder / CHECKSUMS_FILE
    if not path.is_file():
        return False
    record = read_json(path)
    files = record.get("files") if isinstance(record, dict) else None
    who = record.get("identity") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not isinstance(who, dict):
        raise ResultsError(f"{path} is not a unit's record (no \"files\" / \"identity\"): {_redo(folder)}")
    unrecorded = [name for name in required if name not in files]
    if unrecorded:
        raise ResultsError(f"{path} leaves out {unrecorded[0]}, which every finished unit of its format holds and "
                           f"names in its record (an entry was removed, or the file): {_redo(folder)}")
    changed = []
    for name, expected in sorted(files.items()):
        file = folder / name
        if not file.is_file():
            raise ResultsError(f"{file} is missing (its unit's {CHECKSUMS_FILE} records it): {_redo(folder)}")
        if sha256_file(file) != expected:
            changed.append(file)
    for file in changed if explain is not None else ():
        explain(file.name)
    if changed:
        raise ResultsError(f"{changed[0]} is not the file its unit wrote (sha256 differs from {path}: edited, "
                           f"or swapped from another unit): {_redo(folder)}")
    extra = [p.name for p in recorded_files(folder)
             if p.name not in files and p.name.startswith("samples_")]
    if extra:
        raise ResultsError(f"{folder / extra[0]} is not one of its unit's files ({path} does not record it): "
                           "move it out of the folder")
    if spec is not None and who != identity(spec):
        raise ResultsError(f"{path} records another unit ({who.get('model')} / {who.get('task')}) than "
                           f"{folder / UNIT_SPEC_FILE} holds: {_redo(folder)}")
    _check_location(folder, who, path)
    return True


def _check_location(folder: Path, who: dict[str, Any], path: Path) -> None:
    """A unit folder is <model>/<task>: one moved or copied under another model's or task's name is refused."""
    model, task = who.get("model"), who.get("task")
    if not isinstance(model, str) or not isinstance(task, str):
        return
    if folder.name != slugify(task) or folder.parent.name != slugify(model):
        raise ResultsError(f"{path} records {model} / {task}, but the unit lies in "
                           f"{folder.parent.name}/{folder.name}: move it back to "
                           f"{slugify(model)}/{slugify(task)}, or delete the folder")
