"""CUDA graphs: decode steps (ccq_eval.model.cuda_graphs.decode) give the same greedy text as eager decoding, and
scoring forwards (ccq_eval.model.cuda_graphs.score) the same log-likelihoods as eager ones."""

import pytest
import torch
from adapter_support import byte_tokenizer
from lm_eval.api.instance import Instance

from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.model.cuda_graphs.decode import GraphedDecodeStep
from ccq_eval.model.cuda_graphs.score import padded_length
from ccq_eval.model.modeling_ccq import (
    CCQGatedDeltaNetConfig,
    CCQGatedDeltaNetForCausalLM,
    CCQGLAConfig,
    CCQGLAForCausalLM,
    prepare_runtime,
)

prepare_runtime()  # the CCQ model types in transformers' Auto classes

MODELS = {  # head dim 64: CCQ's torch recurrence decodes; 128: the fused decoding kernel (ccq_triton)
    "gla": lambda ccq: CCQGLAForCausalLM(CCQGLAConfig(
        hidden_size=128, num_hidden_layers=2, num_heads=2, vocab_size=384, use_short_conv=True, ccq=ccq)),
    "gla-k128": lambda ccq: CCQGLAForCausalLM(CCQGLAConfig(
        hidden_size=256, num_hidden_layers=2, num_heads=1, vocab_size=384, use_short_conv=True, ccq=ccq)),
    "gated_deltanet": lambda ccq: CCQGatedDeltaNetForCausalLM(CCQGatedDeltaNetConfig(
        hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=64, vocab_size=384, ccq=ccq)),
    "gated_deltanet-k128": lambda ccq: CCQGatedDeltaNetForCausalLM(CCQGatedDeltaNetConfig(
        hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=128, vocab_size=384, ccq=ccq)),
}


def test_cuda_graphs_are_refused_without_cuda():
    model = MODELS["gla"](False).eval()
    with pytest.raises(ValueError, match="cuda_graphs=True needs"):
        CCQEvalLM(model=model, tokenizer=byte_tokenizer(), cuda_graphs=True)


def test_fast_path_defaults_resolve_by_device_and_model():
    """batch_size / cuda_graphs "auto" (None): graphs and batches sized from free memory (batch size None)
    for a recurrent model on CUDA, eager batch 1 on the CPU, for other models and with graphs off (today's
    eager path); explicit values win; True where graphs cannot run is refused, while the default falls
    back."""
    from ccq_eval.harness.adapter import resolve_fast_path

    assert resolve_fast_path("cuda", True, None, None) == (None, True)
    assert resolve_fast_path("cuda", False, None, None) == (1, False)  # e.g. the Llama reference
    assert resolve_fast_path("cpu", True, None, None) == (1, False)
    assert resolve_fast_path("cuda", True, 2, False) == (2, False)
    assert resolve_fast_path("cuda", True, None, False) == (1, False)  # --no-cuda-graphs: the eager path
    assert resolve_fast_path("cuda", True, None, True) == (None, True)
    with pytest.raises(ValueError, match="cuda_graphs=True needs"):
        resolve_fast_path("cuda", False, None, True)
    with pytest.raises(ValueError, match="cuda_graphs=True needs"):
        resolve_fast_path("cpu", True, 1, True)
    # On this CPU "auto" is the eager path: scoring one row at a time, a recurrent model's generation
    # CPU_GENERATION_BATCH prompts together (the most rows a batch may take, which batch_size reports).
    from ccq_eval.harness.batching import CPU_GENERATION_BATCH

    lm = CCQEvalLM(model=MODELS["gla"](False).eval(), tokenizer=byte_tokenizer())
    assert (lm.batch_size, lm.cuda_graphs, lm.sizer.scoring_max_rows) == (CPU_GENERATION_BATCH, False, 1)
    auto = CCQEvalLM(model=MODELS["gla"](False).eval(), tokenizer=byte_tokenizer(), batch_size="auto:8",
                     cuda_graphs="auto")
    assert (auto.batch_size, auto.cuda_graphs) == (CPU_GENERATION_BATCH, False)
    fixed = CCQEvalLM(model=MODELS["gla"](False).eval(), tokenizer=byte_tokenizer(), batch_size=1)
    assert (fixed.batch_size, fixed.sizer.rows_for(generation=True)(100)) == (1, 1)


def test_padded_lengths_add_under_an_eighth_and_few_shapes():
    """Graph lengths: at least the text's, multiples of 64, padding under 1/8 of the positions or 64
    tokens, at most 16 shapes per octave."""
    for length in range(2, 40000):
        padded = padded_length(length)
        assert padded >= length and padded % 64 == 0, length
        assert padded - length < max(64, length / 8), (length, padded)
    for octave in range(7, 15):
        assert len({padded_length(n) for n in range(2 ** octave + 1, 2 ** (octave + 1) + 1)}) <= 16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("ccq", [False, True])
