"""Where one model call spends its time: torch.profiler tables for a 340M-shape forward (or training
step), CCQ off and on, on the same weights; plus the host (enqueue) time of a call against its GPU time.

    python benchmarks/profile_forward.py --arch gla --T 4096 [--mode train] [--rows 25]
    python benchmarks/profile_forward.py --arch gla --T 20480 --mode score --docs 4

--mode generate profiles the adapter's greedy generation (CUDA-graph decode, 128 new tokens) after a
prompt of T tokens, and first times its steps: tokenising, the prefill, building the decode graph
(deep copies of the cache, eager warm-up steps, capture) and the graph replays.

--mode score profiles the harness instead: the ccq adapter's loglikelihood_rolling on --docs documents
of T tokens (tokenisation included) against bare forwards of the same token ids, and first splits the
difference into steps (each timed over --docs documents): the bare forward, the same with the
recurrent cache returned, the adapter's scoring pass on token ids (LM head in slices + log-softmax,
with each log-softmax implementation), loglikelihood_rolling on pre-tokenised text, and the whole call.

A call whose host time is close to its wall time is bound by Python and kernel launches, not by the
GPU. Prints to stdout; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

import torch  # noqa: E402
from benchlib import workload  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="gla", choices=workload.ARCHS)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--mode", default="forward", choices=("forward", "train", "score", "generate"))
    p.add_argument("--docs", type=int, default=4, help="score mode: documents per call")
    p.add_argument("--rows", type=int, default=25, help="rows per profiler table")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_forward.py needs a CUDA GPU")
    from ccq_eval.model.modeling_ccq import prepare_runtime

    prepare_runtime()  # the CCQ model types in transformers' Auto classes

    device = torch.device("cuda")
    model = workload.build_model(args.arch, workload.SHAPES_340M[args.arch], 32000, device, torch.bfloat16)
    tokens = workload.random_tokens(args.batch, args.T, 32000, device)

    if args.mode in ("score", "generate"):  # the adapter on a real document of T tokens
        from lm_eval.api.instance import Instance

        from ccq_eval.harness.adapter import CCQEvalLM

        tokenizer, _ = workload.load_tokenizer("mistral")
        text = workload.long_document(tokenizer, args.T)
    if args.mode == "score":
        tokens = torch.tensor([workload.prefix_ids(tokenizer) + workload.encode(tokenizer, text)], device=device)
        lm = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=args.T, batch_size=1)
        requests = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0,
                             task_name="profile", doc_id=i) for i in range(args.docs)]
    if args.mode == "generate":
        lm = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=args.T + 256, batch_size=1,
                       cuda_graphs=True)
        requests = [Instance(request_type="generate_until", doc={}, idx=0, task_name="profile",
                             arguments=(text, {"until": [], "max_gen_toks": 128, "do_sample": False}))]

    def call():
        if args.mode == "score":
            lm.loglikelihood_rolling(requests, disable_tqdm=True)
        elif args.mode == "generate":
            lm.generate_until(requests, disable_tqdm=True)
        elif args.mode == "train":
            model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
        else:
            with torch.no_grad():
                model(input_ids=tokens, use_cache=False)

    for ccq in (False, True):
        with workload.ccq_mode(model, ccq):
            if args.mode == "score":
                score_steps(model, lm, tokens, requests, ccq)
            if args.mode == "generate":
                generate_steps(lm, text, ccq)
            model.train(args.mode == "train")
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            host, wall = [], []
            for _ in range(5):
                start = time.perf_counter()
                call()
                host.append(time.perf_counter() - start)
                torch.cuda.synchronize()
                wall.append(time.perf_counter() - start)
            host_ms, wall_ms = 1e3 * sorted(host)[2], 1e3 * sorted(wall)[2]
            print(f"\n=== {args.arch} {args.mode} T={args.T} batch={args.batch} ccq={ccq}: "
                  f"median wall {wall_ms:.2f} ms, host (enqueue) {host_ms:.2f} ms")
            if args.mode == "score":
                start = time.perf_counter()
                with torch.no_grad():
                    for _ in range(args.docs):
                        model(input_ids=tokens, use_cache=False)
                torch.cuda.synchronize()
                elapsed_ms = 1e3 * (time.perf_counter() - start)
                print(f"    bare forwards of the same {args.docs} documents: {elapsed_ms:.2f} ms")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            table = prof.key_averages()
            print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
            print(table.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
            model.zero_grad(set_to_none=True)
            model.eval()


def _median_wall_ms(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    wall = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
    return 1e3 * sorted(wall)[repeats // 2]


def generate_steps(lm, text: str, ccq: bool) -> None:
    """Wall time of the steps of the adapter's generate_until (median of 5 after one warm-up)."""
    from ccq_eval.model.cuda_graphs.decode import GraphedDecodeStep

    ids = lm.tok_encode(text)
    input_ids = lm.runtime.tensor([ids])
    _, _, logits, cache = lm.scorer.run(input_ids, len(ids))
    graph = GraphedDecodeStep(lm.runtime.backbone, lm.runtime.lm_head, cache, 1)
    tokens = logits.argmax(-1)

    def replays():
        for _ in range(127):
            graph(tokens)

    steps = [
        ("tokenise the prompt", lambda: lm.tok_encode(text)),
        ("prefill (scorer.run, one slice, cache kept)", lambda: lm.scorer.run(input_ids, len(ids))),
        ("build the decode graph (copies, warm-up, capture)",
         lambda: GraphedDecodeStep(lm.runtime.backbone, lm.runtime.lm_head, cache, 1)),
        ("127 graph replays", replays),
    ]
    print(f"\n=== generate steps, ccq={ccq}: a prompt of {len(ids)} tokens")
    for name, fn in steps:
        print(f"    {name:<50} {_median_wall_ms(fn):8.1f} ms")


