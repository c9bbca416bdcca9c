"""LongBench task configs: templates and constants against the official config files, loading
through lm-eval's TaskManager, prompts of fixture records, data errors, categories."""

import importlib
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "tasks" / "longbench"
FIXTURES = ROOT / "tests" / "fixtures" / "longbench"
# Verbatim copies of THUDM/LongBench@2e00731f LongBench/config/dataset2prompt.json and dataset2maxlen.json
REFERENCE_PROMPTS = json.loads((FIXTURES / "reference" / "dataset2prompt.json").read_text(encoding="utf-8"))
REFERENCE_MAXLEN = json.loads((FIXTURES / "reference" / "dataset2maxlen.json").read_text(encoding="utf-8"))

V1 = ["narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
      "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
      "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p"]
E = ["qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "triviaqa",
     "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p"]


def _load(name):
    return importlib.import_module(f"ccq_eval.tasks.longbench.{name}")


def _records(file_name, folder=FIXTURES):
    lines = (folder / file_name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _task_manager(metadata):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASK_DIR), include_defaults=False, metadata=metadata)


@pytest.fixture(scope="module")
def loaded():
    manager = _task_manager({"data_dir": str(FIXTURES)})
    return manager.load(["ccq_longbench", "ccq_longbench_e"])


# --------------------------------------------------------------------------------- facts


def test_spec_matches_official_config_files():
    spec = _load("spec")
    assert spec.DATASET_PROMPT == REFERENCE_PROMPTS
    assert spec.DATASET_MAX_NEW_TOKENS == REFERENCE_MAXLEN
    assert list(spec.LONGBENCH_DATASETS) == V1 == list(REFERENCE_PROMPTS)
    assert list(spec.LONGBENCH_E_DATASETS) == E
    assert {"trec", "triviaqa", "samsum", "lsht"} == spec.FIRST_LINE_DATASETS
    # every metric name resolves to a function
    metrics = _load("metrics")
    assert set(spec.DATASET_METRIC) == set(V1)
    assert set(spec.DATASET_METRIC.values()) <= set(metrics.METRICS)


def test_generated_yaml_files_are_current():
    generator = _load("_generate_yaml")
    expected = generator.expected_files()
    on_disk = {p.name for p in TASK_DIR.glob("ccq_longbench*.yaml")} | {
        p.name for p in TASK_DIR.glob("_longbench*_yaml")}
    assert on_disk == set(expected)
    for name, content in expected.items():
        assert (TASK_DIR / name).read_text(encoding="utf-8") == content, f"{name} is stale: rerun _generate_yaml.py"


def test_categories_cover_longbench():
    categories = _load("categories")
    assert list(categories.DATASET_CATEGORY) == V1
    assert list(categories.LONGBENCH_E_DATASETS) == E
    assert len(categories.ENGLISH_DATASETS) == 14
    assert len(categories.CHINESE_DATASETS) == 5
    assert categories.CODE_DATASETS == ("lcc", "repobench-p")
    assert set(categories.GATED_DELTANET_DATASETS) == set(categories.ENGLISH_DATASETS + categories.CODE_DATASETS) - {
        "passage_count", "passage_retrieval_en"}


def test_leaderboard_average_reproduces_published_numbers():
    categories = _load("categories")
    # ChatGLM3-6B-32k per-dataset scores from LongBench's README tables
    scores = {
        "narrativeqa": 26.0, "qasper": 43.3, "multifieldqa_en": 51.7, "multifieldqa_zh": 62.3,
        "hotpotqa": 54.4, "2wikimqa": 44.9, "musique": 40.4, "dureader": 44.78,
        "gov_report": 36.8, "qmsum": 23.9, "multi_news": 27.9, "vcsum": 17.8,
        "trec": 79.0, "triviaqa": 87.1, "samsum": 38.2, "lsht": 42.0,
        "passage_count": 2.0, "passage_retrieval_en": 99.0, "passage_retrieval_zh": 94.0,
        "lcc": 57.66, "repobench-p": 54.76,
    }
    # published English row: 48.5 | 40.3 | 46.6 | 29.5 | 68.1 | 56.2 (code) | 50.5 (synthetic)
    english = categories.category_averages(scores, language="en")
    published = {"single_doc_qa": 40.3, "multi_doc_qa": 46.6, "summarization": 29.5, "few_shot": 68.1,
                 "code": 56.2, "synthetic": 50.5}
    for slug, value in published.items():
        assert english[slug] == pytest.approx(value, abs=0.05)
    assert categories.leaderboard_average(scores, "en") == pytest.approx(48.5, abs=0.05)
    # published Chinese row: 52.8 | 62.3 | 44.8 | 17.8 | 42.0 | 56.2 | 94.0
    assert categories.leaderboard_average(scores, "zh") == pytest.approx(52.8, abs=0.05)
    with pytest.raises(ValueError, match="categories"):
        categories.leaderboard_average({"qasper": 10.0}, "en")
    with pytest.raises(ValueError, match="not LongBench datasets"):
        categories.category_averages({"ruler": 1.0})


def test_scores_from_results():
    categories = _load("categories")
    results = {
        "ccq_longbench_qasper": {"score,none": 12.5, "score_stderr,none": 1.0},
        "ccq_longbench_e_qasper": {"score,none": 20.0, "score_0-4k,none": 30.0},
        "ccq_longbench": {"score,none": 99.0},  # a group, not a dataset
        "ccq_longbench_code": {"score,none": 99.0},
    }
    assert categories.scores_from_results(results) == {"qasper": 12.5}
    assert categories.scores_from_results(results, longbench_e=True) == {"qasper": 20.0}
    assert categories.scores_from_results(results, longbench_e=True, metric="score_0-4k") == {"qasper": 30.0}


