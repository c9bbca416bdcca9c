#!/usr/bin/env python3
"""The zero-shot suite's scoring speed: the ccq adapter against lm-eval's stock HFLM on the same model and
the same requests, those lm-eval's own task configs build from the suite's fixtures
(tests/fixtures/zeroshot, through ccq_eval.harness.zeroshot): every loglikelihood request (multiple choice,
lambada) and wikitext's rolling windows.

  python benchmarks/zeroshot_cpu.py                      # tiny-transformer on the CPU, float32
  python benchmarks/zeroshot_cpu.py --model tiny-gla --name zeroshot-fixtures-gla
  python benchmarks/zeroshot_cpu.py --model 340m-gla --device cuda --dtype bfloat16 --out OUT --name zs-340m

Each repeat times every scorer once on the whole request set, the scorers in turn, so that a busy machine
slows all of them alike; the report gives each scorer's median over the repeats and the ratios to stock
HFLM (batch size 1, its default) from the same run. HFLM gets add_bos_token=False for a tokenizer without a
BOS token (the embedded models' ByT5 appends EOS when asked for special tokens), as the parity tests do.
Writes <out>/<name>.json and <out>/<name>.md. Not a test: the numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCHEMA = "ccq-eval-zeroshot-bench/1"
FIXTURES = REPO / "tests" / "fixtures" / "zeroshot"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-transformer",
                   help="a registered model or checkpoint folder, or 340m-gla / 340m-gated_deltanet (random init)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (the development machine: 2 cores)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--copies", type=int, default=1, help="score the fixtures' requests this many times per call")
    p.add_argument("--hflm-batch-sizes", default="1,16", help="HFLM batch sizes; the first is the ratios' base")
    p.add_argument("--out", default=str(HERE / "results" / "cpu"))
    p.add_argument("--name", default="zeroshot-fixtures")
    return p.parse_args(argv)


def suite_requests(copies: int) -> dict[str, list]:
    """Request type -> the suite's lm-eval Instances (built by lm-eval from its own configs), `copies` times:
    copy k's texts begin with "k. ", so that every copy's documents are distinct, as a real dataset's are
    (a copy of a document would share its context with the original)."""
    from ccq_eval.harness import zeroshot
    from ccq_eval.harness.task_registry import make_task_manager

    loaded = zeroshot.load_tasks(make_task_manager(), list(zeroshot.ZEROSHOT_TASKS), FIXTURES)
    by_type: dict[str, list] = {"loglikelihood": [], "loglikelihood_rolling": []}
    for task in loaded["tasks"].values():
        task.set_config(key="num_fewshot", value=0)
        task.build_all_requests(rank=0, world_size=1)
        for instance in task.instances:
            by_type[instance.request_type].append(instance)
    return {kind: [_copy(request, k) for k in range(copies) for request in requests]
            for kind, requests in by_type.items()}


def _copy(request: Any, k: int) -> Any:
    """The request with its text (its context, or the whole text of a rolling request) prefixed by "k. "."""
    from lm_eval.api.instance import Instance

    if k == 0:
        return request
    args = (f"{k}. {request.args[0]}", *request.args[1:])
    return Instance(request.request_type, request.doc, args, request.idx,
                    (request.task_name, request.doc_id, request.repeats))


def load(model_name: str, device: str, dtype: str):
    """(model, tokenizer): a registered model / folder, or fla's 340M shape with random weights (CCQ off)."""
    import torch

    if model_name.startswith("340m-"):
        from benchlib import workload

        tokenizer, _ = workload.load_tokenizer("mistral")
        arch = model_name.removeprefix("340m-")
        model = workload.build_model(arch, workload.SHAPES_340M[arch], vocab_size=len(tokenizer),
                                     device=torch.device(device), dtype=getattr(torch, dtype))
        workload.set_ccq(model, False)
        return model, tokenizer
    from ccq_eval.model.loading import load_model

    return load_model(model_name, device=device, dtype=dtype)


def scorers(model: Any, tokenizer: Any, hflm_batches: list[int]) -> dict[str, Any]:
    """Name -> an lm-eval LM: stock HFLM at each batch size, the adapter as `ccq-eval run` builds it, and the
    adapter with the other share_contexts setting (by default on on the CPU, off on CUDA)."""
    from lm_eval.models.huggingface import HFLM

    from ccq_eval.harness.adapter import CCQEvalLM

    hflm_args: dict[str, Any] = {} if tokenizer.bos_token_id is not None else {"add_bos_token": False}
    built: dict[str, Any] = {f"hflm batch {b}": HFLM(pretrained=model, tokenizer=tokenizer, backend="causal",
                                                     batch_size=b, **hflm_args) for b in hflm_batches}
    window = built[f"hflm batch {hflm_batches[0]}"].max_length  # the windows of wikitext, for both
    default = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=window)
    shared = default.scorer.share_contexts
    built[f"ccq (default: contexts {'' if shared else 'not '}shared)"] = default
    built[f"ccq, contexts {'not ' if shared else ''}shared"] = CCQEvalLM(model=model, tokenizer=tokenizer,
                                                                         max_length=window, share_contexts=not shared)
    return built


