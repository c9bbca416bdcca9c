"""The adapter with the project's recurrent models (CCQ-GLA / CCQ-Gated-DeltaNet on fla, CPU backend):
chunked scoring with fla's Cache equals one full forward, cached decoding equals full recomputation,
and lm-eval builds the adapter by name from a checkpoint folder."""

from __future__ import annotations

import math

import pytest
import torch
from adapter_support import byte_tokenizer, full_token_nll, greedy_full_recompute, one_torch_thread  # noqa: F401
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance

from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.harness.task_registry import make_task_manager
from ccq_eval.model.modeling_ccq import (
    CCQGatedDeltaNetConfig,
    CCQGatedDeltaNetForCausalLM,
    CCQGLAConfig,
    CCQGLAForCausalLM,
    prepare_runtime,
)

prepare_runtime()  # fla's CPU backend and the CCQ model types

TINY = {
    "gla": (CCQGLAConfig, CCQGLAForCausalLM,
            {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "vocab_size": 384, "use_short_conv": True}),
    "gated_deltanet": (CCQGatedDeltaNetConfig, CCQGatedDeltaNetForCausalLM,
                       {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 2, "head_dim": 32, "vocab_size": 384}),
}
TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness"


def _model(kind: str):
    config_cls, model_cls, shape = TINY[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**shape, ccq=True)).double().eval()
    with torch.no_grad():  # a non-trivial CCQ gate, as after training
        for name, param in model.named_parameters():
            if name.endswith("ccq_gate_weight"):
                param.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("kind", ["gla", "gated_deltanet"])
@pytest.mark.parametrize("logits_chunk", [5, 4096])
def test_recurrent_model_scoring_and_decoding(kind: str, logits_chunk: int) -> None:
    tokenizer = byte_tokenizer()
    model = _model(kind)
    # 37 does not divide 108, nor 5 37: partial model slices and partial logit slices
    lm = CCQEvalLM(model=model, tokenizer=tokenizer, chunk_size=37, logits_chunk=logits_chunk)
    assert lm.runtime.backbone is model.model  # fla models: hidden states, then the LM head a slice at a time
    (value,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (TEXT,), 0)])
    reference = full_token_nll(model, tokenizer.encode(TEXT, add_special_tokens=False))
    assert torch.allclose(torch.tensor(value.token_nll, dtype=torch.float64), reference, atol=1e-8, rtol=0)

    prompt = "Once upon a time"
    (text,) = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 10}), 0)])
    expected = greedy_full_recompute(model, tokenizer.encode(prompt, add_special_tokens=False), 10,
                                     stop_ids={tokenizer.eos_token_id})
    assert text == tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["gla", "gated_deltanet"])
def test_prompts_of_different_lengths_decode_together_as_they_would_alone(kind: str) -> None:
    """batch_size > 1: prompts of unequal length are prefilled one by one and decoded in one batch
    (their recurrent states stacked); every text equals greedy full recomputation of that prompt."""
    tokenizer = byte_tokenizer()
    model = _model(kind)
    lm = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=3, chunk_size=16)
    prompts = ["Once upon a time", "It was the best of times, it was", "Call me", "A tale of two cities."]
    requests = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 12}), i)
                for i, p in enumerate(prompts)]
    calls = []
    hook = model.model.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape), with_kwargs=True)
    try:
        texts = lm.generate_until(requests)
    finally:
        hook.remove()
    assert any(shape[0] == 3 and shape[1] == 1 for shape in calls)  # three rows decoded in one call
    for prompt, text in zip(prompts, texts, strict=True):
        expected = greedy_full_recompute(model, tokenizer.encode(prompt, add_special_tokens=False), 12,
                                         stop_ids={tokenizer.eos_token_id})
        assert text == tokenizer.decode(expected, skip_special_tokens=True), prompt


def test_lm_eval_builds_the_adapter_by_name_from_a_checkpoint(tmp_path) -> None:
    folder = tmp_path / "tiny-ccq-gla"
    _model("gla").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    corpus = tmp_path / "doc.txt"
    corpus.write_text(TEXT * 4, encoding="utf-8")

    out = simple_evaluate(
        model="ccq", model_args=f"pretrained={folder},max_length=512,dtype=float64,chunk_size=64",
        tasks=["ccq_ppl_sweep"], device="cpu", bootstrap_iters=0,
        task_manager=make_task_manager({"tokenizer": str(folder), "data_files": str(corpus), "lengths": [128, 256]}),
    )
    result = out["results"]["ccq_ppl_sweep"]
    assert result["tokens@128,none"] == 127 and result["tokens@256,none"] == 255
    assert all(math.isfinite(result[f"ppl@{n},none"]) and result[f"ppl@{n},none"] > 1 for n in (128, 256))
    assert out["config"]["model"] == "ccq"
