#!/usr/bin/env python3
"""Data-parallel S-NIAH evaluation through lm-eval (issue 6, "several GPUs"): the same ccq_s_niah_1
samples with the ccq adapter in one process, then in N processes (torchrun; the adapter sets up
accelerate when WORLD_SIZE > 1 and lm-eval splits the documents by rank), and a comparison of the
per-sample generated text and the throughput.

  python benchmarks/dataparallel.py --out DIR --name dp1
  torchrun --standalone --nproc_per_node 2 benchmarks/dataparallel.py --out DIR --name dp2
  python benchmarks/dataparallel.py --compare DIR/dp1.json DIR/dp2.json --out DIR --name dp

Every rank builds the same random-init model from the same seed (benchlib.workload.build_model), so
the processes evaluate identical weights without loading a checkpoint. --smoke: tiny shapes on CPU
(gloo) to check the wiring.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SCHEMA = "ccq-eval-dataparallel/1"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, 1 thread per process")
    p.add_argument("--arch", default="gla", choices=("gla", "gated_deltanet"))
    p.add_argument("--ccq", default="off", choices=("off", "on"))
    p.add_argument("--length", type=int, help="S-NIAH length (default 8192; smoke 1024)")
    p.add_argument(
        "--samples",
        type=int,
        help="number of samples (needle depths spread over 0..100%%; default 16, smoke 4)",
    )
    p.add_argument("--dtype", default=None, help="bf16 (default on CUDA) or fp32")
    p.add_argument("--tokenizer", default="mistral", help="mistral (32K fixture), byt5, or a folder")
    p.add_argument("--out", default="results/_scratch/bench")
    p.add_argument("--name", default="dataparallel")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("ONE_JSON", "MANY_JSON"),
        help="compare a 1-process and an N-process run (no evaluation)",
    )
    return p.parse_args(argv)


def _device_and_dtype(args: argparse.Namespace, local_rank: int):
    """This rank's device (its own GPU under torchrun, the CPU with --smoke or without CUDA) and the
    model dtype (--dtype, else bf16 on CUDA and fp32 on the CPU)."""
    import torch

    on_cuda = torch.cuda.is_available() and not args.smoke
    if args.smoke:
        torch.set_num_threads(1)
    if on_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device(f"cuda:{local_rank}" if on_cuda else "cpu")
    dtype = {
        "bf16": torch.bfloat16,
        "fp32": torch.float32,
        None: torch.bfloat16 if on_cuda else torch.float32,
    }[args.dtype]
    return device, dtype


def _needle_depths(samples: int) -> list[int]:
    """One needle depth per sample, spread evenly over 0..100%; exits when they would repeat."""
    depths = [round(100 * i / (samples - 1)) for i in range(samples)] if samples > 1 else [50]
    if len(set(depths)) != samples:
        raise SystemExit(f"error: --samples {samples}: at most 101 distinct needle depths")
    return depths


def _build_adapter(args: argparse.Namespace, device, dtype, length: int):
    """The ccq adapter over the random-init model of --arch (CCQ per --ccq), and the tokenizer's spec."""
    from benchlib import workload

    from ccq_eval.model.modeling_ccq import prepare_runtime

    prepare_runtime()  # the CCQ model types in transformers' Auto classes
    from ccq_eval.harness.adapter import CCQEvalLM

    tokenizer, spec = workload.load_tokenizer(args.tokenizer)
    shapes = workload.SHAPES_SMOKE if args.smoke else workload.SHAPES_340M
    model = workload.build_model(args.arch, shapes[args.arch], len(tokenizer), device, dtype)
    workload.set_ccq(model, args.ccq == "on")
    lm = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=length, batch_size=1, device=str(device))
    return lm, spec


def _warm_up(lm, spec, length: int) -> None:
    """One generation on every rank (compilation for this length) with a prompt of the evaluated
    length, then a barrier so that the ranks start the timed evaluation together."""
    from benchlib import workload
    from lm_eval.api.instance import Instance

    utils = workload.s_niah_utils()
    doc = workload.sniah_docs(spec, [length], depths=[50], seed=7)[0]
    gen_kwargs = {"until": [], "do_sample": False, "max_gen_toks": utils.GENERATION_BUDGET}
    lm.generate_until(
        [Instance("generate_until", doc, (utils.doc_to_text(doc), gen_kwargs), 0)], disable_tqdm=True
    )
    lm.barrier()


def _count_generate_seconds(lm, device) -> list[float]:
    """Wraps lm.generate_until so that it adds its wall time (the GPU work synchronised) to the one
    element of the returned list: the time this rank spends generating, the parallel part (building
    the docs is repeated on every rank)."""
    import torch

    generate_seconds = [0.0]
    generate = lm.generate_until

    def timed_generate(requests, disable_tqdm=False):
        begin = time.perf_counter()
        try:
            return generate(requests, disable_tqdm=disable_tqdm)
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            generate_seconds[0] += time.perf_counter() - begin

    lm.generate_until = timed_generate
    return generate_seconds


