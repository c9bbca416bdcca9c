"""Batch sizes of the adapter (ccq_eval.harness.batching): the pure sizing rule, batches whose longest
row decides their size, and the adapter's auto sizing with the memory probe replaced by a stub (the
sizes that ran, the answers unchanged, what meta.json records)."""

from __future__ import annotations

import pytest
import torch
from adapter_support import byte_tokenizer
from lm_eval.api.instance import Instance

from ccq_eval.harness import adapter as adapter_module
from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.harness.batching import AUTO_BATCH_CAP, MEMORY_SHARE, BatchSizer, RowCost, auto_batch_size
from ccq_eval.harness.scoring import batches
from ccq_eval.harness.unit_evaluator import batch_sizes_meta
from ccq_eval.model.modeling_ccq import CCQGLAConfig, CCQGLAForCausalLM, prepare_runtime

prepare_runtime()  # fla's CPU backend and the CCQ model types

GiB = 2**30


def test_auto_batch_size_grows_with_free_memory_and_shrinks_with_length():
    free_steps = [GiB * k for k in (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144)]
    by_free = [auto_batch_size(free, 8192, 100_000, cap=64) for free in free_steps]
    assert by_free == sorted(by_free) and by_free[0] < by_free[-1]
    lengths = [1024, 2048, 4096, 8192, 20480, 32768]
    by_length = [auto_batch_size(40 * GiB, tokens, 100_000, cap=64) for tokens in lengths]
    assert by_length == sorted(by_length, reverse=True) and by_length[0] > by_length[-1]
    for size in by_free + by_length:
        assert size >= 1 and size & (size - 1) == 0  # powers of two: few CUDA graph shapes


def test_auto_batch_size_counts_rows_state_and_cap():
    assert auto_batch_size(10_000, 10, 100, cap=64) == 8  # 10 rows of 1000 bytes fit: 8, a power of two
    assert auto_batch_size(10_000, 10, 100, cap=64, fixed_bytes_per_row=1000) == 4  # 5 rows with state
    assert auto_batch_size(10**15, 10, 100, cap=64) == 64
    assert auto_batch_size(10**15, 10, 100, cap=48) == 32  # the largest power of two under the cap
    assert auto_batch_size(1000, 10, 100, cap=64) == 1  # exactly one row
    assert auto_batch_size(10**6, 10, 0.0, cap=16) == 16  # nothing measured per row: the cap
    # one_forward: one row's forward (1000 bytes) beside every row's state: 9 rows of 1000 bytes fit
    assert auto_batch_size(10_000, 10, 100, cap=64, fixed_bytes_per_row=1000, one_forward=True) == 8
    assert auto_batch_size(10_000, 10, 100, cap=64, one_forward=True) == 64  # no state: the cap
    with pytest.raises(MemoryError, match="one row of 200 tokens"):
        auto_batch_size(10_000, 200, 100, cap=64, one_forward=True)  # the forward alone does not fit


def test_auto_batch_size_refuses_when_one_row_does_not_fit():
    with pytest.raises(MemoryError, match="one row of 20480 tokens needs about"):
        auto_batch_size(GiB, 20480, 100_000, cap=64)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        auto_batch_size(GiB, 10, 10, cap=0)


def test_batches_take_as_many_rows_as_their_longest_row_allows():
    lengths = [5, 40, 12, 39, 30, 8, 20]
    rows_for = {40: 2, 30: 1, 20: 4, 12: 4, 8: 8}.get
    groups = list(batches(lengths, lambda longest: rows_for(longest), any_length=True))
    assert [[lengths[i] for i in group] for group in groups] == [[40, 39], [30], [20, 12, 8, 5]]
    equal = [7, 7, 7, 3, 3, 3, 3, 3]
    groups = list(batches(equal, lambda length: {7: 2, 3: 4}[length]))
    assert [len(group) for group in groups] == [2, 1, 4, 1]
    assert list(batches(equal, 3)) == list(batches(equal, lambda _length: 3))  # an int: every group


def test_sizer_measures_once_and_reads_free_memory_per_call():
    measured, probed = [], []
    sizer = BatchSizer(None, chunk_size=100, cap=64,
                       measure=lambda: measured.append(1) or RowCost(bytes_per_token=10, state_bytes=500),
                       free_memory=lambda: probed.append(1) or 10_000 / MEMORY_SHARE)
    score, generate = sizer.rows_for(generation=False), sizer.rows_for(generation=True)
    assert (len(measured), len(probed)) == (1, 2)
    assert score(50) == 8  # 10000 / (50 * 10 + 500): 10 rows
    assert generate(50) == 4  # the state counted twice (the eager cache and the graph's copy): 6 rows
    assert score(500) == score(100) == 4  # a row counts one forward slice (chunk_size) of its tokens
    assert (sizer.auto, sizer.max_rows) == (True, 64)
    fixed = BatchSizer(3, chunk_size=100)
    assert (fixed.auto, fixed.max_rows, fixed.rows_for(generation=True)(10**9)) == (False, 3, 3)


