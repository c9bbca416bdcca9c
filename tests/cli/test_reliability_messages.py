"""One-line messages naming the file, option or value and the fix, for the cases that used to give a
traceback, a misleading message or a silent gap."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from test_cli_fakes import SNIAH_TASK, baseline_correct, revouch, variant_correct, write_sniah
from test_cli_run import invoke
from test_reliability import assert_one_line_error

from ccq_eval.harness.options import PlanError, parse_depths
from ccq_eval.model.loading import ModelLoadError, load_model

MODELS = Path(__file__).resolve().parents[2] / "models"
TOKENIZERS = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers"


def test_report_on_a_corrupt_results_file_names_it(tmp_path):
    unit = write_sniah(tmp_path / "out", "a", baseline_correct)
    (unit / "unit.json").write_text("{}")  # a started unit beside the corrupt one
    (unit / "results.json").write_text('{"results": ')
    assert_one_line_error(invoke("report", str(tmp_path / "out")), str(unit / "results.json"), "not valid JSON")


def test_compare_with_a_missing_samples_file_names_it(tmp_path):
    write_sniah(tmp_path / "out", "a", baseline_correct)
    unit = write_sniah(tmp_path / "out", "b", variant_correct)
    (unit / f"samples_{SNIAH_TASK}.jsonl").unlink()
    (unit / "checksums.json").unlink()  # as results without a record: the count in results.json still tells
    meta = unit / "meta.json"
    meta.write_text(json.dumps(json.loads(meta.read_text()) | {"format": 2}))
    result = invoke("compare", str(tmp_path / "out"), "--baseline", "a", "--variant", "b")
    assert_one_line_error(result, str(unit), f"has no samples_{SNIAH_TASK}.jsonl", "records 24 samples")


def test_depths_that_read_the_same_in_the_tables_are_refused():
    with pytest.raises(PlanError, match=r"both read 33\.33 in the tables"):
        parse_depths("33.333333333333333,33.33333333333333")
    assert parse_depths("33.33,33.34") == [33.33, 33.34]


def test_one_pair_gives_no_confidence_interval(tmp_path):
    from ccq_eval.analysis import stats
    from ccq_eval.harness import store

    for model, correct in (("a", baseline_correct), ("b", variant_correct)):
        unit = write_sniah(tmp_path / "out", model, correct)
        samples = unit / f"samples_{SNIAH_TASK}.jsonl"
        first = samples.read_text().splitlines()[0]
        samples.write_text(first + "\n")
        results = json.loads((unit / "results.json").read_text())
        value = json.loads(first)["acc"]
        results["results"][SNIAH_TASK] = {"acc,none": value, f"acc_{json.loads(first)['doc']['length']},none": value}
        results["n-samples"][SNIAH_TASK] = {"original": 1, "effective": 1}
        results["task_hashes"][SNIAH_TASK] = store.task_hash([json.loads(first)])
        (unit / "results.json").write_text(json.dumps(results))
        revouch(unit)
    frame = stats.compare_models(store.load_results(tmp_path / "out"), "a", "b", n_boot=100)
    assert (frame["n"] == 1).all() and frame["ci_low"].map(math.isnan).all()


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    folder = tmp_path / "tiny-gla"
    shutil.copytree(MODELS / "tiny-gla", folder)
    return folder


def test_a_number_written_as_text_in_config_names_the_file(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"hidden_size": "256"}))
    with pytest.raises(ModelLoadError, match=r"config\.json: \"hidden_size\": '256' is text"):
        load_model(str(checkpoint), device="cpu")


def test_a_tokenizer_of_another_model_is_named(checkpoint):
    for name in ("tokenizer_config.json", "added_tokens.json"):
        (checkpoint / name).unlink()
    for path in (TOKENIZERS / "mistral_v1").iterdir():
        shutil.copy(path, checkpoint / path.name)
    with pytest.raises(ModelLoadError, match=r"tokenizer has 32000 tokens but the model's embedding table only 384"):
        load_model(str(checkpoint), device="cpu")
