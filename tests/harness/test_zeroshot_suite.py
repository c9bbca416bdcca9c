"""The zero-shot suite as lm-eval's own task configs: the alias and family, the paper's columns against
lm-eval's configs, local data through the configs' own keys, the one-line error without data, and
lm_eval.simple_evaluate end to end on the fixtures (tests/fixtures/zeroshot) with the ccq adapter."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from adapter_support import one_torch_thread  # noqa: F401

from ccq_eval.harness import zeroshot
from ccq_eval.harness.task_registry import list_tasks, make_task_manager, resolve_tasks
from ccq_eval.task_families import ZEROSHOT, ZEROSHOT_AVERAGED, ZEROSHOT_PAPER_COLUMNS, ZEROSHOT_TASKS, family_of

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "zeroshot"


@pytest.fixture(scope="module")
def task_manager():
    return make_task_manager()


def test_alias_resolves_to_lm_evals_own_task_names():
    assert resolve_tasks(["zeroshot"]) == list(ZEROSHOT_TASKS)
    assert resolve_tasks("zeroshot,ppl-sweep")[-1] == "ccq_ppl_sweep"
    assert "zeroshot" in list_tasks()


def test_family_claims_the_suite_by_exact_name_with_the_papers_metrics():
    assert all(family_of(task) is ZEROSHOT for task in ZEROSHOT_TASKS)
    assert family_of("hellaswag_de").name == "other"
    primaries = {task: ZEROSHOT.primary_metric_for(task) for task in ZEROSHOT_TASKS}
    assert primaries["hellaswag"] == primaries["arc_challenge"] == "acc_norm"
    assert primaries["wikitext"] == "word_perplexity"
    assert {primaries[t] for t in ZEROSHOT_TASKS if t not in ("hellaswag", "arc_challenge", "wikitext")} == {"acc"}
    assert set(ZEROSHOT_AVERAGED) <= {(task, metric) for task, metric, _ in ZEROSHOT_PAPER_COLUMNS}


def test_suite_names_are_lm_evals_own_entries_without_its_whole_index():
    """The suite's names come from its folders of lm-eval's tree, the very entries lm-eval's whole index
    holds; another lm-eval name still reaches the whole index."""
    from ccq_eval.harness import task_registry

    manager = make_task_manager()
    found = {name: manager._entry(name) for name in ZEROSHOT_TASKS}
    assert not manager._defaults_loaded  # the whole tree was not indexed for them
    whole = task_registry._default_index()
    assert {name: (entry.kind, entry.yaml_path) for name, entry in found.items()} == {
        name: (whole[name].kind, whole[name].yaml_path) for name in ZEROSHOT_TASKS}
    assert manager._entry("mmlu") is whole["mmlu"] and manager._defaults_loaded


def test_the_paper_columns_and_primaries_are_metrics_lm_evals_configs_declare(task_manager):
    for task in ZEROSHOT_TASKS:
        config = zeroshot.task_config(task_manager, task)
        declared = {entry["metric"] for entry in config["metric_list"]}
        assert declared <= set(ZEROSHOT.metrics), task
        assert ZEROSHOT.primary_metric_for(task) in declared, task
        assert {metric for t, metric, _ in ZEROSHOT_PAPER_COLUMNS if t == task} <= declared, task
        assert config["output_type"] in ("multiple_choice", "loglikelihood", "loglikelihood_rolling"), task


def test_local_data_goes_through_the_configs_own_keys(task_manager):
    loaded = zeroshot.load_tasks(task_manager, list(ZEROSHOT_TASKS), FIXTURES)
    assert sorted(loaded["tasks"]) == sorted(ZEROSHOT_TASKS) and not loaded["groups"]
    for name, task in loaded["tasks"].items():
        original = zeroshot.task_config(task_manager, name)
        split = zeroshot.evaluated_split(original)
        fixture = FIXTURES / name / f"{split}.jsonl"
        assert task.config.dataset_path == "json" and task.config.dataset_name is None
        assert task.config.dataset_kwargs == {"data_files": {split: str(fixture)}}
        # lm-eval's own YAML built the task: its prompt, metrics and version, not a copy
        assert task.config.metadata["config_source"].endswith(".yaml") and "lm_eval" in task.config.metadata[
            "config_source"]
        assert task.config.metadata.get("version") == original["metadata"]["version"]
        assert [m["metric"] for m in task.config.metric_list] == [m["metric"] for m in original["metric_list"]]
        assert len(list(task.eval_docs)) == len(fixture.read_text().splitlines())


def test_a_folder_without_the_evaluated_split_is_refused(task_manager, tmp_path):
    (tmp_path / "arc_easy").mkdir()
    (tmp_path / "arc_easy" / "validation.jsonl").write_text((FIXTURES / "arc_easy" / "test.jsonl").read_text())
    with pytest.raises(zeroshot.ZeroshotDataError, match=r"arc_easy/test\.jsonl not found.*test split"):
        zeroshot.task_specs(task_manager, ["arc_easy"], tmp_path)
    # a task without a folder there loads as lm-eval loads it
    assert zeroshot.task_specs(task_manager, ["piqa"], tmp_path) == ["piqa"]


def test_without_data_one_line_names_the_dataset_and_the_command(task_manager, monkeypatch):
    import datasets

    def unreachable(path, name=None, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset_builder", unreachable)
    with pytest.raises(zeroshot.ZeroshotDataError) as raised:
        zeroshot.check_data(task_manager, ["piqa", "arc_easy"], FIXTURES / "nothing here")
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("task piqa: dataset baber/piqa is neither reachable")
    assert """python -c "import datasets; datasets.load_dataset('baber/piqa')\"""" in message
    zeroshot.check_data(task_manager, ["piqa"], FIXTURES)  # the local folder has it: no question asked


