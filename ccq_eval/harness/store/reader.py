"""Reading results back: every results file below a folder with its metadata and per-sample logs.

Readers (`table`, `compare`, `figures`, `report`) only read these files; they never load a model. Read are:
this package's unit folders (unit_folder.py), the layout lm-eval's own CLI writes (results_<timestamp>.json
next to samples_<task>_<timestamp>.jsonl), and archived units (archive.py: samples as
samples_<task>.jsonl.xz with long prompt / document strings replaced by their digest, no resume cache),
which is how results are committed to the repository.
"""

from __future__ import annotations

import json
import lzma
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ccq_eval.harness.store import aggregates, lm_eval_mirror, vouch
from ccq_eval.harness.store.files import (
    ARCHIVED_RESULTS_FILE,
    META_FILE,
    RESULTS_FILE,
    UNIT_SPEC_FILE,
    ResultsError,
    is_unit_results,
    read_json,
    slugify,
)
from ccq_eval.harness.store.formats import COMPLETE_RECORD_SINCE, RECORD_SINCE, read_meta, stored_spec, unit_format
from ccq_eval.harness.store.unit_folder import task_hash


@dataclass
class StoredUnit:
    """One results file and what lies next to it."""

    results_path: Path
    results: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    samples_paths: dict[str, Path] = field(default_factory=dict)
    vouched: bool = False  # its files were checked against its record (checksums.json)

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
            name = self.folder.parent.name if is_unit_results(self.results_path) else self.folder.name
        return str(name)

    @property
    def backbone(self) -> str | None:
        """The model's family without CCQ (meta.json's model_type, `ccq_` dropped); None where the meta has no
        model_type (older unit formats, lm-eval's layout)."""
        model_type = self.meta.get("model_type")
        return model_type.removeprefix("ccq_") if isinstance(model_type, str) else None

    @property
    def spec(self) -> dict[str, Any]:
        """What the unit was asked to compute (its unit.json, in the current form), {} for lm-eval's layout."""
        if not is_unit_results(self.results_path):
            return {}
        return stored_spec(self.folder / UNIT_SPEC_FILE, self.folder / META_FILE) or {}

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
        aggregates.check_task(self.results_path, self.results, task, records,
                              self._redo("the unit's files as they were written"))
        return records

    def missing_samples(self) -> str | None:
        """The one line for a unit folder whose results.json counts samples of a task that has no samples
        file beside it (None when every such task has its file)."""
        for task in self.leaf_tasks():
            counts = (self.results.get("n-samples") or {}).get(task)
            if (task not in self.samples_paths and is_unit_results(self.results_path)
                    and isinstance(counts, dict) and counts.get("original")):
                return (f"{self.folder} has no samples_{slugify(task)}.jsonl, though {self.results_path.name} "
                        f"records {counts['original']} samples of {task}: restore it, or delete "
                        f"{self.results_path} to redo the unit")
        return None

    def explain_changed_file(self, name: str) -> None:
        """For a file its record does not vouch for: the more telling error of a samples file that does not
        hold what results.json counts (cut short, or from another run), if that is what happened."""
        for task, path in self.samples_paths.items():
            if path.name == name:
                self._check_samples(task, path, list(iter_jsonl(path)))

    def check_aggregates(self) -> None:
        """Recompute every aggregate its samples decide (aggregates.check_task): ResultsError when one differs."""
        for task in self.leaf_tasks():
            if task in self.samples_paths:
                self.samples(task)

    def _redo(self, subject: str = "it") -> str:
        """What to do about a file of this unit that does not agree: restore `subject` or redo the unit."""
        if is_unit_results(self.results_path):
            return f"restore {subject}, or delete {self.results_path} to redo the unit"
        return f"restore {subject} from the run's output"

    def _check_samples(self, task: str, path: Path, records: list[dict[str, Any]]) -> None:
        """The log must be the one the results were computed from: as many samples as lm-eval's
        n-samples records, and (for units this package wrote) the same task hash."""
        redo = self._redo()
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
        if (is_unit_results(self.results_path) and stored_hash and records and "doc_hash" in records[0]
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


def _samples_for(results_path: Path, task_names: Iterable[str]) -> dict[str, Path]:
    folder = results_path.parent
    found: dict[str, Path] = {}
    stamp_match = lm_eval_mirror.LMEVAL_RESULTS.match(results_path.name)
    for task in task_names:
        candidates = [folder / f"samples_{slugify(task)}.jsonl", folder / f"samples_{task}.jsonl"]
        if stamp_match:
            candidates.insert(0, folder / f"samples_{task}_{stamp_match.group('stamp')}.jsonl")
        compressed = [c.with_name(c.name + ".xz") for c in candidates]
        # an archive's results read its archived samples first, a run's its own
        for candidate in compressed + candidates if results_path.suffix == ".xz" else candidates + compressed:
            if candidate.is_file():
                found[task] = candidate
                break
    return found


def find_results_files(root: Path) -> list[Path]:
    """Every unit's results.json and every lm-eval results_<stamp>.json, except the copies of the
    units read here that the store lays out for lm-eval's readers (each result is read once). A linked
    folder below `root` that holds results is a ResultsError: rglob does not follow links, so its results
    would be left out without a word."""
    root = Path(root)
    _refuse_linked_results(root)
    files = [p for p in root.rglob("*.json") if not _in_archive_temp(p, root) and (p.name == RESULTS_FILE
             or (lm_eval_mirror.LMEVAL_RESULTS.match(p.name) and not lm_eval_mirror.is_tracker_copy(p, root)))]
    files += [p for p in root.rglob(ARCHIVED_RESULTS_FILE) if not _in_archive_temp(p, root)]
    return sorted(files)


def _refuse_linked_results(root: Path) -> None:
    """ResultsError naming the first symbolic link to a folder below `root` that holds results."""
    for folder, subfolders, _files in os.walk(root):
        for name in sorted(subfolders):
            link = Path(folder, name)
            if link.is_symlink() and (any(link.rglob(RESULTS_FILE)) or any(link.rglob(ARCHIVED_RESULTS_FILE))):
                raise ResultsError(f"{link} is a symbolic link (to {link.readlink()}) to results, which the "
                                   "readers do not follow: replace the link by a copy of its target, or move it "
                                   f"out of {root}")


def read_unit(path: Path) -> StoredUnit:
    """One results file with its metadata (a unit folder's meta.json, read by its format's reader), checked
    as every reader checks it: its record (checksums.json, samples included), its samples' counts and task
    hash, and every aggregate its samples decide; ResultsError naming the first file that does not agree."""
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
    meta_path, spec_path = path.parent / META_FILE, path.parent / UNIT_SPEC_FILE
    version = unit_format(spec_path, meta_path) if is_unit_results(path) else None
    if is_unit_results(path) and version is None:
        raise ResultsError(f"{path.parent} holds {path.name} but neither {META_FILE} nor {UNIT_SPEC_FILE}, so "
                           f"nothing shows which run wrote it: restore them, or delete {path} to redo the unit")
    meta = read_meta(meta_path) if is_unit_results(path) and meta_path.is_file() else {}
    unit = StoredUnit(results_path=path, results=results, meta=meta,
                      samples_paths=_samples_for(path, results["results"].keys()))
    if version is not None:
        complete = version >= COMPLETE_RECORD_SINCE  # its record names every file the format requires
        unit.vouched = vouch.verify_record(path.parent, stored_spec(spec_path, meta_path),
                                           explain=unit.explain_changed_file,
                                           required=vouch.required_files(path, results) if complete else ())
        if not unit.vouched and complete:
            raise ResultsError(f"{path.parent} has no {vouch.CHECKSUMS_FILE}, which a unit of results format "
                               f"{version} writes before {path.name}: it was deleted, so its files cannot be "
                               f"checked; restore it, or delete {path} to redo the unit with `ccq-eval run`")
        if not unit.vouched and version >= RECORD_SINCE:
            raise ResultsError(f"{path.parent} has no {vouch.CHECKSUMS_FILE}: the run that wrote it stopped before "
                               "the unit was stored whole; rerun the same `ccq-eval run` command to redo it")
    unit.check_aggregates()
    return unit


def _in_archive_temp(path: Path, root: Path) -> bool:
    """Whether a file lies in the temporary folder of an archive being written (archive.py), not yet a result."""
    return any(part.startswith(".ccq-archive-") for part in path.relative_to(root).parts)


def load_results(root: Path) -> list[StoredUnit]:
    """Every results file under `root` with its metadata and sample logs.

    Raises ResultsError when the folder does not exist, holds no results, or a results /
    metadata file is corrupt or of a newer format (its path is named; nothing is modified).
    """
    root = Path(root)
    if not root.exists():
        raise ResultsError(f"results folder {root} does not exist; run `ccq-eval run --output {root}` first")
    files = [root] if root.is_file() else find_results_files(root)
    if not files:
        raise ResultsError(
            f"{root} holds no results (no results.json below it); run `ccq-eval run --output {root}` first"
        )
    units = [read_unit(path) for path in files]
    keep = lm_eval_mirror.newest_copies([(unit.results_path, unit.results) for unit in units])
    units = [unit for unit in units if unit.results_path in keep]
    _check_one_file_per_unit(root, units)
    return units


def run_folder(results_path: Path) -> Path:
    """The results folder of one results file: <run>/<model>/<task>/results.json, or lm-eval's
    <run>/<model>/results_<stamp>.json."""
    return results_path.parents[2] if is_unit_results(results_path) else results_path.parents[1]


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
