"""Archiving: a compact copy of finished units, for committing results to the repository.

Results (xz-compressed), metadata and unit specs are copied with the run's machine paths made relative
(portable.py: the working folder becomes '.', the run's output folder the archive's); per-sample logs are
xz-compressed with their long strings (haystacks, documents, prompts) replaced by length and sha256;
resume caches stay out; each unit's record (checksums.json) covers the archived files. `ccq-eval table`,
`compare` and `figures` read an archive exactly as the run it came from.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
from pathlib import Path
from typing import Any

from ccq_eval.atomic_io import atomic_write_bytes, dumps
from ccq_eval.harness.portable import PathRewrite
from ccq_eval.harness.store import (
    ARCHIVED_RESULTS_FILE,
    META_FILE,
    RESULTS_FILE,
    UNIT_SPEC_FILE,
    ResultsError,
    is_unit_results,
    load_results,
    read_json,
    vouch,
)
from ccq_eval.harness.store.formats import stored_spec
from ccq_eval.harness.store.unit_lock import LOCK_FILE

# The folder an archive is written into before its units are moved into place (one per process).
TEMP_PREFIX = ".ccq-archive-"

# Strings longer than this in a sample's doc / arguments (haystacks, documents, prompts) are stored
# as their digest: they are regenerated from the task seed or the embedded corpus, and they make up
# nearly all of a per-sample log's bytes.
ARCHIVE_MAX_STRING = 2000


def _digest_long_strings(value: Any) -> Any:
    if isinstance(value, str) and len(value) > ARCHIVE_MAX_STRING:
        digest = hashlib.sha256(value.encode("utf-8")).hexdigest()
        return f"<{len(value)} chars, sha256 {digest}; not archived>"
    if isinstance(value, dict):
        return {k: _digest_long_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_digest_long_strings(v) for v in value]
    return value


def archive_results(source: Path, destination: Path) -> list[Path]:
    """Copy every finished unit under `source` to the same place under `destination`: results,
    metadata and unit spec as they are; per-sample logs xz-compressed, with the long strings of
    `doc`, `arguments` and `target` (a perplexity document is its own target) replaced by their
    length and sha256 (metrics, responses, short targets and cells are kept). Unfinished units and
    resume caches are left out. Returns the unit folders.

    Everything is read, checked and compressed before the first file is written: a unit whose samples
    do not match its results.json (truncated, or from another run), a unit a running `ccq-eval run` holds,
    a destination that is a file, a run's results folder or holds an archive of another run's unit stop the
    archive with nothing written."""
    source, destination = Path(source), Path(destination)
    _check_destination(destination)
    _check_no_overlap(source, destination)
    _check_not_a_run_folder(destination)
    _check_no_unit_running(source)
    units = [unit for unit in load_results(source) if is_unit_results(unit.results_path)]
    packed_units = []
    for unit in units:
        target = destination / _archived_path(unit.folder, source)
        rewrite = PathRewrite.for_unit(unit.meta, source, destination)  # meta.json as its format's reader reads it
        packed = {name: _portable_bytes(unit.folder / name, rewrite) for name in (UNIT_SPEC_FILE, META_FILE)
                  if (unit.folder / name).is_file()}
        _check_archive_target(target, packed.get(META_FILE))
        packed |= {unit.samples_paths[task].name.removesuffix(".xz") + ".xz":
                   _packed_samples(unit.samples(task), rewrite) for task in unit.task_results
                   if task in unit.samples_paths}
        packed[ARCHIVED_RESULTS_FILE] = lzma.compress(_portable_bytes(unit.results_path, rewrite), preset=9)
        packed_units.append((unit, target, packed))
    destination.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp(destination)
    temp = destination / f"{TEMP_PREFIX}{os.getpid()}"
    try:
        for unit, target, packed in packed_units:  # written whole into the temporary folder first
            _write_unit(unit, temp / target.relative_to(destination), packed)
        written = []
        for _unit, target, _packed in packed_units:  # then each moved into place
            _move_into_place(temp / target.relative_to(destination), target)
            written.append(target)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return written


def _archived_path(folder: Path, source: Path) -> Path:
    """Where a unit folder goes below the archive: its place below `source`, and at least <model>/<task>
    (archiving one model's or one unit's folder keeps the names a unit's record is checked against)."""
    relative = folder.relative_to(source)
    return relative if len(relative.parts) >= 2 else Path(folder.parent.name, folder.name)


def _write_unit(unit: Any, folder: Path, packed: dict[str, bytes]) -> None:
    """One archived unit: unit.json and meta.json, the packed samples, results.json.xz (in that order), and
    its record (checksums.json over the archived files) last."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in packed.items():
        atomic_write_bytes(folder / name, data)
    vouch.write_record(folder, stored_spec(folder / UNIT_SPEC_FILE, folder / META_FILE) or {})


def _portable_bytes(path: Path, rewrite: PathRewrite) -> bytes:
    """A JSON file of a unit with its machine paths rewritten; unchanged bytes where it names none."""
    data = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    original = read_json(path)
    portable = rewrite(original)
    return data if portable == original else (dumps(portable) + "\n").encode("utf-8")


def _move_into_place(built: Path, target: Path) -> None:
    """Replace `target` (an earlier archive of the same run, or nothing) by the unit folder `built`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        old = target.with_name(f"{TEMP_PREFIX}old-{os.getpid()}-{target.name}")
        os.replace(target, old)
        os.replace(built, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(built, target)


def _remove_stale_temp(destination: Path) -> None:
    """Temporary folders an archive that was killed left (its process is gone)."""
    for folder in destination.glob(f"{TEMP_PREFIX}*"):
        pid = folder.name.removeprefix(TEMP_PREFIX).removeprefix("old-").split("-")[0]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_no_overlap(source: Path, destination: Path) -> None:
    """An archive is written beside its source, never into it nor around it."""
    src, dst = source.resolve(), destination.resolve()
    if src == dst or dst.is_relative_to(src) or src.is_relative_to(dst):
        raise ResultsError(f"the archive {destination} overlaps its source {source} (one lies inside the other); "
                           "nothing was written: archive into a folder outside the run, e.g. results/<name>")


def _packed_samples(records: list[dict[str, Any]], rewrite: PathRewrite) -> bytes:
    """One unit's per-sample log as archived: long strings as their digest, machine paths relative,
    xz-compressed."""
    lines = []
    for sample in records:
        for key in ("doc", "arguments", "target"):
            if key in sample:
                sample[key] = rewrite(_digest_long_strings(sample[key]))
        lines.append(dumps(sample, indent=None) + "\n")
    return lzma.compress("".join(lines).encode("utf-8"), preset=9)


def _check_destination(destination: Path) -> None:
    for folder in (destination, *destination.parents):
        if folder.exists() and not folder.is_dir():
            raise ResultsError(f"{folder} is a file, not a folder; nothing was written: give a folder for "
                               "the archive, e.g. results/<name>")


def _check_archive_target(target: Path, archived_meta: bytes | None) -> None:
    """An archive may refresh an archive of the same run (the same meta.json per unit), never replace an
    archive of another run or a live run's folder (its uncompressed samples would stay and be read
    instead of the archived ones)."""
    if not target.is_dir():
        return
    live = _live_files(target)
    if live:
        raise ResultsError(f"{target} holds a live run ({', '.join(live[:3])}), not an archive; nothing was "
                           "written: archive into a new folder, or delete that unit folder first")
    finished = (target / RESULTS_FILE).is_file() or (target / ARCHIVED_RESULTS_FILE).is_file()
    if finished and _meta_bytes(target) != archived_meta:
        raise ResultsError(f"{target} holds an archive of another run ({target / META_FILE} differs from the "
                           "unit's meta.json); nothing was replaced: archive into a new folder, or move the old "
                           "archive away first")


def _live_files(unit: Path) -> list[str]:
    """The files of unit folder `unit` that an archived unit does not hold (a run's samples, resume cache)."""
    archived = {UNIT_SPEC_FILE, META_FILE, RESULTS_FILE, ARCHIVED_RESULTS_FILE, vouch.CHECKSUMS_FILE}
    return sorted(p.name for p in unit.iterdir() if p.name not in archived and not p.name.startswith(".")
                  and not (p.name.startswith("samples_") and p.name.endswith(".jsonl.xz")))


def _check_not_a_run_folder(destination: Path) -> None:
    """An archive goes into a new folder or an earlier archive, never into a run's results folder (its
    lm_eval/ copies and unarchived units would be read beside the archived ones, its table.md replaced)."""
    if not destination.is_dir():
        return
    found = sorted({path.parent for name in (UNIT_SPEC_FILE, META_FILE) for path in destination.rglob(name)
                    if not path.parent.name.startswith(".") and _live_files(path.parent)})
    found += [destination / "lm_eval"] if (destination / "lm_eval").is_dir() else []
    if found:
        raise ResultsError(f"{destination} holds a live run ({found[0]} is not archived): a run's results folder, "
                           "not an archive; nothing was written: archive into a new folder (e.g. results/<name>) or "
                           "an earlier archive")


def _check_no_unit_running(source: Path) -> None:
    """Archiving a run while it computes would leave out the units it has not finished, without a word: a unit
    whose lock (store.unit_lock) another process holds stops the archive."""
    import filelock

    for lock_file in sorted(source.rglob(LOCK_FILE)):
        lock = filelock.FileLock(str(lock_file))
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            raise ResultsError(f"{lock_file.parent} is being computed by a running `ccq-eval run` (it holds "
                               f"{lock_file}); nothing was written: archive {source} once that run has "
                               "finished") from None
        except OSError:  # a filesystem without locks: nothing to tell
            continue
        lock.release()


def _meta_bytes(unit: Path) -> bytes | None:
    path = unit / META_FILE
    return path.read_bytes() if path.is_file() else None
