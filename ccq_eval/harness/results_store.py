"""Results on disk: the interface between running and analysing.

One folder per (model, task) unit:

    <output>/<model>/<task>/
        unit.json              what the unit was asked to compute (written when it starts)
        responses.sqlite       model responses so far (resume cache, JSON values, no pickle)
        samples_<task>.jsonl   lm-eval per-sample log, one file per evaluated lm-eval task
        meta.json              run metadata (versions, seed, device, wall time, ...)
        results.json           lm-eval results dict; written last, so it marks the unit finished

and every finished unit once more as lm-eval's EvaluationTracker lays out its output, so that
lm-eval's readers (lm_eval.utils.get_results_filenames, get_sample_results_filenames, ...) and
tools built on them work on `<output>/lm_eval`:

    <output>/lm_eval/<model>/results_<time>.json, samples_<task>_<time>.jsonl (hard links)

Every file is written atomically (temporary file in the same folder, then os.replace), so
a run killed at any moment leaves either the old file or the new one, never half of one.
Readers (`table`, `compare`, `figures`) only read these files; they never load a model.
The layout lm-eval's own CLI writes (results_<timestamp>.json next to
samples_<task>_<timestamp>.jsonl) is read as well, and so are archived units (archive.py:
samples as samples_<task>.jsonl.xz with long prompt / document strings replaced by their digest,
no resume cache), which is how results are committed to the repository.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import lzma
import math
import os
import re
import shutil
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ccq_eval.atomic_io import (  # noqa: F401  (re-exported: the writers of every results file)
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    dumps,
    json_default,
)
from ccq_eval.harness.unit_lock import LOCK_FILE, UnitLock  # noqa: F401  (re-exported)

RESULTS_FILE = "results.json"
META_FILE = "meta.json"
UNIT_SPEC_FILE = "unit.json"
RESPONSES_DB = "responses.sqlite"
TRACKER_DIR = "lm_eval"
TRACKER_UNIT_KEY = "ccq_eval_unit"  # in a tracker copy: its unit folder, <model>/<task> below the output


class ResultsError(Exception):
    """A problem with results on disk that the user can fix (message says what and where)."""


def slugify(name: str) -> str:
    """A folder-safe version of a model or task name ('models/tiny-gla' -> 'models_tiny-gla'; '+' is kept,
    so a --ccq-attach model 'tiny-gla+ccq-lambda2' is stored under that name)."""
    slug = re.sub(r"[^A-Za-z0-9._+-]+", "_", name.strip()).strip("._")
    if not slug:
        raise ValueError(f"cannot make a folder name from {name!r}")
    return slug


def read_json(path: Path) -> Any:
    """Read a JSON file; a corrupt file raises ResultsError naming it and is left untouched."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"cannot read {path}: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}). "
            "The file was left as it is: fix or delete it (deleting results.json makes "
            "`ccq-eval run` redo that unit)."
        ) from None


def sample_to_jsonable(sample: dict[str, Any]) -> dict[str, Any]:
    """One lm-eval logged sample in the form lm-eval's EvaluationTracker writes it.

    arguments become {"gen_args_i": {"arg_j": ...}}, resps / filtered_resps are stringified,
    target becomes a string; metric values stay as they are.
    """
    out = dict(sample)
    arguments = sample.get("arguments")
    if isinstance(arguments, (list, tuple)):
        out["arguments"] = {
            f"gen_args_{i}": {f"arg_{j}": arg for j, arg in enumerate(args)}
            for i, args in enumerate(arguments)
        }
    for key in ("resps", "filtered_resps"):
        if key in sample:
            out[key] = _stringify_nested(sample[key])
    if "target" in sample:
        out["target"] = str(sample["target"])
    return out


def _stringify_nested(value: Any) -> Any:
    if isinstance(value, list):
        return [_stringify_nested(item) for item in value]
    if isinstance(value, tuple):
        return [_stringify_nested(item) for item in value]
    return str(value)


def task_hash(samples: Iterable[dict[str, Any]]) -> str:
    """lm-eval's cumulative task hash over doc, prompt and target hashes."""
    joined = "".join(
        str(s.get("doc_hash", "")) + str(s.get("prompt_hash", "")) + str(s.get("target_hash", ""))
        for s in samples
    )
    return hashlib.sha256(joined.encode("utf-8")).hexdigest()


def non_finite_values(results: dict[str, Any]) -> list[str]:
    """'task metric = value' for every NaN or infinite metric value in an lm-eval results dict: the
    evaluation failed there (a NaN weight, a CCQ lambda the model cannot take), whatever lm-eval says."""
    found = []
    for task, values in sorted((results.get("results") or {}).items()):
        for key, value in (values or {}).items() if isinstance(values, dict) else ():
            if isinstance(value, float) and not math.isfinite(value):
                found.append(f"{task} {key.partition(',')[0]} = {value}")
    return found


