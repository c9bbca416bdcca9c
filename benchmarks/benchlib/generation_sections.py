"""The "generation" and "sniah" sections: greedy generation after S-NIAH prompts (prefill and decode
timed apart) and S-NIAH-1 samples through generate_until, the ccq adapter against transformers'
generate() and lm-eval's HFLM. Each appends rows to bench.results[section]."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchlib import workload
from benchlib.bench_context import Bench
from benchlib.timing import Stamp, read_peak, reset_peak, synchronize


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
        def generate():
            return lm.generate_until([request], disable_tqdm=True)[0]
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
            lm = bench.stock_hflm(model, max(s["sniah_length"], s["harness_tokens"]))
        else:
            from ccq_eval.harness.adapter import CCQEvalLM

            lm = CCQEvalLM(
                model=model,
                tokenizer=bench.tokenizer,
                max_length=s["sniah_length"],
                batch_size=case["batch"] or "auto",
                chunk_size=s["sniah_chunk_size"],
                cuda_graphs="auto" if _graphs(bench, case) else False,
                shared_prefill=s.get("sniah_shared_prefill", False),
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
        # The largest batch that ran (auto batches are sized per batch; lm.batch_size is their cap).
        "batch_size": max(map(int, getattr(lm, "batch_sizes_run", None) or [getattr(lm, "batch_size", 1)])),
        "cuda_graphs": bool(getattr(lm, "cuda_graphs", False)),
    }


# ------------------------------------------------------------------------------------------ sniah: near ties
# Greedy decoding of a random-init model, whose top logits are near ties, follows the rounding of its path.
# Two paths (a batched kernel and a batch-1 one) compute the same logit with different accumulated
# rounding, a few ulps of the logit scale (dtype eps * max|logit|) apart; TIE_ULPS allows some margin over
# that. A split is a near tie when the two texts' tokens lie within TIE_ULPS such ulps of each other and of
# the position's top logit, in the logits of the reference's own path: the whole prompt in one forward with
# a cache, then one cached step per generated token, as batch 1 and HFLM's generate compute them (a plain
# forward over prompt and answer runs the chunk kernel over the answer too, which in half precision can
# round far from what either generation saw).
TIE_ULPS = 8


def generated_ids(tokenizer, context: str, text: str) -> list[list[int]]:
    """Two candidate token ids of `text`, generated after `context` (a decoded text does not tell whether
    its first token started a word: the decoder drops that token's leading space): the tokens of context +
    text past the context's own, where they split there and decode back to the text, and the text's own
    tokens, which start a word (those twice where the first fails)."""
    context_ids = workload.encode(tokenizer, context)
    ids = workload.encode(tokenizer, context + text)
    rest, alone = ids[len(context_ids):], workload.encode(tokenizer, text)
    if ids[:len(context_ids)] == context_ids and tokenizer.decode(rest, skip_special_tokens=True) == text:
        return [rest, alone]
    return [alone, alone]


def parting_points(tokenizer, context: str, tested: str, reference: str) -> list[dict[str, Any]]:
    """Where two different texts generated after `context` part, per candidate tokenization
    (generated_ids; duplicates dropped): the generated tokens they share ("common") and each one's next
    token (EOS past a text's end). generate_until returns texts, so they are re-tokenized; where a text's
    ids do not decode back to it (a random model may emit splits that decode lossily), only the texts'
    longest common character prefix is re-encoded, less its last token (a word the texts may go on to
    finish differently), and both texts' ids must begin with those. Empty where no candidate parts them."""
    decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
    chars = 0
    while chars < min(len(tested), len(reference)) and tested[chars] == reference[chars]:
        chars += 1
    candidates = zip(generated_ids(tokenizer, context, tested), generated_ids(tokenizer, context, reference),
                     generated_ids(tokenizer, context, tested[:chars]))
    points = []
    for test_ids, ref_ids, common_ids in candidates:
        common, shorter = 0, min(len(test_ids), len(ref_ids))
        if decode(test_ids) == tested and decode(ref_ids) == reference:
            how = "tokens"
        else:
            how, common = "common characters", len(common_ids[:-1])
            if test_ids[:common] != common_ids[:common] or ref_ids[:common] != common_ids[:common]:
                continue
        # past the common characters' ids, the tokens the texts share whole (in the fallback: the dropped one)
        while (common < shorter and test_ids[common] == ref_ids[common]
               and (how == "tokens" or tested[:chars].startswith(decode(test_ids[:common + 1])))):
            common += 1
        tokens = [ids[common] if common < len(ids) else tokenizer.eos_token_id for ids in (test_ids, ref_ids)]
        point = {"common": test_ids[:common], "tested_token": tokens[0], "reference_token": tokens[1], "how": how}
        if None not in tokens and tokens[0] != tokens[1] and point not in points:
            points.append(point)
    return points


def classify_split(logits: torch.Tensor, reference_token: int, tested_token: int, dtype: torch.dtype,
                   tie_ulps: float = TIE_ULPS) -> dict[str, Any]:
    """A split at one position, judged on the reference model's logits there (one row): the gap between
    the two tokens' logits, in absolute terms and in ulps of the logit scale (eps of `dtype` times the
    largest |logit|), each token's rank (0: argmax, 1: runner-up), and whether it is a near tie: both
    tokens within tie_ulps of the scale of each other and of the top logit (either could then have been a
    path's argmax; a token far below the top, e.g. after a re-tokenized context other than the generated
    one, is no tie)."""
    logits = logits.float()
    ulp = max(torch.finfo(dtype).eps * float(logits.abs().max()), torch.finfo(torch.float32).tiny)
    ref, test, top = float(logits[reference_token]), float(logits[tested_token]), float(logits.max())
    gap, tolerance = abs(ref - test), tie_ulps * ulp
    return {
        "gap": gap,
        "gap_ulps": gap / ulp,
        "top_gap_ulps": (top - min(ref, test)) / ulp,
        "tie": gap <= tolerance and top - min(ref, test) <= tolerance,
        "reference_rank": int((logits > ref).sum()),
        "tested_rank": int((logits > test).sum()),
    }


def _greedy_consistent(logits: torch.Tensor, tokens: list[int], dtype: torch.dtype) -> bool:
    """Whether each of `tokens` is within TIE_ULPS of the top logit of its row of `logits`: a token greedy
    decoding could have chosen there, by classify_split's measure."""
    if not tokens:
        return True
    logits = logits.float()
    ulp = torch.finfo(dtype).eps * logits.abs().amax(-1)
    chosen = logits.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    return bool((logits.amax(-1) - chosen <= TIE_ULPS * ulp).all())


def generation_path_logits(model, prompt: list[int], generated: list[int], device) -> torch.Tensor:
    """The logits greedy generation reads after `prompt` and after each of `generated` ([1 + len, V]): the
    prompt in one forward with a cache, then one cached step per token (the kernels batch 1 runs)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        rows = [out.logits[0, -1]]
        for token in generated:
            out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=out.past_key_values,
                        use_cache=True)
            rows.append(out.logits[0, -1])
    return torch.stack(rows)


def compare_texts(bench: Bench, model, ccq: bool, contexts: list[str], tested: list[str],
                  reference: list[str]) -> list[dict[str, Any] | None]:
    """Per sample (as many as both ran): None where the texts are equal, else where they part
    (parting_points) and classify_split's verdict on the generation path's logits
    (generation_path_logits, the bench's dtype) after the prompt as the adapter encodes it (BOS, then the
    context) and the generated tokens the texts share. The same logits check that context: each shared
    token within TIE_ULPS of its position's top logit, as greedy decoding chose it ("prefix_consistent"; a
    split in any other context is no tie). Where the first candidate tokenization fails that check, the
    second is judged too: at most two per differing sample, after the timed runs."""
    tokenizer, splits = bench.tokenizer, []
    for context, test, ref in zip(contexts, tested, reference):
        if test == ref:
            splits.append(None)
            continue
        prompt = workload.prefix_ids(tokenizer) + workload.encode(tokenizer, context)
        split = {"how": "unresolved", "tie": False}
        for point in parting_points(tokenizer, context, test, ref):
            with workload.ccq_mode(model, ccq):
                logits = generation_path_logits(model, prompt, point["common"], bench.device)
            consistent = _greedy_consistent(logits[:-1], point["common"], bench.dtype)
            judged = classify_split(logits[-1], point["reference_token"], point["tested_token"], bench.dtype)
            split = {"first_divergence_token": len(point["common"]), "how": point["how"],
                     "tested_token": point["tested_token"], "reference_token": point["reference_token"],
                     **judged, "prefix_consistent": consistent, "tie": judged["tie"] and consistent}
            if consistent:
                break
        splits.append(split)
    return splits


def _near_ties(bench: Bench, model, contexts: list[str], row: dict[str, Any], reference: dict[str, Any],
               against: str) -> None:
    """compare_texts' verdicts for `row`'s texts against `reference`'s (`against`: "hflm", "batch1"), stored
    in `row`: the fraction of samples that part at a near tie, the largest gap in ulps, and per sample the
    generated tokens shared before the split (None: same text) and the split itself."""
    case = {key: row[key] for key in ("arch", "ccq", "method", "length", "batch")}
    splits = bench.attempt("sniah", {**case, "compared_with": against}, functools.partial(
        compare_texts, bench, model, row["ccq"], contexts, row["texts"], reference["texts"]))
    if splits is None:
        return
    judged = [s for s in splits if s is not None and "gap_ulps" in s]
    row[f"ties_vs_{against}_fraction"] = sum(s is not None and s["tie"] for s in splits) / len(splits)
    row[f"max_gap_ulps_vs_{against}"] = max((s["gap_ulps"] for s in judged), default=None)
    row[f"first_divergence_tokens_vs_{against}"] = [
        None if s is None else s.get("first_divergence_token") for s in splits]
    row[f"splits_vs_{against}"] = splits


def run_sniah(bench: Bench) -> None:
    """S-NIAH-1 samples at one length through generate_until: the ccq adapter vs lm-eval's stock HFLM
    (max_length large enough, RULER's generation settings), same requests, same model (HFLM on the first
    sniah_hflm_samples of them): seconds per sample and whether the generated texts agree, with HFLM's
    and, for the adapter's other batch sizes, with its batch 1's (every sample), or part at a near tie."""
    from lm_eval.api.instance import Instance

    s = bench.settings
    n = s["sniah_samples"]
    depths = [round(100 * i / (n - 1)) for i in range(n)] if n > 1 else [50]
    docs = workload.sniah_docs(bench.tokenizer_spec, [s["sniah_length"]], depths=depths)
    utils = workload.s_niah_utils()
    contexts = [utils.doc_to_text(doc) for doc in docs]
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
        for ccq in bench.ccq_settings(arch):
            rows = []
            for method, batch, kwargs in methods:
                # HFLM runs the first sniah_hflm_samples documents: the per-sample times are compared.
                method_docs = docs[:s["sniah_hflm_samples"]] if method == "lm_eval HFLM" else docs
                requests = [
                    Instance(
                        request_type="generate_until",
                        doc=doc,
                        idx=0,
                        task_name="ccq_s_niah_1",
                        doc_id=i,
                        arguments=(contexts[i], dict(kwargs)),
                    )
                    for i, doc in enumerate(method_docs)
                ]
                case = {"arch": arch, "ccq": ccq, "method": method, "length": s["sniah_length"],
                        "batch": batch}
                bench.log(f"sniah {case}")
                row = bench.attempt(
                    "sniah", case, functools.partial(_sniah_case, bench, model, case, requests)
                )
                if row is not None:
                    rows.append(bench.add("sniah", row))
            # Every sample, not only HFLM's: a larger batch must answer as batch 1 does (issue 54), or part from
            # it at a near tie (compare_texts; untimed, after the timed runs).
            batch1 = next((r for r in rows if r["method"] == "ccq_adapter" and r["batch"] == 1), None)
            for adapter in (r for r in rows if batch1 is not None and r["method"] == "ccq_adapter" and r is not batch1):
                same = [a == b for a, b in zip(adapter["texts"], batch1["texts"], strict=True)]
                adapter["same_text_as_batch1_fraction"] = sum(same) / len(same)
                _near_ties(bench, model, contexts, adapter, batch1, "batch1")
            hflm = next((r for r in rows if r["method"] == "lm_eval HFLM"), None)
            if hflm is None:
                continue
            for adapter in (r for r in rows if r["method"] == "ccq_adapter"):
                # the samples both ran (HFLM's are the first ones of the adapter's)
                same = [a == b for a, b in zip(adapter["texts"], hflm["texts"])]
                adapter["same_text_fraction"] = sum(same) / len(same)
                adapter["speedup_vs_hflm"] = hflm["seconds_per_sample"] / adapter["seconds_per_sample"]
                hflm["same_text_fraction"] = min(
                    hflm.get("same_text_fraction", 1.0), adapter["same_text_fraction"]
                )
                _near_ties(bench, model, contexts, adapter, hflm, "hflm")
