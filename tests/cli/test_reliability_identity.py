"""Fault injection, round two (issue 29, cases 1-7): a unit's identity is everything that decides its
numbers (the weights actually loaded, the config, the data files, the settings, the seed), and every
reader and every waiting worker checks it.

Each test breaks one part of that identity and checks the clear one-line error (or the correct result)
and that no stored result changed. The runs use test_cli_run's fake world (the real
lm_eval.simple_evaluate, a fake model), the loading cases the embedded tiny checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from test_cli_fakes import as_older_unit
from test_cli_run import RUN_ARGS, TASK_NAME, fake_world, invoke  # noqa: F401
from test_reliability import assert_one_line_error, finished_run, snapshot

from ccq_eval.harness import plan as run_plan
from ccq_eval.harness import runner, store

# 1 -------------------------------------------------------------------------------------------


def test_waiting_worker_refuses_a_unit_another_finished_with_other_settings(fake_world, monkeypatch):
    """Worker B (--seed 5) plans while the folder is empty; worker A (--seed 0) finishes the unit before
    B takes its lock. B must not count A's unit as its own."""
    plan_run = run_plan.plan_run
    stored: dict[str, bytes] = {}

    def plan_then_other_worker_finishes(options):
        mine = plan_run(options)
        runner.execute_plan(plan_run(dataclasses.replace(options, seed=0)))
        stored.update(snapshot(Path("out")))
        return mine

    monkeypatch.setattr(run_plan, "plan_run", plan_then_other_worker_finishes)
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--seed", "5", "--output", "out")
    line = assert_one_line_error(result, "holds a run with different settings (task_metadata:", "'seed': 0",
                                 "'seed': 5", "use another --output", code=1)
    assert "another worker" not in line
    assert stored and snapshot(Path("out")) == stored


def test_waiting_worker_accepts_a_unit_another_finished_with_the_same_settings(fake_world, monkeypatch):
    plan_run = run_plan.plan_run

    def plan_then_other_worker_finishes(options):
        mine = plan_run(options)
        runner.execute_plan(plan_run(options))
        return mine

    monkeypatch.setattr(run_plan, "plan_run", plan_then_other_worker_finishes)
    calls = len(fake_world.calls)
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--seed", "5", "--output", "out")
    assert result.exit_code == 0, result.output
    assert "1 finished by another worker" in result.output
    assert len(fake_world.calls) - calls == 12  # computed once, by the other worker


# 6 -------------------------------------------------------------------------------------------


def test_finished_unit_without_unit_json_is_matched_by_its_meta(fake_world):
    finished_run("out")
    unit = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME)
    unit.spec.unlink()
    as_older_unit(unit.path)  # a unit of format 2 or older: no record of its files
    before = snapshot(Path("out"))
    fake_world.loads.clear()
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--seed", "3", "--output", "out")
    assert_one_line_error(result, str(unit.path), "different settings (task_metadata:", "'seed': 3",
                          "use another --output")
    assert fake_world.loads == [] and snapshot(Path("out")) == before
    same = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")  # the same question: finished
    assert same.exit_code == 0 and "1 already finished" in same.output, same.output
    assert snapshot(Path("out")) == before


def test_finished_unit_with_no_record_of_its_settings_is_refused(fake_world):
    finished_run("out")
    unit = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME)
    unit.spec.unlink()
    as_older_unit(unit.path)
    meta = json.loads(unit.meta.read_text())
    del meta["spec"]
    unit.meta.write_text(json.dumps(meta))
    before = snapshot(Path("out"))
    fake_world.loads.clear()
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--seed", "3", "--output", "out")
    assert_one_line_error(result, str(unit.path), "neither unit.json nor meta.json records its settings",
                          "use another --output, or delete that folder")
    assert fake_world.loads == [] and snapshot(Path("out")) == before


# 5 -------------------------------------------------------------------------------------------


