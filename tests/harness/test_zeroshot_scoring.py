"""Short loglikelihood rows scored fast (ccq_eval.harness.short_requests): right-padded batches and shared
contexts give the scores of each request scored alone, on the zero-shot suite's real requests (lm-eval's
configs on tests/fixtures/zeroshot) for the recurrent models; and the batch plans cover every row once
within their bounds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from adapter_support import byte_tokenizer, one_torch_thread, tiny_model  # noqa: F401
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from ccq_eval.harness import short_requests, zeroshot
from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.harness.short_requests import MAX_PADDING, context_groups, padded_batches, shared_batches
from ccq_eval.harness.task_registry import make_task_manager
from ccq_eval.model.loading import load_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "zeroshot"


@pytest.fixture(scope="module")
def suite_requests() -> dict[str, list]:
    loaded = zeroshot.load_tasks(make_task_manager(), list(zeroshot.ZEROSHOT_TASKS), FIXTURES)
    requests = {}
    for name, task in loaded["tasks"].items():
        task.set_config(key="num_fewshot", value=0)
        task.build_all_requests(rank=0, world_size=1)
        requests[name] = task.instances
    return requests


def test_padded_batches_cover_every_row_once_within_cap_and_padding():
    lengths = [100, 30, 97, 80, 76, 74, 10, 9, 100, 60]
    groups = padded_batches(lengths, lambda longest: 3)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert len(group) <= 3 and lengths[group[0]] == longest
        assert all(lengths[i] >= (1 - MAX_PADDING) * longest for i in group)
    assert groups[0] == [0, 8, 2]  # longest first, as many as the cap allows


def test_context_groups_and_shared_batches():
    rows = [[5, 6, 7, 1], [5, 6, 7, 2, 3], [9, 9, 1], [5, 6, 7, 4], [8, 1], [8, 2]]
    groups, alone = context_groups(rows, [1, 2, 1, 1, 1, 1])
    # rows 0, 1, 3 share [5, 6, 7]; row 2 has its context alone; rows 4, 5 share a 1-token context (too short
    # to read a prefix of)
    assert groups == [[0, 1, 3]] and alone == [2, 4, 5]
    plan = shared_batches([40, 12, 38, 31, 30], [4, 2, 4, 4, 2], [3, 3, 5, 2, 2], lambda tokens: 10)
    assert plan == [[0, 2], [3, 4], [1]]  # 4 + 4 rows, then 4 + 2 (31 >= 0.75 * 40 fails for 30 at 40)


def _choice_requests() -> list[Instance]:
    """Three documents' multiple-choice requests (contexts of different lengths, 2-4 choices each)."""
    documents = [("Question: which is warm?\nAnswer:", [" the sun", " snow", " ice", " a cold stone"]),
                 ("The kettle boiled, so she", [" made tea", " went to sleep on the roof"]),
                 ("Seeds are spread by", [" wind", " birds", " rocks"])]
    return [Instance("loglikelihood", {}, (context, choice), i, ("choices", d, 1))
            for d, (context, choices) in enumerate(documents) for i, choice in enumerate(choices)]


