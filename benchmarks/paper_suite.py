#!/usr/bin/env python3
"""The wall time of `ccq-eval run --suite paper` at the papers' scale, per task (issue 28, item 4).

  python benchmarks/paper_suite.py --out DIR              # GPU: 1.3B GLA and Gated DeltaNet, CCQ on and off
  python benchmarks/paper_suite.py --arch gla --ccq on --out DIR
  python benchmarks/paper_suite.py --smoke --out DIR      # CPU, tiny shapes, about a minute: the tooling

For each architecture it writes a random-init checkpoint folder (safetensors, config, the 32K Mistral
tokenizer fixture) per CCQ setting, both with the same weights, and LongBench-shaped synthetic data
(benchlib/synthetic_longbench.py: the 21 datasets at LongBench's sample counts and average lengths), then
runs `ccq-eval run -m <checkpoint> --suite paper --longbench-dir <data>` in a new process per checkpoint,
with ccq-eval's defaults (device, dtype, batch size, CUDA graphs). Each unit's time is the wall_time_s its
meta.json records (the first unit of a run includes loading the model); the process's own wall time adds
start-up, planning and the end-of-run report. Writes <out>/<name>.json and <out>/<name>.md, rewritten
while a run goes on; a later call with the same --work resumes (benchmarks/README.md).

Scales (--scale): `paper` (the models' 1.3B shapes, the suite's own grid, every LongBench sample) and
`smoke` (benchlib's tiny CPU shape of GLA with CCQ, byte-level tokens, one S-NIAH depth and one sample
per cell, three LongBench datasets with one record at 1% of the average length, 8 new tokens at most).
Extra `ccq-eval run` flags go through --run-arg (e.g. --run-arg=--depths=0,25,50,75,100).
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchlib import workload  # noqa: E402  (benchmarks/ is on sys.path from here on)

SCHEMA = "ccq-eval-paper-suite/1"
POLL_S = 15  # while a run goes on, its units so far are written into the report this often
JIEBA_STANDIN = HERE / "benchlib" / "jieba_standin"  # on a run's path, after anything installed
ARCH_NAMES = {"gla": "gla", "gdn": "gated_deltanet", "gated_deltanet": "gated_deltanet"}

# The 1.3B shapes: fla's 340M shapes (benchlib/workload.py, from flame's configs) at hidden size 2048, which
# gives fla 0.6.0's GLAConfig and GatedDeltaNetConfig defaults: GLA 24 layers x 4 heads, expand_k 0.5 (the
# GLA paper's 1.3B model); Gated DeltaNet 21 layers x 6 heads x 256, expand_v 2, short convolutions (flame's
# configs/gated_deltanet_1B.json: 21 rather than 24 layers keeps it at 1.3B beside its wider values). Untied
# embeddings and initializer_range 0.02 as fla's defaults. Given here rather than taken from fla, so that a
# change of fla's defaults does not change the benchmark.
SHAPES_1P3B: dict[str, dict[str, Any]] = {
    arch: {**shape, "hidden_size": 2048, "tie_word_embeddings": False, "initializer_range": 0.02}
    for arch, shape in workload.SHAPES_340M.items()
}
# The context the Gated DeltaNet paper trained its 1.3B models at. Recorded as max_position_embeddings: it is
# below the suite's S-NIAH grid (up to 8K), so the suite adds no length past the training context.
TRAINING_CONTEXT = 4096

# Per scale: models, tokenizer, LongBench data (None: every dataset / every sample) and extra run flags.
SCALES: dict[str, dict[str, Any]] = {
    "paper": {
        "arch": "gla,gdn",
        "ccq": "on,off",
        "tokenizer": "mistral",
        "longbench_datasets": None,
        "longbench_samples": None,
        "length_scale": 1.0,
        "run_args": [],
    },
    # One model; three LongBench datasets (English, Chinese, code; the suite runs those whose files exist),
    # byte-level tokens (a 32K-row LM head over the suite's 20K-token documents dominates a CPU run), and
    # one process as on a GPU: CPU helper processes would overlap the units and leave no time outside them.
    "smoke": {
        "arch": "gla",
        "ccq": "on",
        "tokenizer": "byt5",
        "longbench_datasets": ("narrativeqa", "dureader", "repobench-p"),
        "longbench_samples": 1,
        "length_scale": 0.01,
        "run_args": [
            "--depths",
            "50",
            "--samples-per-cell",
            "1",
            "--lm-eval-arg",
            "gen_kwargs=max_gen_toks=8",
            "--no-report",
            "--quiet",
            "--workers",
            "1",
        ],
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", help="gla,gdn (gdn: Gated DeltaNet; default: both, smoke: gla)")
    p.add_argument("--ccq", help="on,off: the CCQ settings to run (default: both, smoke: on)")
    p.add_argument("--scale", choices=tuple(SCALES), default="paper")
    p.add_argument("--smoke", action="store_true", help="--scale smoke")
    p.add_argument(
        "--longbench-e", action="store_true", help="also write LongBench-E's 13 files (the suite runs them)"
    )
    p.add_argument(
        "--run-arg", action="append", default=[], help="one more `ccq-eval run` argument (repeatable)"
    )
    p.add_argument(
        "--work", help="folder for checkpoints, data and runs (default: a temporary folder, removed)"
    )
    p.add_argument(
        "--timeout", type=int, default=3600, help="seconds per `ccq-eval run` before it is stopped"
    )
    p.add_argument(
        "--out", default="results/_scratch/paper_suite", help="report folder (default %(default)s)"
    )
    p.add_argument("--name", default="paper_suite", help="file stem: <out>/<name>.json and .md")
    args = p.parse_args(argv)
    if args.smoke:
        args.scale = "smoke"
    scale = SCALES[args.scale]
    args.archs = _choices(args.arch or scale["arch"], ARCH_NAMES, "--arch")
    args.ccq_settings = [
        value == "on" for value in _choices(args.ccq or scale["ccq"], {"on": "on", "off": "off"}, "--ccq")
    ]
    return args


def _choices(text: str, valid: dict[str, str], flag: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    bad = [item for item in items if item not in valid]
    if bad or not items:
        raise SystemExit(f"error: {flag} {text!r}: choose from {', '.join(valid)}")
    return list(dict.fromkeys(valid[item] for item in items))


# ------------------------------------------------------------------------------------------ inputs
def shape_of(arch: str, smoke: bool) -> dict[str, Any]:
    """The model shape of a scale: the 1.3B shape, or benchlib's tiny CPU shape for the smoke scale."""
    return workload.SHAPES_SMOKE[arch] if smoke else SHAPES_1P3B[arch]