def test_deleted_model_folder_does_not_come_back_from_the_tracker_copies(fake_world):
    import shutil

    finished_run("out", "--model", "tiny-weak")
    assert len(list(Path("out/lm_eval").glob("*/results_*.json"))) == 2
    shutil.rmtree("out/tiny-weak")
    before = snapshot(Path("out"))
    table = invoke("table", "out", "--view", "tidy", "--format", "csv")
    assert table.exit_code == 0, table.output
    assert "tiny-strong" in table.output and "tiny-weak" not in table.output
    compare = invoke("compare", "out", "--baseline", "tiny-strong", "--variant", "tiny-weak")
    assert compare.exit_code != 0 and "tiny-weak" in compare.output, compare.output
    shutil.rmtree("out/tiny-strong")  # no unit folder left: the copies name their units
    assert_one_line_error(invoke("table", "out"), "holds no results")
    assert snapshot(Path("out")) == {path: data for path, data in before.items() if "tiny-strong" not in path
                                     or "lm_eval" in path}
    lm_eval_layout = invoke("table", "out/lm_eval", "--view", "tidy", "--format", "csv")  # asked for by name
    assert lm_eval_layout.exit_code == 0 and "tiny-weak" in lm_eval_layout.output, lm_eval_layout.output


# 2 -------------------------------------------------------------------------------------------


def test_checkpoint_replaced_between_planning_and_loading_is_not_stored(fake_world, monkeypatch, tmp_path):
    from safetensors.numpy import save_file
    from test_cli_run import REGISTRY
    from test_reliability import make_checkpoint

    from ccq_eval.model import checkpoint
    from ccq_eval.model import registry as model_registry

    folder = make_checkpoint(tmp_path / "ckpt", 1.0)
    registry = dict(REGISTRY)
    registry["tiny-strong"] = model_registry.ModelEntry("tiny-strong", str(folder), "", True)
    monkeypatch.setattr(run_plan, "load_model_registry", lambda *a, **k: registry)
    plan_run = run_plan.plan_run

    def plan_then_replace_the_weights(options):
        planned = plan_run(options)
        save_file({"w": np.full(1000, 2.0, dtype=np.float32)}, str(folder / "model.safetensors"))
        return planned

    monkeypatch.setattr(run_plan, "plan_run", plan_then_replace_the_weights)
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert_one_line_error(result, "tiny-strong / ccq_s_niah_fake: files changed after the run was planned "
                          "(model.safetensors: planned ", "the unit was not stored; once they stay as they are, "
                          "rerun the same command", code=1)
    unit = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME)
    assert not unit.is_finished() and snapshot(Path("out")) == {str(unit.spec): unit.spec.read_bytes()}
    monkeypatch.setattr(run_plan, "plan_run", plan_run)
    rerun = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")  # plans with the current weights
    assert rerun.exit_code == 0, rerun.output
    recorded = json.loads(unit.spec.read_text())["checkpoint"]["sha256"]["model.safetensors"]
    assert unit.is_finished() and recorded == checkpoint.file_sha256(folder / "model.safetensors")


# 7 -------------------------------------------------------------------------------------------

LONGBENCH_TASK = "ccq_longbench_qasper"


@pytest.fixture
def longbench_world(fake_world, monkeypatch, tmp_path):
    """The fake world with a LongBench-like task whose documents are read from --longbench-dir."""
    from test_cli_run import TASK_YAML, FakeCatalog, FakeLM

    tasks = tmp_path / "lb_tasks"
    tasks.mkdir()
    (tasks / "lb.yaml").write_text(TASK_YAML.replace(f"task: {TASK_NAME}", f"task: {LONGBENCH_TASK}")
                                   .replace("fake_utils.make_docs", "lb_utils.read_docs")
                                   .replace("fake_utils.score", "lb_utils.score"))
    (tasks / "lb_utils.py").write_text(
        "import json, pathlib, datasets\n"
        "def read_docs(data_dir, **_other):\n"
        "    lines = (pathlib.Path(data_dir) / 'qasper.jsonl').read_text().splitlines()\n"
        "    return {'test': datasets.Dataset.from_list([json.loads(line) for line in lines])}\n"
        "def score(doc, results):\n"
        "    return {'acc': 100.0 * (doc['value'] in results[0]), 'acc_1024': 0.0, 'acc_2048': 0.0}\n")

    class LongBenchCatalog(FakeCatalog):
        def aliases(self):
            return {"lb": "a LongBench-like task"}

        def resolve(self, name):
            return [LONGBENCH_TASK]

    catalog = LongBenchCatalog(tasks)
    monkeypatch.setattr(run_plan, "default_task_catalog", lambda: catalog)
    monkeypatch.setattr(runner, "default_evaluator", lambda: runner.LmEvalUnitEvaluator(
        load_model=lambda source, device, dtype: (Path(source).name, None),
        make_adapter=lambda model, *settings: FakeLM(model, fake_world.calls), task_catalog=catalog))
    data = tmp_path / "longbench"
    data.mkdir()
    write_records(data / "qasper.jsonl", ["111", "222", "333"])
    return data


