"""The sniah section's tie-aware agreement (benchlib.generation_sections: parting_point, classify_split,
compare_texts) and the issue-54 targets and table read off it (benchlib.report), on hand-built logits, the
32K test tokenizer and a stand-in model: fast, CPU only."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CONTEXT = "The special magic number for stormy-rocket mentioned in the provided text is"


@pytest.fixture
def benchlib(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from benchlib import generation_sections, report, workload

    return SimpleNamespace(sections=generation_sections, report=report, workload=workload)


@pytest.fixture
def tokenizer(benchlib):
    return benchlib.workload.load_tokenizer("mistral")[0]


def _logits(values: dict[int, float], vocab: int = 16, rest: float = -4.0) -> torch.Tensor:
    row = torch.full((vocab,), rest)
    for token, value in values.items():
        row[token] = value
    return row


def test_classify_split_near_tie_counts_and_clear_gap_does_not(benchlib):
    classify = benchlib.sections.classify_split
    eps = torch.finfo(torch.bfloat16).eps
    # Top logit 8.0: one ulp of the logit scale is 8 * eps; tokens 3 (reference) and 5 (tested).
    near = classify(_logits({3: 8.0, 5: 8.0 - 2 * 8 * eps}), 3, 5, torch.bfloat16)
    assert near["tie"] is True and near["gap_ulps"] == pytest.approx(2.0)
    assert near["reference_rank"] == 0 and near["tested_rank"] == 1
    clear = classify(_logits({3: 8.0, 5: 8.0 - 40 * 8 * eps}), 3, 5, torch.bfloat16)
    assert clear["tie"] is False and clear["gap_ulps"] == pytest.approx(40.0)
    assert clear["gap"] == pytest.approx(40 * 8 * eps)
    # The tolerance is the module's: just inside and just outside TIE_ULPS.
    ulps = benchlib.sections.TIE_ULPS
    assert classify(_logits({3: 8.0, 5: 8.0 - (ulps - 0.5) * 8 * eps}), 3, 5, torch.bfloat16)["tie"] is True
    assert classify(_logits({3: 8.0, 5: 8.0 - (ulps + 0.5) * 8 * eps}), 3, 5, torch.bfloat16)["tie"] is False
    # The same gap is a clear one in float32, whose ulps are finer.
    assert classify(_logits({3: 8.0, 5: 8.0 - 2 * 8 * eps}), 3, 5, torch.float32)["tie"] is False
    # Two tokens close to each other but far below the top logit: neither was an argmax there, no tie.
    low = classify(_logits({0: 8.0, 3: 2.0, 5: 2.0}), 3, 5, torch.bfloat16)
    assert low["gap"] == 0.0 and low["tie"] is False and low["reference_rank"] == 1


def test_parting_points_find_the_first_differing_token(benchlib, tokenizer):
    encode = benchlib.workload.encode
    # Decoded texts have no leading space (the decoder drops the first token's): in context "isapples",
    # alone "▁apples"; both are candidates, the text's own tokens second.
    tested, reference = "apples and pears are green", "apples and pears were sold"
    points = benchlib.sections.parting_points(tokenizer, CONTEXT, tested, reference)
    alone = points[-1]
    assert alone["how"] == "tokens" and alone["common"] == encode(tokenizer, "apples and pears")
    assert tokenizer.decode(alone["common"] + [alone["tested_token"]]) == "apples and pears are"
    assert tokenizer.decode(alone["common"] + [alone["reference_token"]]) == "apples and pears were"
    for point in points:
        assert tokenizer.decode(point["common"]) == "apples and pears"
    # A text that stops where the other goes on ends at EOS.
    ended = benchlib.sections.parting_points(tokenizer, CONTEXT, "apples", "apples and")
    assert ended and all(p["tested_token"] == tokenizer.eos_token_id for p in ended)
    # The first candidate continues the context's tokens: its first token need not start a word.
    glued, own = benchlib.sections.generated_ids(tokenizer, CONTEXT, "bell<>();Curve")
    assert tokenizer.decode(encode(tokenizer, CONTEXT) + glued).endswith("text isbell<>();Curve")
    assert own == encode(tokenizer, "bell<>();Curve") != glued
    # A text that does not decode back from its ids (a special token's text): only the common characters'
    # ids are trusted.
    lossy = benchlib.sections.parting_points(tokenizer, CONTEXT, "one two thr</s>ee", "one two four")
    assert lossy and all(p["how"] == "common characters" for p in lossy)
    assert all(tokenizer.decode(p["common"]) == "one two" for p in lossy)


class StandInModel(torch.nn.Module):
    """Logits that make greedy decoding pick `path` after `prompt_length` tokens and `last` after it: at
    each position, the next token of the path 2.0 above the rest. Its cache is the number of tokens read;
    `inputs` holds each sequence it was fed (a prefill, then its cached steps)."""

    def __init__(self, prompt_length: int, path: list[int], last: torch.Tensor):
        super().__init__()
        self.prompt_length, self.path, self.last, self.inputs = prompt_length, path, last, []

    def forward(self, input_ids, use_cache=False, past_key_values=None):
        assert use_cache is True
        if past_key_values is None:
            self.inputs.append([])
        self.inputs[-1] += input_ids[0].tolist()
        start = past_key_values or 0
        logits = torch.zeros(1, input_ids.shape[1], self.last.shape[0])
        for offset in range(input_ids.shape[1]):
            step = start + offset - (self.prompt_length - 1)  # generated tokens before this position's next
            if 0 <= step < len(self.path):
                logits[0, offset, self.path[step]] = 2.0
            elif step == len(self.path):
                logits[0, offset] = self.last
        return SimpleNamespace(logits=logits, past_key_values=start + input_ids.shape[1])


def test_generation_path_logits_are_the_forwards_over_prompt_and_answer(benchlib):
    """A prefill with a cache and one cached step per token: the logits one forward gives (float32)."""
    workload = benchlib.workload
    shape = dict(workload.SHAPES_SMOKE["delta_net"])
    model = workload.build_fla_model("delta_net", shape, 300, torch.device("cpu"), torch.float32)
    ids = torch.randint(3, 300, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    path = benchlib.sections.generation_path_logits(model, ids[:80], ids[80:], torch.device("cpu"))
    whole = model(input_ids=torch.tensor([ids])).logits[0, 79:]
    assert path.shape == whole.shape
    torch.testing.assert_close(path, whole, rtol=1e-4, atol=1e-5)


def test_compare_texts_judges_each_differing_sample_on_its_generation_path(benchlib, tokenizer):
    tested, reference = "one two three", "one two four"
    point = benchlib.sections.parting_points(tokenizer, CONTEXT, tested, reference)[0]
    prompt = benchlib.workload.prefix_ids(tokenizer) + benchlib.workload.encode(tokenizer, CONTEXT)
    vocab, eps = len(tokenizer), torch.finfo(torch.bfloat16).eps
    tied = _logits({point["reference_token"]: 6.0, point["tested_token"]: 6.0 - 6 * eps}, vocab)
    model = StandInModel(len(prompt), point["common"], tied)
    bench = SimpleNamespace(tokenizer=tokenizer, device=torch.device("cpu"), dtype=torch.bfloat16)
    splits = benchlib.sections.compare_texts(bench, model, False, [CONTEXT] * 3, [tested, reference, tested],
                                             [reference, reference, reference])
    assert splits[1] is None and splits[0] == splits[2]
    assert splits[0]["tie"] is True and splits[0]["prefix_consistent"] is True
    assert splits[0]["tested_rank"] == 1 and splits[0]["reference_rank"] == 0
    assert splits[0]["first_divergence_token"] == len(point["common"]) > 0
    # One prefill and its steps per differing sample, over BOS, the prompt and the tokens the texts share.
    assert model.inputs == [prompt + point["common"]] * 2
    # A model that would not have generated the shared tokens: the split is judged in a context other
    # than the texts', so no tie (after a forward for each candidate tokenization).
    model.path, model.inputs = [point["common"][0] + 1, *point["common"][1:]], []
    off = benchlib.sections.compare_texts(bench, model, False, [CONTEXT], [tested], [reference])[0]
    assert off["prefix_consistent"] is False and off["tie"] is False and 1 <= len(model.inputs) <= 2
    # The same split with a clear gap is no tie; the row records the comparison's fields.
    model.path, model.last = point["common"], _logits({point["reference_token"]: 6.0, point["tested_token"]: 4.0},
                                                       vocab)
    row = {"arch": "kda", "ccq": False, "method": "ccq_adapter", "length": 512, "batch": None,
           "texts": [tested, reference], "same_text_as_batch1_fraction": 0.5}
    bench.attempt = lambda section, case, fn: fn()
    benchlib.sections._near_ties(bench, model, [CONTEXT] * 2, row, {"texts": [reference, reference]}, "batch1")
    assert row["ties_vs_batch1_fraction"] == 0.0 and row["first_divergence_tokens_vs_batch1"][1] is None
    assert row["first_divergence_tokens_vs_batch1"][0] == len(point["common"])
    assert row["max_gap_ulps_vs_batch1"] == pytest.approx(2.0 / (eps * 6.0))
    assert row["splits_vs_batch1"][0]["tie"] is False


def _row(batch, splits_b1=None, splits_hflm=None, speedup=100.0):
    row = {"arch": "kda", "ccq": False, "method": "ccq_adapter", "length": 8192, "batch": batch,
           "batch_size": 64 if batch is None else 1, "graphs": True, "samples": 2, "seconds_per_sample": 0.1,
           "speedup_vs_hflm": speedup, "cuda_graphs": True}
    for against, splits in (("batch1", splits_b1), ("hflm", splits_hflm)):
        if splits is not None:
            row[f"splits_vs_{against}"] = splits
            gaps = [s["gap_ulps"] for s in splits if s and "gap_ulps" in s]
            row[f"max_gap_ulps_vs_{against}"] = max(gaps, default=None)
    return row


def test_issue_54_targets_pass_on_equal_texts_or_near_ties_only(benchlib):
    target = benchlib.report._fla_sniah_target
    tie, gap = {"tie": True, "gap_ulps": 3.0}, {"tie": False, "gap_ulps": 90.0}
    assert target(_row(None, splits_b1=[None, tie]))["passed"] is True
    assert target(_row(None, splits_b1=[None, gap]))["passed"] is False
    assert target(_row(None, splits_b1=[tie, tie], speedup=40.0))["passed"] is False
    assert target(_row(1, splits_hflm=[tie, None]))["passed"] is True
    assert target(_row(1, splits_hflm=[{"how": "unresolved", "tie": False}, None]))["passed"] is False
    # A report from before the tie check: exact equality.
    assert target({**_row(1), "same_text_fraction": 0.5})["passed"] is False
    assert target({**_row(None), "same_text_as_batch1_fraction": 1.0})["passed"] is True
    table = "".join(benchlib.report._sniah_section([_row(None, splits_b1=[None, tie], splits_hflm=[gap, None])]))
    assert "| same text (or near-tie split) | max gap ulps | same text as batch 1 (or near-tie split) |" in table
    assert "| 1 + 0 ties / 2 | 90.0 | 1 + 1 ties / 2 | 3.0 |" in table