def _write_report(args: argparse.Namespace, out: dict, world: int, device, dtype, length: int,
                  seconds: float, per_rank: list[float]) -> None:
    """<out>/<name>.json: the run's settings, throughput and the generated text of every sample."""
    import torch

    rows = sorted(out["samples"]["ccq_s_niah_1"], key=lambda r: r["doc_id"])
    report = {
        "schema": SCHEMA,
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "arch": args.arch,
        "ccq": args.ccq == "on",
        "length": length,
        "samples": len(rows),
        "seconds": seconds,  # the whole simple_evaluate call, doc building included
        "generate_seconds_per_rank": per_rank,
        "generate_wall_s": max(per_rank),  # the slowest rank bounds the parallel part
        "samples_per_s": len(rows) / max(per_rank),
        "acc": out["results"]["ccq_s_niah_1"].get("acc,none"),
        "per_sample": [
            {"doc_id": r["doc_id"], "depth": r["doc"]["depth"], "text": r["resps"][0][0]} for r in rows
        ],
    }
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(
        f"world_size {world}: {len(rows)} samples in {seconds:.2f} s -> {path / args.name}.json",
        file=sys.stderr,
    )


def evaluate(args: argparse.Namespace) -> int:
    """ccq_s_niah_1 through simple_evaluate on this process's rank; rank 0 writes the report."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device, dtype = _device_and_dtype(args, int(os.environ.get("LOCAL_RANK", "0")))
    length = args.length or (1024 if args.smoke else 8192)
    samples = args.samples or (4 if args.smoke else 16)
    depths = _needle_depths(samples)

    from lm_eval import simple_evaluate

    lm, spec = _build_adapter(args, device, dtype, length)
    from ccq_eval.harness.task_registry import make_task_manager

    _warm_up(lm, spec, length)
    generate_seconds = _count_generate_seconds(lm, device)
    metadata = {"tokenizer": spec, "lengths": [length], "depths": depths, "samples_per_cell": 1}
    start = time.perf_counter()
    out = simple_evaluate(
        model=lm,
        tasks=["ccq_s_niah_1"],
        task_manager=make_task_manager(metadata),
        bootstrap_iters=0,
        log_samples=True,
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    per_rank = [generate_seconds[0]]
    if world > 1:
        per_rank = [None] * world
        torch.distributed.all_gather_object(per_rank, generate_seconds[0])
    if lm.rank != 0:
        return 0
    _write_report(args, out, world, device, dtype, length, seconds, per_rank)
    return 0


def compare(args: argparse.Namespace) -> int:
    runs = []
    for name in args.compare:
        data = json.loads(Path(name).read_text(encoding="utf-8"))
        if data.get("schema") != SCHEMA:
            raise SystemExit(f"error: {name} is not a {SCHEMA} file")
        runs.append(data)
    one, many = runs
    texts_one = {r["doc_id"]: r["text"] for r in one["per_sample"]}
    texts_many = {r["doc_id"]: r["text"] for r in many["per_sample"]}
    same = texts_one == texts_many
    speedup = many["samples_per_s"] / one["samples_per_s"]
    summary = {
        "schema": SCHEMA + "/compare",
        "world_sizes": [one["world_size"], many["world_size"]],
        "samples": [one["samples"], many["samples"]],
        "same_per_sample_text": same,
        "n_differing": sum(texts_one.get(k) != texts_many.get(k) for k in set(texts_one) | set(texts_many)),
        "throughput_ratio": speedup,
        "targets": {"same results": same, "throughput >= 1.8x": speedup >= 1.8},
        "runs": args.compare,
    }
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{args.name}.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    md = (
        "| processes | samples | generate wall s | samples/s | simple_evaluate s |\n|---|---|---|---|---|\n"
        + "".join(
            f"| {r['world_size']} | {r['samples']} | {r['generate_wall_s']:.2f} | {r['samples_per_s']:.3f} "
            f"| {r['seconds']:.2f} |\n"
            for r in (one, many)
        )
        + "\n"
        f"{one['arch']} ccq={one['ccq']} S-NIAH-1 at {one['length']} on {one['device']} ({one['dtype']}): "
        f"throughput x{speedup:.2f}, per-sample text {'identical' if same else 'DIFFERENT'} "
        f"({summary['n_differing']} differ).\n"
    )
    (path / f"{args.name}.md").write_text(md, encoding="utf-8")
    print(md, end="")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return compare(args) if args.compare else evaluate(args)


if __name__ == "__main__":
    sys.exit(main())
