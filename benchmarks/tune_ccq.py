"""Side-by-side timings of the fused CCQ forward's choices at the 340M shapes, on one GPU, in one process:
every candidate config of the read kernel, forced one at a time (the autotuner's pick besides), the
state kernel's segment length, and raw against already-unit keys. Each row is the whole
`ccq_order1_forward` (the gate formed in the kernel, bf16): the device time of its kernels, and of the
read kernel alone, per call (torch.profiler over --repeats calls after a warm-up call), and the wall
time of a call (median of CUDA-event timings, the host's enqueue included).

    python benchmarks/tune_ccq.py [--T 20480] [--repeats 20] [--shapes gdn,gla]

For choosing candidates and defaults (ccq_eval/model/kernels/ccq_forward.py): the autotuner times the candidates of a
kernel alone, this the whole forward. Prints to stdout; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import torch  # noqa: E402
import triton  # noqa: E402
from benchlib.timing import measure  # noqa: E402

# (heads, head dim): fla's 340M configs, the key heads CCQ reads (benchlib.workload builds the models).
SHAPES = {"gdn": (6, 256), "gla": (4, 128)}


def _inputs(T: int, H: int, K: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = torch.randn(1, T, H, K, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, T, H, K, device="cuda", generator=g).bfloat16()
    log_gamma = torch.nn.functional.logsigmoid(torch.randn(1, T, H, device="cuda", generator=g) + 4)
    gate = (0.1 * torch.randn(H, K, device="cuda", generator=g), torch.zeros(H, device="cuda"), 4.0)
    return r, k, log_gamma, gate


def _kernel_times(fn, calls: int) -> dict[str, float]:
    """Mean device time per call of each kernel fn launches (us), from torch.profiler over `calls`
    calls: GPU work only. (At these sizes the host's enqueue of one call, about 0.5 ms with the
    autotuners' dispatch, is longer than GLA's kernels, so CUDA events around a call time the host.)"""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", type=int, default=20480)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--shapes", default="gdn,gla", help=f"comma-separated subset of {','.join(SHAPES)}")
    p.add_argument("--segments", default="4,6,8,10,15,20,30", help="segment lengths (chunks) to try")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_ccq.py needs a CUDA GPU")
    from ccq_eval.model.kernels import ccq_chunk_states, ccq_forward

    read = ccq_forward._ccq_read_kernel
    all_read_configs = list(read.configs)
    # The read kernel's candidates and more (a config is forced by making it the only candidate).
    # (SPLIT 4 with WHOLE at d_k = 128 hit an illegal memory access on the H200, triton 3.6: not tried.)
    tried = [triton.Config({"BK": 32, "BV": 64, "SPLIT": split, "WHOLE": whole}, num_warps=warps, num_stages=stages)
             for whole, splits, shapes in ((True, (1, 2), ((8, 2), (8, 1))),
                                           (False, (1, 2, 4), ((8, 2), (8, 3), (4, 2), (4, 3), (4, 4))))
             for split in splits for warps, stages in shapes]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"T = {args.T}, bf16, median of {args.repeats}")
    for name in args.shapes.split(","):
        H, K = SHAPES[name]
        r, k, log_gamma, gate = _inputs(args.T, H, K)

        def forward(raw_keys=True, segment_chunks=None, keys=k):  # timed within this iteration only
            return ccq_forward.ccq_order1_forward(r, keys, log_gamma, None, True, None,  # noqa: B023
                                                 output_final_state=True, raw_keys=raw_keys,
                                                 gate=gate, segment_chunks=segment_chunks)  # noqa: B023

        print(f"\n## {name}: H = {H}, d_k = {K}\n\nkernels of the default call (autotuned), us per call:")
        for kernel, us in sorted(_kernel_times(forward, args.repeats).items(), key=lambda item: -item[1]):
            print(f"  {kernel[:60]:60s} {us:9.1f}")
        print(f"\nautotuner's pick: {getattr(read, 'best_config', None)}\n\n"
              "| variant | kernels us | read kernel us | wall us |\n|---|---|---|---|")

        def row(label, fn):  # printed as it comes: a config that crashes the process ends the table
            kernels = _kernel_times(fn, args.repeats)
            wall = measure(fn, torch.device("cuda"), warmup=args.warmup, repeats=args.repeats).median_ms * 1000
            print(f"| {label} | {sum(kernels.values()):.1f} | {kernels.get('_ccq_read_kernel', 0.0):.1f} | "
                  f"{wall:.1f} |", flush=True)

        row("default (autotuned)", forward)
        NT = triton.cdiv(args.T, ccq_chunk_states.CHUNK)
        auto = ccq_chunk_states.chunks_per_segment(NT, K // ccq_chunk_states.STATE_ROWS * H, r.device)
        for seg in sorted({auto, *(int(s) for s in args.segments.split(","))}):
            row(f"segment {seg} chunks{' (auto)' if seg == auto else ''}", lambda seg=seg: forward(segment_chunks=seg))
        unit = torch.nn.functional.normalize(k.float(), dim=-1).bfloat16()
        row("unit keys given (raw_keys=False)", lambda unit=unit: forward(raw_keys=False, keys=unit))
        row("same unit keys, normalised again (raw_keys=True)", lambda unit=unit: forward(keys=unit))
        for config in tried:
            read.configs, read.cache = [config], {}
            row(f"read {config.kwargs} warps {config.num_warps} stages {config.num_stages}"
                f"{' (a candidate)' if str(config) in map(str, all_read_configs) else ''}", forward)
        read.configs, read.cache = all_read_configs, {}


if __name__ == "__main__":
    main()