def checkpoint_path(folder: Path, arch: str, ccq: bool, smoke: bool) -> Path:
    """<folder>/<arch>-<1.3b|smoke>[-ccq]: the folder name is the model's name in the results."""
    return folder / f"{arch}-{'smoke' if smoke else '1.3b'}{'-ccq' if ccq else ''}"


def write_checkpoints(
    folder: Path, arch: str, ccq_settings: list[bool], smoke: bool, tokenizer_name: str
) -> dict[bool, dict[str, Any]]:
    """One random-init checkpoint folder per CCQ setting, all with the same weights (CCQ switched in the
    config, as benchlib.workload.set_ccq switches it); {ccq: {path, parameters}}. Folders an earlier call
    wrote into --work are kept as they are, so that a later call resumes their runs."""
    import torch

    paths = {ccq: checkpoint_path(folder, arch, ccq, smoke) for ccq in ccq_settings}
    missing = [ccq for ccq, path in paths.items() if not (path / "model.safetensors").is_file()]
    if missing:
        tokenizer, _ = workload.load_tokenizer(tokenizer_name)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # a 1.3B init is slow on a CPU
        model = workload.build_model(
            arch, shape_of(arch, smoke), vocab_size=len(tokenizer), device=device, dtype=torch.float32
        )
        model.config.max_position_embeddings = TRAINING_CONTEXT
        model = model.to(torch.float32 if smoke else torch.bfloat16)
        for ccq in missing:
            workload.set_ccq(model, ccq)
            model.save_pretrained(paths[ccq], safe_serialization=True)
            tokenizer.save_pretrained(paths[ccq])
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {ccq: {"path": path, "parameters": stored_parameters(path)} for ccq, path in paths.items()}


def stored_parameters(checkpoint: Path) -> int:
    """Parameters in a checkpoint's model.safetensors, from the tensors' shapes (nothing is loaded)."""
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as weights:
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118


def jieba_standin_notes(datasets: tuple[str, ...]) -> list[str]:
    """Where jieba is missing, the note that the Chinese metrics of `datasets` use benchlib's stand-in
    (timed_run puts it on the run's path); nothing where jieba is installed or no dataset needs it."""
    from benchlib import synthetic_longbench

    spec = synthetic_longbench.spec
    needing = [d for d in datasets if spec.DATASET_METRIC[d] in spec.JIEBA_METRICS]
    if not needing or importlib.util.find_spec("jieba") is not None:
        return []
    note = (
        f"jieba is not installed: the metrics of {', '.join(needing)} segment with "
        "benchlib/jieba_standin (single characters), so their times stand but their scores are not "
        "LongBench's"
    )
    return [note]


