"""Every aggregate its samples decide is recomputed, for every family: on real units (tiny-gla and tiny-gdn on
both perplexity protocols; tiny-gla on a LongBench-E dataset and three of lm-eval's zero-shot tasks, offline on
tests/fixtures), each numeric aggregate of results.json must be what lm-eval's aggregation of its samples
gives (relative 1e-6). An edited aggregate or swapped samples are refused in one line naming the file, by the
readers and by a rerun, which checks a finished unit's files before it takes the unit as finished.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from test_cli_fakes import as_older_unit
from test_cli_run import invoke
from test_reliability import assert_one_line_error, snapshot

from ccq_eval.harness import store
from ccq_eval.harness.store import aggregates
from ccq_eval.task_families import family_of

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODELS = ("tiny-gla", "tiny-gdn")
LONGBENCH_E = "ccq_longbench_e_lcc"
PPL_RUN = ("run", "-m", MODELS[0], "-m", MODELS[1], "-t", "ppl", "--lengths", "256", "--samples-per-cell", "2",
           "--no-report", "--quiet")
OTHER_RUN = ("run", "-m", MODELS[0], "-t", LONGBENCH_E, "-t", "lambada_openai", "-t", "wikitext", "-t", "hellaswag",
             "--limit", "3", "--longbench-dir", str(FIXTURES / "longbench"), "--zeroshot-dir",
             str(FIXTURES / "zeroshot"), "--no-report", "--quiet")
# One metric of each kind of aggregation: the perplexity tasks' own (token-weighted perplexity of (nll, tokens)
# pairs, sums, lm-eval's mean), LongBench-E's mean score overall and per length bucket, and lm-eval's mean,
# perplexity, weighted_perplexity and bits_per_byte. Blocks of 256 tokens make position buckets of 64.
EDITED = [("ccq_ppl_sweep", "ppl@256"), ("ccq_ppl_sweep", "nll@256"), ("ccq_ppl_sweep", "doc_ppl@256"),
          ("ccq_ppl_buckets", "ppl@0-64"), ("ccq_ppl_buckets", "tokens"), (LONGBENCH_E, "score"),
          (LONGBENCH_E, "score_0-4k"), ("hellaswag", "acc_norm"), ("lambada_openai", "perplexity"),
          ("wikitext", "word_perplexity"), ("wikitext", "bits_per_byte")]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """The real units of the module's tests (two runs, about half a minute on a 2-core CPU: tests that use
    them are marked slow)."""
    output = tmp_path_factory.mktemp("aggregates") / "run"
    for args in (PPL_RUN, OTHER_RUN):
        result = invoke(*args, "--output", str(output))
        assert result.exit_code == 0, result.output
    return output


@pytest.fixture
def run_copy(real_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(real_run, copy)
    return copy


def _numeric_metrics(unit: store.StoredUnit, task: str) -> set[str]:
    return {key.partition(",")[0] for key, value in unit.task_results[task].items()
            if "," in key and "_stderr," not in key and isinstance(value, (int, float))}


def _edit(unit: Path, task: str, metric: str, change) -> Path:
    """Change one aggregate of a unit's results.json and drop its record, as in a unit written before the
    record existed (otherwise the record refuses the edited file first)."""
    path = unit / store.RESULTS_FILE
    results = json.loads(path.read_text())
    results["results"][task][f"{metric},none"] = change(results["results"][task][f"{metric},none"])
    path.write_text(json.dumps(results))
    as_older_unit(unit)
    return path


@pytest.mark.slow
def test_every_aggregate_of_every_family_is_its_samples_aggregate(real_run):
    units = store.load_results(real_run)
    families = set()
    for unit in units:
        (task,) = unit.leaf_tasks()
        families.add(family_of(task).name)
        found = aggregates.recompute_task(unit.results, task, unit.samples(task))
        assert {item.metric for item in found} == _numeric_metrics(unit, task), task  # none left unchecked
        for item in found:
            assert item.n_samples > 0 and item.value is not None, (task, item.metric)
            assert math.isclose(item.value, item.stored, rel_tol=aggregates.RELATIVE_TOLERANCE), (task, item)
    assert families == {"ppl", "longbench-e", "zeroshot"}, families
    assert invoke("table", str(real_run)).exit_code == 0


@pytest.mark.slow
@pytest.mark.parametrize(("task", "metric"), EDITED)
def test_an_edited_aggregate_is_refused_in_one_line(run_copy, task, metric):
    path = _edit(store.unit_dir(run_copy, MODELS[0], task).path, task, metric, lambda v: v * (1 + 1e-5) + 1e-5)
    for args in (["table", str(run_copy)], ["compare", str(run_copy), "--baseline", MODELS[0], "--variant",
                                            MODELS[1]]):
        assert_one_line_error(invoke(*args), str(path), f"{task} {metric} = ", "samples is", "delete")


@pytest.mark.slow
def test_a_difference_within_the_tolerance_reads(run_copy):
    task, metric = "ccq_ppl_sweep", "ppl@256"
    _edit(store.unit_dir(run_copy, MODELS[0], task).path, task, metric, lambda v: v * (1 + 1e-9))
    assert invoke("table", str(run_copy)).exit_code == 0


@pytest.mark.slow
@pytest.mark.parametrize("recorded", [True, False])
def test_swapped_samples_are_refused(run_copy, recorded):
    task = "ccq_ppl_sweep"
    first, second = (store.unit_dir(run_copy, model, task) for model in MODELS)
    if not recorded:  # written before the record existed: the aggregates are what catches the swap
        as_older_unit(first.path)
        as_older_unit(second.path)
    parked = first.samples(task).rename(run_copy / "parked.jsonl")
    second.samples(task).rename(first.samples(task))
    parked.rename(second.samples(task))
    expected = ((str(second.samples(task)), "is not the file its unit wrote") if recorded
                else (str(second.results), "token-weighted perplexity of its 2 samples", "swapped"))
    assert_one_line_error(invoke("table", str(run_copy)), *expected)


@pytest.mark.slow
def test_a_rerun_takes_unedited_finished_units(run_copy):
    result = invoke(*PPL_RUN, "--output", str(run_copy))
    assert result.exit_code == 0, result.output
    assert "0 evaluated, 4 skipped" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("edit", ["swapped samples", "edited aggregate"])
def test_a_rerun_checks_a_finished_units_files_before_taking_it(run_copy, edit):
    task = "ccq_ppl_buckets"
    first, second = (store.unit_dir(run_copy, model, task) for model in MODELS)
    if edit == "swapped samples":
        shutil.copyfile(second.samples(task), first.samples(task))
        expected: tuple[str, ...] = (str(first.samples(task)), "is not the file its unit wrote", "swapped")
    else:
        path = _edit(first.path, task, "ppl", lambda v: v + 0.5)
        expected = (str(path), f"{task} ppl = ", "token-weighted perplexity", "delete")
    before = snapshot(run_copy)
    assert_one_line_error(invoke(*PPL_RUN, "--output", str(run_copy)), *expected)
    assert snapshot(run_copy) == before


def test_aggregate_is_lm_evals_aggregation_of_logged_values():
    """The shared recomputation (also what per-cell rows can use): lm-eval's functions on values as JSON logs
    them (pairs as lists); None for an aggregation it does not recompute or values of the wrong shape."""
    assert aggregates.aggregate([1, 0, True], "mean") == pytest.approx(2 / 3, rel=1e-12)
    assert aggregates.aggregate([3.0, 1.0, 4.0, 2.0], "median") == 3.0  # lm-eval's: sorted(values)[n // 2]
    assert aggregates.aggregate([-1.0, -3.0], "perplexity") == pytest.approx(math.exp(2.0), rel=1e-12)
    pairs = [[-2.0, 1], [-4.0, 3]]
    assert aggregates.aggregate(pairs, "weighted_perplexity") == pytest.approx(math.exp(6 / 4), rel=1e-12)
    assert aggregates.aggregate(pairs, "bits_per_byte") == pytest.approx(6 / 4 / math.log(2), rel=1e-12)
    assert aggregates.aggregate([[1, 0], [0, 0]], "f1") is None
    assert aggregates.aggregate([1.0, "1.0"], "mean") is None
    assert aggregates.aggregate([1.0, 2.0], "weighted_perplexity") is None