def non_finite_message(model: str, found: list[str]) -> str:
    """The one line that says a stored unit failed with non-finite values, and what to look at."""
    shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    return (f"non-finite result of {model} ({shown}); the unit is stored, counted as failed and shown as "
            "failed in the tables: look for NaN / inf weights in the checkpoint, or use a smaller "
            "--ccq-attach lambda")


# --------------------------------------------------------------------------------------------
# Writing one unit


@dataclass(frozen=True)
class UnitDir:
    """Paths of one (model, task) unit folder."""

    path: Path

    @property
    def results(self) -> Path:
        return self.path / RESULTS_FILE

    @property
    def meta(self) -> Path:
        return self.path / META_FILE

    @property
    def spec(self) -> Path:
        return self.path / UNIT_SPEC_FILE

    @property
    def responses_db(self) -> Path:
        return self.path / RESPONSES_DB

    def samples(self, task: str) -> Path:
        return self.path / f"samples_{slugify(task)}.jsonl"

    def is_finished(self) -> bool:
        return self.results.is_file()


def unit_dir(output: Path, model: str, task: str) -> UnitDir:
    return UnitDir(Path(output) / slugify(model) / slugify(task))


def write_unit(
    unit: UnitDir,
    results: dict[str, Any],
    samples: dict[str, list[dict[str, Any]]],
    meta: dict[str, Any],
) -> None:
    """Store a finished unit: samples, then metadata, then the results under lm-eval's tracker
    names, then results.json (the 'finished' mark).

    `results` is the dict lm_eval.simple_evaluate returns (its "samples" entry is ignored;
    pass the samples separately).
    """
    unit.path.mkdir(parents=True, exist_ok=True)
    for task_name, task_samples in samples.items():
        lines = [dumps(sample_to_jsonable(s), indent=None) for s in task_samples]
        atomic_write_text(unit.samples(task_name), "".join(line + "\n" for line in lines))
    atomic_write_json(unit.meta, meta)
    stored = {key: value for key, value in results.items() if key != "samples"}
    stored["task_hashes"] = {name: task_hash(task_samples) for name, task_samples in samples.items()}
    stored.setdefault("model_name", meta.get("model"))
    _write_tracker_files(unit, stored, samples)
    atomic_write_json(unit.results, stored)


def tracker_folder(unit: UnitDir) -> Path:
    """<output>/lm_eval/<model>: where the unit's results are also stored as lm-eval lays them out."""
    return unit.path.parent.parent / TRACKER_DIR / unit.path.parent.name


def _write_tracker_files(unit: UnitDir, stored: dict[str, Any], samples: dict[str, list]) -> None:
    """results_<stamp>.json and samples_<task>_<stamp>.jsonl as lm-eval's EvaluationTracker names them
    (stamp: ISO time with '-' for ':'); the samples are hard links to the unit's (copies where links
    fail)."""
    folder = tracker_folder(unit)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().isoformat().replace(":", "-")
    for task_name in samples:
        tracker_samples = folder / f"samples_{task_name}_{stamp}.jsonl"
        try:
            os.link(unit.samples(task_name), tracker_samples)
        except OSError:
            shutil.copyfile(unit.samples(task_name), tracker_samples)
    copy = stored | {TRACKER_UNIT_KEY: f"{unit.path.parent.name}/{unit.path.name}"}
    atomic_write_json(folder / f"results_{stamp}.json", copy)
    _remove_stale_tracker_copies(folder, copy[TRACKER_UNIT_KEY], stamp)


def _remove_stale_tracker_copies(folder: Path, unit_name: str, stamp: str) -> None:
    """The tracker copies an earlier, unfinished write of the same unit left (a run killed, or a full
    disk, between the copies and results.json): lm-eval's readers would see the unit twice."""
    for path in folder.glob("results_*.json"):
        match = _LMEVAL_RESULTS.match(path.name)
        if match is None or match.group("stamp") == stamp:
            continue
        try:
            stale = json.loads(path.read_text(encoding="utf-8")).get(TRACKER_UNIT_KEY) == unit_name
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            stale = False
        if stale:
            for samples in folder.glob(f"samples_*_{match.group('stamp')}.jsonl"):
                samples.unlink(missing_ok=True)
            path.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# Resume cache: model responses keyed by request, one SQLite row per response.


