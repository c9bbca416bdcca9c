"""Do the forward paths of one random-init fla model agree at the last position of a long prompt?

Greedy generation ends a prompt on different kernels depending on the batch: batch 1 prefills the whole
prompt in one forward (the chunk kernels), a batched generate of prompts of different lengths prefills up
to the shortest one and feeds each row's last tokens through the cached one-token step (the recurrent
kernels; on CUDA replayed from a CUDA graph). This compares, for the bench's 340M shapes
(benchlib.workload.SHAPES_340M) on random tokens, the last position's logits of
  - one forward without a cache,
  - one forward with a cache (what a prefill runs),
  - a forward over all but the last TAIL tokens, then TAIL cached one-token steps (eager, and on CUDA
    also replayed from ccq-eval's decode graph),
against a float32 copy of the same weights (`--reference float32`, the default: the bench dtype's weights
widened exactly, so the model the paths compute, without their rounding; where fla's chunk kernel refuses
float32 on CUDA, that layer runs its fused_recurrent mode, exact in float32) or against the first path
(`--reference none`). Each difference is given in ulps of the bench dtype's logit scale (its eps times
max |reference logit|), from the reference and from the first path, with the rank the reference gives
the path's argmax, and the reference's own top-2 gap in the same unit: a path whose difference exceeds
that gap may pick another token. Used to tell rounding from a path that computes something else, e.g.

    python benchmarks/decode_paths.py --arch delta_net --length 8192 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from benchlib import workload
from benchlib.generation_sections import generation_path_logits


def last_logits_by_path(model: torch.nn.Module, ids: torch.Tensor, tail: int,
                        graphed: bool = False) -> dict[str, torch.Tensor]:
    """The last position's float32 logits of each forward path (module docstring); `graphed` adds the
    tail replayed from ccq-eval's CUDA decode graph (CUDA only)."""
    prompt, fed = ids[0, :-tail].tolist(), ids[0, -tail:].tolist()
    with torch.no_grad():
        paths = {"no cache": model(input_ids=ids, use_cache=False).logits[0, -1].float(),
                 "cache": model(input_ids=ids, use_cache=True).logits[0, -1].float(),
                 f"prefill + {tail} steps": generation_path_logits(model, prompt, fed, ids.device)[-1].float()}
        if graphed:
            from ccq_eval.harness.model_runtime import ModelRuntime
            from ccq_eval.model.cuda_graphs.decode import GraphedDecodeStep

            runtime = ModelRuntime(model)
            prefilled = model(input_ids=ids[:, :-tail], use_cache=True).past_key_values
            step = GraphedDecodeStep(runtime.backbone, runtime.lm_head, prefilled, batch=1)
            for token in fed:
                logits = step(torch.tensor([token], device=ids.device))
            paths[f"prefill + {tail} graphed steps"] = logits[0].float()
    return paths


def float32_reference(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The last position's logits of a float32 copy of `model` (TF32 off), without a cache. On CUDA, a
    layer whose chunk kernel refuses float32 (families.CUDA_HALF_ONLY_LAYERS) runs in fused_recurrent mode."""
    from ccq_eval.model.families import CUDA_HALF_ONLY_LAYERS

    exact = copy.deepcopy(model).float()
    if ids.is_cuda:
        for module in exact.modules():  # fla's class or fla_cpu's subclass of it
            if any(f"{cls.__module__}:{cls.__name__}" in CUDA_HALF_ONLY_LAYERS for cls in type(module).__mro__):
                module.mode = "fused_recurrent"
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            return exact(input_ids=ids, use_cache=False).logits[0, -1].float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        del exact


def report(paths: dict[str, torch.Tensor], reference: torch.Tensor, dtype: torch.dtype) -> list[str]:
    """One line per path: its largest difference from `reference` and the rank `reference` gives its argmax."""
    ulp = torch.finfo(dtype).eps * reference.abs().max().item()
    top2 = reference.topk(2).values
    first_name, first = next(iter(paths.items()))
    lines = [f"reference top-2 gap {(top2[0] - top2[1]).item() / ulp:.1f} ulps"]
    for name, logits in paths.items():
        rank = int((reference > reference[logits.argmax()]).sum())
        lines.append(f"  {name}: max difference {(logits - reference).abs().max().item() / ulp:.1f} ulps "
                     f"({(logits - first).abs().max().item() / ulp:.1f} from {first_name}); "
                     f"its argmax is the reference's rank {rank}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="delta_net", choices=sorted(workload.SHAPES_340M))
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--tail", type=int, default=8, help="tokens fed as one-token steps at the end")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--reference", default="float32", choices=["float32", "none"],
                        help="float32: a float32 copy of the weights; none: the forward without a cache")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.tail < args.length:
        parser.error(f"--tail {args.tail} must lie between 0 and --length {args.length}")
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    ids = torch.randint(3, 32000, (1, args.length), generator=torch.Generator().manual_seed(args.seed)).to(device)
    model = workload.build_fla_model(args.arch, workload.SHAPES_340M[args.arch], 32000, device, dtype, args.seed)
    started = time.time()
    reference = float32_reference(model, ids) if args.reference == "float32" else None
    paths = last_logits_by_path(model, ids, args.tail, graphed=device.type == "cuda")
    what = "a float32 copy of the weights, no cache"
    if reference is None:
        reference, what = paths["no cache"], "the forward without a cache"
    print(f"{args.arch}, {args.length} tokens, {args.dtype} on {device} ({time.time() - started:.1f} s); "
          f"reference: {what}, logit scale {reference.abs().max().item():.3f}")
    print("\n".join(report(paths, reference, dtype)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
