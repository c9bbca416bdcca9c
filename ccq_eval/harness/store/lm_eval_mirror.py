"""Every finished unit once more as lm-eval's EvaluationTracker lays out its output, so that lm-eval's
readers (lm_eval.utils.get_results_filenames, get_sample_results_filenames, ...) and tools built on them
work on `<output>/lm_eval`:

    <output>/lm_eval/<model>/results_<time>.json, samples_<task>_<time>.jsonl (hard links)

Each copy names its unit folder (TRACKER_UNIT_KEY), so the readers of this package read a unit once:
from its own folder, never again from its copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

from ccq_eval import atomic_io
from ccq_eval.harness.store.files import RESULTS_FILE, UNIT_SPEC_FILE

TRACKER_DIR = "lm_eval"
TRACKER_UNIT_KEY = "ccq_eval_unit"  # in a tracker copy: its unit folder, <model>/<task> below the output
LMEVAL_RESULTS = re.compile(r"^results_(?P<stamp>.+)\.json$")


def tracker_folder(unit_path: Path) -> Path:
    """<output>/lm_eval/<model>: where a unit's results are also stored as lm-eval lays them out."""
    return unit_path.parent.parent / TRACKER_DIR / unit_path.parent.name


def write_copies(unit_path: Path, stored: dict[str, Any], samples: dict[str, Path]) -> None:
    """results_<stamp>.json and samples_<task>_<stamp>.jsonl as lm-eval's EvaluationTracker names them
    (stamp: ISO time with '-' for ':'); the samples are hard links to the unit's files in `samples`
    (lm-eval task -> path; copies where links fail)."""
    folder = tracker_folder(unit_path)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().isoformat().replace(":", "-")
    for task_name, unit_samples in samples.items():
        tracker_samples = folder / f"samples_{task_name}_{stamp}.jsonl"
        try:
            os.link(unit_samples, tracker_samples)
        except OSError:
            shutil.copyfile(unit_samples, tracker_samples)
    copy = stored | {TRACKER_UNIT_KEY: f"{unit_path.parent.name}/{unit_path.name}"}
    atomic_io.atomic_write_json(folder / f"results_{stamp}.json", copy)
    _remove_stale_copies(folder, copy[TRACKER_UNIT_KEY], stamp)


def _remove_stale_copies(folder: Path, unit_name: str, stamp: str) -> None:
    """The tracker copies an earlier, unfinished write of the same unit left (a run killed, or a full
    disk, between the copies and results.json): lm-eval's readers would see the unit twice."""
    for path in folder.glob("results_*.json"):
        match = LMEVAL_RESULTS.match(path.name)
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


def is_tracker_copy(path: Path, root: Path) -> bool:
    """A results_<stamp>.json in <output>/lm_eval/<model>/ that this package laid out for lm-eval's readers
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
    return names_its_unit or any(output.glob(f"*/*/{UNIT_SPEC_FILE}")) or any(output.glob(f"*/*/{RESULTS_FILE}*"))


def newest_copies(copies: list[tuple[Path, Any]]) -> set[Path]:
    """Of (results path, its results) pairs, the paths to keep: of several tracker copies of one unit in
    one folder (left by a write that did not finish) only the newest, since the others are not another
    result; every file that is not such a copy."""
    newest: dict[tuple[Path, str], Path] = {}
    for path, results in copies:
        name = results.get(TRACKER_UNIT_KEY) if isinstance(results, dict) else None
        if isinstance(name, str):
            key = (path.parent, name)
            newest[key] = max(newest.get(key, path), path)
    keep = set()
    for path, results in copies:
        name = results.get(TRACKER_UNIT_KEY) if isinstance(results, dict) else None
        if not isinstance(name, str) or newest[(path.parent, name)] == path:
            keep.add(path)
    return keep