def score_all(lm: Any, requests: dict[str, list], device: str) -> tuple[list[float], list[float], list[float]]:
    """(loglikelihoods, rolling log-likelihoods, seconds of each of the two calls)."""
    import torch

    seconds = []
    scores = []
    for kind in ("loglikelihood", "loglikelihood_rolling"):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        answers = getattr(lm, kind)(requests[kind], disable_tqdm=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        scores.append([float(a[0]) if kind == "loglikelihood" else float(a) for a in answers])
    return scores[0], scores[1], seconds


def measure(built: dict[str, Any], requests: dict[str, list], repeats: int, device: str) -> dict[str, Any]:
    """Seconds of each scorer per repeat, of both calls and each, after a first pass whose seconds (kernels'
    compilation and autotuning, CUDA graph captures) are kept apart; and each scorer's scores."""
    seconds: dict[str, list[list[float]]] = {name: [] for name in built}
    first = {name: score_all(lm, requests, device) for name, lm in built.items()}
    for _ in range(repeats):
        for name, lm in built.items():
            seconds[name].append(score_all(lm, requests, device)[2])
    return {"seconds": seconds, "scores": {name: f[:2] for name, f in first.items()},
            "first_pass_s": {name: sum(f[2]) for name, f in first.items()}}


def report(args: argparse.Namespace, requests: dict[str, list], measured: dict[str, Any]) -> dict[str, Any]:
    import torch
    from benchlib.report import environment

    names = list(measured["seconds"])
    base = names[0]
    base_scores = measured["scores"][base]
    base_median = statistics.median(sum(times) for times in measured["seconds"][base])
    rows = []
    for name in names:
        times = measured["seconds"][name]
        median = statistics.median(sum(pair) for pair in times)
        likelihoods, rolling = measured["scores"][name]
        rows.append({
            "scorer": name, "median_s": median, "seconds": times,
            "median_loglikelihood_s": statistics.median(pair[0] for pair in times),
            "median_rolling_s": statistics.median(pair[1] for pair in times),
            "first_pass_s": measured["first_pass_s"][name],
            "speedup_vs_base": base_median / median,
            "max_abs_diff_loglikelihood_vs_base": max(abs(a - b) for a, b in zip(likelihoods, base_scores[0],
                                                                                 strict=True)),
            "max_abs_diff_rolling_vs_base": max(abs(a - b) for a, b in zip(rolling, base_scores[1], strict=True)),
        })
    settings = dict(vars(args))
    out = Path(args.out).resolve()
    settings["out"] = str(out.relative_to(REPO)) if out.is_relative_to(REPO) else "OUT"  # no machine's paths
    return {"schema": SCHEMA, "settings": settings, "base": base,
            "requests": {kind: len(items) for kind, items in requests.items()},
            "environment": environment(torch.device(args.device), getattr(torch, args.dtype)) | {
                "load_average": os.getloadavg()},
            "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    env, settings = result["environment"], result["settings"]
    lines = [f"# Zero-shot suite scoring: {settings['model']} on {env['device_name']} ({settings['dtype']})", "",
             f"Command: `{' '.join(['python', 'benchmarks/zeroshot_cpu.py', *sys.argv[1:]])}`", "",
             f"Requests: {result['requests']['loglikelihood']} loglikelihood (multiple choice, lambada), "
             f"{result['requests']['loglikelihood_rolling']} wikitext texts; lm-eval's configs on "
             f"tests/fixtures/zeroshot (x{settings['copies']}, every copy's texts distinct). Median of "
             f"{settings['repeats']} timed passes (a loglikelihood and a loglikelihood_rolling call) each, "
             "scorers in turn; "
             f"torch threads {env['torch_threads']}, load average at the end "
             f"{', '.join(f'{x:.1f}' for x in env['load_average'])}; commit {env['git']['commit']}"
             f"{' (dirty)' if env['git']['dirty'] else ''}.", "",
             f"| scorer | median s | loglikelihood s | wikitext s | speed-up vs {result['base']} | first pass s | "
             "max abs diff, loglikelihood | max abs diff, wikitext |", "|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['scorer']} | {row['median_s']:.3f} | {row['median_loglikelihood_s']:.3f} | "
                     f"{row['median_rolling_s']:.3f} | {row['speedup_vs_base']:.2f} | {row['first_pass_s']:.2f} | "
                     f"{row['max_abs_diff_loglikelihood_vs_base']:.2e} | {row['max_abs_diff_rolling_vs_base']:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from benchlib.report import write_files

    torch.set_num_threads(args.threads)
    requests = suite_requests(args.copies)
    model, tokenizer = load(args.model, args.device, args.dtype)
    built = scorers(model, tokenizer, [int(b) for b in args.hflm_batch_sizes.split(",")])
    result = report(args, requests, measure(built, requests, args.repeats, args.device))
    json_path, md_path = write_files(result, markdown(result), Path(args.out), args.name)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