def score_steps(model, lm, tokens, requests, ccq: bool) -> None:
    """Wall time of the steps between a bare forward and loglikelihood_rolling, over len(requests)
    documents each (median of 5 after 2 warm-up calls), so the harness overhead has an address."""
    import os
    from unittest import mock

    n = len(requests)
    encoded = {request.args[0]: lm.tok_encode(request.args[0]) for request in requests}

    def with_logprob(kind, fn):
        def call():
            before = os.environ.get("CCQ_EVAL_TOKEN_LOGPROB")
            os.environ["CCQ_EVAL_TOKEN_LOGPROB"] = kind
            try:
                fn()
            finally:  # the later steps run with the setting the process started with
                if before is None:
                    os.environ.pop("CCQ_EVAL_TOKEN_LOGPROB")
                else:
                    os.environ["CCQ_EVAL_TOKEN_LOGPROB"] = before
        return call

    def forwards(use_cache):
        with torch.no_grad():
            for _ in range(n):
                model(input_ids=tokens, use_cache=use_cache)

    def scoring_passes():
        for _ in range(n):
            lm.scorer.run(tokens, 0, to_cpu=False)

    def pretokenised():
        with mock.patch.object(lm.codec, "encode", lambda text: encoded[text]):
            lm.loglikelihood_rolling(requests, disable_tqdm=True)

    steps = [
        ("bare forward (all logits, no cache)", lambda: forwards(False)),
        ("bare forward, cache returned", lambda: forwards(True)),
        ("adapter scorer.run on ids, torch log-softmax", with_logprob("torch", scoring_passes)),
        ("adapter scorer.run on ids, triton log-softmax", with_logprob("triton", scoring_passes)),
        ("loglikelihood_rolling, pre-tokenised", pretokenised),
        ("loglikelihood_rolling, whole call", lambda: lm.loglikelihood_rolling(requests, disable_tqdm=True)),
    ]
    print(f"\n=== score steps, ccq={ccq}: {n} documents of {tokens.shape[1]} tokens per call; CCQ read "
          f"{os.environ.get('CCQ_EVAL_CCQ_KERNEL', 'default')}, "
          f"log-softmax {os.environ.get('CCQ_EVAL_TOKEN_LOGPROB', 'default')}")
    for name, fn in steps:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        wall, host = [], []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            host.append(time.perf_counter() - start)  # when the call returned: its host-side work
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - start)
        median, host_median = sorted(wall)[2], sorted(host)[2]
        print(f"    {name:<45} {1e3 * median:8.1f} ms  ({1e3 * median / n:6.1f} ms per document, "
              f"host {1e3 * host_median / n:6.1f})")


if __name__ == "__main__":
    main()
