"""Results on disk: the interface between running and analysing.

One folder per (model, task) unit below the results folder, and every finished unit once more as
lm-eval's EvaluationTracker lays out its output (<output>/lm_eval), so that lm-eval's readers work on it:

    files.py           the files' names, ResultsError, reading one JSON file
    formats.py         the format version of unit.json and meta.json, one reader per version
    unit_folder.py     a unit's folder (UnitDir) and writing a finished unit into it
    response_cache.py  the resume cache of a running unit (ResponseCache)
    lm_eval_mirror.py  the copies in lm-eval's tracker layout
    vouch.py           a finished unit's record of its files (checksums.json) and its check
    aggregates.py      every aggregate its samples decide, recomputed from them (lm-eval's aggregations)
    reader.py          reading results back (load_results, StoredUnit), with both checks
    unit_lock.py       a unit's lock, so that processes sharing the folder compute each unit once
    results_folder.py  ResultsStore: the one object planning and running call, once per phase of a unit

Every file is written atomically (ccq_eval.atomic_io, whose writers this package exports as the writers of
every results file), so a run killed at any moment leaves either the old file or the new one, never half
of one.
"""

from ccq_eval.atomic_io import atomic_write_bytes, atomic_write_json, atomic_write_text, dumps
from ccq_eval.harness.store.files import (
    ARCHIVED_RESULTS_FILE,
    META_FILE,
    RESPONSES_DB,
    RESULTS_FILE,
    UNIT_SPEC_FILE,
    ResultsError,
    is_unit_results,
    read_json,
    slugify,
)
from ccq_eval.harness.store.formats import FORMAT_KEY, FORMAT_VERSION, TIMESTAMP_FORMAT, read_meta, read_spec
from ccq_eval.harness.store.lm_eval_mirror import TRACKER_DIR, TRACKER_UNIT_KEY
from ccq_eval.harness.store.reader import StoredUnit, find_results_files, iter_jsonl, load_results, run_folder
from ccq_eval.harness.store.response_cache import ResponseCache, answered_count, spec_identity
from ccq_eval.harness.store.results_folder import ResultsStore, UnitOnDisk
from ccq_eval.harness.store.unit_folder import (
    UnitDir,
    non_finite_message,
    non_finite_values,
    task_hash,
    unit_dir,
    write_unit,
)

__all__ = [
    "ARCHIVED_RESULTS_FILE", "FORMAT_KEY", "FORMAT_VERSION", "META_FILE", "RESPONSES_DB", "RESULTS_FILE",
    "TIMESTAMP_FORMAT", "TRACKER_DIR", "TRACKER_UNIT_KEY", "UNIT_SPEC_FILE", "ResponseCache", "ResultsError",
    "ResultsStore", "StoredUnit", "UnitDir", "UnitOnDisk", "answered_count", "atomic_write_bytes", "atomic_write_json",
    "atomic_write_text", "dumps", "find_results_files", "is_unit_results", "iter_jsonl", "load_results",
    "non_finite_message", "non_finite_values", "read_json", "read_meta", "read_spec", "run_folder", "slugify",
    "spec_identity", "task_hash", "unit_dir", "write_unit",
]