def write_records(path: Path, values: list[str]) -> None:
    path.write_text("".join(json.dumps({"input": f"needle={v} #{i}", "value": v}) + "\n"
                            for i, v in enumerate(values)))


def longbench_run(data: Path):
    return invoke("run", "-m", "tiny-strong", "-t", "lb", "--longbench-dir", str(data), "--lm-eval-arg",
                  "bootstrap_iters=0", "--quiet", "--output", "out")


def test_edited_longbench_file_is_not_taken_for_the_one_a_unit_read(longbench_world):
    result = longbench_run(longbench_world)
    assert result.exit_code == 0, result.output
    unit = store.unit_dir(Path("out"), "tiny-strong", LONGBENCH_TASK)
    assert list(json.loads(unit.spec.read_text())["data_files"]) == ["qasper.jsonl"]
    before = snapshot(Path("out"))
    write_records(longbench_world / "qasper.jsonl", ["111", "222", "334"])
    assert_one_line_error(longbench_run(longbench_world), str(unit.path), "different settings (data_files:",
                          "use another --output")
    assert snapshot(Path("out")) == before


def test_longbench_file_edited_while_a_unit_runs_is_not_stored(longbench_world, fake_world, monkeypatch):
    """The file changes after the model is loaded, before lm-eval reads the documents."""
    make_evaluator = runner.default_evaluator

    def evaluator_that_edits_the_data():
        evaluator = make_evaluator()
        make_adapter = evaluator._make_adapter

        def edit_then_make_adapter(*args):
            write_records(longbench_world / "qasper.jsonl", ["111", "222", "334"])
            return make_adapter(*args)

        evaluator._make_adapter = edit_then_make_adapter
        return evaluator

    monkeypatch.setattr(runner, "default_evaluator", evaluator_that_edits_the_data)
    unit = store.unit_dir(Path("out"), "tiny-strong", LONGBENCH_TASK)
    assert_one_line_error(longbench_run(longbench_world), "files changed after the run was planned "
                          "(qasper.jsonl: planned ", "the unit was not stored", f"delete {unit.path} (its 3 "
                          "answers may come from the old files)", code=1)
    assert any("needle=334" in prompt for _, prompt in fake_world.calls)  # the edited file was read
    assert not unit.is_finished()


# 3 -------------------------------------------------------------------------------------------

MODELS = Path(__file__).resolve().parents[2] / "models"


