"""Auto batch sizes on CUDA (ccq_eval.harness.batching) give the answers of batch 1 on trained weights: the
embedded tiny-gla and tiny-gdn, greedy S-NIAH-1 generation and rolling log-likelihoods of texts of mixed
lengths, each model at batch 1 and at the auto size, both with CUDA graphs (the default fast path). And the
row cost they are sized from bounds the memory a batch allocates."""

from __future__ import annotations

import importlib

import pytest
import torch
from adapter_support import byte_tokenizer
from lm_eval.api.instance import Instance

from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.model.loading import load_model
from ccq_eval.model.modeling_ccq import (
    CCQGatedDeltaNetConfig,
    CCQGatedDeltaNetForCausalLM,
    CCQGLAConfig,
    CCQGLAForCausalLM,
)

sn = importlib.import_module("ccq_eval.tasks.s_niah.utils")

# Rolling NLL per token, batch of several rows vs one row: the bf16 matrix products of a batch take other
# kernel tiles than those of one row, so hidden states differ in the last bf16 bit (2^-8 relative) and a
# token's NLL moves by up to a few hundredths of a nat; over a text that rounding averages out well below
# this. A real batching error (a row scored with another row's state or tokens) moves NLLs by nats.
MEAN_NLL_TOLERANCE = 0.01
TOKEN_NLL_TOLERANCE = 0.25  # any one token: rounding near a flat softmax moves a few tokens by more


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["tiny-gla", "tiny-gdn"])
def test_auto_batches_answer_as_batch_one_does(name: str) -> None:
    model, tokenizer = load_model(name, device="cuda", dtype="bfloat16")
    docs = sn.generate_docs("s_niah_1", tokenizer=name, lengths=[1024, 2048], depths=[0, 50, 100],
                            samples_per_cell=1)  # prompts of about 800 to 1900 tokens
    generate = [Instance("generate_until", doc, (doc["input"], {"until": [], "max_gen_toks": 24}), i)
                for i, doc in enumerate(docs)]
    # Scoring batches texts of one token length: slices of the (ASCII, byte-token) prompts, four of 1500
    # tokens, two of 700, and two that stand alone.
    short, long = [doc["input"] for doc in docs[:3]], [doc["input"] for doc in docs[3:]]
    texts = [long[0][:1500], long[1][:1500], long[2][:1500], long[0][300:1800],
             short[0][:700], short[1][:700], long[2], short[2][:200]]
    rolling = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)]

    single = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=4096, batch_size=1)
    auto = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=4096)
    assert auto.batch_size_auto and auto.cuda_graphs and single.cuda_graphs

    texts_auto = auto.generate_until(generate, disable_tqdm=True)
    assert texts_auto == single.generate_until(generate, disable_tqdm=True)
    assert max(auto.batch_sizes_run) > 1  # prompts of mixed lengths decoded together
    auto.batch_sizes_run.clear()

    got = auto.loglikelihood_rolling(rolling, disable_tqdm=True)
    want = single.loglikelihood_rolling(rolling, disable_tqdm=True)
    assert max(auto.batch_sizes_run) >= 4  # the four texts of 1500 tokens in one batch
    for text, a, b in zip(texts, got, want, strict=True):
        nll_a, nll_b = torch.tensor(a.token_nll), torch.tensor(b.token_nll)
        assert nll_a.shape == nll_b.shape
        assert abs(nll_a.mean() - nll_b.mean()) <= MEAN_NLL_TOLERANCE, len(text)
        assert (nll_a - nll_b).abs().max() <= TOKEN_NLL_TOLERANCE, len(text)


# 340M widths (benchmarks/benchlib/workload.py) at 4 layers, 32K vocabulary, CCQ on: the logits and the
# layers' intermediates both matter at these widths.
ROW_COST_MODELS = {
    "gla": lambda: CCQGLAForCausalLM(CCQGLAConfig(
        hidden_size=1024, num_hidden_layers=4, num_heads=4, expand_k=0.5, expand_v=1, vocab_size=32000,
        ccq=True)),
    "gated_deltanet": lambda: CCQGatedDeltaNetForCausalLM(CCQGatedDeltaNetConfig(
        hidden_size=1024, num_hidden_layers=4, num_heads=6, head_dim=256, expand_v=2, use_short_conv=True,
        vocab_size=32000, ccq=True)),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", sorted(ROW_COST_MODELS))
@pytest.mark.parametrize("generation", [True, False], ids=["prefill", "scoring"])
def test_auto_row_cost_covers_what_a_batch_allocates(arch: str, generation: bool) -> None:
    """Auto batches are sized from the measured row cost, so it must bound what a batch really allocates:
    the eager prefill of a generation batch (the last position's logits, the cache kept) and the eager
    scoring of a batch (every position scored), 8 rows of 4096 tokens."""
    torch.manual_seed(0)
    model = ROW_COST_MODELS[arch]().to(device="cuda", dtype=torch.bfloat16).eval()
    lm = CCQEvalLM(model=model, tokenizer=byte_tokenizer(), max_length=8192)
    assert lm.batch_size_auto
    rows, tokens = 8, 4096
    planned = rows * lm.sizer.planned_row_bytes(tokens, generation=generation)
    ids = torch.randint(0, 384, (rows, tokens), device="cuda")
    # Once before measuring: kernels first met at this shape compile and autotune (one-time buffers, inside
    # the share of free memory that auto sizing leaves unplanned).
    lm.scorer.run(ids, tokens if generation else 0, to_cpu=False, keep_cache=generation)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    # generation: scored from the last position (nothing scored, its logits formed) with the cache kept
    out = lm.scorer.run(ids, tokens if generation else 0, to_cpu=False, keep_cache=generation)
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - before
    del out
    assert 0 < used <= planned, f"{used / 2**20:.0f} MiB used, {planned / 2**20:.0f} MiB planned"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", sorted(ROW_COST_MODELS))
def test_auto_prefill_alone_cost_covers_what_a_batch_allocates(arch: str) -> None:
    """A generation batch whose prompts are prefilled one at a time (the default) is sized as one forward
    slice beside every row's state and logits: that must bound what its prefill allocates, the stacked
    cache and the logits kept, 16 prompts of 3000 to 4096 tokens."""
    torch.manual_seed(0)
    model = ROW_COST_MODELS[arch]().to(device="cuda", dtype=torch.bfloat16).eval()
    lm = CCQEvalLM(model=model, tokenizer=byte_tokenizer(), max_length=8192)
    assert lm.batch_size_auto and lm.generator.prefills_alone
    lengths = [4096 - 73 * row for row in range(16)]
    prompts = [torch.randint(0, 384, (length,)).tolist() for length in lengths]
    planned = lm.sizer.planned_batch_bytes(lengths, generation=True, prefill_alone=True)
    assert planned < len(lengths) * lm.sizer.planned_row_bytes(lengths[0], generation=True)
    lm.generator._prefill(prompts)  # once first: kernels first met at these shapes autotune
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = lm.generator._prefill(prompts)
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - before
    del out
    assert 0 < used <= planned, f"{used / 2**20:.0f} MiB used, {planned / 2**20:.0f} MiB planned"
