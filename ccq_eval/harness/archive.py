"""Archiving: a compact copy of finished units, for committing results to the repository.

Results, metadata and unit specs are copied as they are; per-sample logs are xz-compressed with their
long strings (haystacks, documents, prompts) replaced by length and sha256; resume caches stay out.
`ccq-eval table`, `compare` and `figures` read an archive exactly as the run it came from.
"""

from __future__ import annotations

import hashlib
import lzma
import shutil
from pathlib import Path
from typing import Any

from ccq_eval.harness.results_store import (
    META_FILE,
    RESULTS_FILE,
    UNIT_SPEC_FILE,
    ResultsError,
    atomic_write_bytes,
    dumps,
    find_results_files,
    iter_jsonl,
)

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
    resume caches are left out. Returns the unit folders."""
    source, destination = Path(source), Path(destination)
    units = [path.parent for path in find_results_files(source) if path.name == RESULTS_FILE]
    for unit in units:  # every check before anything is written
        _check_archive_target(destination / unit.relative_to(source))
    written = []
    for unit in units:
        results_path = unit / RESULTS_FILE
        target = destination / unit.relative_to(source)
        target.mkdir(parents=True, exist_ok=True)
        for name in (UNIT_SPEC_FILE, META_FILE):
            if (unit / name).is_file():
                shutil.copyfile(unit / name, target / name)
        for samples in unit.glob("samples_*.jsonl"):
            records = []
            for sample in iter_jsonl(samples):
                for key in ("doc", "arguments", "target"):
                    if key in sample:
                        sample[key] = _digest_long_strings(sample[key])
                records.append(dumps(sample, indent=None) + "\n")
            packed = lzma.compress("".join(records).encode("utf-8"), preset=9)
            atomic_write_bytes(target / (samples.name + ".xz"), packed)
        shutil.copyfile(results_path, target / RESULTS_FILE)  # last: marks the archived unit finished
        written.append(target)
    return written


def _check_archive_target(target: Path) -> None:
    """An archive may replace an earlier archive of a unit, never a live run's folder (its uncompressed
    samples would stay and be read instead of the archived ones)."""
    if not target.is_dir():
        return
    archived = {UNIT_SPEC_FILE, META_FILE, RESULTS_FILE}
    live = sorted(p.name for p in target.iterdir()
                  if p.name not in archived and not (p.name.startswith("samples_") and p.name.endswith(".jsonl.xz")))
    if live:
        raise ResultsError(f"{target} holds a live run ({', '.join(live[:3])}), not an archive; nothing was "
                           "written: archive into a new folder, or delete that unit folder first")