class ResponseCache:
    """Model responses of one unit, committed as they arrive, so a killed run can resume.

    Values are JSON (never pickle). Keys hash the request type and arguments, computed
    before the model sees the request. `identity` (a digest of the unit's spec) is stored with the
    answers: a cache holding answers of another model or other settings is refused, never read.
    """

    def __init__(self, path: Path, identity: str | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(self.path))
        try:
            self._conn.execute("CREATE TABLE IF NOT EXISTS responses (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._conn.execute("CREATE TABLE IF NOT EXISTS identity (value TEXT NOT NULL)")
            self._conn.commit()
            if identity is not None:
                self._claim(identity)
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise ResultsError(cache_error_message(self.path, exc)) from None
        except ResultsError:
            self._conn.close()
            raise

    def _claim(self, identity: str) -> None:
        row = self._conn.execute("SELECT value FROM identity").fetchone()
        if row is not None and row[0] != identity and len(self):
            raise ResultsError(
                f"{self.path} holds answers of another model or other settings; delete it to recompute "
                "this unit (other units are unaffected)")
        with self._conn:
            self._conn.execute("DELETE FROM identity")
            self._conn.execute("INSERT INTO identity (value) VALUES (?)", (identity,))

    @staticmethod
    def key(request_type: str, args: tuple[Any, ...]) -> str:
        payload = json.dumps([request_type, list(args)], sort_keys=True, default=json_default)
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()

    def get_many(self, keys: list[str]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        unique = list(dict.fromkeys(keys))
        for start in range(0, len(unique), 500):
            chunk = unique[start : start + 500]
            marks = ",".join("?" * len(chunk))
            rows = self._conn.execute(f"SELECT key, value FROM responses WHERE key IN ({marks})", chunk)
            for key, value in rows:
                found[key] = json.loads(value)
        return found

    def put_many(self, items: list[tuple[str, Any]]) -> None:
        try:
            with self._conn:  # one transaction: all of a batch or none of it
                self._conn.executemany(
                    "INSERT OR REPLACE INTO responses (key, value) VALUES (?, ?)",
                    [(key, json.dumps(value, default=json_default)) for key, value in items],
                )
        except sqlite3.OperationalError as exc:
            raise ResultsError(cache_error_message(self.path, exc)) from None

    def __len__(self) -> int:
        return int(self._conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        self._conn.close()


def remove_resume_cache(unit: UnitDir) -> None:
    """Delete a stored unit's resume cache (and sqlite's journal beside it): a finished unit is never
    resumed, and the cache of a perplexity unit holds every token's log-likelihood."""
    for path in (unit.responses_db, unit.responses_db.with_name(RESPONSES_DB + "-journal")):
        path.unlink(missing_ok=True)


def unreadable_cache_message(path: Path, exc: Exception) -> str:
    return (f"{path} is not a readable SQLite database ({exc}: truncated or corrupt); delete it to "
            "recompute this unit's answers (finished units are unaffected)")


# sqlite's messages for a cache it could not write, as opposed to one it cannot read
_UNWRITABLE = ("disk is full", "disk i/o error", "readonly database", "unable to open")


def cache_error_message(path: Path, exc: Exception) -> str:
    """The one line for a resume cache sqlite refused: a full disk or a folder that cannot be written
    keeps the answers stored so far (the cache is valid; deleting it would lose them), anything else
    is a damaged file."""
    if isinstance(exc, sqlite3.OperationalError) and any(text in str(exc).lower() for text in _UNWRITABLE):
        return (f"cannot write the resume cache {path} ({exc}); the answers it holds are kept: free disk "
                "space (or make the folder writable) and rerun the same command to resume")
    return unreadable_cache_message(path, exc)


def answered_count(path: Path) -> int:
    """How many answers a unit's resume cache holds (0 when there is none); ResultsError when it is
    corrupt. Checks the whole file (sqlite's quick_check), so a truncated cache is found before a run."""
    path = Path(path)
    if not path.is_file():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(str(path))) as conn:
            check = conn.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {check[0] if check else 'no answer'}")
            tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if "responses" not in tables:
                return 0
            return int(conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0])
    except sqlite3.DatabaseError as exc:
        raise ResultsError(cache_error_message(path, exc)) from None


def spec_identity(spec: dict[str, Any]) -> str:
    """A digest of what a unit computes (its unit.json), stored with its resume cache."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=json_default).encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------------------------
# Reading


@dataclass
class StoredUnit:
    """One results file and what lies next to it."""

    results_path: Path
    results: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    samples_paths: dict[str, Path] = field(default_factory=dict)

    @property
    def folder(self) -> Path:
        return self.results_path.parent

    @property
    def model(self) -> str:
        """The model's display name: run metadata, then lm-eval's config, then the folder."""
        name = self.meta.get("model") or self.results.get("model_name")
        if not name:
            config = self.results.get("config") or {}
            name = config.get("model") if isinstance(config, dict) else None
            if name in (None, "", "CUSTOM"):
                name = None
        if not name:
            # <output>/<model>/<task>/results.json or lm-eval's <output>/<model>/results_*.json
            name = self.folder.parent.name if self.results_path.name == RESULTS_FILE else self.folder.name
        return str(name)

    @property
    def task_results(self) -> dict[str, dict[str, Any]]:
        return dict(self.results.get("results") or {})

    @property
    def group_names(self) -> set[str]:
        return set((self.results.get("groups") or {}).keys()) | set(
            (self.results.get("group_subtasks") or {}).keys()
        )

    def leaf_tasks(self) -> list[str]:
        groups = self.group_names
        return [name for name in self.task_results if name not in groups]

    def samples(self, task: str) -> list[dict[str, Any]]:
        """The per-sample log of `task` (empty when the run did not log samples)."""
        path = self.samples_paths.get(task)
        if path is None:
            return []
        records = list(iter_jsonl(path))
        self._check_samples(task, path, records)
        return records

    def _check_samples(self, task: str, path: Path, records: list[dict[str, Any]]) -> None:
        """The log must be the one the results were computed from: as many samples as lm-eval's
        n-samples records, and (for units this package wrote) the same task hash."""
        redo = (f"restore it, or delete {self.results_path} to redo the unit" if self.results_path.name == RESULTS_FILE
                else "restore it from the run's output")
        # One logged sample per evaluated document: "original" documents, cut by the run's limit.
        # (lm-eval's "effective" is the smallest per-metric count, which per-length metrics make smaller.)
        counts = (self.results.get("n-samples") or {}).get(task)
        expected = counts.get("original") if isinstance(counts, dict) else None
        limit = (self.results.get("config") or {}).get("limit")
        if isinstance(expected, int) and isinstance(limit, (int, float)) and limit > 0:
            # lm-eval's rule (evaluator_utils.get_sample_size): a fraction is rounded up
            expected = min(expected, int(limit) if limit >= 1 else math.ceil(limit * expected))
        if isinstance(expected, int) and len(records) != expected:
            raise ResultsError(f"{path} holds {len(records)} samples but {self.results_path.name} records {expected} "
                               f"(truncated, or from another run): {redo}")
        stored_hash = (self.results.get("task_hashes") or {}).get(task)
        if (self.results_path.name == RESULTS_FILE and stored_hash and records and "doc_hash" in records[0]
                and task_hash(records) != stored_hash):
            raise ResultsError(f"{path} does not hold the samples {self.results_path.name} was computed from "
                               f"(task hash differs): {redo}")


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    try:
        # split on "\n" only: JSON strings may hold U+2028, U+0085 and the like unescaped, which
        # str.splitlines() would also break at
        raw = Path(path).read_bytes()
        lines = (lzma.decompress(raw) if Path(path).suffix == ".xz" else raw).decode("utf-8").split("\n")
    except (OSError, UnicodeDecodeError, lzma.LZMAError) as exc:
        raise ResultsError(f"cannot read {path}: {exc}") from None
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            raise ResultsError(
                f"{path} line {line_number} is not valid JSON ({exc.msg}). The file was left as "
                "it is: fix or delete it (delete the unit's results.json too to redo the unit)."
            ) from None


_LMEVAL_RESULTS = re.compile(r"^results_(?P<stamp>.+)\.json$")


def _samples_for(results_path: Path, task_names: Iterable[str]) -> dict[str, Path]:
    folder = results_path.parent
    found: dict[str, Path] = {}
    stamp_match = _LMEVAL_RESULTS.match(results_path.name)
    for task in task_names:
        candidates = [folder / f"samples_{slugify(task)}.jsonl", folder / f"samples_{task}.jsonl"]
        if stamp_match:
            candidates.insert(0, folder / f"samples_{task}_{stamp_match.group('stamp')}.jsonl")
        for candidate in candidates + [c.with_name(c.name + ".xz") for c in candidates]:
            if candidate.is_file():
                found[task] = candidate
                break
    return found


def _is_tracker_copy(path: Path, root: Path) -> bool:
    """A results_<stamp>.json in <output>/lm_eval/<model>/ that `write_unit` laid out for lm-eval's readers
    (it names its unit, or <output> holds unit folders), with <output> below `root`: there the units are
    read from their own folders only, so a deleted model folder does not come back from its copies.
    Pointed at <output>/lm_eval itself, a reader takes the copies as lm-eval's layout."""
    model_folder = path.parent
    output = model_folder.parent.parent
    if model_folder.parent.name != TRACKER_DIR or not output.resolve().is_relative_to(root.resolve()):
        return False
    try:
        names_its_unit = TRACKER_UNIT_KEY in json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, TypeError):
        names_its_unit = False
    return names_its_unit or any(output.glob(f"*/*/{UNIT_SPEC_FILE}")) or any(output.glob(f"*/*/{RESULTS_FILE}"))