def write_data(
    folder: Path, scale: dict[str, Any], longbench_e: bool
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The synthetic LongBench files (benchlib/synthetic_longbench.py) the suite's LongBench part reads, and
    notes on how they are scored."""
    from benchlib import synthetic_longbench

    datasets = scale["longbench_datasets"] or synthetic_longbench.spec.LONGBENCH_DATASETS
    notes = jieba_standin_notes(datasets)
    options = {"samples": scale["longbench_samples"], "length_scale": scale["length_scale"]}
    written = synthetic_longbench.write_longbench(folder, datasets=datasets, **options)
    if longbench_e:
        e_datasets = tuple(d for d in synthetic_longbench.E_BUCKET_COUNTS if d in datasets)
        written |= synthetic_longbench.write_longbench(
            folder, datasets=e_datasets, longbench_e=True, **options
        )
    return written, notes


# ------------------------------------------------------------------------------------------ runs
def timed_run(
    checkpoint: Path,
    data: Path,
    out: Path,
    run_args: list[str],
    timeout: int,
    threads: int | None = None,
    on_poll: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """`ccq-eval run --suite paper` on one checkpoint in a new process (with OMP_NUM_THREADS=threads when
    given), its output in <out>.log: wall time, exit status (None when stopped), whether it was interrupted
    (Ctrl-C, `timeout -s INT`) and the tail of its output. on_poll is called every POLL_S seconds
    meanwhile."""
    command = [sys.executable, "-m", "ccq_eval", "run", "-m", str(checkpoint), "--suite", "paper"]
    command += ["--longbench-dir", str(data), "-o", str(out), "--keep-going", *run_args]
    env = dict(os.environ)
    # jieba's timing stand-in goes last: an installed jieba comes first (jieba_standin_notes).
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")]), str(JIEBA_STANDIN)]
    )
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    log = out.with_name(out.name + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    interrupted = False
    with log.open("w", encoding="utf-8") as handle:
        process = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    process.wait(timeout=POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    if time.perf_counter() - start > timeout:
                        handle.write(f"\n[paper_suite] stopped after {timeout} s\n")
                        break
                    if on_poll is not None:
                        on_poll()
        except KeyboardInterrupt:
            interrupted = True
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    stopped = interrupted or time.perf_counter() - start > timeout
    return {
        "command": shlex.join(command),
        "returncode": None if stopped else process.returncode,
        "interrupted": interrupted,
        "wall_s": time.perf_counter() - start,
        "log": str(log),
        "output_tail": log.read_text(encoding="utf-8", errors="replace")[-3000:],
    }


def unit_rows(run_folder: Path, since: float, finished: bool) -> list[dict[str, Any]]:
    """One row per unit folder of a run (<out>/<model>/<task>/), in the order they ran: task, samples and
    meta.json's wall time. A unit without results.json is "running" until the run has `finished`, then
    "failed" (no time); a running unit's `elapsed_s` counts from its unit.json, written as it starts.
    `earlier` marks a unit an earlier call stored (it started before `since`, a Unix time: this call's
    run skipped it)."""
    from ccq_eval.task_families import family_of

    rows = []
    for spec_path in sorted(run_folder.glob("*/*/unit.json")):
        folder = spec_path.parent
        task = json.loads(spec_path.read_text(encoding="utf-8"))["task"]
        meta_path = folder / "meta.json"
        meta = json.loads(meta_path.read_text(encoding="utf-8")) if meta_path.is_file() else {}
        samples = sum(1 for path in folder.glob("samples_*.jsonl") for _ in path.open(encoding="utf-8"))
        wall, started = meta.get("wall_time_s"), meta.get("started_at")
        started_unix = dt.datetime.strptime(started, "%Y-%m-%dT%H:%M:%S%z").timestamp() if started else None
        status = "done" if (folder / "results.json").is_file() else "failed" if finished else "running"
        rows.append(
            {
                "task": task,
                "family": family_of(task).name,
                "status": status,
                "elapsed_s": time.time() - spec_path.stat().st_mtime if status == "running" else None,
                "samples": samples,
                "wall_s": wall,
                "s_per_sample": wall / samples if wall and samples else None,
                "batch_size": meta.get("batch_size"),
                "cuda_graphs": meta.get("cuda_graphs"),
                "device": meta.get("device"),
                "dtype": meta.get("dtype"),
                "started_at": started,
                "earlier": started_unix is not None
                and started_unix < since - 1,  # meta.json keeps whole seconds
            }
        )
    return sorted(rows, key=lambda row: row["started_at"] or "~")


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """Totals of a run: seconds per task family (finished units), all units, and what this call's process
    spent outside the units it ran (start-up, planning, tables; not the time of a unit still running)."""
    units = run["units"]
    by_family: dict[str, float] = {}
    for row in units:
        by_family[row["family"]] = by_family.get(row["family"], 0.0) + (row["wall_s"] or 0.0)
    total = sum(by_family.values())
    earlier = [row for row in units if row["earlier"]]
    return {
        "units": len(units),
        "failed": sum(row["status"] == "failed" for row in units),
        "earlier_units": len(earlier),
        "units_s": total,
        "by_family_s": by_family,
        "outside_units_s": run["wall_s"]
        - total
        + sum(row["wall_s"] or 0.0 for row in earlier)
        - sum(row.get("elapsed_s") or 0.0 for row in units),
    }


# ------------------------------------------------------------------------------------------ report
def _header(report: dict[str, Any]) -> str:
    """The title and a paragraph naming the machine, versions, scale, flags and outcome."""
    env, settings = report["environment"], report["settings"]
    packages, git = env["packages"], env["git"]
    smoke = " (SMOKE: tiny shapes, numbers are not meaningful)" if settings["scale"] == "smoke" else ""
    fla = packages.get("fla-core") or packages.get("flash-linear-attention")
    commit = (git.get("commit") or "?")[:10] + (" (dirty)" if git.get("dirty") else "")
    flags = " ".join(settings["run_args"]) or "none"
    notes = "".join(f" Note: {note}." for note in report["notes"])
    return (
        f"# `ccq-eval run --suite paper`: wall time per task{smoke}\n\n"
        f"{env['device_name']}, checkpoints in {settings['checkpoint_dtype']}, "
        f"torch {packages.get('torch')}, "
        f"fla {fla}, lm_eval {packages.get('lm_eval')}, commit {commit}. Scale `{settings['scale']}`; extra "
        f"run flags: `{flags}`. {report['status']}, {report['wall_s']:.0f} s.{notes}"
    )


def markdown(report: dict[str, Any]) -> str:
    from benchlib.report import _f, _table

    parts = [_header(report), "", "## Per model\n"]
    families = sorted({family for run in report["runs"] for family in run["summary"]["by_family_s"]})
    parts.append(
        _table(
            [
                "arch",
                "CCQ",
                "parameters",
                "units",
                "failed",
                "earlier call",
                *[f"{family} s" for family in families],
                "units s",
                "outside units s",
                "process s",
                "exit",
            ],
            [
                [
                    run["arch"],
                    _f(run["ccq"]),
                    f"{run['parameters'] / 1e6:,.1f}M",
                    str(run["summary"]["units"]),
                    str(run["summary"]["failed"]),
                    str(run["summary"]["earlier_units"]),
                    *[_f(run["summary"]["by_family_s"].get(f), 1) for f in families],
                    _f(run["summary"]["units_s"], 1),
                    _f(run["summary"]["outside_units_s"], 1),
                    _f(run["wall_s"], 1),
                    str(run["returncode"]),
                ]
                for run in report["runs"]
            ],
        )
    )
    parts.append(
        "\nA run's first unit includes loading the model; \"outside units\" is the process's start-up, "
        "planning and the tables it prints. Units an earlier call stored (into the same --work) keep the "
        "time that call measured.\n"
    )
    for run in report["runs"]:
        parts.append(
            f"## {run['arch']}, CCQ {'on' if run['ccq'] else 'off'} (`{Path(run['checkpoint']).name}`)\n"
        )
        parts.append(
            _table(
                ["task", "family", "status", "samples", "wall s", "s/sample", "batch", "graphs"],
                [
                    [
                        row["task"],
                        row["family"],
                        row["status"] + (" (earlier call)" if row["earlier"] else ""),
                        str(row["samples"]),
                        _f(row["wall_s"], 1)
                        if row.get("elapsed_s") is None
                        else f"{row['elapsed_s']:.0f} so far",
                        _f(row["s_per_sample"], 3),
                        _f(row["batch_size"]),
                        _f(row["cuda_graphs"]),
                    ]
                    for row in run["units"]
                ],
            )
        )
        if "output_tail" in run and run["returncode"] != 0:  # the run has ended, and not well
            parts.append(
                f"\nExit status {run['returncode']}; output tail:\n\n```text\n{run['output_tail']}\n```\n"
            )
        parts.append("")
    parts.append("## LongBench data (synthetic)\n")
    parts.append(
        _table(
            ["file", "language", "samples", "mean length (words; zh: characters)"],
            [
                [stem, info["language"], str(info["samples"]), f"{info['mean_length']:,.0f}"]
                for stem, info in report["longbench_data"].items()
            ],
        )
    )
    return "\n".join(parts) + "\n"


def write_report(report: dict[str, Any], out: Path, name: str) -> tuple[Path, Path]:
    from benchlib.report import write_files

    return write_files(report, markdown(report), out, name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scale = SCALES[args.scale]
    smoke = args.scale == "smoke"
    run_args = [*scale["run_args"], *args.run_arg]
    started = dt.datetime.now(dt.UTC)
    clock = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ccq-paper-suite-") as scratch:
        work = Path(args.work) if args.work else Path(scratch)
        data = work / "longbench"
        print(f"writing the synthetic LongBench data to {data}", file=sys.stderr)
        longbench_data, notes = write_data(data, scale, args.longbench_e)

        import torch
        from benchlib.report import environment

        report: dict[str, Any] = {
            "schema": SCHEMA,
            "status": "running",
            "created": started.isoformat(timespec="seconds"),
            "command": "python benchmarks/paper_suite.py "
            + shlex.join(argv if argv is not None else sys.argv[1:]),
            "environment": environment(
                torch.device("cuda" if torch.cuda.is_available() else "cpu"),
                torch.float32 if smoke else torch.bfloat16,
            ),
            "settings": {
                "scale": args.scale,
                "archs": args.archs,
                "ccq": args.ccq_settings,
                "run_args": run_args,
                "checkpoint_dtype": "float32" if smoke else "bfloat16",
                "training_context": TRAINING_CONTEXT,
                "shapes": {a: shape_of(a, smoke) for a in args.archs},
            },
            "longbench_data": longbench_data,
            "notes": notes,
            "runs": [],
        }
        status = run_all(args, work, data, run_args, report, clock)
    report |= {"status": status, "wall_s": time.perf_counter() - clock}
    json_path, md_path = write_report(report, Path(args.out), args.name)
    print(f"wrote {json_path} and {md_path} ({status})", file=sys.stderr)
    return {"complete": 0, "interrupted": 130}.get(status, 1)


def refresh_run(
    report: dict[str, Any],
    run: dict[str, Any],
    run_folder: Path,
    since: float,
    begun: float,
    clock: float,
    args: argparse.Namespace,
    finished: bool = False,
) -> None:
    """Bring a run's entry up to date with its unit folders (and, while it goes on, its wall time), and
    rewrite the report: a job cut short keeps what it measured."""
    if not finished:
        run["wall_s"] = time.perf_counter() - begun
    run["units"] = unit_rows(run_folder, since, finished)
    run["summary"] = summarise(run)
    report["wall_s"] = time.perf_counter() - clock
    write_report(report, Path(args.out), args.name)


def run_all(
    args: argparse.Namespace,
    work: Path,
    data: Path,
    run_args: list[str],
    report: dict[str, Any],
    clock: float,
) -> str:
    """Write each architecture's checkpoints and run the suite on each; every run's entry in report["runs"]
    is kept current (the report rewritten while it runs). Returns "complete", "failed" or "interrupted"."""
    smoke = args.scale == "smoke"
    for arch in args.archs:
        print(f"writing the {arch} checkpoints", file=sys.stderr)
        checkpoints = write_checkpoints(
            work / "checkpoints", arch, args.ccq_settings, smoke, SCALES[args.scale]["tokenizer"]
        )
        for ccq, checkpoint in checkpoints.items():
            run_folder = work / "runs" / checkpoint["path"].name
            run: dict[str, Any] = {
                "arch": arch,
                "ccq": ccq,
                "checkpoint": str(checkpoint["path"]),
                "parameters": checkpoint["parameters"],
                "returncode": None,
                "wall_s": 0.0,
            }
            report["runs"].append(run)
            refresh = functools.partial(
                refresh_run, report, run, run_folder, time.time(), time.perf_counter(), clock, args
            )
            print(f"running the suite on {checkpoint['path'].name}", file=sys.stderr)
            threads = 1 if smoke else None
            run |= timed_run(checkpoint["path"], data, run_folder, run_args, args.timeout, threads, refresh)
            refresh(finished=True)
            summary = run["summary"]
            print(
                f"  {run['wall_s']:.1f} s, exit {run['returncode']}, {summary['units']} units, "
                f"{summary['failed']} failed, {summary['earlier_units']} from an earlier call",
                file=sys.stderr,
            )
            if run["interrupted"]:
                return "interrupted"
    ok = all(run["returncode"] == 0 and run["summary"]["failed"] == 0 for run in report["runs"])
    return "complete" if ok else "failed"


if __name__ == "__main__":
    sys.exit(main())