def edited_checkpoint(tmp_path: Path, model: str, config_edit=None, drop_tensors: str | None = None) -> Path:
    """A copy of an embedded checkpoint with its config.json edited and / or tensors removed."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / f"{model}-edited"
    shutil.copytree(MODELS / model, folder)
    config = json.loads((folder / "config.json").read_text())
    if config_edit is not None:
        config_edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    if drop_tensors is not None:
        tensors = load_file(folder / "model.safetensors")
        save_file({k: v for k, v in tensors.items() if drop_tensors not in k}, folder / "model.safetensors",
                  metadata={"format": "pt"})
    return folder


def fewer_layers(config):
    config["num_hidden_layers"] = 2


def relabelled_plain(config):
    config["model_type"] = "gla"
    del config["ccq"]


def tensor_names(model: str, keep) -> list[str]:
    from safetensors import safe_open

    with safe_open(MODELS / model / "model.safetensors", "np") as weights:
        return sorted(name for name in weights.keys() if keep(name))  # noqa: SIM118  (safe_open is not iterable)


def in_layers_2_and_3(name: str) -> bool:
    return name.startswith(("model.layers.2.", "model.layers.3."))


def in_the_ccq_gate(name: str) -> bool:
    return ".ccq_gate_" in name


@pytest.mark.parametrize(("edit", "drop", "named", "wrong"), [
    (fewer_layers, None, in_layers_2_and_3, "the weights hold {} tensors the config does not use"),
    (relabelled_plain, None, in_the_ccq_gate, "the weights hold {} tensors the config does not use"),
    (None, ".ccq_gate_", in_the_ccq_gate, "the weights lack {} tensors the config needs"),
])
def test_checkpoint_whose_weights_the_model_does_not_take_whole_is_refused(tmp_path, edit, drop, named,
                                                                            wrong):
    from ccq_eval.model.loading import ModelLoadError, load_model

    folder = edited_checkpoint(tmp_path, "tiny-gla-ccq", edit, drop)
    with pytest.raises(ModelLoadError) as error:
        load_model(str(folder))
    message = str(error.value)
    names = tensor_names("tiny-gla-ccq", named)
    assert "\n" not in message and str(folder) in message and "use the config.json saved with" in message
    assert wrong.format(len(names)) in message and f"(e.g. {', '.join(names[:3])})" in message, message


def test_baseline_with_ccq_attached_loads_without_gate_tensors():
    from ccq_eval.model.loading import load_model

    for name in ("tiny-gla", "tiny-gla-ccq"):
        model, _ = load_model(name, ccq=True)
        assert model.config.ccq
    model, _ = load_model("tiny-gla", ccq_lambda=1.0)
    assert model.config.ccq_gate == "constant"


def test_run_stops_on_a_checkpoint_the_model_does_not_take_whole(fake_world, monkeypatch, tmp_path):
    """Through `ccq-eval run`: the real loader, the fake model's answers."""
    from test_cli_run import FakeLM
    from transformers.utils import logging as hf_logging

    folder = edited_checkpoint(tmp_path, "tiny-gla-ccq", fewer_layers)
    before = finished_run("out")
    monkeypatch.setattr(runner, "default_evaluator", lambda: runner.LmEvalUnitEvaluator(
        make_adapter=lambda model, *settings: FakeLM("tiny-strong", fake_world.calls),
        task_catalog=run_plan.default_task_catalog()))
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # transformers' load report would go to a stream an earlier invoke closed
    try:
        result = invoke(*RUN_ARGS, "--model", str(folder), "--output", "out")
    finally:
        hf_logging.set_verbosity(verbosity)
    surplus = tensor_names("tiny-gla-ccq", in_layers_2_and_3)
    assert_one_line_error(result, str(folder), f"{len(surplus)} tensors the config does not use", code=1)
    assert not store.unit_dir(Path("out"), folder.name, TASK_NAME).is_finished()
    assert {k: v for k, v in snapshot(Path("out")).items() if folder.name not in k} == before


# 4 -------------------------------------------------------------------------------------------


def sampled_requests():
    """Six sampled prompts and one asked three times (lm-eval's repeats: the same Instance thrice)."""
    from lm_eval.api.instance import Instance

    sampling = {"until": [], "max_gen_toks": 12, "do_sample": True, "temperature": 1.0}
    prompts = [Instance("generate_until", {}, (f"prompt {i}: ", sampling), i, metadata=("t", i, 1))
               for i in range(6)]
    repeated = Instance("generate_until", {}, ("asked three times: ", sampling), 6, metadata=("t", 6, 3))
    return prompts + [repeated] * 3


def sampling_adapter(seed: int, killed_after: int | None = None):
    """The adapter on a tiny random model; killed_after=k: it dies once k requests were answered."""
    import torch
    from adapter_support import byte_tokenizer, tiny_model

    from ccq_eval.harness.adapter import CCQEvalLM

    class Killable(CCQEvalLM):
        answered = 0

        def generate_until(self, requests, disable_tqdm=False, request_ids=None):
            if killed_after is not None and self.answered + len(requests) > killed_after:
                raise RuntimeError("killed")
            self.answered += len(requests)
            ids = {} if request_ids is None else {"request_ids": request_ids}
            return super().generate_until(requests, disable_tqdm, **ids)

    tokenizer = byte_tokenizer()
    return Killable(model=tiny_model(tokenizer, dtype=torch.float32), tokenizer=tokenizer, max_length=256,
                    seed=seed)