def find_results_files(root: Path) -> list[Path]:
    """Every unit's results.json and every lm-eval results_<stamp>.json, except the copies of the
    units read here that `write_unit` lays out for lm-eval's readers (each result is read once)."""
    root = Path(root)
    files = [p for p in root.rglob("*.json") if p.name == RESULTS_FILE
             or (_LMEVAL_RESULTS.match(p.name) and not _is_tracker_copy(p, root))]
    return sorted(files)


def load_results(root: Path) -> list[StoredUnit]:
    """Every results file under `root` with its metadata and sample logs.

    Raises ResultsError when the folder does not exist, holds no results, or a results /
    metadata file is corrupt (its path is named; nothing is modified).
    """
    root = Path(root)
    if not root.exists():
        raise ResultsError(f"results folder {root} does not exist; run `ccq-eval run --output {root}` first")
    if root.is_file():
        files = [root]
    else:
        files = find_results_files(root)
    if not files:
        raise ResultsError(
            f"{root} holds no results (no results.json below it); run `ccq-eval run --output {root}` first"
        )
    units = []
    for path in files:
        results = read_json(path)
        if not isinstance(results, dict) or not isinstance(results.get("results"), dict):
            raise ResultsError(
                f"{path} is not an lm-eval results file (no 'results' mapping). The file was left as it is."
            )
        not_metrics = [task for task, values in results["results"].items() if not isinstance(values, dict)]
        if not_metrics:
            raise ResultsError(f"{path} is not an lm-eval results file: results.{not_metrics[0]} should map "
                               "metric names to values. The file was left as it is: restore it from the run "
                               "that wrote it")
        meta_path = path.parent / META_FILE
        meta = read_json(meta_path) if path.name == RESULTS_FILE and meta_path.is_file() else {}
        if not isinstance(meta, dict):
            raise ResultsError(f"{meta_path} should hold a JSON object. The file was left as it is.")
        units.append(
            StoredUnit(
                results_path=path,
                results=results,
                meta=meta,
                samples_paths=_samples_for(path, results["results"].keys()),
            )
        )
    units = _newest_tracker_copies(units)
    _check_one_file_per_unit(root, units)
    return units