def test_logits_count_by_the_positions_that_form_them():
    # 10 bytes per token of the body, 100 per position whose logits are formed, 500 of state; 10000 free.
    sizer = BatchSizer(None, chunk_size=100, cap=64, logits_chunk=20,
                       measure=lambda: RowCost(bytes_per_token=10, state_bytes=500, head_bytes_per_position=100),
                       free_memory=lambda: 10_000 / MEMORY_SHARE)
    # scoring: 50 * 10 + 20 positions * 100 + 500 = 3000 bytes a row (3 rows fit); 8 tokens: 8 positions
    assert sizer.planned_row_bytes(50, generation=False) == 3000
    assert sizer.rows_for(generation=False)(50) == 2
    assert sizer.planned_row_bytes(8, generation=False) == 8 * 10 + 8 * 100 + 500
    # generation: 3 positions' logits whatever the prompt's length, the state twice: 50 * 10 + 300 + 1000
    assert sizer.planned_row_bytes(50, generation=True) == 1800
    assert sizer.rows_for(generation=True)(50) == 4  # 5 rows fit
    assert sizer.planned_row_bytes(500, generation=True) == 100 * 10 + 300 + 1000  # one slice of 100 tokens


@pytest.fixture
def auto_lm(monkeypatch):
    """An adapter on the CPU with auto sizing as on the CUDA fast path: each row costs 1000 bytes per token
    and 100 KB are free to batches, so a batch takes 100 / (longest row's tokens) rows, a power of two."""
    # batch_size "auto" (None) stays auto on the CPU; graphs off (they need CUDA).
    monkeypatch.setattr(adapter_module, "resolve_fast_path",
                        lambda device_type, recurrent, batch_size, cuda_graphs, **kwargs: (batch_size, False))
    monkeypatch.setattr(adapter_module, "measure_row_cost", lambda *args, **kwargs: RowCost(1000, 0))
    monkeypatch.setattr(adapter_module, "free_memory_bytes", lambda device: 100_000 / MEMORY_SHARE)
    return CCQEvalLM(model=_model(), tokenizer=byte_tokenizer(), chunk_size=64)


def _model():
    torch.manual_seed(0)
    return CCQGLAForCausalLM(CCQGLAConfig(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=384,
                                          use_short_conv=True)).double().eval()


def test_auto_adapter_sizes_shared_prefill_batches_by_their_longest_prompt(auto_lm):
    # Byte tokens, no BOS: 40, 39, 30, 20, 19, 18, 17, 12, 8 tokens. A shared prefill runs the rows'
    # forwards together, so each row counts one: longest first, 100 / tokens rows: 40 -> 2 rows; 30 -> 2
    # (with 20); 19 -> 4 (19, 18, 17, 12); 8 -> 8 (only one prompt left).
    auto_lm.generator.shared_prefill = True
    prompts = ["x" * n for n in (8, 40, 17, 30, 19, 12, 39, 20, 18)]
    requests = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 6}), i)
                for i, p in enumerate(prompts)]
    assert auto_lm.batch_size_auto and auto_lm.batch_size == AUTO_BATCH_CAP
    texts = auto_lm.generate_until(requests)
    assert auto_lm.batch_sizes_run == {2: 2, 4: 1, 1: 1}
    single = CCQEvalLM(model=auto_lm.model, tokenizer=byte_tokenizer(), batch_size=1, chunk_size=64)
    assert texts == single.generate_until(requests)
    assert batch_sizes_meta(auto_lm, auto_lm.batch_size) == {
        "batch_size": 4, "batch_sizes_run": {"4": 1, "2": 2, "1": 1}}
    assert batch_sizes_meta(single, single.batch_size) == {"batch_size": 1, "batch_sizes_run": {"1": 9}}


def test_auto_adapter_sizes_generation_batches_by_state_and_one_forward(auto_lm, monkeypatch):
    """Prompts prefilled one at a time (the default): a batch holds one prompt's forward beside every
    row's state (twice: the cache and the decode graph's copy), here 1000 bytes a token and 2 * 5000 a row."""
    monkeypatch.setattr(adapter_module, "measure_row_cost", lambda *args, **kwargs: RowCost(1000, 5000))
    prompts = ["x" * n for n in (8, 40, 17, 30, 19, 12, 39, 20, 18)]
    requests = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 6}), i)
                for i, p in enumerate(prompts)]
    texts = auto_lm.generate_until(requests)
    # 40 tokens: (100000 - 40000) // 10000 = 6 rows -> 4 (40, 39, 30, 20); 19: 8 rows, 5 prompts left
    assert auto_lm.batch_sizes_run == {4: 1, 5: 1}
    single = CCQEvalLM(model=auto_lm.model, tokenizer=byte_tokenizer(), batch_size=1, chunk_size=64)
    assert texts == single.generate_until(requests)