def test_an_unreachable_hub_is_one_line_without_asking_datasets(task_manager, monkeypatch, unreachable_hub):
    """The hub allowed (no offline variable) but unreachable: one quick probe, then the one line that says
    to read the cache offline or pass a folder; datasets, which would retry the hub, is never asked."""
    import datasets

    def asked(*args, **kwargs):
        raise AssertionError("datasets.load_dataset_builder was called with the hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset_builder", asked)
    with pytest.raises(zeroshot.ZeroshotDataError) as raised:
        zeroshot.check_data(task_manager, ["piqa"], FIXTURES / "nothing here")
    zeroshot.check_data(task_manager, ["piqa"], FIXTURES)  # a folder that holds it needs no hub
    message = str(raised.value)
    assert "\n" not in message and message.startswith("task piqa: the Hugging Face hub cannot be reached")
    assert "HF_HUB_OFFLINE=1" in message and "--zeroshot-dir FOLDER holding piqa/validation.jsonl" in message


def test_loading_without_data_stops_with_the_one_line_error(task_manager):
    """The real path offline (tests set HF_DATASETS_OFFLINE=1): lm-eval's download of arc_challenge fails
    and the error names it (skipped where this machine's datasets cache holds it)."""
    try:
        zeroshot.load_tasks(task_manager, ["arc_challenge"])
    except zeroshot.ZeroshotDataError as error:
        assert str(error).startswith("task arc_challenge: dataset allenai/ai2_arc (ARC-Challenge) is neither")
        assert "datasets.load_dataset('allenai/ai2_arc', 'ARC-Challenge')" in str(error)
        return
    pytest.skip("the datasets cache holds allenai/ai2_arc")


@pytest.mark.slow
def test_simple_evaluate_runs_the_suite_end_to_end_on_a_recurrent_model(task_manager):
    """lm_eval.simple_evaluate with the adapter on tiny-gla over the suite's real configs: every paper
    column comes out finite and in range, and the results say which rolling protocol scored wikitext."""
    from lm_eval import simple_evaluate

    from ccq_eval.harness.adapter import CCQEvalLM
    from ccq_eval.model.loading import load_model

    model, tokenizer = load_model("tiny-gla", device="cpu", dtype="float32")
    lm = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=2048)
    specs = zeroshot.task_specs(task_manager, list(ZEROSHOT_TASKS), FIXTURES)
    results = simple_evaluate(model=lm, tasks=specs, task_manager=task_manager, bootstrap_iters=0)
    for task, metric, _ in ZEROSHOT_PAPER_COLUMNS:
        value = results["results"][task][f"{metric},none"]
        assert math.isfinite(value), (task, metric)
        assert (value >= 1.0) if "perplexity" in metric else (0.0 <= value <= 1.0), (task, metric, value)
    assert results["config"]["ccq_scoring"]["rolling_protocol_by_task"] == {"wikitext": "hflm"}
    assert results["config"]["ccq_scoring"]["window_tokens"] == 2048
    json.dumps(results["config"])  # stored as JSON by every writer


@pytest.mark.slow
def test_simple_evaluate_gives_hflms_numbers_for_a_softmax_model(task_manager):
    """Every metric of every task of the suite, through lm-eval's evaluator: the adapter on tiny-transformer
    equals lm-eval's HFLM (add_bos_token=False, see test_zeroshot_hflm_parity.py) with the same windows."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from ccq_eval.harness.adapter import CCQEvalLM
    from ccq_eval.model.loading import load_model

    model, tokenizer = load_model("tiny-transformer", device="cpu", dtype="float32")
    runs = {}
    # max_length 256: no request of the fixtures is cut, and wikitext's texts span several windows
    for name, lm in (("hflm", HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=4,
                                   max_length=256, add_bos_token=False)),
                     ("ccq", CCQEvalLM(model=model, tokenizer=tokenizer, max_length=256, window_tokens=256))):
        specs = zeroshot.task_specs(task_manager, list(ZEROSHOT_TASKS), FIXTURES)
        runs[name] = simple_evaluate(model=lm, tasks=specs, task_manager=task_manager, bootstrap_iters=0)["results"]
    for task in ZEROSHOT_TASKS:
        for key, want in runs["hflm"][task].items():
            if isinstance(want, float) and "stderr" not in key:
                assert runs["ccq"][task][key] == pytest.approx(want, rel=1e-5), (task, key)
