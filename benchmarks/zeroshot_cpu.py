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
    """Request type -> the suite's lm-eval Instances (built by lm-eval from its own configs), `copies` times."""
    from ccq_eval.harness import zeroshot
    from ccq_eval.harness.task_registry import make_task_manager

    loaded = zeroshot.load_tasks(make_task_manager(), list(zeroshot.ZEROSHOT_TASKS), FIXTURES)
    by_type: dict[str, list] = {"loglikelihood": [], "loglikelihood_rolling": []}
    for task in loaded["tasks"].values():
        task.set_config(key="num_fewshot", value=0)
        task.build_all_requests(rank=0, world_size=1)
        for instance in task.instances:
            by_type[instance.request_type].append(instance)
    return {kind: requests * copies for kind, requests in by_type.items()}


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
    """Name -> an lm-eval LM: stock HFLM at each batch size, the adapter as `ccq-eval run` builds it, and
    the adapter without shared contexts."""
    from lm_eval.models.huggingface import HFLM

    from ccq_eval.harness.adapter import CCQEvalLM

    hflm_args: dict[str, Any] = {} if tokenizer.bos_token_id is not None else {"add_bos_token": False}
    built: dict[str, Any] = {f"hflm batch {b}": HFLM(pretrained=model, tokenizer=tokenizer, backend="causal",
                                                     batch_size=b, **hflm_args) for b in hflm_batches}
    window = built[f"hflm batch {hflm_batches[0]}"].max_length  # the windows of wikitext, for both
    built["ccq (default)"] = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=window)
    built["ccq, contexts not shared"] = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=window,
                                                  share_contexts=False)
    return built


def score_all(lm: Any, requests: dict[str, list]) -> tuple[list[float], list[float]]:
    """(loglikelihoods, rolling log-likelihoods) of every request, each from one call."""
    likelihoods = [float(x[0]) for x in lm.loglikelihood(requests["loglikelihood"], disable_tqdm=True)]
    rolling = [float(x) for x in lm.loglikelihood_rolling(requests["loglikelihood_rolling"], disable_tqdm=True)]
    return likelihoods, rolling


def measure(built: dict[str, Any], requests: dict[str, list], repeats: int, device: str) -> dict[str, Any]:
    """Seconds of each scorer per repeat (after one untimed call each), and its scores."""
    import torch

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    seconds: dict[str, list[float]] = {name: [] for name in built}
    scores = {name: score_all(lm, requests) for name, lm in built.items()}  # warm-up, and the scores
    for _ in range(repeats):
        for name, lm in built.items():
            sync()
            start = time.perf_counter()
            score_all(lm, requests)
            sync()
            seconds[name].append(time.perf_counter() - start)
    return {"seconds": seconds, "scores": scores}


def report(args: argparse.Namespace, requests: dict[str, list], measured: dict[str, Any]) -> dict[str, Any]:
    import torch
    from benchlib.report import environment

    names = list(measured["seconds"])
    base = names[0]
    base_scores = measured["scores"][base]
    rows = []
    for name in names:
        median = statistics.median(measured["seconds"][name])
        likelihoods, rolling = measured["scores"][name]
        rows.append({
            "scorer": name, "median_s": median, "seconds": measured["seconds"][name],
            "speedup_vs_base": statistics.median(measured["seconds"][base]) / median,
            "max_abs_diff_loglikelihood_vs_base": max(abs(a - b) for a, b in zip(likelihoods, base_scores[0],
                                                                                 strict=True)),
            "max_abs_diff_rolling_vs_base": max(abs(a - b) for a, b in zip(rolling, base_scores[1], strict=True)),
        })
    return {"schema": SCHEMA, "settings": vars(args), "base": base,
            "requests": {kind: len(items) for kind, items in requests.items()},
            "environment": environment(torch.device(args.device), getattr(torch, args.dtype)) | {
                "load_average": os.getloadavg()},
            "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    env, settings = result["environment"], result["settings"]
    lines = [f"# Zero-shot suite scoring: {settings['model']} on {env['device_name']} ({settings['dtype']})", "",
             f"Command: `python benchmarks/zeroshot_cpu.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             f"Requests: {result['requests']['loglikelihood']} loglikelihood (multiple choice, lambada), "
             f"{result['requests']['loglikelihood_rolling']} wikitext texts; lm-eval's configs on "
             f"tests/fixtures/zeroshot, x{settings['copies']}. Median of {settings['repeats']} timed calls "
             f"each, scorers in turn; torch threads {env['torch_threads']}, load average at the end "
             f"{', '.join(f'{x:.1f}' for x in env['load_average'])}; commit {env['git']['commit']}"
             f"{' (dirty)' if env['git']['dirty'] else ''}.", "",
             f"| scorer | median s | speed-up vs {result['base']} | max abs diff, loglikelihood | "
             "max abs diff, wikitext |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['scorer']} | {row['median_s']:.3f} | {row['speedup_vs_base']:.2f} | "
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
