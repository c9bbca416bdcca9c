#!/usr/bin/env python3
"""GPU performance benchmark for ccq-eval (issue 6): baseline (fla's layers) and CCQ side by side, in
one process, on the same random-init weights.

Sections (--sections, comma-separated):
  model       forward (eval, use_cache=False) and forward+backward at each T: time, tokens/s,
              CCQ/baseline ratio, peak memory, MFU against a bf16 matmul rate measured here; also
              for the other CCQ backbones (--archs delta_net,kda,retnet,mamba2,precond_gated_deltanet:
              fla's own model vs CCQ attached to the same weights; no MFU, the FLOP model is GLA's and
              Gated DeltaNet's)
  ops         single kernels on the issue's reference shape (chunk_gla, chunk_simple_gla v=k,
              chunk_gated_delta_rule, the whole CCQ read)
  harness     perplexity scoring of long documents: bare forward vs the ccq adapter's
              loglikelihood_rolling vs lm-eval's stock HFLM
  generation  S-NIAH-1 prompts at each length, greedy: prefill time and decode tokens/s through the
              adapter's generate_until vs transformers' model.generate()
  sniah       S-NIAH-1 samples through generate_until: adapter (batch 1 and its default batch) vs
              stock HFLM, seconds per sample and whether the texts agree; also for fla's own DeltaNet,
              KDA and Mamba2 (--archs delta_net,kda,mamba2: no CCQ)

With no flags the adapter runs as `ccq-eval run` runs it: CUDA graphs and its default batch size on
CUDA (--no-cuda-graphs: eager everywhere).

Writes <out>/<name>.json and <out>/<name>.md. --merge combines the JSON of several runs (sections
split across device calls) into one report. See benchmarks/README.md for the commands to run on a GPU.

  python benchmarks/bench.py --smoke                       # CPU, tiny shapes, < 1 min
  python benchmarks/bench.py --sections model --out $OUT   # on the GPU
  # the cost CCQ adds per backbone (issue 55): forward at 8K, CCQ over fla's own model, on the GPU
  python benchmarks/bench.py --sections model --archs delta_net,kda,retnet,mamba2,precond_gated_deltanet \
      --modes forward --lengths 8192 --out $OUT --name backbones
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCHEMA = "ccq-eval-bench/1"
SECTION_NAMES = ("model", "ops", "harness", "generation", "sniah")

# Full (GPU) defaults and the CPU smoke defaults; an explicit flag wins over both.
FULL = {
    # With no flags the adapter runs as `ccq-eval run` runs it: CUDA graphs and the default batch size
    # on CUDA; the model section adds the graphed forward, the mode the harness scores in.
    "sections": "model,harness,generation,sniah",
    "archs": "gla,gated_deltanet",
    "ccq": "off,on",
    "modes": "forward,forward_graphed,train",
    "lengths": "4096,8192,16384,20480",
    "batch": 1,
    "warmup": 3,
    "repeats": 10,
    "harness_tokens": 20480,
    "harness_docs": 32,  # fewer understate throughput: the first text's tokenisation shows
    # A harness call scores harness_docs documents (about 1.5 s of GPU work at 20K): a few calls give a
    # stable median, and the section fits one device call for all four models.
    "harness_warmup": 1,
    "harness_repeats": 5,
    # The adapter's default (ccq_eval.harness.scoring.DEFAULT_CHUNK_SIZE); 2048,32768 adds shorter slices.
    "adapter_chunk_sizes": "32768",
    "gen_lengths": "1024,8192,20480",
    "new_tokens": 128,
    "gen_warmup": 1,
    "gen_repeats": 3,
    "sniah_length": 8192,
    # Enough samples for the adapter's automatic batch to fill (it sizes batches up to 64 rows); stock
    # HFLM, seconds a sample, runs the first sniah_hflm_samples of them and is compared per sample.
    "sniah_samples": 64,
    "sniah_hflm_samples": 8,
    "sniah_batches": "1,auto",  # auto: the adapter's default batch size (from free memory with graphs)
    # The adapter's default (ccq_eval.harness.scoring.DEFAULT_CHUNK_SIZE): an 8K prompt prefilled in one
    # slice, as HFLM prefills it. Slices of another length give other segment sums in the CCQ state
    # kernels, so the states, and on an untrained model the greedy texts, differ by rounding.
    "sniah_chunk_size": 32768,
    "sniah_warmup": 1,
    "sniah_repeats": 1,
    "ops_shape": "20480,16,128,256",
    "matmul_size": 8192,
    "device": "auto",
    "dtype": "auto",
    "tokenizer": "mistral",
    "threads": None,
}
SMOKE = {
    **FULL,
    "sections": "model,ops,harness,generation,sniah",
    "lengths": "128,256",
    "warmup": 1,
    "repeats": 2,
    "harness_tokens": 512,
    "harness_docs": 2,
    "harness_repeats": 2,
    "adapter_chunk_sizes": "2048",
    "gen_lengths": "512,1024",
    "new_tokens": 8,
    "gen_repeats": 1,
    "sniah_length": 1024,
    "sniah_samples": 1,
    "sniah_hflm_samples": 1,
    "sniah_warmup": 0,
    "modes": "forward,train",
    "ops_shape": "256,2,16,32",
    "matmul_size": 256,
    "device": "cpu",
    "dtype": "float32",
    "threads": 1,
}
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes, short T, CPU, 1 thread: checks the tooling"
    )
    p.add_argument(
        "--sections",
        help=f"comma-separated, from {', '.join(SECTION_NAMES)} (default {FULL['sections']}; smoke: all)",
    )
    p.add_argument("--archs", help="gla,gated_deltanet; with --sections sniah also fla's own delta_net,kda,mamba2; "
                   "with --sections model also delta_net,kda,retnet,mamba2,precond_gated_deltanet (fla's own "
                   "model vs CCQ attached to its weights)")
    p.add_argument("--ccq", help="off,on: which CCQ settings to run (off = fla's own layer forward)")
    p.add_argument("--modes", help="model section: forward,train (eager), forward_graphed,train_graphed (the "
                   "same call captured once in a CUDA graph and replayed: no host-side cost)")
    p.add_argument(
        "--lengths", help="model section: sequence lengths T, e.g. 4096,8192,16384,20480 (k = 1024)"
    )
    p.add_argument("--batch", type=int, help="model section: rows per step")
    p.add_argument("--warmup", type=int, help="untimed calls before timing (model, ops)")
    p.add_argument("--repeats", type=int, help="timed calls; the median is reported (model, ops)")
    p.add_argument("--harness-warmup", type=int, help="harness: untimed calls before timing")
    p.add_argument("--harness-repeats", type=int, help="harness: timed calls (median reported)")
    p.add_argument(
        "--harness-tokens", type=int, help="harness: document length in model tokens (BOS included)"
    )
    p.add_argument(
        "--adapter-chunk-sizes",
        help="ccq adapter chunk_size values for harness (the first is also used by generation and sniah)",
    )
    p.add_argument("--harness-docs", type=int, help="harness: documents scored per timed call")
    p.add_argument("--no-hflm", action="store_true", help="skip lm-eval's HFLM comparisons")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="the adapter runs eagerly everywhere (default on CUDA: decode steps (generation, "
                        "sniah) and, as extra harness rows, scoring forwards replayed from CUDA graphs)")
    p.add_argument("--gen-lengths", help="generation: S-NIAH lengths (prompt + 128-token budget)")
    p.add_argument("--new-tokens", type=int, help="generation: greedy tokens to generate")
    p.add_argument("--gen-warmup", type=int)
    p.add_argument("--gen-repeats", type=int)
    p.add_argument("--sniah-length", type=int, help="sniah: S-NIAH-1 length")
    p.add_argument("--sniah-samples", type=int, help="sniah: samples (needle depths spread over 0..100%%)")
    p.add_argument("--sniah-hflm-samples", type=int,
                   help="sniah: how many of the samples stock HFLM runs (the first ones; compared per sample)")
    p.add_argument("--sniah-batches", help="sniah: the adapter's batch sizes, e.g. 1,auto (auto: its default)")
    p.add_argument("--sniah-chunk-size", type=int, help="sniah: the adapter's chunk_size (prefill slice)")
    p.add_argument("--sniah-warmup", type=int, help="sniah: untimed generate_until calls on one sample first")
    p.add_argument("--sniah-repeats", type=int)
    p.add_argument("--sniah-shared-prefill", action="store_true",
                   help="sniah: the adapter's shared_prefill=True (prompts of nearly one length prefilled together)")
    p.add_argument("--ops-shape", help="ops: T,H,K,V")
    p.add_argument("--matmul-size", type=int, help="n of the n^3 matmul measured for MFU")
    p.add_argument("--device", help="auto (cuda when available), cuda, cuda:1, cpu")
    p.add_argument("--dtype", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32")
    p.add_argument("--tokenizer", help="mistral (32K fixture, default), byt5, or a tokenizer folder")
    p.add_argument("--threads", type=int, help="torch CPU threads (smoke: 1)")
    p.add_argument("--out", default="results/_scratch/bench", help="output folder (default %(default)s)")
    p.add_argument("--name", default="bench", help="file stem: <out>/<name>.json and .md")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="combine these bench JSON files into one report (no measuring)",
    )
    p.add_argument("--fail-on-error", action="store_true", help="exit 1 when any case failed")
    return p.parse_args(argv)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: --{what} {text!r}: expected comma-separated integers") from None
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"error: --{what} {text!r}: expected positive integers")
    return values


def _batches(text: str) -> list[int | None]:
    """Batch sizes from "1,auto": positive integers, None for auto (the adapter picks)."""
    values = [x.strip() for x in str(text).split(",") if x.strip()]
    if not values or not all(v == "auto" or (v.isdigit() and int(v) >= 1) for v in values):
        raise SystemExit(f"error: --sniah-batches {text!r}: expected positive integers or auto, e.g. 1,auto")
    return list(dict.fromkeys(None if v == "auto" else int(v) for v in values))


def _choices(text: str, valid: tuple[str, ...], what: str) -> list[str]:
    values = [x.strip() for x in str(text).split(",") if x.strip()]
    bad = [v for v in values if v not in valid]
    if not values or bad:
        raise SystemExit(f"error: --{what} {text!r}: choose from {', '.join(valid)}")
    return list(dict.fromkeys(values))


def resolve_settings(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from benchlib import workload

    base = SMOKE if args.smoke else FULL
    raw = {
        key: getattr(args, key) if getattr(args, key, None) is not None else default
        for key, default in base.items()
    }
    device = raw["device"]
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"error: --device {device}: CUDA is not available here (use --device cpu or --smoke)"
        )
    dtype_name = raw["dtype"]
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.startswith("cuda") else "float32"
    if dtype_name not in DTYPES:
        raise SystemExit(f"error: --dtype {dtype_name!r}: choose from auto, {', '.join(DTYPES)}")
    ops_shape = _ints(raw["ops_shape"], "ops-shape")
    if len(ops_shape) != 4:
        raise SystemExit(f"error: --ops-shape {raw['ops_shape']!r}: expected T,H,K,V")
    sections = _choices(raw["sections"], SECTION_NAMES, "sections")
    # GLA and Gated DeltaNet run everywhere. fla's own families run in the sniah section (no CCQ) and, paired
    # with CCQ attached to their weights, in the model section; the other sections switch CCQ in place.
    runs_in = {arch: set(SECTION_NAMES) for arch in workload.ARCHS}
    for arch in workload.FLA_ARCHS:
        runs_in.setdefault(arch, set()).add("sniah")
    for arch in workload.ATTACH_ARCHS:
        runs_in.setdefault(arch, set()).add("model")
    archs = _choices(raw["archs"], tuple(runs_in), "archs")
    outside = [arch for arch in archs if not set(sections) <= runs_in[arch]]
    if outside:
        raise SystemExit(f"error: --archs {','.join(outside)}: fla's own families run in the sniah section only "
                         f"({', '.join(workload.FLA_ARCHS)}, no CCQ) and the model section (fla's model vs CCQ "
                         "attached to its weights): --sections sniah or --sections model")
    settings = {
        "smoke": args.smoke,
        "sections": sections,
        "archs": archs,
        "ccq": _choices(raw["ccq"], ("off", "on"), "ccq"),
        "modes": _choices(raw["modes"], ("forward", "train", "forward_graphed", "train_graphed"), "modes"),
        "lengths": _ints(raw["lengths"], "lengths"),
        "batch": raw["batch"],
        "warmup": max(0, raw["warmup"]),
        "repeats": raw["repeats"],
        "harness_tokens": raw["harness_tokens"],
        "harness_docs": max(1, raw["harness_docs"]),
        "harness_warmup": max(0, raw["harness_warmup"]),
        "harness_repeats": raw["harness_repeats"],
        "adapter_chunk_sizes": _ints(raw["adapter_chunk_sizes"], "adapter-chunk-sizes"),
        "hflm": not args.no_hflm,
        "cuda_graphs": device.startswith("cuda") and not args.no_cuda_graphs,
        "gen_lengths": _ints(raw["gen_lengths"], "gen-lengths"),
        "new_tokens": raw["new_tokens"],
        "gen_warmup": max(0, raw["gen_warmup"]),
        "gen_repeats": max(1, raw["gen_repeats"]),
        "sniah_length": raw["sniah_length"],
        "sniah_samples": max(1, raw["sniah_samples"]),
        "sniah_hflm_samples": max(1, min(raw["sniah_hflm_samples"], raw["sniah_samples"])),
        "sniah_batches": _batches(raw["sniah_batches"]),
        "sniah_chunk_size": max(1, raw["sniah_chunk_size"]),
        "sniah_warmup": max(0, raw["sniah_warmup"]),
        "sniah_repeats": max(1, raw["sniah_repeats"]),
        "sniah_shared_prefill": args.sniah_shared_prefill,
        "ops_shape": ops_shape,
        "matmul_size": raw["matmul_size"],
        "device": device,
        "dtype_name": DTYPES[dtype_name],
        "tokenizer": raw["tokenizer"],
        "threads": raw["threads"],
        "shapes": {
            arch: (workload.SHAPES_SMOKE if args.smoke else workload.SHAPES_340M)[arch] for arch in archs
        },
    }
    if args.modes is None and not settings["cuda_graphs"]:  # graphed modes need CUDA graphs
        settings["modes"] = [m for m in settings["modes"] if not m.endswith("_graphed")]
    if settings["repeats"] < 1 or settings["harness_repeats"] < 1:
        raise SystemExit("error: --repeats and --harness-repeats must be >= 1")
    return settings


def write_report(report: dict[str, Any], out: Path, name: str) -> tuple[Path, Path]:
    from benchlib.report import markdown, write_files

    return write_files(report, markdown(report), out, name)


def merge(paths: list[str]) -> dict[str, Any]:
    """One report from several runs: results and errors concatenated, targets recomputed; settings and
    environment from the first file, with the union of sections and archs."""
    from benchlib.report import targets

    reports = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"error: --merge {path}: {error}") from None
        if data.get("schema") != SCHEMA:
            raise SystemExit(f"error: --merge {path}: not a {SCHEMA} file (schema {data.get('schema')!r})")
        reports.append(data)
    merged = dict(reports[0])
    merged["results"] = {}
    merged["errors"] = []
    merged["models"] = {}
    merged["settings"] = dict(reports[0]["settings"])
    merged["settings"]["sections"] = list(
        dict.fromkeys(s for r in reports for s in r["settings"]["sections"])
    )
    merged["settings"]["archs"] = list(dict.fromkeys(a for r in reports for a in r["settings"]["archs"]))
    merged["command"] = " ; ".join(r["command"] for r in reports)
    merged["merged_from"] = [str(p) for p in paths]
    for r in reports:
        for section, rows in r["results"].items():
            merged["results"].setdefault(section, []).extend(rows)
        merged["errors"].extend(r["errors"])
        merged["models"].update(r.get("models", {}))
        merged["matmul"] = merged.get("matmul") or r.get("matmul")
    merged["targets"] = targets(merged["results"], merged["settings"])
    return merged


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python benchmarks/bench.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    if args.merge:
        report = merge(args.merge)
        json_path, md_path = write_report(report, Path(args.out), args.name)
        print(f"wrote {json_path} and {md_path}", file=sys.stderr)
        return 0

    import torch

    settings = resolve_settings(args)
    if settings["threads"]:
        torch.set_num_threads(settings["threads"])
    settings["dtype"] = getattr(torch, settings["dtype_name"])

    from benchlib.bench_context import Bench
    from benchlib.report import environment, targets
    from benchlib.sections import SECTIONS

    from ccq_eval.model.modeling_ccq import prepare_runtime

    prepare_runtime()  # the CCQ model types in transformers' Auto classes

    bench = Bench(settings)
    started = dt.datetime.now(dt.UTC)
    public_settings = {k: v for k, v in settings.items() if k != "dtype"}
    env = environment(bench.device, settings["dtype"])
    out = Path(args.out)

    def snapshot(status: str) -> tuple[Path, Path]:
        report = {
            "schema": SCHEMA,
            "status": status,  # "running" (partial), "complete" or "interrupted"
            "created": started.isoformat(timespec="seconds"),
            "wall_s": round(bench.elapsed(), 1),
            "command": command,
            "environment": env,
            "settings": public_settings,
            "models": bench.model_info(),
            "matmul": bench.matmul,
            "results": bench.results,
            "errors": bench.errors,
            "targets": targets(bench.results, settings),
        }
        return write_report(report, out, args.name)

    # Rewritten after every case: a run cut short by a time limit still leaves its results.
    bench.on_update = lambda: snapshot("running")
    status = "complete"
    try:
        for section in settings["sections"]:
            bench.log(f"section {section}")
            # Failures inside a case are recorded per case; this catches set-up failures of a section.
            bench.attempt(
                section, {"section_setup": section}, lambda section=section: SECTIONS[section](bench)
            )
    except KeyboardInterrupt:  # e.g. `timeout -s INT` before the device call's limit
        status = "interrupted"
        bench.log("interrupted: writing what was measured")
    json_path, md_path = snapshot(status)
    bench.log(f"wrote {json_path} and {md_path} ({status}, {len(bench.errors)} failed case(s))")
    if status == "interrupted":
        return 130
    return 1 if (args.fail_on_error and bench.errors) else 0


if __name__ == "__main__":
    sys.exit(main())
