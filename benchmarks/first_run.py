#!/usr/bin/env python3
"""A user's first `ccq-eval run` on a fresh machine (issue 19, part 3): the wall time of S-NIAH-1 at 8K,
10 samples, end to end (process start, loading, triton's compilation and autotuning, generation,
tables), as someone meets it who installs ccq-eval and runs it once.

  python benchmarks/first_run.py --out DIR              # GPU: GLA 340M shape, CCQ on, random weights
  python benchmarks/first_run.py --arch gated_deltanet --out DIR
  python benchmarks/first_run.py --smoke --out DIR      # CPU, tiny shape: checks the tooling

It writes a checkpoint folder (random-init weights in fla's 340M shape, benchlib/workload.py, with the
32K Mistral tokenizer fixture) to DIR/checkpoint, then runs `ccq-eval run -m DIR/checkpoint -t s-niah-1
--lengths 8k --depths 0,25,50,75,100 --samples-per-cell 2` in a new process twice: "cold" with an empty
TRITON_CACHE_DIR (what a fresh machine has; ccq-eval copies its shipped autotune winners into it), then
"warm" with the cache the first run filled. No other flag: the run gets ccq-eval's defaults (device,
dtype, CUDA graphs, batch size). Writes DIR/first_run.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCHEMA = "ccq-eval-first-run/1"
TARGET_SECONDS = 180  # issue 19: a fresh machine's first S-NIAH-1 run at 8K, 10 samples, under 3 minutes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU at 1K, 2 samples")
    p.add_argument("--arch", default="gla", choices=("gla", "gated_deltanet"))
    p.add_argument("--ccq", default="on", choices=("off", "on"))
    p.add_argument("--out", required=True, help="folder for the checkpoint, the runs and first_run.json")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per run before it is stopped")
    return p.parse_args(argv)


def write_checkpoint(folder: Path, arch: str, ccq: bool, smoke: bool) -> int:
    """A random-init checkpoint folder as a user's would be (safetensors, config, tokenizer); returns
    the parameter count."""
    import torch
    from benchlib import workload

    tokenizer, _ = workload.load_tokenizer("mistral")
    shape = (workload.SHAPES_SMOKE if smoke else workload.SHAPES_340M)[arch]
    model = workload.build_model(arch, shape, vocab_size=len(tokenizer), device=torch.device("cpu"),
                                 dtype=torch.float32)
    model.config.ccq = ccq
    model.config.max_position_embeddings = 8192
    model.to(torch.float32 if smoke else torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return workload.parameter_count(model)


def timed_run(checkpoint: Path, out: Path, cache: Path, smoke: bool, timeout: int) -> dict:
    """One `ccq-eval run` in a new process with `cache` as triton's cache: wall seconds and outcome."""
    command = [sys.executable, "-m", "ccq_eval", "run", "-m", str(checkpoint), "-t", "s-niah-1",
               "--lengths", "1k" if smoke else "8k", "--depths", "0,100" if smoke else "0,25,50,75,100",
               "--samples-per-cell", "1" if smoke else "2", "-o", str(out)]
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if smoke:
        env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        returncode, tail = done.returncode, (done.stdout + done.stderr)[-2000:]
    except subprocess.TimeoutExpired as expired:
        returncode, tail = None, f"stopped after {timeout} s: {str(expired.stderr or '')[-1500:]}"
    seconds = time.perf_counter() - start
    samples = sum(1 for path in out.rglob("samples_ccq_s_niah_1.jsonl") for _ in path.open(encoding="utf-8"))
    return {"command": command, "seconds": seconds, "returncode": returncode, "samples": samples,
            "cache_files": sum(1 for p in cache.rglob("*") if p.is_file()), "output_tail": tail}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    checkpoint = out / "checkpoint"
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: --out {out} is not empty; give a new folder (the cold run needs an empty cache)")
    out.mkdir(parents=True, exist_ok=True)
    parameters = write_checkpoint(checkpoint, args.arch, args.ccq == "on", args.smoke)
    cache = out / "triton-cache"
    cache.mkdir()
    runs = {}
    for label in ("cold", "warm"):
        runs[label] = timed_run(checkpoint, out / f"run-{label}", cache, args.smoke, args.timeout)
        print(f"{label}: {runs[label]['seconds']:.1f} s, rc {runs[label]['returncode']}, "
              f"{runs[label]['samples']} samples", file=sys.stderr)

    import torch

    report = {
        "schema": SCHEMA,
        "arch": args.arch,
        "ccq": args.ccq == "on",
        "smoke": args.smoke,
        "parameters": parameters,
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "target_seconds": TARGET_SECONDS,
        "runs": runs,
        "cold_under_target": runs["cold"]["returncode"] == 0 and runs["cold"]["seconds"] < TARGET_SECONDS,
    }
    (out / "first_run.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0 if all(run["returncode"] == 0 for run in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
