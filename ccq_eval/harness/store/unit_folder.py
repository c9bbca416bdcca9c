"""One (model, task) unit's folder and writing a finished unit into it.

    <output>/<model>/<task>/
        unit.json              what the unit was asked to compute (written when it starts)
        responses.sqlite       model responses so far (response_cache.py)
        samples_<task>.jsonl   lm-eval per-sample log, one file per evaluated lm-eval task
        meta.json              run metadata (versions, seed, device, wall time, ...)
        checksums.json         sha256 of every other file and who the unit is (vouch.py)
        results.json           lm-eval results dict, written last; marks the unit finished

A unit of an archive (`ccq-eval archive`) keeps results.json.xz and xz-compressed samples instead; it is a
finished unit like any other, so a run into an archive's folder takes it as done.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ccq_eval import atomic_io
from ccq_eval.harness.store import lm_eval_mirror, vouch
from ccq_eval.harness.store.files import (
    ARCHIVED_RESULTS_FILE,
    META_FILE,
    RESPONSES_DB,
    RESULTS_FILE,
    UNIT_SPEC_FILE,
    slugify,
)
from ccq_eval.harness.store.formats import stamped, stored_spec


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

    @property
    def finished_results(self) -> Path:
        """The results file that marks the unit finished: results.json, or an archived unit's results.json.xz
        (results.json when neither exists)."""
        archived = self.path / ARCHIVED_RESULTS_FILE
        return archived if archived.is_file() and not self.results.is_file() else self.results

    def is_finished(self) -> bool:
        return self.finished_results.is_file()


def unit_dir(output: Path, model: str, task: str) -> UnitDir:
    return UnitDir(Path(output) / slugify(model) / slugify(task))


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
    if isinstance(value, (list, tuple)):
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


def write_spec(unit: UnitDir, spec: dict[str, Any]) -> None:
    """unit.json: what the unit computes, in the current format."""
    atomic_io.atomic_write_json(unit.spec, stamped(spec))


def write_unit(
    unit: UnitDir,
    results: dict[str, Any],
    samples: dict[str, list[dict[str, Any]]],
    meta: dict[str, Any],
) -> None:
    """Store a finished unit: unit.json (meta's "spec", where it has one), samples, then metadata, then the
    results under lm-eval's tracker names (lm_eval_mirror.py), then checksums.json (its record, which holds
    the digest of results.json to come), then results.json (the 'finished' mark). A finished unit stored
    again (recomputed) loses its results.json and record first, so that it is never finished with a mix of
    old and new files.

    `results` is the dict lm_eval's evaluator returns (its "samples" entry is ignored;
    pass the samples separately).
    """
    unit.path.mkdir(parents=True, exist_ok=True)
    unit.results.unlink(missing_ok=True)  # unfinished from here on, until the new results.json is in place
    (unit.path / vouch.CHECKSUMS_FILE).unlink(missing_ok=True)  # an earlier record must not vouch for these
    if isinstance(meta.get("spec"), dict):  # a recomputed unit kept its old unit.json while it ran
        write_spec(unit, meta["spec"])
    for task_name, task_samples in samples.items():
        lines = [atomic_io.dumps(sample_to_jsonable(s), indent=None) for s in task_samples]
        atomic_io.atomic_write_text(unit.samples(task_name), "".join(line + "\n" for line in lines))
    atomic_io.atomic_write_json(unit.meta, stamped(meta))
    stored = {key: value for key, value in results.items() if key != "samples"}
    stored["task_hashes"] = {name: task_hash(task_samples) for name, task_samples in samples.items()}
    stored.setdefault("model_name", meta.get("model"))
    lm_eval_mirror.write_copies(unit.path, stored, {name: unit.samples(name) for name in samples})
    results_bytes = (atomic_io.dumps(stored) + "\n").encode("utf-8")  # the bytes atomic_write_json writes
    vouch.write_record(unit.path, stored_spec(unit.spec, unit.meta) or {}, pending={unit.results.name: results_bytes})
    atomic_io.atomic_write_json(unit.results, stored)
