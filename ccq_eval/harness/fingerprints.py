"""What a unit's answers depend on besides its settings: the sha256 of its checkpoint files and of the
data files it reads (a LongBench dataset of --longbench-dir, a QA file of --qa-dir, a zero-shot task's split
files in --zeroshot-dir, a recall task's dataset file in --recall-dir), recorded in its spec
when it is planned and checked again before it runs.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from ccq_eval.model import checkpoint


class PlannedUnit(Protocol):
    """What changed_since_planning reads of a unit (plan.Unit)."""

    task: str
    model_source: str
    spec: dict[str, Any]
    task_metadata: dict[str, Any]  # what the task is given (its data folders included)


def longbench_data_file(task: str, data_dir: Path) -> Path | None:
    """The jsonl file of a LongBench leaf task in data_dir, None when it has none (ccq_longbench_<dataset>
    reads <dataset>.jsonl, ccq_longbench_e_<dataset> <dataset>_e.jsonl; first in data_dir, then under
    data/, as tasks/longbench looks)."""
    for prefix, suffix in (("ccq_longbench_e_", "_e.jsonl"), ("ccq_longbench_", ".jsonl")):
        if task.startswith(prefix):
            name = task[len(prefix) :] + suffix
            return next(
                (path for path in (data_dir / name, data_dir / "data" / name) if path.is_file()), None
            )
    return None


def longbench_data_present(task: str, data_dir: Path) -> bool:
    """Whether data_dir holds the jsonl file of a LongBench leaf task (longbench_data_file)."""
    return longbench_data_file(task, data_dir) is not None


def qa_data_file(task: str, qa_dir: Path) -> Path | None:
    """The data file of a RULER QA task in qa_dir, None when it has none, found as the task finds it."""
    from ccq_eval.tasks.ruler_qa.data import qa_data_file as task_data_file

    return task_data_file(task, qa_dir)


def qa_data_present(task: str, qa_dir: Path) -> bool:
    """Whether qa_dir holds the data file of a RULER QA task (qa_data_file)."""
    return qa_data_file(task, qa_dir) is not None


def qa_data_names(task: str) -> str:
    """The file name a RULER QA task looks for (its official name; the task accepts RULER's as well)."""
    from ccq_eval.tasks.ruler_qa.data import FILE_NAMES, dataset_of

    return FILE_NAMES[dataset_of(task)][0]


def hub_offline() -> bool:
    """Whether the Hugging Face hub is off for the tasks (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set), as
    the RULER QA tasks decide it: then data no folder holds cannot be fetched."""
    from ccq_eval.tasks.ruler_qa.data import hub_allowed

    return not hub_allowed()


# Proxy settings that route the hub's traffic elsewhere: a direct connection then says nothing about it.
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@lru_cache(maxsize=1)
def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub's endpoint (HF_ENDPOINT, by default huggingface.co) accepts a connection within
    `timeout_s`: one quick probe, so that an unreachable hub is known before any download retries it.
    True behind a proxy (not probed)."""
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return True
    endpoint = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname, port), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def hub_unreachable() -> bool:
    """The hub is allowed (no offline variable) but does not answer hub_reachable's probe: data it would
    provide is missing, and `datasets` would only retry it."""
    return not hub_offline() and not hub_reachable()


def zeroshot_data_files(task: str, zeroshot_dir: Path) -> list[Path]:
    """The split files <zeroshot_dir>/<task>/*.jsonl a zero-shot task may read (zeroshot.local_overrides
    picks the config's splits among them)."""
    return sorted((zeroshot_dir / task).glob("*.jsonl"))


def recall_data_file(task: str, metadata: dict[str, Any]) -> Path | None:
    """The --recall-dir file a recall task reads (<dataset>/validation.jsonl; NQ's per recall_length), None
    when the folder has none (the task then reads the hub or the datasets cache)."""
    from ccq_eval.task_families import RECALL, family_of
    from ccq_eval.tasks.recall.data import RecallDataError, dataset_for, local_file

    if family_of(task) is not RECALL:
        return None
    try:
        return local_file(dataset_for(task, metadata.get("recall_length")), metadata["recall_dir"])
    except RecallDataError:  # a length without an NQ dataset: planning refuses it with its own line
        return None


def data_fingerprint(task: str, metadata: dict[str, Any]) -> dict[str, str] | None:
    """{file name: sha256} of the data files a task's documents are read from (a LongBench dataset in
    --longbench-dir, metadata's data_dir; a QA file in --qa-dir, metadata's qa_dir; the split files of a
    zero-shot task in --zeroshot-dir, metadata's zeroshot_dir, named <task>/<split>.jsonl; the dataset file of a
    recall task in --recall-dir, metadata's recall_dir, named <dataset>/validation.jsonl); None for tasks
    built from the embedded corpora or read from the hub or the datasets cache."""
    data_dir, qa_dir, zeroshot_dir = metadata.get("data_dir"), metadata.get("qa_dir"), metadata.get("zeroshot_dir")
    if metadata.get("recall_dir"):
        path = recall_data_file(task, metadata)
        if path is not None:
            return {path.relative_to(Path(metadata["recall_dir"])).as_posix(): checkpoint.file_sha256(path)}
    if zeroshot_dir:
        files = zeroshot_data_files(task, Path(zeroshot_dir))
        if files:
            return {f"{task}/{path.name}": checkpoint.file_sha256(path) for path in files}
    path = longbench_data_file(task, Path(data_dir)) if data_dir else None
    if path is None and qa_dir:
        path = qa_data_file(task, Path(qa_dir))
    return None if path is None else {path.name: checkpoint.file_sha256(path)}


def embedded_corpora_fingerprint() -> dict[str, str]:
    """{file name: sha256} of the embedded corpora (ccq_eval/data/<name>.jsonl.xz) as this installation holds
    them: an editable install's corpora can be edited, and a unit whose task reads them records this in its
    spec ("embedded_corpora"). Hashed again on each call (about 4 MB), never remembered, so that an edit is
    seen by the next check."""
    from ccq_eval.data import corpora

    return {file: checkpoint.file_sha256(corpora.DATA_DIR / file)
            for file, _description in sorted(corpora.CORPORA.values()) if (corpora.DATA_DIR / file).is_file()}


def changed_since_planning(unit: PlannedUnit) -> str | None:
    """What of a unit's checkpoint, data files and embedded corpora differs from the sha256 its spec recorded
    at planning ("model.safetensors: planned 1a2b3c4d..., now 5e6f7a8b..."), None when nothing does."""
    planned: dict[str, str] = {}
    current: dict[str, str] = {}
    if isinstance(unit.spec.get("checkpoint"), dict):
        planned |= unit.spec["checkpoint"]["sha256"]
        current |= (checkpoint_fingerprint(unit.model_source) or {"sha256": {}})["sha256"]
    if unit.spec.get("data_files") is not None:
        planned |= unit.spec["data_files"]
        current |= data_fingerprint(unit.task, unit.task_metadata) or {}
    if unit.spec.get("embedded_corpora") is not None:
        planned |= unit.spec["embedded_corpora"]
        current |= embedded_corpora_fingerprint()
    changed = sorted(name for name in set(planned) | set(current) if planned.get(name) != current.get(name))
    return (
        "; ".join(
            f"{name}: planned {_digest(planned.get(name))}, now {_digest(current.get(name))}"
            for name in changed
        )
        or None
    )


def _digest(value: str | None) -> str:
    return "absent" if value is None else value[:8] + "..."


def checkpoint_fingerprint(source: str) -> dict[str, Any] | None:
    """Identity of a local checkpoint folder (every file that decides what it computes, hashed whole),
    so that a resumed or skipped unit never mixes two checkpoints."""
    folder = Path(source)
    if not folder.is_dir():
        return None
    return checkpoint.fingerprint(folder)