# --------------------------------------------------------------------------------- lm-eval loading


def test_all_tasks_and_groups_load(loaded):
    tasks, group_map = loaded["tasks"], loaded["group_map"]
    assert set(tasks) == {f"ccq_longbench_{d}" for d in V1} | {f"ccq_longbench_e_{d}" for d in E}
    assert group_map["ccq_longbench"] == [f"ccq_longbench_{c}" for c in (
        "single_doc_qa", "multi_doc_qa", "summarization", "few_shot", "synthetic", "code")]
    assert group_map["ccq_longbench_single_doc_qa"] == [
        "ccq_longbench_narrativeqa", "ccq_longbench_qasper", "ccq_longbench_multifieldqa_en",
        "ccq_longbench_multifieldqa_zh"]
    assert group_map["ccq_longbench_e_synthetic"] == [
        "ccq_longbench_e_passage_count", "ccq_longbench_e_passage_retrieval_en"]

def test_gdn14_group_loads():
    # lm-eval refuses one run holding a task twice, so this group is loaded on its own
    loaded = _task_manager({"data_dir": str(FIXTURES)}).load(["ccq_longbench_gdn14"])
    assert loaded["group_map"]["ccq_longbench_gdn14"] == [
        f"ccq_longbench_{d}" for d in ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa",
                                       "musique", "gov_report", "qmsum", "multi_news", "trec", "triviaqa",
                                       "samsum", "lcc", "repobench-p")]


@pytest.mark.parametrize("longbench_e", [False, True], ids=["v1", "e"])
def test_requests_are_official_prompts_of_fixture_records(loaded, longbench_e):
    datasets = E if longbench_e else V1
    for dataset in datasets:
        name = f"ccq_longbench_e_{dataset}" if longbench_e else f"ccq_longbench_{dataset}"
        task = loaded["tasks"][name]
        records = _records(f"{dataset}_e.jsonl" if longbench_e else f"{dataset}.jsonl")
        docs = list(task.test_docs())
        assert [doc["_id"] for doc in docs] == [record["_id"] for record in records]
        task.build_all_requests(limit=None, rank=0, world_size=1)
        by_id = {instance.doc["_id"]: instance for instance in task.instances}
        for record in records:
            context, gen_kwargs = by_id[record["_id"]].args
            # pred.py: prompt_format.format(**json_obj), with the official template
            assert context == REFERENCE_PROMPTS[dataset].format(**record), (name, record["_id"])
            assert gen_kwargs == {"until": [], "max_gen_toks": REFERENCE_MAXLEN[dataset], "do_sample": False}, name
            assert task.config.metadata["ccq_truncation"] == "middle", name
            assert by_id[record["_id"]].doc["answers"] == record["answers"]


def test_prompt_keeps_braces_and_trailing_newline(loaded):
    task = loaded["tasks"]["ccq_longbench_lcc"]
    doc = next(iter(task.test_docs()))
    text = task.doc_to_text(doc)
    assert '{"w": w, "h": h}' in text  # braces in the context are not format fields
    assert text.endswith("Next line of code:\n")


# --------------------------------------------------------------------------------- data errors


def test_missing_dataset_file_names_file_and_folder(tmp_path):
    (tmp_path / "qasper.jsonl").write_text((FIXTURES / "qasper.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    manager = _task_manager({"data_dir": str(tmp_path)})
    manager.load(["ccq_longbench_qasper"])  # present: loads
    with pytest.raises(FileNotFoundError) as info:
        manager.load(["ccq_longbench_e_qasper"])
    assert "qasper_e.jsonl" in str(info.value) and str(tmp_path) in str(info.value)


def test_data_subfolder_of_unzipped_archive_is_found(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "trec.jsonl").write_text((FIXTURES / "trec.jsonl").read_text(encoding="utf-8"),
                                                  encoding="utf-8")
    loaded = _task_manager({"data_dir": str(tmp_path)}).load(["ccq_longbench_trec"])
    assert len(list(loaded["tasks"]["ccq_longbench_trec"].test_docs())) == len(_records("trec.jsonl"))


def test_no_data_source_is_a_clear_error():
    with pytest.raises(ValueError, match="data_dir"):
        _task_manager({}).load(["ccq_longbench_qasper"])


def test_hub_unreachable_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: nothing to fall back on
    utils = _load("utils")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="data_dir"):
        utils.load_longbench("qasper", longbench_from_hub=True)


def test_bad_records_are_reported_with_file_and_line(tmp_path):
    utils = _load("utils")
    good = (FIXTURES / "qasper.jsonl").read_text(encoding="utf-8").splitlines()[0]
    record = json.loads(good)
    del record["answers"]
    (tmp_path / "qasper.jsonl").write_text(good + "\n" + json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"qasper.jsonl line 2: record lacks answers"):
        utils.load_longbench("qasper", data_dir=str(tmp_path))
    # a file holding another dataset's records
    (tmp_path / "trec.jsonl").write_text(good + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="record of dataset 'qasper', expected 'trec'"):
        utils.load_longbench("trec", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="valid: qasper"):
        utils.load_longbench("narrativeqa", longbench_e=True, data_dir=str(tmp_path))


def test_metadata_of_other_families_is_ignored():
    utils = _load("utils")
    data = utils.load_longbench("trec", data_dir=str(FIXTURES), version=1.0, max_seq_lengths=[4096],
                                tokenizer="byt5")
    assert data["test"].num_rows == len(_records("trec.jsonl"))
