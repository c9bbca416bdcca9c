"""S-NIAH scoring: RULER's string_match_all on hand cases, per-sample metric keys, and the
metric declarations in the task YAML."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sn = importlib.import_module("ccq_eval.tasks.s_niah.utils")


def ruler_string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    """RULER scripts/eval/synthetic/constants.py, restated (without its final rounding)."""
    per_sample = [sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref) for p, ref in zip(preds, refs)]
    return sum(per_sample) / len(preds) * 100


CASES = [
    # (prediction, gold values, expected score)
    (" 4817263.", ["4817263"], 100.0),
    ("The number is 4817263", ["4817263"], 100.0),
    ("481726", ["4817263"], 0.0),  # a prefix of the value is not the value
    ("no idea", ["4817263"], 0.0),
    ("", ["4817263"], 0.0),
    # case-insensitive
    (" 9B2C4E1A-0000-4000-8000-00000000ABCD is it", ["9b2c4e1a-0000-4000-8000-00000000abcd"], 100.0),
    ("1111111 and 2222222", ["1111111", "3333333"], 50.0),  # fraction of gold values found
    ("1111111, 2222222, 3333333", ["1111111", "2222222", "3333333", "4444444"], 75.0),
]


@pytest.mark.parametrize(("prediction", "gold", "expected"), CASES)
def test_string_match_all_hand_cases(prediction, gold, expected):
    assert sn.string_match_all(prediction, gold) == pytest.approx(expected)
    assert ruler_string_match_all([prediction], [gold]) == pytest.approx(expected)


def test_mean_over_samples_equals_ruler_aggregate():
    preds = [p for p, _, _ in CASES]
    refs = [g for _, g, _ in CASES]
    ours = sum(sn.string_match_all(sn.postprocess_prediction(p), g) for p, g in zip(preds, refs)) / len(preds)
    assert ours == pytest.approx(ruler_string_match_all(preds, refs))


def test_postprocess_matches_ruler():
    # strip, control characters to newlines, strip again
    assert sn.postprocess_prediction("  \t12\x0034\x1f56 \n") == "12\n34\n56"
    assert sn.postprocess_prediction("\x01\x02 7654321") == "7654321"


def test_process_results_reports_overall_and_per_length():
    doc = {"outputs": ["4817263"], "length": 2048}
    assert sn.process_results(doc, ["It is 4817263."]) == {"acc": 100.0, "acc_2048": 100.0}
    assert sn.process_results(doc, ["It is 1234567."]) == {"acc": 0.0, "acc_2048": 0.0}


def test_yaml_declares_a_metric_for_every_supported_length():
    template = (ROOT / "tasks/s_niah/_s_niah_template_yaml").read_text(encoding="utf-8")
    declared = re.findall(r"- metric: (\S+)\n\s+aggregation: mean\n\s+higher_is_better: true", template)
    assert declared[0] == "acc"
    assert [int(m.removeprefix("acc_")) for m in declared[1:]] == list(sn.METRIC_LENGTHS)
    assert 1024 in sn.METRIC_LENGTHS and 20480 in sn.METRIC_LENGTHS and 131072 in sn.METRIC_LENGTHS
    assert 1048576 in sn.METRIC_LENGTHS and 3000 not in sn.METRIC_LENGTHS
    for key in ("max_gen_toks: 128", "do_sample: false", "until: []"):
        assert key in template
    # the ccq adapter's policy lives in the metadata, where other lm-eval models never see it
    assert "\nmetadata:\n  version: 1.0\n  ccq_truncation: error\n" in template
    assert sn.GENERATION_BUDGET == 128
