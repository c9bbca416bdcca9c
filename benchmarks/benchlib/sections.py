"""The measured sections. Each takes the Bench context and appends rows to bench.results[section].

Every case runs inside Bench.attempt: a failure (out of memory, an unsupported combination) is
recorded under "errors" with its case, and the other cases still run.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchlib import workload
from benchlib.timing import Stamp, matmul_rate, measure, read_peak, reset_peak, synchronize

GiB = 1024**3


class Bench:
    """Settings, shared state (models, tokenizer, the matmul ceiling) and collected results."""

    def __init__(self, settings: dict[str, Any]):
        self.settings = settings
        self.device = torch.device(settings["device"])
        self.dtype = settings["dtype"]
        self.results: dict[str, list[dict[str, Any]]] = {}
        self.errors: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self._models: dict[str, torch.nn.Module] = {}
        self.tokenizer, self.tokenizer_spec = workload.load_tokenizer(settings["tokenizer"])
        self.vocab_size = settings.get("vocab_size") or len(self.tokenizer)
        self.matmul: dict[str, Any] | None = None
        self.on_update: Callable[[], Any] | None = None  # called after every recorded row / error

    # -------------------------------------------------------------------------------- helpers
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def log(self, message: str) -> None:
        print(f"[bench {time.perf_counter() - self.started:7.1f}s] {message}", file=sys.stderr, flush=True)

    def model(self, arch: str) -> torch.nn.Module:
        if arch not in self._models:
            self.log(
                f"building {arch} ({'smoke' if self.settings['smoke'] else '340M'} shape, "
                f"vocab {self.vocab_size}, {self.dtype}) on {self.device}"
            )
            model = workload.build_model(
                arch, self.settings["shapes"][arch], self.vocab_size, self.device, self.dtype
            )
            self._models[arch] = model
        return self._models[arch]

    def model_info(self) -> dict[str, Any]:
        return {
            arch: {"parameters": workload.parameter_count(m), "config": self.settings["shapes"][arch]}
            for arch, m in self._models.items()
        }

    def attempt(self, section: str, case: dict[str, Any], fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as error:  # noqa: BLE001  (record and carry on with the other cases)
            message = f"{type(error).__name__}: {error}"
            self.log(f"{section} {case}: FAILED {message[:300]}")
            self.errors.append({"section": section, "case": case, "error": message[:2000]})
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self._updated()
            return None

    def add(self, section: str, row: dict[str, Any]) -> dict[str, Any]:
        self.results.setdefault(section, []).append(row)
        self._updated()
        return row

    def _updated(self) -> None:
        if self.on_update is not None:
            self.on_update()

    def ccq_settings(self) -> list[bool]:
        return [flag == "on" for flag in self.settings["ccq"]]

    def matmul_ceiling(self) -> dict[str, Any]:
        if self.matmul is None:
            size = self.settings["matmul_size"]
            self.log(f"measuring the {self.dtype} matmul rate ({size}^3)")
            self.matmul = matmul_rate(self.device, self.dtype, size)
            self.log(f"matmul: {self.matmul['flops_per_s'] / 1e12:.2f} TFLOP/s")
        return self.matmul


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
        flops = workload.forward_flops_per_token(model, ccq)
    n_tokens = s["batch"] * T
    step_flops = flops["total"] * n_tokens * (3 if training else 1)
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
        "mfu": step_flops / seconds / ceiling,
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


def run_model(bench: Bench) -> None:
    """Forward (eval, use_cache=False, logits for every position) and forward + backward (train mode,
    loss on the same tokens) at each T, CCQ off and on, on the same weights; eagerly, or (*_graphed
    modes) replayed from a CUDA graph."""
    s = bench.settings
    ceiling = bench.matmul_ceiling()["flops_per_s"]
    for arch in s["archs"]:
        model = bench.model(arch)
        for mode in s["modes"]:
            for T in s["lengths"]:
                tokens = workload.random_tokens(s["batch"], T, bench.vocab_size, bench.device)
                by_ccq: dict[bool, dict[str, Any]] = {}
                for ccq in bench.ccq_settings():
                    case = {"arch": arch, "mode": mode, "T": T, "ccq": ccq}
                    bench.log(f"model {case}")
                    row = bench.attempt(
                        "model",
                        case,
                        functools.partial(_model_case, bench, model, arch, mode, T, ccq, tokens, ceiling),
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


# ------------------------------------------------------------------------------------------ harness
def _scorer(method: str, bench: Bench, model, n_tokens: int, chunk: int | None,
            cuda_graphs: bool = False) -> Callable[[list], Any]:
    """A callable scoring loglikelihood_rolling requests: the ccq adapter or lm-eval's stock HFLM."""
    if method == "hflm":
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(
            pretrained=model,
            tokenizer=bench.tokenizer,
            backend="causal",
            max_length=n_tokens,
            batch_size=1,
            device=str(bench.device),
        )
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


