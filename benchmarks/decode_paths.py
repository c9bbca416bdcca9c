"""Do the forward paths of one random-init fla model agree at the last position of a long prompt?

Greedy generation ends a prompt on different kernels depending on the batch: batch 1 prefills the whole
prompt in one forward (the chunk kernels), a batched generate of prompts of different lengths prefills up
to the shortest one and feeds each row's last tokens through the cached one-token step (the recurrent
kernels). This compares, for the bench's 340M shapes (benchlib.workload.SHAPES_340M) on random tokens,
the last position's logits of
  - one forward without a cache (the reference),
  - one forward with a cache (what a prefill runs),
  - a forward over all but the last TAIL tokens, then TAIL cached one-token steps,
as the largest difference in ulps of the logit scale (eps of the dtype times max |logit|) and whether the
argmax agrees. Used to tell rounding from a path that computes something else, e.g.

    python benchmarks/decode_paths.py --arch delta_net --length 8192 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch
from benchlib import workload


def last_logits_by_path(model: torch.nn.Module, ids: torch.Tensor, tail: int) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        paths = {"no cache": model(input_ids=ids, use_cache=False).logits[0, -1].float(),
                 "cache": model(input_ids=ids, use_cache=True).logits[0, -1].float()}
        out = model(input_ids=ids[:, :-tail], use_cache=True)
        for i in range(ids.shape[1] - tail, ids.shape[1]):
            out = model(input_ids=ids[:, i:i + 1], past_key_values=out.past_key_values, use_cache=True)
        paths[f"prefill + {tail} steps"] = out.logits[0, -1].float()
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="delta_net", choices=sorted(workload.SHAPES_340M))
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--tail", type=int, default=8, help="tokens fed as one-token steps at the end")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.tail < args.length:
        parser.error(f"--tail {args.tail} must lie between 0 and --length {args.length}")
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    ids = torch.randint(3, 32000, (1, args.length), generator=torch.Generator().manual_seed(args.seed)).to(device)
    model = workload.build_fla_model(args.arch, workload.SHAPES_340M[args.arch], 32000, device, dtype, args.seed)
    started = time.time()
    paths = last_logits_by_path(model, ids, args.tail)
    reference = paths.pop("no cache")
    ulp = torch.finfo(dtype).eps * reference.abs().max().item()
    print(f"{args.arch}, {args.length} tokens, {args.dtype} on {device} ({time.time() - started:.1f} s); "
          f"reference: the forward without a cache, logit scale {reference.abs().max().item():.3f}")
    for name, logits in paths.items():
        rank = int((reference > reference[logits.argmax()]).sum())
        print(f"  {name}: max difference {(logits - reference).abs().max().item() / ulp:.1f} ulps; "
              f"its argmax is the reference's rank {rank}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
