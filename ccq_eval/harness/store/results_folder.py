"""One results folder (`ccq-eval run --output`) as planning and running use it: one call per phase of a
unit, so the runner never assembles a unit's files itself.

    store.unit(model, task)                      the unit's folder (UnitDir)
    store.on_disk(unit)                          what an earlier run left there (planning compares it)
    store.claim(unit, blocking=...)              the unit's lock; None while another worker holds it
    store.open(unit, spec)                       unit.json written, the resume cache opened for answers
    store.commit(unit, results, samples, meta)   the finished unit stored; its failure, if any
    store.failure(unit, model)                   a stored unit's failure (non-finite values), if any
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccq_eval.harness.store import response_cache, vouch
from ccq_eval.harness.store.files import read_json
from ccq_eval.harness.store.formats import COMPLETE_RECORD_SINCE, RECORD_SINCE, read_spec, stored_spec, unit_format
from ccq_eval.harness.store.reader import read_unit
from ccq_eval.harness.store.response_cache import ResponseCache
from ccq_eval.harness.store.unit_folder import (
    UnitDir,
    non_finite_message,
    non_finite_values,
    unit_dir,
    write_spec,
    write_unit,
)
from ccq_eval.harness.store.unit_lock import UnitLock


@dataclass(frozen=True)
class UnitOnDisk:
    """What an earlier run left in a unit folder: whether the unit is finished, the settings it recorded
    (in the current form; None when it recorded none) and how many answers its resume cache holds."""

    finished: bool
    spec: dict[str, Any] | None
    answered: int


@dataclass(frozen=True)
class ResultsStore:
    """The results folder `output` (its units, their locks, resume caches and files)."""

    output: Path

    def unit(self, model: str, task: str) -> UnitDir:
        return unit_dir(self.output, model, task)

    def on_disk(self, unit: UnitDir) -> UnitOnDisk:
        """Read what `unit`'s folder holds, each file by its format's reader; ResultsError names a file that
        is unreadable, damaged, of a newer format or not the files its record vouches for (nothing is
        changed). A unit of format 3 whose write stopped before its record (checksums.json) is not finished; one
        of format 4 with results.json but no record has lost it and is refused. A finished
        unit is checked as the readers check it (reader.read_unit: its record, samples re-hashed, and the
        aggregates its samples decide) before it counts as finished."""
        if not unit.is_finished() or not self._write_finished(unit):
            answered = response_cache.answered_count(unit.responses_db)
            return UnitOnDisk(False, read_spec(unit.spec) if unit.spec.is_file() else None, answered)
        read_unit(unit.finished_results)
        return UnitOnDisk(True, stored_spec(unit.spec, unit.meta), 0)  # version 1: maybe only meta.json's copy

    @staticmethod
    def _write_finished(unit: UnitDir) -> bool:
        """Whether a unit with results.json finished its write: units of format 3 end with their record, so one
        without it stopped short; format 4 writes results.json last, so one with it did finish (read_unit then
        refuses a missing record)."""
        version = unit_format(unit.spec, unit.meta)  # a newer format is refused here, before any check
        if version is None or version < RECORD_SINCE or version >= COMPLETE_RECORD_SINCE:
            return True
        return (unit.path / vouch.CHECKSUMS_FILE).is_file()

    def answered(self, unit: UnitDir) -> int:
        """How many answers `unit`'s resume cache holds."""
        return response_cache.answered_count(unit.responses_db)

    def claim(self, unit: UnitDir, *, blocking: bool) -> UnitLock | None:
        """`unit`'s lock, taken (release it when done); None when another worker holds it and not `blocking`."""
        lock = UnitLock(unit)
        return lock if lock.acquire(blocking=blocking) else None

    def open(self, unit: UnitDir, spec: dict[str, Any], *, write_spec_file: bool = True) -> ResponseCache:
        """Start `unit`: its unit.json (unless `write_spec_file` is False: a data-parallel rank that does not
        write; or the unit is finished and recomputed, whose unit.json commit writes with its new results, so
        that a recompute that fails leaves the finished unit as it was) and its resume cache, which refuses
        answers another spec left (close it when done)."""
        if write_spec_file and not unit.is_finished():  # a finished unit recomputed keeps its files until commit
            write_spec(unit, spec)
        return ResponseCache(unit.responses_db, identity=response_cache.spec_identity(spec))

    def commit(self, unit: UnitDir, model: str, results: dict[str, Any], samples: dict[str, list[dict[str, Any]]],
               meta: dict[str, Any]) -> str | None:
        """Store the evaluated `unit` (unit_folder.write_unit) and drop its resume cache, whose answers its
        samples now hold. Returns the unit's failure when its results hold non-finite values (it is stored
        all the same, and shown as failed), else None."""
        write_unit(unit, results, samples, meta)
        response_cache.remove_resume_cache(unit.responses_db)
        found = non_finite_values(results)
        return non_finite_message(model, found) if found else None

    def failure(self, unit: UnitDir, model: str) -> str | None:
        """A finished unit's failure: the message for its non-finite values, None when it has none."""
        found = non_finite_values(read_json(unit.finished_results))
        return non_finite_message(model, found) if found else None