def _harness_case(
    bench: Bench, model, case: dict[str, Any], input_ids: torch.Tensor, text: str, chunk: int | None
) -> dict[str, Any]:
    from lm_eval.api.instance import Instance

    s = bench.settings
    n_tokens = int(input_ids.shape[1])
    n_docs = s["harness_docs"]
    holder: dict[str, Any] = {}
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

        m = measure(call, bench.device, warmup=s["warmup"], repeats=s["repeats"])
    total = n_tokens * n_docs
    row = {**case, "tokens": n_tokens, "docs": n_docs, **m.as_dict(),
           "tokens_per_s": total / (m.median_ms / 1000.0)}
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
    methods += [(f"ccq_adapter chunk={chunk}", chunk) for chunk in s["adapter_chunk_sizes"]]
    if s["cuda_graphs"]:  # the adapter's scoring forwards replayed from CUDA graphs (ccq_eval.model.cuda_graphs.score)
        methods += [(f"ccq_adapter chunk={chunk}{GRAPHS_SUFFIX}", chunk) for chunk in s["adapter_chunk_sizes"]]
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


# ------------------------------------------------------------------------------------------ generation
class CallRecorder:
    """Stamps the start of every model call with its input length, to split a generate() call into
    prefill (up to the first one-token call) and decode (one-token calls to the end)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.calls: list[tuple[int, Stamp]] = []
        # The backbone sees every call: generate() goes through the causal LM's forward, the adapter
        # calls an fla model's backbone directly (and applies the LM head itself).
        target = model.get_decoder() if hasattr(model, "get_decoder") else model
        self.handle = target.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        length = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else -1
        self.calls.append((length, Stamp(self.device)))

    def close(self) -> None:
        self.handle.remove()


def _timed_generation(bench: Bench, model, fn: Callable[[], Any],
                      steps_counter: Callable[[], int] | None = None) -> tuple[dict[str, Any], Any]:
    from ccq_eval.model.cuda_graphs.decode import GraphedDecodeStep

    recorder = CallRecorder(model, bench.device)
    # The first CUDA-graph replay, stamped: the decode time from the first one-token call includes the
    # graph's eager warm-up steps and its capture where this call captured one. A graph reused from an
    # earlier call (the adapter keeps one per batch size) makes no one-token model call at all: then
    # decoding starts at the first replay.
    replays: list[Stamp] = []
    replay = GraphedDecodeStep.__call__

    def stamped_replay(step, tokens):
        if not replays:
            replays.append(Stamp(bench.device))
            recorder.calls.append((1, replays[0]))
        return replay(step, tokens)

    GraphedDecodeStep.__call__ = stamped_replay
    try:
        start = Stamp(bench.device)
        out = fn()
        end = Stamp(bench.device)
    finally:
        GraphedDecodeStep.__call__ = replay
        recorder.close()
    total = start.ms_until(end)
    decode_calls = [stamp for length, stamp in recorder.calls if length == 1]
    prefill_calls = [length for length, _ in recorder.calls if length != 1]
    prefill_ms = start.ms_until(decode_calls[0]) if decode_calls else total
    decode_ms = decode_calls[0].ms_until(end) if decode_calls else 0.0
    # CUDA-graph replays bypass the forward hook: the adapter counts its decode steps itself (the
    # decode time then runs from the graph's capture, which the hook sees, to the end).
    steps = steps_counter() if steps_counter is not None else len(decode_calls)
    return {
        "total_ms": total,
        "prefill_ms": prefill_ms,
        "decode_ms": decode_ms,
        "decode_steps": steps,
        # From the first graph replay to the end (None without graphs): the replays and the host's
        # per-token loop only.
        "replay_ms": replays[0].ms_until(end) if replays else None,
        "prefill_calls": len(prefill_calls),
    }, out


def _graphs(bench: Bench, case: dict[str, Any]) -> bool:
    """--cuda-graphs applies to the adapter's decoding (fla's layers and CCQ's alike)."""
    return bench.settings["cuda_graphs"] and case["method"] == "ccq_adapter"


