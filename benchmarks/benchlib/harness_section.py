"""The "harness" section: perplexity scoring of long documents through the ccq adapter and lm-eval's
HFLM, against bare forwards of the same model. It appends rows to bench.results["harness"]."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from benchlib import workload
from benchlib.bench_context import Bench
from benchlib.timing import measure, reset_peak


def _scorer(method: str, bench: Bench, model, n_tokens: int, chunk: int | None,
            cuda_graphs: bool = False) -> Callable[[list], Any]:
    """A callable scoring loglikelihood_rolling requests: the ccq adapter or lm-eval's stock HFLM."""
    if method == "hflm":
        lm = bench.stock_hflm(model, n_tokens)
    else:
        from ccq_eval.harness.adapter import CCQEvalLM

        lm = CCQEvalLM(
            model=model,
            tokenizer=bench.tokenizer,
            max_length=max(n_tokens, 2),
            batch_size=1,
            chunk_size=chunk,
            cuda_graphs=cuda_graphs,
        )
    return functools.partial(lm.loglikelihood_rolling, disable_tqdm=True)


GRAPHS_SUFFIX = " cuda_graphs"


def adapter_method(chunk: int, cuda_graphs: bool) -> str:
    """The harness row name of the ccq adapter scoring with `chunk` tokens per slice, graphed or eager."""
    return f"ccq_adapter chunk={chunk}" + (GRAPHS_SUFFIX if cuda_graphs else "")


def _harness_case(
    bench: Bench, model, case: dict[str, Any], input_ids: torch.Tensor, text: str, chunk: int | None
) -> dict[str, Any]:
    from lm_eval.api.instance import Instance

    s = bench.settings
    n_tokens = int(input_ids.shape[1])
    n_docs = s["harness_docs"]
    holder: dict[str, Any] = {}
    # What the process held before this case built its scorer (other models, earlier sections' graphs):
    # the case's own peak is its peak above this, plus this model's weights.
    case_base = reset_peak(bench.device)
    with workload.ccq_mode(model, case["ccq"]):
        if case["method"] == "bare_forward":

            def call():
                with torch.no_grad():
                    for _ in range(n_docs):
                        model(input_ids=input_ids, use_cache=False)
        else:
            score = _scorer(
                "hflm" if case["method"] == "lm_eval HFLM" else "adapter", bench, model, n_tokens, chunk,
                cuda_graphs=case["method"].endswith(GRAPHS_SUFFIX),
            )
            # What an evaluation does: n_docs texts scored in one call, each tokenised by the harness.
            requests = [
                Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0,
                         task_name="bench_ppl", doc_id=i)
                for i in range(n_docs)
            ]

            def call():
                holder["out"] = score(requests)

        m = measure(call, bench.device, warmup=s["harness_warmup"], repeats=s["harness_repeats"])
    total = n_tokens * n_docs
    row = {**case, "tokens": n_tokens, "docs": n_docs, **m.as_dict(),
           "tokens_per_s": total / (m.median_ms / 1000.0)}
    if case_base is not None and m.peak_mem_bytes is not None:
        row["own_peak_mem_bytes"] = m.peak_mem_bytes - case_base + workload.weight_bytes(model)
    if chunk is not None:
        row["chunk_size"] = chunk
    out = holder.get("out")
    if out:  # the summed log-likelihood of the document (a TokenNLL from the adapter)
        row["logprob_sum"] = float(out[0])
        scored = getattr(out[0], "token_nll", None)
        if scored is not None:
            row["scored_tokens"] = len(scored)
    return row


def run_harness(bench: Bench) -> None:
    """Perplexity scoring of harness_docs long documents: bare forwards of the same model on the
    token ids, the ccq adapter's loglikelihood_rolling (one request per document, tokenisation
    included), and lm-eval's stock HFLM configured to fit a document (max_length = its length)."""
    s = bench.settings
    text = workload.long_document(bench.tokenizer, s["harness_tokens"])
    ids = workload.prefix_ids(bench.tokenizer) + workload.encode(bench.tokenizer, text)
    bench.log(f"harness document: {len(ids)} tokens (target {s['harness_tokens']})")
    input_ids = torch.tensor([ids], device=bench.device)
    methods: list[tuple[str, int | None]] = [("bare_forward", None)]
    methods += [(adapter_method(chunk, False), chunk) for chunk in s["adapter_chunk_sizes"]]
    if s["cuda_graphs"]:
        # the adapter's scoring forwards replayed from CUDA graphs (ccq_eval.model.cuda_graphs.score)
        methods += [
            (adapter_method(chunk, True), chunk) for chunk in s["adapter_chunk_sizes"]
        ]
    if s["hflm"]:
        methods.append(("lm_eval HFLM", None))
    for arch in s["archs"]:
        model = bench.model(arch)
        for ccq in bench.ccq_settings():
            bare_row = None
            for method, chunk in methods:
                case = {"arch": arch, "ccq": ccq, "method": method}
                bench.log(f"harness {case}")
                row = bench.attempt(
                    "harness",
                    case,
                    functools.partial(_harness_case, bench, model, case, input_ids, text, chunk),
                )
                if row is None:
                    continue
                if method == "bare_forward":
                    bare_row = row
                elif bare_row is not None:
                    row["throughput_vs_bare"] = row["tokens_per_s"] / bare_row["tokens_per_s"]
                bench.add("harness", row)