def test_auto_adapter_prefills_prompts_of_one_length_in_forwards_that_fit(auto_lm, monkeypatch):
    """Prompts of one length share a prefill forward only as far as the memory beside the batch's
    states holds their slices: 30 tokens at 1000 bytes, 4 rows of 10000 bytes in 100000 -> 2 per forward."""
    monkeypatch.setattr(adapter_module, "measure_row_cost", lambda *args, **kwargs: RowCost(1000, 5000))
    forward_rows = []
    run = auto_lm.scorer.run

    def counted_run(ids, *args, **kwargs):
        forward_rows.append(ids.shape[0])
        return run(ids, *args, **kwargs)

    monkeypatch.setattr(auto_lm.scorer, "run", counted_run)
    requests = [Instance("generate_until", {}, (letter * 30, {"until": [], "max_gen_toks": 6}), i)
                for i, letter in enumerate("abcdef")]
    texts = auto_lm.generate_until(requests)
    assert auto_lm.batch_sizes_run == {4: 1, 2: 1}  # (100000 - 30000) // 10000 = 7 rows -> 4
    assert forward_rows == [2, 2, 2]
    single = CCQEvalLM(model=auto_lm.model, tokenizer=byte_tokenizer(), batch_size=1, chunk_size=64)
    assert texts == single.generate_until(requests)


def test_auto_adapter_sizes_scoring_batches_by_their_length(auto_lm):
    # 25 tokens: 4 rows, three texts of that length; 10 tokens: 8 rows, two texts.
    texts = ["abcdefghijklmnopqrstuvwxy", "ABCDEFGHIJKLMNOPQRSTUVWXY", "a quick brown fox jumps o",
             "0123456789", "9876543210"]
    requests = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(texts)]
    scored = auto_lm.loglikelihood_rolling(requests)
    assert auto_lm.batch_sizes_run == {3: 1, 2: 1}
    single = CCQEvalLM(model=auto_lm.model, tokenizer=byte_tokenizer(), batch_size=1, chunk_size=64)
    expected = single.loglikelihood_rolling(requests)
    for got, want in zip(scored, expected, strict=True):
        assert got.token_nll == pytest.approx(want.token_nll, rel=1e-9, abs=1e-9)  # float64: rounding only


def test_auto_adapter_runs_one_row_where_the_estimate_fits_none(auto_lm, monkeypatch, caplog):
    """The row cost is an upper bound: where it says not even one row fits, batches of one run (as
    batch_size=1 would), with a warning that says why."""
    monkeypatch.setattr(adapter_module, "free_memory_bytes", lambda device: 30_000 / MEMORY_SHARE)
    requests = [Instance("generate_until", {}, (p, {"until": [], "max_gen_toks": 2}), i)
                for i, p in enumerate(["x" * 40, "y" * 40, "z" * 10, "w" * 10])]
    auto_lm.generate_until(requests)
    assert auto_lm.batch_sizes_run == {1: 2, 2: 1}  # 40 tokens: none fits by the estimate; 10: 3 (2)
    assert "one row of 40 tokens needs about" in caplog.text


def test_fits_now_counts_a_further_batch_against_the_memory_free_now():
    free = [10_000 / MEMORY_SHARE]
    sizer = BatchSizer(1, chunk_size=100, measure=lambda: RowCost(bytes_per_token=10, state_bytes=500),
                       free_memory=lambda: free[0])
    # generation: 50 * 10 + 2 * 500 = 1500 bytes a row; 6 rows fit in 10000, 7 do not
    assert sizer.fits_now([50] * 6, generation=True) and not sizer.fits_now([50] * 7, generation=True)
    # prompts prefilled one at a time: one 50-token forward and 1000 bytes a row; 9 rows fit, 10 do not
    assert sizer.fits_now([50] * 9, generation=True, prefill_alone=True)
    assert not sizer.fits_now([50] * 10, generation=True, prefill_alone=True)
    assert sizer.prefill_rows(50, 9) == 9  # a fixed batch size: one forward takes every prompt
    free[0] /= 2  # memory taken since (a batch decoding): read again at each call
    assert not sizer.fits_now([50] * 6, generation=True) and sizer.fits_now([50] * 3, generation=True)
    assert sizer.rows_for(generation=True)(50) == 1  # the fixed size still decides the batches
    assert not BatchSizer(1, chunk_size=100).fits_now([1], generation=True)  # nothing to count by
    with pytest.raises(ValueError, match="together"):
        BatchSizer(1, chunk_size=100, measure=lambda: RowCost(10, 0))