def _generator(method: str, bench: Bench, model, prompt: str, ids: list[int],
               cuda_graphs: bool = False) -> Callable[[], str]:
    """Greedy generation of new_tokens tokens after `prompt` (token ids `ids`), returning the text."""
    new_tokens = bench.settings["new_tokens"]
    tokenizer = bench.tokenizer
    if method == "ccq_adapter":
        from lm_eval.api.instance import Instance

        from ccq_eval.harness.adapter import CCQEvalLM

        lm = CCQEvalLM(
            model=model,
            tokenizer=tokenizer,
            max_length=len(ids) + new_tokens,
            batch_size=1,
            chunk_size=bench.settings["adapter_chunk_sizes"][0],
            cuda_graphs=cuda_graphs,
        )
        request = Instance(
            request_type="generate_until",
            doc={},
            idx=0,
            task_name="bench_gen",
            arguments=(prompt, {"until": [], "max_gen_toks": new_tokens, "do_sample": False}),
        )
        generate = lambda: lm.generate_until([request], disable_tqdm=True)[0]  # noqa: E731
        generate.decode_steps = lambda: lm.last_decode_steps
        return generate

    input_ids = torch.tensor([ids], device=bench.device)
    eos = tokenizer.eos_token_id

    def hf_generate() -> str:
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=eos,
                eos_token_id=eos,
            )
        new = out[0, input_ids.shape[1] :].tolist()
        if eos in new:
            new = new[: new.index(eos)]
        return tokenizer.decode(new, skip_special_tokens=True)

    return hf_generate


def _generation_case(
    bench: Bench, model, case: dict[str, Any], prompt: str, ids: list[int]
) -> dict[str, Any]:
    s = bench.settings
    with workload.ccq_mode(model, case["ccq"]):
        fn = _generator(case["method"], bench, model, prompt, ids, cuda_graphs=_graphs(bench, case))
        # The first call's wall time: compilation, and the adapter's decode-graph capture, which later
        # calls of the same batch size reuse (the timed calls below).
        first_call_ms = None
        for i in range(s["gen_warmup"]):
            started = time.perf_counter()
            fn()
            synchronize(bench.device)
            if i == 0:
                first_call_ms = (time.perf_counter() - started) * 1000.0
        mem_before = reset_peak(bench.device)
        runs, text = [], None
        for _ in range(s["gen_repeats"]):
            timing, text = _timed_generation(bench, model, fn, getattr(fn, "decode_steps", None))
            runs.append(timing)
        peak = read_peak(bench.device)
    med = {
        key: statistics.median(r[key] for r in runs)
        for key in ("total_ms", "prefill_ms", "decode_ms", "decode_steps")
    }
    per_token = med["decode_ms"] / med["decode_steps"] if med["decode_steps"] else None
    replay_ms = [r["replay_ms"] for r in runs if r["replay_ms"] is not None]
    replay_per_token = (statistics.median(replay_ms) / med["decode_steps"]
                        if replay_ms and med["decode_steps"] else None)
    return {
        **case,
        "prompt_tokens": len(ids),
        "max_new_tokens": s["new_tokens"],
        "prefill_calls": runs[-1]["prefill_calls"],
        "first_call_ms": first_call_ms,
        **med,
        "decode_ms_per_token": per_token,
        "replay_ms_per_token": replay_per_token,
        "decode_tokens_per_s": 1000.0 / per_token if per_token else None,
        "prefill_tokens_per_s": len(ids) / (med["prefill_ms"] / 1000.0),
        "runs": runs,
        "peak_mem_bytes": peak,
        "mem_before_bytes": mem_before,
        "text": text,
        "cuda_graphs": _graphs(bench, case),
    }


def run_generation(bench: Bench) -> None:
    """Greedy generation of `new_tokens` tokens after S-NIAH prompts of each length: the ccq adapter's
    generate_until (chunked prefill, cached one-token steps) vs transformers' model.generate() on the
    same model and the same prompt tokens."""
    s = bench.settings
    docs = workload.sniah_docs(bench.tokenizer_spec, s["gen_lengths"], depths=[50])
    for arch in s["archs"]:
        model = bench.model(arch)
        for ccq in bench.ccq_settings():
            for doc in docs:
                prompt = doc["input"]
                ids = workload.prefix_ids(bench.tokenizer) + workload.encode(bench.tokenizer, prompt)
                rows = {}
                for method in ("ccq_adapter", "hf_generate"):
                    case = {"arch": arch, "ccq": ccq, "method": method, "length": doc["length"]}
                    bench.log(f"generation {case}")
                    row = bench.attempt(
                        "generation",
                        case,
                        functools.partial(_generation_case, bench, model, case, prompt, ids),
                    )
                    if row is not None:
                        rows[method] = bench.add("generation", row)
                if len(rows) == 2:
                    same = rows["ccq_adapter"]["text"] == rows["hf_generate"]["text"]
                    for row in rows.values():
                        row["same_text_as_other_method"] = same


