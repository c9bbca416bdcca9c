"""benchmarks/paper_suite.py: the synthetic LongBench data it writes (fast) and its CPU smoke scale end to
end (a checkpoint, the data, `ccq-eval run --suite paper` in a new process, the per-task report)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def suite_module():
    return load("ccq_paper_suite", REPO / "benchmarks" / "paper_suite.py")  # puts benchmarks/ on sys.path


@pytest.fixture(scope="module")
def synthetic(suite_module):
    from benchlib import synthetic_longbench

    return synthetic_longbench


def test_sizes_follow_longbench_counts_and_average_lengths(synthetic):
    """At the paper scale every dataset has LongBench's sample count and about its average length; the
    LongBench-E sizes fall in their buckets in the published numbers."""
    from ccq_eval.tasks.longbench import spec

    assert set(synthetic.V1_STATS) == set(spec.LONGBENCH_DATASETS)
    assert set(synthetic.E_BUCKET_COUNTS) == set(spec.LONGBENCH_E_DATASETS)
    assert sum(count for _, count in synthetic.V1_STATS.values()) == 4750  # LongBench's test samples
    for dataset, (average, count) in synthetic.V1_STATS.items():
        sizes = synthetic.sizes(
            dataset, random.Random(dataset), samples=None, length_scale=1.0, longbench_e=False
        )
        assert len(sizes) == count
        assert statistics.mean(sizes) == pytest.approx(average, rel=0.06)
    sizes = synthetic.sizes("qasper", random.Random(0), samples=None, length_scale=1.0, longbench_e=True)
    buckets = [spec.length_bucket(size) for size in sizes]
    assert [buckets.count(name) for name in ("0-4k", "4-8k", "8k+")] == [100, 100, 24]
    assert len(synthetic.sizes("lcc", random.Random(0), samples=3, length_scale=0.5, longbench_e=False)) == 3


def test_records_load_and_fill_the_project_templates(synthetic, tmp_path):
    """Every written file parses as LongBench records (tasks/longbench/utils.py) and fills its template;
    lengths count words (characters in Chinese); answers have the form their metric reads."""
    from ccq_eval.tasks.longbench import categories, spec

    utils = load("ccq_longbench_utils_for_bench", REPO / "tasks" / "longbench" / "utils.py")
    written = synthetic.write_longbench(tmp_path, samples=2, length_scale=0.05)
    assert set(written) == set(spec.LONGBENCH_DATASETS)
    for dataset in spec.LONGBENCH_DATASETS:
        records = list(utils.load_longbench(dataset, data_dir=str(tmp_path))["test"])
        assert len(records) == written[dataset]["samples"] == 2
        for record in records:
            language = categories.DATASET_LANGUAGE[dataset]
            assert record["language"] == language and record["dataset"] == dataset
            words = len(record["context"]) if language == "zh" else len(record["context"].split())
            assert record["length"] == words > 0
            assert "{context}" not in utils.doc_to_text(record) and record["context"] in utils.doc_to_text(
                record
            )
            if dataset in ("trec", "lsht"):
                assert record["answers"][0] in record["all_classes"]
            utils.score_doc(record, record["answers"][0])  # the metric accepts the record
    e_written = synthetic.write_longbench(tmp_path, datasets=("qasper",), samples=3, longbench_e=True)
    assert e_written["qasper_e"]["samples"] == 3 and (tmp_path / "qasper_e.jsonl").is_file()


def test_scale_defaults_and_bad_flags(suite_module):
    paper = suite_module.parse_args([])
    assert paper.archs == ["gla", "gated_deltanet"] and paper.ccq_settings == [True, False]
    smoke = suite_module.parse_args(["--smoke"])
    assert smoke.scale == "smoke" and smoke.archs == ["gla"] and smoke.ccq_settings == [True]
    assert suite_module.parse_args(["--arch", "gdn", "--ccq", "off"]).archs == ["gated_deltanet"]
    with pytest.raises(SystemExit, match="choose from gla, gdn"):
        suite_module.parse_args(["--arch", "mamba"])


def test_1p3b_shapes_are_fla_defaults(suite_module):
    """The 1.3B shapes are fla's GLA / Gated DeltaNet config defaults (the papers' 1.3B models)."""
    from fla.models import GatedDeltaNetConfig, GLAConfig

    for arch, config in (("gla", GLAConfig()), ("gated_deltanet", GatedDeltaNetConfig())):
        for key, value in suite_module.SHAPES_1P3B[arch].items():
            if key not in ("bos_token_id", "eos_token_id"):
                assert getattr(config, key) == value, (arch, key)


@pytest.mark.slow
def test_smoke_times_every_task_of_the_suite(suite_module, tmp_path, monkeypatch):
    """One checkpoint through the whole suite: a row per task with its time; the report is rewritten while
    the run goes on (every second here); a second call on the same --work resumes, every unit stored."""
    monkeypatch.setattr(suite_module, "POLL_S", 1)
    out, work = tmp_path / "report", tmp_path / "work"
    assert suite_module.main(["--smoke", "--work", str(work), "--out", str(out)]) == 0
    report = json.loads((out / "paper_suite.json").read_text(encoding="utf-8"))
    markdown = (out / "paper_suite.md").read_text(encoding="utf-8")
    assert report["schema"] == suite_module.SCHEMA and report["status"] == "complete"
    (run,) = report["runs"]
    assert run["returncode"] == 0 and run["arch"] == "gla" and run["ccq"] is True and run["parameters"] > 0
    assert (
        "--suite paper" in run["command"] and "--longbench-dir" in run["command"] and not run["interrupted"]
    )
    expected = {
        "ccq_s_niah_1",
        "ccq_s_niah_2",
        "ccq_s_niah_3",
        "ccq_ppl_buckets",
        "ccq_ppl_sweep",
        "ccq_longbench_narrativeqa",
        "ccq_longbench_dureader",
        "ccq_longbench_repobench-p",
    }
    assert sorted(row["task"] for row in run["units"]) == sorted(expected)  # only the datasets with data
    for row in run["units"]:
        assert row["status"] == "done" and not row["earlier"]
        assert row["samples"] > 0 and row["wall_s"] > 0 and row["s_per_sample"] > 0
        assert f"| {row['task']} | {row['family']} | done |" in markdown
    summary = run["summary"]
    assert summary["units"] == 8 and summary["failed"] == 0 and summary["earlier_units"] == 0
    assert summary["units_s"] == pytest.approx(sum(row["wall_s"] for row in run["units"]))
    assert set(summary["by_family_s"]) == {"s-niah", "ppl", "longbench"}
    assert 0 < summary["outside_units_s"] < run["wall_s"]
    assert set(report["longbench_data"]) == {"narrativeqa", "dureader", "repobench-p"}

    assert suite_module.main(["--smoke", "--work", str(work), "--out", str(out), "--name", "again"]) == 0
    (again,) = json.loads((out / "again.json").read_text(encoding="utf-8"))["runs"]
    assert again["summary"]["earlier_units"] == 8 and again["summary"]["failed"] == 0
    assert [row["wall_s"] for row in again["units"]] == [row["wall_s"] for row in run["units"]]
    assert "done (earlier call)" in (out / "again.md").read_text(encoding="utf-8")


def test_chinese_metrics_run_on_the_jieba_standin_where_jieba_is_missing(suite_module, monkeypatch):
    """Without jieba the three datasets whose metrics segment with it are named in the report's note (lsht
    and passage_retrieval_zh need no segmentation); LongBench's Chinese metrics run on the stand-in, which
    splits into single CJK characters and whitespace-free runs of anything else."""
    from ccq_eval.tasks.longbench import metrics, spec

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        suite_module.importlib.util,
        "find_spec",
        lambda name, *args: None if name == "jieba" else real_find_spec(name, *args),
    )
    (note,) = suite_module.jieba_standin_notes(spec.LONGBENCH_DATASETS)
    assert "multifieldqa_zh, dureader, vcsum segment with benchlib/jieba_standin" in note
    assert suite_module.jieba_standin_notes(("narrativeqa", "lsht", "passage_retrieval_zh")) == []
    monkeypatch.undo()
    assert suite_module.jieba_standin_notes(spec.LONGBENCH_DATASETS) == []  # jieba is installed here

    standin = load("jieba", suite_module.JIEBA_STANDIN / "jieba.py")
    assert standin.STANDIN and list(standin.cut("北京 Tian-an men，2024年")) == [
        "北", "京", "Tian-an", "men，2024", "年",
    ]  # fmt: skip
    monkeypatch.setattr(metrics, "_jieba_module", standin)
    # 2 of 3 characters shared: precision 2/2, recall 2/3, F1 0.8.
    assert metrics.qa_f1_zh_score("北京", "北京市") == pytest.approx(0.8)
    assert metrics.rouge_zh_score("北京", "北京市") == pytest.approx(0.8)


def test_a_running_unit_counts_its_time_so_far_not_as_outside(suite_module, tmp_path):
    """While a run goes on, its running unit shows the seconds since its unit.json was written, and
    "outside units" leaves them out; a finished unit keeps meta.json's wall time."""
    import time

    done, running = tmp_path / "model" / "ccq_s_niah_1", tmp_path / "model" / "ccq_longbench_trec"
    for folder, task in ((done, "ccq_s_niah_1"), (running, "ccq_longbench_trec")):
        folder.mkdir(parents=True)
        (folder / "unit.json").write_text(json.dumps({"task": task}), encoding="utf-8")
    (done / "results.json").write_text("{}", encoding="utf-8")
    (done / "meta.json").write_text(
        json.dumps(
            {"wall_time_s": 30.0, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime())}
        ),
        encoding="utf-8",
    )
    os.utime(running / "unit.json", (time.time() - 100, time.time() - 100))
    rows = suite_module.unit_rows(tmp_path, since=0.0, finished=False)
    assert [(row["task"], row["status"]) for row in rows] == [
        ("ccq_s_niah_1", "done"), ("ccq_longbench_trec", "running"),
    ]  # fmt: skip
    assert rows[0]["elapsed_s"] is None and rows[1]["elapsed_s"] == pytest.approx(100, abs=5)
    summary = suite_module.summarise({"units": rows, "wall_s": 140.0})
    assert summary["units_s"] == 30.0 and summary["outside_units_s"] == pytest.approx(10, abs=5)
    finished = suite_module.unit_rows(tmp_path, since=0.0, finished=True)
    assert finished[1]["status"] == "failed" and finished[1]["elapsed_s"] is None


def test_a_run_finds_the_jieba_standin_only_after_what_is_installed(suite_module, tmp_path, monkeypatch):
    """timed_run's child gets the repository first and the jieba stand-in last on its PYTHONPATH, so an
    installed jieba wins over the stand-in."""
    seen = {}

    class FinishedAtOnce:
        returncode = 0

        def __init__(self, command, env, **_):
            seen["command"], seen["path"] = command, env["PYTHONPATH"].split(os.pathsep)

        def wait(self, timeout=None):
            return 0

        def poll(self):
            return 0

    monkeypatch.setenv("PYTHONPATH", "/nonexistent/site")
    monkeypatch.setattr(suite_module.subprocess, "Popen", FinishedAtOnce)
    run = suite_module.timed_run(tmp_path / "model", tmp_path / "data", tmp_path / "out", [], timeout=60)
    assert run["returncode"] == 0 and "--suite" in seen["command"]
    assert seen["path"] == [str(suite_module.REPO), "/nonexistent/site", str(suite_module.JIEBA_STANDIN)]
