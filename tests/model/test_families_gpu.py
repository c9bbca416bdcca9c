"""Every family that runs on the CPU, on CUDA too (marked gpu): fla's triton kernels (CUDA) and ccq-eval's
torch backend (CPU) give one model the same logits, and the adapter on CUDA at its default answers as at
eager batch 1."""

from __future__ import annotations

import pytest
import torch
from family_support import CPU_FAMILIES, tiny_checkpoint
from lm_eval.api.instance import Instance

from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.model.families import GPU_FAST_PATH_MEASURED
from ccq_eval.model.loading import load_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and fla's triton kernels")]
TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness"


@pytest.mark.parametrize("model_type", ["mamba", *CPU_FAMILIES])
def test_cuda_kernels_give_the_cpu_backend_logits(tmp_path, model_type):
    folder = tiny_checkpoint(model_type, tmp_path / model_type)
    ids = torch.tensor([list(TEXT.encode())[:96]]) + 3
    # fla's chunked DeltaNet kernel refuses float32 on CUDA: that family is compared in bfloat16 there
    cuda_dtype, tolerance = ("bfloat16", 1e-1) if model_type == "delta_net" else ("float32", 2e-2)
    logits = {}
    for device, dtype in (("cpu", "float32"), ("cuda", cuda_dtype)):
        model, _ = load_model(str(folder), device=device, dtype=dtype)
        with torch.no_grad():
            logits[device] = model(ids.to(device), use_cache=False).logits.float().cpu()
    # fla's kernels compute in tf32 / bf16 pieces on the GPU: agreement to a few 1e-3 in logits of a random model
    assert torch.allclose(logits["cuda"], logits["cpu"], atol=tolerance, rtol=0), (
        (logits["cuda"] - logits["cpu"]).abs().max())


@pytest.mark.parametrize("model_type", ["mamba", *CPU_FAMILIES])
def test_cuda_default_batch_answers_as_batch_one(tmp_path, model_type):
    """The adapter's default on CUDA (the fast path for the measured families, families.GPU_FAST_PATH_MEASURED;
    eager batch 1 for the others) answers as eager batch 1."""
    model, tokenizer = load_model(str(tiny_checkpoint(model_type, tmp_path / model_type)), device="cuda",
                                  dtype="bfloat16" if model_type == "delta_net" else "float32")
    prompts = ["Once upon a time", "It was the best of times, it was", "Call me", "A tale of two cities.",
               "Call me Ishmael."]
    requests = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 16}), i)
                for i, p in enumerate(prompts)]
    alone = [CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=1, cuda_graphs=False).generate_until([r])[0]
             for r in requests]
    assert CCQEvalLM(model=model, tokenizer=tokenizer).generate_until(requests) == alone


# Families the fast path cannot take: transformers' models.
NO_FAST_PATH = {"llama", "mistral", "qwen2"}


FAST_PATH_CASES = [
    model_type if model_type in GPU_FAST_PATH_MEASURED else pytest.param(model_type, marks=pytest.mark.xfail(
        strict=True, reason="not in GPU_FAST_PATH_MEASURED: not measured, or its graphed batch decodes other "
                            "tokens than batch 1 (RetNet)"))
    for model_type in sorted({"mamba", *CPU_FAMILIES} - NO_FAST_PATH)]


@pytest.mark.parametrize("model_type", FAST_PATH_CASES)
def test_cuda_fast_path_answers_as_batch_one(tmp_path, model_type):
    """The fast path forced on (batching by memory, CUDA graphs) answers and scores as eager batch 1 for
    every family in families.GPU_FAST_PATH_MEASURED; for the others it does not (strict xfail, so a fix
    shows)."""
    model, tokenizer = load_model(str(tiny_checkpoint(model_type, tmp_path / model_type)), device="cuda",
                                  dtype="bfloat16" if model_type == "delta_net" else "float32")
    prompts = ["Once upon a time", "It was the best of times, it was", "Call me", "A tale of two cities.",
               "Call me Ishmael."]
    generations = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 16}), i)
                   for i, p in enumerate(prompts)]
    scorings = [Instance("loglikelihood", {}, (p, " " + TEXT[:8 * (i + 1)]), i) for i, p in enumerate(prompts)]
    eager = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=1, cuda_graphs=False)
    alone = ([eager.generate_until([r])[0] for r in generations],
             [eager.loglikelihood([r])[0][0] for r in scorings])
    fast = CCQEvalLM(model=model, tokenizer=tokenizer, cuda_graphs=True)
    together = (fast.generate_until(generations), [score for score, _ in fast.loglikelihood(scorings)])
    assert together[0] == alone[0]
    tolerance = 5e-2 if model_type == "delta_net" else 1e-3  # bf16 for DeltaNet; float32 otherwise
    assert together[1] == pytest.approx(alone[1], abs=tolerance)


@pytest.mark.parametrize("model_type", sorted(NO_FAST_PATH))
def test_cuda_fast_path_refused_where_it_cannot_apply(tmp_path, model_type):
    """transformers' models keep per-position caches: no recurrent state to graph or stack."""
    model, tokenizer = load_model(str(tiny_checkpoint(model_type, tmp_path / model_type)), device="cuda")
    with pytest.raises(ValueError, match="cuda_graphs=True needs a recurrent fla model"):
        CCQEvalLM(model=model, tokenizer=tokenizer, cuda_graphs=True)