# ------------------------------------------------------------------------------------------ sniah
def _sniah_case(bench: Bench, model, case: dict[str, Any], requests: list) -> dict[str, Any]:
    s = bench.settings
    with workload.ccq_mode(model, case["ccq"]):
        if case["method"] == "lm_eval HFLM":
            from lm_eval.models.huggingface import HFLM

            lm = HFLM(
                pretrained=model,
                tokenizer=bench.tokenizer,
                backend="causal",
                max_length=max(s["sniah_length"], s["harness_tokens"]),
                batch_size=1,
                device=str(bench.device),
            )
        else:
            from ccq_eval.harness.adapter import CCQEvalLM

            lm = CCQEvalLM(
                model=model,
                tokenizer=bench.tokenizer,
                max_length=s["sniah_length"],
                batch_size=case["batch"] or "auto",
                chunk_size=s["sniah_chunk_size"],
                cuda_graphs="auto" if _graphs(bench, case) else False,
            )
        # Compilation for this length, and the adapter's decode graph for its batch size: captured once
        # in an evaluation and then reused by every batch (HFLM's batch is 1).
        for _ in range(s["sniah_warmup"]):
            lm.generate_until(requests[:int(lm.batch_size)], disable_tqdm=True)
        mem_before = reset_peak(bench.device)
        totals, texts = [], []
        for _ in range(s["sniah_repeats"]):
            start = Stamp(bench.device)
            texts = lm.generate_until(requests, disable_tqdm=True)
            totals.append(start.ms_until(Stamp(bench.device)))
        peak = read_peak(bench.device)
    total = statistics.median(totals)
    return {
        **case,
        "samples": len(requests),
        "total_ms": total,
        "times_ms": totals,
        "seconds_per_sample": total / 1000.0 / len(requests),
        "prompt_tokens": [r.doc["prompt_tokens"] for r in requests],
        "peak_mem_bytes": peak,
        "mem_before_bytes": mem_before,
        "texts": list(texts),
        "batch_size": int(getattr(lm, "batch_size", 1)),
        "cuda_graphs": bool(getattr(lm, "cuda_graphs", False)),
    }


def run_sniah(bench: Bench) -> None:
    """S-NIAH-1 samples at one length through generate_until: the ccq adapter vs lm-eval's stock HFLM
    (max_length large enough, RULER's generation settings), same requests, same model: seconds per
    sample and whether the generated texts agree."""
    from lm_eval.api.instance import Instance

    s = bench.settings
    n = s["sniah_samples"]
    depths = [round(100 * i / (n - 1)) for i in range(n)] if n > 1 else [50]
    docs = workload.sniah_docs(bench.tokenizer_spec, [s["sniah_length"]], depths=depths)
    utils = workload.s_niah_utils()
    # The task YAML's generation_kwargs (tasks/s_niah/_s_niah_template_yaml); HFLM gets the same
    # minus the adapter-only truncation key, which transformers' generate() would reject.
    adapter_kwargs = {
        "until": [],
        "do_sample": False,
        "temperature": 0.0,
        "max_gen_toks": utils.GENERATION_BUDGET,
        "ccq_truncation": "error",
    }
    hflm_kwargs = {k: v for k, v in adapter_kwargs.items() if k != "ccq_truncation"}
    # (method, batch size asked for: None = the adapter's default, generation kwargs)
    methods = [("ccq_adapter", batch, adapter_kwargs) for batch in s["sniah_batches"]]
    methods += [("lm_eval HFLM", 1, hflm_kwargs)] if s["hflm"] else []
    for arch in s["archs"]:
        model = bench.model(arch)
        for ccq in bench.ccq_settings():
            rows = []
            for method, batch, kwargs in methods:
                requests = [
                    Instance(
                        request_type="generate_until",
                        doc=doc,
                        idx=0,
                        task_name="ccq_s_niah_1",
                        doc_id=i,
                        arguments=(utils.doc_to_text(doc), dict(kwargs)),
                    )
                    for i, doc in enumerate(docs)
                ]
                case = {"arch": arch, "ccq": ccq, "method": method, "length": s["sniah_length"],
                        "batch": batch}
                bench.log(f"sniah {case}")
                row = bench.attempt(
                    "sniah", case, functools.partial(_sniah_case, bench, model, case, requests)
                )
                if row is not None:
                    rows.append(bench.add("sniah", row))
            hflm = next((r for r in rows if r["method"] == "lm_eval HFLM"), None)
            if hflm is None:
                continue
            for adapter in (r for r in rows if r["method"] == "ccq_adapter"):
                same = [a == b for a, b in zip(adapter["texts"], hflm["texts"], strict=True)]
                adapter["same_text_fraction"] = sum(same) / len(same)
                adapter["speedup_vs_hflm"] = hflm["seconds_per_sample"] / adapter["seconds_per_sample"]
                hflm["same_text_fraction"] = min(hflm.get("same_text_fraction", 1.0), adapter["same_text_fraction"])


SECTIONS: dict[str, Callable[[Bench], None]] = {
    "model": run_model,
    "ops": run_ops,
    "harness": run_harness,
    "generation": run_generation,
    "sniah": run_sniah,
}