def test_shared_contexts_on_a_kv_cache_model_equal_each_request_alone():
    """A transformer's KV cache (GPT-2 shape, learned positions, float64) copied per choice gives each
    request's score alone; so does the fallback for a model whose cache cannot be copied."""
    tokenizer = byte_tokenizer()
    model = tiny_model(tokenizer)
    requests = _choice_requests()
    want = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=1, share_contexts=False).loglikelihood(requests)
    shared = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=8)
    got = shared.loglikelihood(requests)
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], rel=1e-9, abs=1e-9)
    assert [g[1] for g in got] == [w[1] for w in want]
    # contexts of 32 and 25 bytes are read together (25 >= 0.75 * 32): 4 + 2 rows; then the 19-byte one's 3
    assert shared.batch_sizes_run == {6: 1, 3: 1}

    opaque = CCQEvalLM(model=model, tokenizer=tokenizer, batch_size=8)
    forward = opaque.runtime.forward_features

    def no_copyable_cache(ids, cache, keep, use_cache=True):
        features, _ = forward(ids, None, keep, use_cache=False)
        return features, object()  # a cache without reorder_cache

    opaque.runtime.forward_features = no_copyable_cache
    fallback = opaque.loglikelihood(requests)
    assert [g[0] for g in fallback] == pytest.approx([w[0] for w in want], rel=1e-9, abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-gla", "tiny-gdn"])
def test_shared_contexts_and_padded_batches_equal_each_request_alone(name, suite_requests, monkeypatch):
    """float64 on the CPU backend: every multiple-choice and lambada request of the suite scored with its
    document's context read once (and padded batches of several rows) equals scoring each request alone in
    one pass, within 1e-5, greedy flags equal."""
    model, tokenizer = load_model(name, device="cpu", dtype="float64")
    reads = []
    read_contexts = short_requests.read_contexts
    monkeypatch.setattr(short_requests, "read_contexts",
                        lambda *args, **kwargs: reads.append(1) or read_contexts(*args, **kwargs))
    fast = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048)  # "auto": CPU short-row batches
    alone = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048, batch_size=1, share_contexts=False)
    for task, requests in suite_requests.items():
        if requests[0].request_type != "loglikelihood":
            continue
        got = fast.loglikelihood(requests, disable_tqdm=True)
        want = alone.loglikelihood(requests, disable_tqdm=True)
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-5), task
        assert [g[1] for g in got] == [w[1] for w in want], task
    assert reads and max(fast.batch_sizes_run) > 1
    assert set(alone.batch_sizes_run) == {1}


@pytest.mark.slow
def test_hflm_windows_of_a_recurrent_model_equal_hflm(suite_requests):
    """The HFLM rolling protocol on a recurrent model: each window read from an empty state, as lm-eval's
    HFLM scores it (fla's model through HFLM's forward)."""
    model, tokenizer = load_model("tiny-gla", device="cpu", dtype="float32")
    requests = suite_requests["wikitext"]
    hflm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", max_length=128, batch_size=4,
                add_bos_token=False)
    want = hflm.loglikelihood_rolling(requests, disable_tqdm=True)
    got = CCQEvalLM(model=model, tokenizer=tokenizer, window_tokens=128).loglikelihood_rolling(requests,
                                                                                              disable_tqdm=True)
    assert [float(g) for g in got] == pytest.approx(want, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["tiny-gla", "tiny-gdn"])
def test_cuda_memory_sized_batches_equal_each_request_alone(name, suite_requests):
    """On CUDA (fla's Triton kernels, float32): batches sized by free memory and replayed from CUDA graphs
    (the default), and shared contexts (eager), give each request's score alone, HFLM's windows too, within
    the rounding of those kernels: Triton runs float32 dot products at TF32 precision by default, and which
    kernel runs changes with a forward's length (fla reads 64 tokens or fewer with its recurrent kernel), so
    a continuation scored from a shared context's state differs from the whole row's score by up to about
    1e-3 of it (7e-4 seen on the H200). A lost or misplaced token moves a score by far more."""
    model, tokenizer = load_model(name, device="cuda", dtype="float32")
    alone = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048, batch_size=1, share_contexts=False,
                      cuda_graphs=False)
    default = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048)  # "auto": memory-sized, graphs
    shared = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048, share_contexts=True)
    assert default.batch_size_auto and default.cuda_graphs and not default.scorer.share_contexts
    for task, requests in suite_requests.items():
        kind = requests[0].request_type
        want = [float(w[0]) if kind == "loglikelihood" else float(w)
                for w in getattr(alone, kind)(requests, disable_tqdm=True)]
        for lm in (default, shared):
            got = [float(g[0]) if kind == "loglikelihood" else float(g)
                   for g in getattr(lm, kind)(requests, disable_tqdm=True)]
            assert got == pytest.approx(want, rel=2e-3, abs=0.05), (task, lm.scorer.share_contexts)
    assert max(default.batch_sizes_run) > 1 and max(shared.batch_sizes_run) > 1