def _newest_tracker_copies(units: list[StoredUnit]) -> list[StoredUnit]:
    """Of several tracker copies of one unit in one folder (left by a write that did not finish), the
    newest: the others are not another result."""
    newest: dict[tuple[Path, str], Path] = {}
    for unit in units:
        name = unit.results.get(TRACKER_UNIT_KEY)
        if isinstance(name, str):
            key = (unit.folder, name)
            newest[key] = max(newest.get(key, unit.results_path), unit.results_path)
    return [unit for unit in units if not isinstance(unit.results.get(TRACKER_UNIT_KEY), str)
            or newest[(unit.folder, unit.results[TRACKER_UNIT_KEY])] == unit.results_path]


def run_folder(results_path: Path) -> Path:
    """The results folder of one results file: <run>/<model>/<task>/results.json, or lm-eval's
    <run>/<model>/results_<stamp>.json."""
    return results_path.parents[2] if results_path.name == RESULTS_FILE else results_path.parents[1]


def _check_one_file_per_unit(root: Path, units: list[StoredUnit]) -> None:
    """One results file per (model, task): a folder that holds several runs of the same unit (the
    repository's results/ with results/reference and results/gpu-grid) is refused, never read as one
    of them picked silently."""
    seen: dict[tuple[str, str], Path] = {}
    for unit in units:
        for task in unit.leaf_tasks():
            first = seen.setdefault((unit.model, task), unit.results_path)
            if first == unit.results_path:
                continue
            folders = sorted({str(run_folder(u.results_path)) for u in units})
            files = (f"model {unit.model!r} has results for task {task!r} in more than one file ({first}, "
                     f"{unit.results_path})")
            if len(folders) == 1:
                raise ResultsError(f"{files}; move the one that is not wanted out of {folders[0]}")
            raise ResultsError(f"{root} holds {len(folders)} result folders ({', '.join(folders)}) and "
                               f"{files}; point the command at one result folder")
