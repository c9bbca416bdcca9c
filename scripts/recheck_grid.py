"""Rerun the units of a committed results folder and check that every sample comes back identical.

Each unit's meta.json records the argv that made it; this replays those commands (one process per
model, as the grid was run) into a fresh folder, then compares every samples file record by record
and every results.json's metrics exactly. A committed archive (`ccq-eval archive`: long strings stored as
their digest) is compared with an archive of the rerun, made the same way. Used to show that a change of
the model code leaves the committed GPU grid bitwise unchanged:

    python3 scripts/recheck_grid.py results/gpu-grid --out /tmp/grid-recheck --models tiny-gla,tiny-gdn-ccq

Exit status 0 when everything matches, 1 otherwise (the first differences are printed).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

from ccq_eval.harness.archive import archive_results
from ccq_eval.harness.store import UnitDir, iter_jsonl, read_json

REPO = Path(__file__).resolve().parent.parent


def model_of(meta: dict) -> str:
    """The model a unit's command named (-m): an attached variant's unit belongs to its checkpoint."""
    argv = meta["argv"]
    return argv[argv.index("-m") + 1] if "-m" in argv else meta["model"]


def tasks_of(meta: dict) -> set[str]:
    """The task names a unit's command asked for (-t / --task)."""
    argv = meta["argv"]
    return {argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-t", "--task")}


def chosen_units(committed: Path, models: set[str] | None, tasks: set[str] | None) -> dict[Path, dict]:
    """The unit folders of `committed` (with their meta.json) whose command named one of `models` and
    asked for one of `tasks` (None: any), in a stable order."""
    units = {}
    for meta_path in sorted(committed.glob("*/*/meta.json")):
        meta = json.loads(meta_path.read_text())
        if (models is None or model_of(meta) in models) and (tasks is None or tasks & tasks_of(meta)):
            units[meta_path.parent] = meta
    return units


def commands_of(units: dict[Path, dict]) -> dict[str, list[list[str]]]:
    """The distinct recorded argv per model, in the units' order."""
    per_model: dict[str, list[list[str]]] = {}
    for meta in units.values():
        argvs = per_model.setdefault(model_of(meta), [])
        if meta["argv"] not in argvs:
            argvs.append(meta["argv"])
    return per_model


def replay(per_model: dict[str, list[list[str]]], out: Path) -> None:
    """Run each model's commands in order, the models side by side, writing into `out` (a log per model
    beside it)."""
    with contextlib.ExitStack() as logs:
        processes = []
        for model, argvs in per_model.items():
            commands = []
            for argv in argvs:
                argv = list(argv)
                argv[argv.index("-o") + 1] = str(out)
                commands.append(shlex.join([sys.executable, *argv]))
            log = logs.enter_context(open(out.parent / f"{out.name}-{model}.log", "w"))
            processes.append(subprocess.Popen(["bash", "-c", " && ".join(commands)], cwd=REPO, stdout=log,
                                              stderr=subprocess.STDOUT))
        for process in processes:
            process.wait()


def changed_fields(committed: dict, rerun: dict) -> set[str]:
    """The fields in which two sample records differ, a document's own fields as `doc.<name>`: a task's
    document may record where its data came from (a tokenizer's path) beside what the model answered."""
    fields = {key for key in committed.keys() | rerun.keys() if committed.get(key) != rerun.get(key)}
    docs = [record.get("doc") for record in (committed, rerun)]
    if "doc" in fields and all(isinstance(doc, dict) for doc in docs):
        fields.remove("doc")
        fields |= {f"doc.{key}" for key in docs[0].keys() | docs[1].keys() if docs[0].get(key) != docs[1].get(key)}
    return fields


def differences(units: dict[Path, dict], committed: Path, rerun: Path) -> list[str]:
    """Every unit of `units` (under `committed`) against its rerun under `rerun`: samples (with the fields
    that differ) and metrics."""
    found = []
    for unit in units:
        relative = unit.relative_to(committed)
        other = rerun / relative
        if not (other / "meta.json").exists():
            found.append(f"{relative}: no rerun unit")
            continue
        metrics = [read_json(UnitDir(folder).finished_results)["results"] for folder in (unit, other)]
        if metrics[0] != metrics[1]:
            found.append(f"{relative}: results.json metrics differ")
        for samples in sorted(unit.glob("samples_*.jsonl*")):
            records = [list(iter_jsonl(samples)), list(iter_jsonl(other / samples.name))]
            if len(records[0]) != len(records[1]):
                found.append(f"{relative}/{samples.name}: {len(records[0])} vs {len(records[1])} records")
                continue
            changed = {i: changed_fields(a, b) for i, (a, b) in enumerate(zip(*records)) if a != b}
            if changed:
                fields = ", ".join(sorted(set().union(*changed.values())))
                found.append(f"{relative}/{samples.name}: {len(changed)} of {len(records[0])} records differ "
                             f"(first: record {min(changed)}; fields: {fields})")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("committed", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="fresh folder for the rerun")
    parser.add_argument("--models", help="comma-separated models to recheck (default: all)")
    parser.add_argument("--tasks", help="comma-separated task names as the commands gave them (default: all)")
    parser.add_argument("--compare-only", action="store_true", help="compare an existing --out")
    args = parser.parse_args()
    models = set(args.models.split(",")) if args.models else None
    tasks = set(args.tasks.split(",")) if args.tasks else None
    committed, out = args.committed.resolve(), args.out.resolve()
    units = chosen_units(committed, models, tasks)
    archived = out.with_name(out.name + "-archive")  # the rerun as `ccq-eval archive` stores it
    if not args.compare_only:
        for folder in (out, archived):
            if folder.exists() and any(folder.iterdir()):
                parser.error(f"{folder} is not empty: choose a fresh --out")
        out.mkdir(parents=True, exist_ok=True)
        replay(commands_of(units), out)
    compared = out
    if any(UnitDir(unit).finished_results.suffix == ".xz" for unit in units):
        if not args.compare_only or not archived.exists():
            archive_results(out, archived)
        compared = archived
    found = differences(units, committed, compared)
    print("\n".join(found[:40]) if found else f"all {len(units)} units identical, sample for sample")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