def test_sampled_unit_killed_and_resumed_gives_the_uninterrupted_answers(tmp_path):
    from ccq_eval.harness.resume import ResumableLM

    requests = sampled_requests()
    cache = store.ResponseCache(tmp_path / "whole.sqlite")
    uninterrupted = ResumableLM(sampling_adapter(7), cache, chunk_size=2).generate_until(requests)
    assert len(set(uninterrupted[-3:])) == 3  # the repeats are three draws, not one
    assert sampling_adapter(8).generate_until(requests) != uninterrupted  # the seed decides the draws

    cache = store.ResponseCache(tmp_path / "killed.sqlite")
    with pytest.raises(RuntimeError, match="killed"):
        ResumableLM(sampling_adapter(7, killed_after=4), cache, chunk_size=2).generate_until(requests)
    assert len(cache) == 4
    resumed = ResumableLM(sampling_adapter(7), cache, chunk_size=3).generate_until(requests)
    assert resumed == uninterrupted
    assert sampling_adapter(7).generate_until(requests) == uninterrupted  # unwrapped, in one batch run


# Embedded corpora ----------------------------------------------------------------------------


@pytest.fixture
def fake_task_reads_a_corpus_copy(fake_world, tmp_path, monkeypatch):
    """The fake task counted as reading the embedded corpora, which are read from a copy (to edit)."""
    import shutil

    from ccq_eval.data import corpora

    copy = tmp_path / "corpora"
    copy.mkdir()
    for file, _description in corpora.CORPORA.values():
        shutil.copy(corpora.DATA_DIR / file, copy / file)
    monkeypatch.setattr(corpora, "DATA_DIR", copy)
    monkeypatch.setattr(run_plan, "reads_embedded_corpora", lambda task: True)
    return copy


def test_an_edited_corpus_is_computed_again_and_replaces_the_unit(fake_world, fake_task_reads_a_corpus_copy):
    finished_run("out")
    unit = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME)
    stored = json.loads(unit.spec.read_text())["embedded_corpora"]
    sotu = fake_task_reads_a_corpus_copy / "sotu.jsonl.xz"
    sotu.write_bytes(sotu.read_bytes() + b"\0")
    fake_world.calls.clear()
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert result.exit_code == 0, result.output
    assert "read embedded corpora that changed since they were stored (sotu.jsonl.xz)" in result.output
    assert len(fake_world.calls) == 12  # every request computed again
    recorded = json.loads(unit.spec.read_text())["embedded_corpora"]
    assert recorded["sotu.jsonl.xz"] != stored["sotu.jsonl.xz"] and recorded["kjv.jsonl.xz"] == stored["kjv.jsonl.xz"]
    (loaded,) = store.load_results(Path("out"))
    assert loaded.vouched and loaded.spec["embedded_corpora"] == recorded
    again = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert "1 already finished" in again.output and len(fake_world.calls) == 12, again.output


def test_a_recompute_that_fails_leaves_the_finished_unit_as_it_was(fake_world, fake_task_reads_a_corpus_copy):
    before = finished_run("out")
    sotu = fake_task_reads_a_corpus_copy / "sotu.jsonl.xz"
    sotu.write_bytes(sotu.read_bytes() + b"\0")
    fake_world.calls.clear()
    fake_world.fail_after = 5
    failed = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert failed.exit_code != 0 and len(fake_world.calls) == 5
    assert snapshot(Path("out")) == before  # the old unit whole (unit.json included) and still readable
    assert store.load_results(Path("out"))[0].vouched
    fake_world.fail_after = None
    resumed = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert resumed.exit_code == 0, resumed.output
    assert len(fake_world.calls) == 12  # the 5 answered before the failure came from the resume cache
    assert snapshot(Path("out")) != before and store.load_results(Path("out"))[0].vouched
