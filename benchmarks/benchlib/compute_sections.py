"""The "model" and "ops" sections: whole-model forward / training steps and single kernels, timed on
random tokens and inputs, CCQ off and on. Each appends rows to bench.results[section]."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchlib import workload
from benchlib.bench_context import Bench
from benchlib.timing import measure


# ------------------------------------------------------------------------------------------ model
def _model_case(
    bench: Bench, model, arch: str, mode: str, T: int, ccq: bool, tokens: torch.Tensor, ceiling: float
) -> dict[str, Any]:
    s = bench.settings

    def forward():
        with torch.no_grad():
            model(input_ids=tokens, use_cache=False)

    def train_step():
        for p in model.parameters():
            p.grad = None
        model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()

    training = mode.startswith("train")
    with workload.ccq_mode(model, ccq):
        model.train(training)
        try:
            call = train_step if training else forward
            if mode.endswith("_graphed"):
                call = _graphed(call, bench.device)
            m = measure(call, bench.device, warmup=s["warmup"], repeats=s["repeats"])
        finally:
            model.eval()
            for p in model.parameters():
                p.grad = None
        # The FLOP model knows GLA's and Gated DeltaNet's mixing only: the other backbones get no MFU.
        flops = workload.forward_flops_per_token(model, ccq) if arch in workload.ARCHS else None
    n_tokens = s["batch"] * T
    step_flops = flops["total"] * n_tokens * (3 if training else 1) if flops else None
    seconds = m.median_ms / 1000.0
    return {
        "arch": arch,
        "mode": mode,
        "T": T,
        "ccq": ccq,
        "batch": s["batch"],
        "tokens": n_tokens,
        **m.as_dict(),
        "tokens_per_s": n_tokens / seconds,
        "flops": step_flops,
        "flops_breakdown_per_token": flops,
        "mfu": step_flops / seconds / ceiling if flops else None,
    }


def _graphed(call: Callable[[], Any], device: torch.device) -> Callable[[], None]:
    """`call` captured in a CUDA graph (after warm-up calls on a side stream, which compile and autotune
    the kernels): its replay runs the same kernels with one launch, the GPU-side cost alone. A training
    step's gradients are allocated inside the graph and rewritten by every replay."""
    if device.type != "cuda":
        raise ValueError("the *_graphed modes need a CUDA device")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def _models(bench: Bench, arch: str) -> dict[bool, torch.nn.Module]:
    """The model each CCQ setting runs: one model for GLA and Gated DeltaNet (CCQ switched in place); for
    the other backbones fla's own model off, and on a CCQ model holding its weights (workload.attach_ccq)."""
    models = {ccq: bench.model(arch) for ccq in bench.ccq_settings()}
    if arch in workload.ATTACH_ARCHS and True in models:
        bench.log(f"attaching CCQ to {arch}'s weights")
        models[True] = workload.attach_ccq(models[True], arch, bench.settings["shapes"][arch], bench.vocab_size)
    return models


def run_model(bench: Bench) -> None:
    """Forward (eval, use_cache=False, logits for every position) and forward + backward (train mode,
    loss on the same tokens) at each T, CCQ off and on, on the same weights; eagerly, or (*_graphed
    modes) replayed from a CUDA graph. GLA and Gated DeltaNet switch CCQ in place in one model; the other
    backbones (workload.ATTACH_ARCHS) time fla's own model against CCQ attached to its weights."""
    s = bench.settings
    ceiling = bench.matmul_ceiling()["flops_per_s"]
    for arch in s["archs"]:
        # Recorded per arch: a backbone that fails to build leaves the others to run.
        models = bench.attempt("model", {"arch": arch, "build": True}, functools.partial(_models, bench, arch))
        if models is None:
            continue
        for mode in s["modes"]:
            for T in s["lengths"]:
                tokens = workload.random_tokens(s["batch"], T, bench.vocab_size, bench.device)
                by_ccq: dict[bool, dict[str, Any]] = {}
                for ccq in models:
                    case = {"arch": arch, "mode": mode, "T": T, "ccq": ccq}
                    bench.log(f"model {case}")
                    row = bench.attempt(
                        "model",
                        case,
                        functools.partial(_model_case, bench, models[ccq], arch, mode, T, ccq, tokens, ceiling),
                    )
                    if row is not None:
                        by_ccq[ccq] = bench.add("model", row)
                if True in by_ccq and False in by_ccq:
                    on, off = by_ccq[True], by_ccq[False]
                    on["ratio_vs_baseline"] = on["median_ms"] / off["median_ms"]
                    on["peak_mem_ratio_vs_baseline"] = (
                        on["peak_mem_bytes"] / off["peak_mem_bytes"]
                        if on["peak_mem_bytes"] and off["peak_mem_bytes"]
                        else None
                    )
        del models  # an ATTACH_ARCHS backbone's CCQ twin: freed before the next arch's is built


# ------------------------------------------------------------------------------------------ ops
def _ops_case(bench: Bench, case: dict[str, Any], fn: Callable[[], Any]) -> dict[str, Any]:
    def call():
        with torch.no_grad():
            fn()

    m = measure(call, bench.device, warmup=bench.settings["warmup"], repeats=bench.settings["repeats"])
    return {**case, **m.as_dict()}


def run_ops(bench: Bench) -> None:
    """Single kernels on the issue's reference shape (forward, no grad): the GLA read, the same
    kernel with v = k, the scalar-decay pass CCQ uses, the gated delta rule, and the whole CCQ read."""
    from ccq_eval.model import fla_cpu
    from ccq_eval.model.ccq import ccq_read_chunk, unit_keys

    T, H, K, V = bench.settings["ops_shape"]
    dev, dt = bench.device, bench.dtype
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=dev, generator=gen)

    q, k = randn(1, T, H, K).to(dt), randn(1, T, H, K).to(dt)
    v = randn(1, T, H, V).to(dt)
    g_channel = (F.logsigmoid(randn(1, T, H, K)) / 16).to(dt)
    g_scalar = F.logsigmoid(randn(1, T, H)) / 16  # fp32, as the layers pass it
    beta = torch.rand(1, T, H, device=dev, generator=gen).to(dt)
    lam = 4.0 * torch.sigmoid(randn(1, T, H))
    q_unit, k_unit = F.normalize(q.float(), dim=-1).to(dt), F.normalize(k.float(), dim=-1).to(dt)

    cases: list[tuple[str, Callable[[], Any]]] = [
        (f"chunk_gla d_v={V}", lambda: fla_cpu.chunk_gla(q, k, v, g_channel)),
        ("chunk_gla v=k", lambda: fla_cpu.chunk_gla(q, k, k, g_channel)),
        (
            "chunk_simple_gla v=k (CCQ covariance pass)",
            lambda: fla_cpu.chunk_simple_gla(q, k_unit, k_unit, g=g_scalar, scale=1.0),
        ),
        (
            f"chunk_gated_delta_rule d_v={V}",
            lambda: fla_cpu.chunk_gated_delta_rule(q_unit, k_unit, v, g_scalar, beta),
        ),
        (
            "ccq_read_chunk order 1 (whole CCQ read)",
            lambda: ccq_read_chunk(q, unit_keys(k), g_scalar, lam, order=1),
        ),
    ]
    for name, fn in cases:
        case = {"op": name, "T": T, "H": H, "K": K, "V": V}
        bench.log(f"ops {case}")
        row = bench.attempt("ops", case, functools.partial(_ops_case, bench, case, fn))
        if row is not None:
            bench.add("ops", row)