def test_graphed_scoring_equals_eager_scoring(kind, ccq):
    """loglikelihood_rolling and loglikelihood with cuda_graphs=True (each length's second text on
    replays a graph of a padded length) against eager scoring: per-token NLL within 1e-4 (fp32; the
    padded shapes change matrix tiling, not the values)."""
    torch.manual_seed(0)
    model = MODELS[kind](ccq).cuda().eval()
    tokenizer = byte_tokenizer()
    texts = ["The quick brown fox jumps over the lazy dog. " * 9, "Call me Ishmael. " * 13] * 3
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    pairs = [Instance("loglikelihood", {}, (t, " and so on"), i) for i, t in enumerate(texts)]
    eager = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=1, cuda_graphs=False)
    graphed = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=1, cuda_graphs=True)
    expected, got = eager.loglikelihood_rolling(rolling), graphed.loglikelihood_rolling(rolling)
    assert len(graphed.scorer.graphed._graphs) == 2  # both lengths captured (the second time each)
    for a, b in zip(got, expected):
        torch.testing.assert_close(torch.tensor(a.token_nll), torch.tensor(b.token_nll), rtol=1e-4, atol=1e-4)
    for (a, greedy_a), (b, greedy_b) in zip(graphed.loglikelihood(pairs), eager.loglikelihood(pairs)):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-4) and greedy_a == greedy_b


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("ccq", [False, True])
def test_graphed_decoding_equals_eager_decoding(kind, ccq):
    """Greedy text through the adapter, graphed vs eager (fla's layers passed on the H200 for both
    kinds, 2026-12-01)."""
    torch.manual_seed(0)
    model = MODELS[kind](ccq).cuda().eval()
    tokenizer = byte_tokenizer()
    prompts = ["Once upon a time", "It was the best of times, it was", "Call me"]
    requests = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 40}), i)
                for i, p in enumerate(prompts)]
    eager_lm = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=3, cuda_graphs=False)
    graphed_lm = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=3, cuda_graphs=True)
    assert graphed_lm.generate_until(requests) == eager_lm.generate_until(requests)
    # A second batch of the same size replays the first one's graph from its own prefill.
    graph = graphed_lm.generator.decode_graphs[3]
    later = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 40}), i)
             for i, p in enumerate(["A long way", "In the beginning was", "Happy families are all alike;"])]
    assert graphed_lm.generate_until(later) == eager_lm.generate_until(later)
    assert graphed_lm.generator.decode_graphs[3] is graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_on_cuda_is_the_graphed_batched_path():
    """With no flags, a recurrent fla model on CUDA gets graph replay and the auto batch size, and its
    greedy texts equal the eager path's; a softmax-attention model falls back to eager batch 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ccq_eval.harness.batching import AUTO_BATCH_CAP

    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    model = MODELS["gla"](True).cuda().eval()
    default_lm = CCQEvalLM(model=model, tokenizer=tokenizer)
    assert default_lm.cuda_graphs and default_lm.batch_size_auto and default_lm.batch_size == AUTO_BATCH_CAP
    eager_lm = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=4, cuda_graphs=False)
    requests = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 24}), i)
                for i, p in enumerate(["Once upon a time", "Call me", "It was the best of times", "A"])]
    assert default_lm.generate_until(requests) == eager_lm.generate_until(requests)
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=384)).cuda().eval()
    fallback = CCQEvalLM(model=llama, tokenizer=tokenizer)
    assert (fallback.cuda_graphs, fallback.batch_size) == (False, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("ccq", [False, True])
def test_graphed_step_equals_eager_step(kind, ccq):
    """The graph itself, below the adapter's CCQ refusal: 16 replays vs 16 eager steps from the same
    prefilled cache and the same tokens give the same logits (fp32; same kernels, so near-exact)."""
    import copy

    torch.manual_seed(0)
    model = MODELS[kind](ccq).cuda().eval()

    def replays_match_eager_steps(graphed, prefill_cache, steps, label):
        cache = copy.deepcopy(prefill_cache)
        for step in range(steps):
            tokens = torch.randint(0, 384, (2,), device="cuda")
            got = graphed(tokens)
            out = model.model(input_ids=tokens.view(2, 1), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            expected = model.lm_head(out[0][:, -1]).float()
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"{label}step {step}")

    with torch.no_grad():
        prefill = model.model(input_ids=torch.randint(0, 384, (2, 50), device="cuda"), use_cache=True)
        graphed = GraphedDecodeStep(model.model, model.lm_head, prefill.past_key_values, batch=2)
        replays_match_eager_steps(graphed, prefill.past_key_values, 16, "")
        # The same graph started from another prefill (GraphedDecodeStep.load), against eager steps.
        prefill = model.model(input_ids=torch.randint(0, 384, (2, 70), device="cuda"), use_cache=True)
        graphed.load(prefill.past_key_values)
        replays_match_eager_steps(graphed, prefill.past_key_values, 8, "after load, ")


def test_load_copies_states_into_the_graph_buffers_and_refuses_another_layout():
    """GraphedDecodeStep.load (no CUDA needed for this part: the buffers are set by hand)."""
    from types import SimpleNamespace

    step = object.__new__(GraphedDecodeStep)
    step._buffers = [torch.zeros(2, 3), torch.zeros(2, dtype=torch.bfloat16)]  # copied per dtype

    def cache(*states):
        return SimpleNamespace(layers=[SimpleNamespace(state={"recurrent_state": states[0]}),
                                       SimpleNamespace(state={"recurrent_state": states[1]})])

    buffers = list(step._buffers)
    two = torch.full((2,), 2.0, dtype=torch.bfloat16)
    step.load(cache(torch.ones(2, 3), two))
    assert [b.data_ptr() for b in step._buffers] == [b.data_ptr() for b in buffers]
    assert torch.equal(step._buffers[0], torch.ones(2, 3)) and torch.equal(step._buffers[1], two)
    assert not step.matches(cache(torch.ones(3, 3), two))
    with pytest.raises(ValueError, match="capture a new graph"):
        step.load(cache(torch.ones(2, 3), torch.ones(2)))  # fp32 where the graph holds bf16
    assert torch.equal(step._buffers[1], two)  # nothing copied from a refused cache
