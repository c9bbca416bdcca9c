"""Rerun the units of a committed results folder and check that every sample comes back identical.

Each unit's meta.json records the argv that made it; this replays those commands (one process per
model, as the grid was run) into a fresh folder, then compares every samples file record by record
and every results.json's metrics exactly. Used to show that a change of the model code leaves the
committed GPU grid bitwise unchanged:

    python3 scripts/recheck_grid.py results/gpu-grid --out /tmp/grid-recheck --models tiny-gla,tiny-gdn-ccq

Exit status 0 when everything matches, 1 otherwise (the first differences are printed).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import lzma
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def read_text(path: Path) -> str:
    """A results file as text, whether `archive` compressed it (.xz) or not."""
    xz = path.with_name(path.name + ".xz")
    return lzma.open(xz, "rt").read() if xz.exists() else path.read_text()


def model_of(meta: dict) -> str:
    """The model a unit's command named (-m): an attached variant's unit belongs to its checkpoint."""
    argv = meta["argv"]
    return argv[argv.index("-m") + 1] if "-m" in argv else meta["model"]


def tasks_of(meta: dict) -> set[str]:
    """The task names a unit's command asked for (-t / --task)."""
    argv = meta["argv"]
    return {argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-t", "--task")}


def commands_of(committed: Path, models: set[str] | None, tasks: set[str] | None = None,
                ) -> dict[str, list[list[str]]]:
    """The distinct recorded argv per model (of the commands that asked for one of `tasks`), in a stable
    order."""
    per_model: dict[str, list[list[str]]] = {}
    for meta_path in sorted(committed.glob("*/*/meta.json")):
        meta = json.loads(meta_path.read_text())
        argv, model = meta["argv"], model_of(meta)
        if not chosen(meta, models, tasks):
            continue
        if argv not in per_model.setdefault(model, []):
            per_model[model].append(argv)
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


def chosen(meta: dict, models: set[str] | None, tasks: set[str] | None) -> bool:
    return (models is None or model_of(meta) in models) and (tasks is None or bool(tasks & tasks_of(meta)))


def differences(committed: Path, rerun: Path, models: set[str] | None, tasks: set[str] | None) -> list[str]:
    """Every chosen unit of `committed` against its rerun: samples and metrics."""
    found = []
    for unit in sorted(p.parent for p in committed.glob("*/*/meta.json")):
        relative = unit.relative_to(committed)
        if not chosen(json.loads((unit / "meta.json").read_text()), models, tasks):
            continue
        other = rerun / relative
        if not (other / "meta.json").exists():
            found.append(f"{relative}: no rerun unit")
            continue
        metrics = [json.loads(read_text(u / "results.json"))["results"] for u in (unit, other)]
        if metrics[0] != metrics[1]:
            found.append(f"{relative}: results.json metrics differ")
        for samples in sorted(unit.glob("samples_*.jsonl*")):
            name = samples.name.removesuffix(".xz")
            lines = [read_text(u / name).splitlines() for u in (unit, other)]
            if len(lines[0]) != len(lines[1]):
                found.append(f"{relative}/{name}: {len(lines[0])} vs {len(lines[1])} records")
                continue
            changed = [i for i, (a, b) in enumerate(zip(*lines)) if json.loads(a) != json.loads(b)]
            if changed:
                found.append(f"{relative}/{name}: {len(changed)} of {len(lines[0])} records differ "
                             f"(first: record {changed[0]})")
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
    committed = args.committed.resolve()
    out = args.out.resolve()
    if not args.compare_only:
        if out.exists() and any(out.iterdir()):
            parser.error(f"--out {out} is not empty: choose a fresh folder")
        out.mkdir(parents=True, exist_ok=True)
        replay(commands_of(committed, models, tasks), out)
    found = differences(committed, out, models, tasks)
    units = sum(chosen(json.loads(p.read_text()), models, tasks) for p in committed.glob("*/*/meta.json"))
    print("\n".join(found[:40]) if found else f"all {units} units identical, sample for sample")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
