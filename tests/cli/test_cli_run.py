"""`ccq-eval run`: planning errors, the results store, and resuming a killed run.

The runs here go through the real lm_eval.simple_evaluate with a tiny generate_until task
written by the test and a fake LM (no model), so the resume path is the one real runs use.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval.harness import options, resume, runner, store, task_selection
from ccq_eval.harness import plan as run_plan
from ccq_eval.model import registry as model_registry

TASK_NAME = "ccq_s_niah_fake"

TASK_YAML = f"""
task: {TASK_NAME}
dataset_path: ""
dataset_name: ""
custom_dataset: !function fake_utils.make_docs
test_split: test
output_type: generate_until
doc_to_text: "{{{{input}}}}"
doc_to_target: "{{{{value}}}}"
generation_kwargs:
  until: []
  max_gen_toks: 8
process_results: !function fake_utils.score
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_1024
    aggregation: mean
    higher_is_better: true
  - metric: acc_2048
    aggregation: mean
    higher_is_better: true
"""

TASK_UTILS = '''
import datasets


def make_docs(lengths=(1024,), depths=(0,), samples_per_cell=1, seed=0, **_other):
    rows = []
    for length in lengths:
        for depth in depths:
            for index in range(int(samples_per_cell)):
                value = str(1000000 + 7919 * (len(rows) + 1) + int(seed))
                rows.append({"input": f"len {length} depth {depth:g} needle={value} #{index}",
                             "value": value, "length": int(length), "depth": float(depth)})
    return {"test": datasets.Dataset.from_list(rows)}


def score(doc, results):
    value = 100.0 * (doc["value"] in results[0])
    return {"acc": value, f"acc_{doc['length']}": value}
'''


class FakeLM:
    """Finds the needle unless it sits at depth 100 (or the model is 'weak' and length is 2048).

    Counts the requests it answers; with fail_after=k it raises once k requests were answered,
    like a process killed mid-unit."""

    def __init__(self, name: str, calls: list, fail_after: int | None = None):
        self.name, self.calls, self.fail_after = name, calls, fail_after

    def generate_until(self, requests, disable_tqdm=False):
        answers = []
        for request in requests:
            if self.fail_after is not None and len(self.calls) >= self.fail_after:
                raise RuntimeError("simulated kill")
            prompt = request.args[0]
            self.calls.append((self.name, prompt))
            needle = re.search(r"needle=(\d+)", prompt).group(1)
            lost = "depth 100 " in prompt or (self.name == "tiny-weak" and "len 2048 " in prompt)
            answers.append("I forgot" if lost else f"it is {needle}")
        return answers

    def loglikelihood(self, requests):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError


class FakeCatalog:
    def __init__(self, tasks_dir: Path):
        self.tasks_dir = tasks_dir

    def aliases(self):
        return {"fake": "a tiny S-NIAH-like task", TASK_NAME: "lm-eval task in the test folder"}

    def resolve(self, name):
        if name not in self.aliases():
            raise KeyError(name)
        return [TASK_NAME]

    def make_task_manager(self, metadata):
        from lm_eval.tasks import TaskManager

        return TaskManager(include_path=str(self.tasks_dir), include_defaults=False, metadata=metadata)


REGISTRY = {
    "tiny-strong": model_registry.ModelEntry("tiny-strong", "/nonexistent/tiny-strong", "finds needles", default=True),
    "tiny-weak": model_registry.ModelEntry("tiny-weak", "/nonexistent/tiny-weak", "loses them at 2K", default=True),
    "tiny-other": model_registry.ModelEntry("tiny-other", "/nonexistent/tiny-other", "not a default"),
}


@pytest.fixture
def fake_world(tmp_path, monkeypatch):
    """Registry, task catalog and evaluator replaced by fakes; returns a controller."""
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    (tasks_dir / "fake.yaml").write_text(TASK_YAML)
    (tasks_dir / "fake_utils.py").write_text(TASK_UTILS)
    catalog = FakeCatalog(tasks_dir)

    class World:
        calls: ClassVar[list] = []
        fail_after: int | None = None
        evaluators_made = 0
        loads: ClassVar[list] = []

    def make_evaluator():
        World.evaluators_made += 1

        def load(source, device, dtype):
            World.loads.append(source)
            return Path(source).name, None

        return runner.LmEvalUnitEvaluator(
            load_model=load,
            make_adapter=lambda model, tokenizer, max_length, batch_size, seed, cuda_graphs: FakeLM(
                model, World.calls, World.fail_after),
            task_catalog=catalog,
        )

    monkeypatch.setattr(run_plan, "load_model_registry", lambda *a, **k: dict(REGISTRY))
    monkeypatch.setattr(run_plan, "default_task_catalog", lambda: catalog)
    monkeypatch.setattr(runner, "default_evaluator", make_evaluator)
    monkeypatch.setattr(run_plan, "cuda_available", lambda: False)  # --device auto: the CPU, as in CI
    monkeypatch.chdir(tmp_path)
    return World


RUN_ARGS = ["run", "--task", "fake", "--lengths", "1k,2k", "--depths", "0,50,100", "--samples-per-cell", "2",
            "--lm-eval-arg", "bootstrap_iters=0", "--quiet"]
N_DOCS = 2 * 3 * 2


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def read_samples(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / f"samples_{TASK_NAME}.jsonl").read_text().splitlines()]


def test_run_resumes_killed_unit_without_redoing_answered_requests(fake_world, tmp_path):
    models = ["--model", "tiny-strong", "--model", "tiny-weak"]

    # Uninterrupted reference run.
    result = invoke(*RUN_ARGS, *models, "--output", "reference")
    assert result.exit_code == 0, result.output
    assert len(fake_world.calls) == 2 * N_DOCS

    # A run that dies 5 requests into the second unit.
    fake_world.calls.clear()
    fake_world.fail_after = N_DOCS + 5
    result = invoke(*RUN_ARGS, *models, "--output", "killed")
    assert result.exit_code == 1
    assert "simulated kill" in result.output and "rerun the same command" in result.output
    strong = store.unit_dir(Path("killed"), "tiny-strong", TASK_NAME)
    weak = store.unit_dir(Path("killed"), "tiny-weak", TASK_NAME)
    assert strong.is_finished() and not weak.is_finished()
    finished_bytes = strong.results.read_bytes()
    assert len(store.ResponseCache(weak.responses_db)) == 5  # answered requests were kept

    # Rerun the same command: the finished unit is skipped, the killed one asks only what is missing.
    fake_world.calls.clear()
    fake_world.fail_after = None
    result = invoke(*RUN_ARGS, *models, "--output", "killed")
    assert result.exit_code == 0, result.output
    assert [name for name, _ in fake_world.calls] == ["tiny-weak"] * (N_DOCS - 5)
    assert "1 skipped" in result.output
    assert strong.results.read_bytes() == finished_bytes  # nothing finished was rewritten

    # Same results and same per-sample log as the uninterrupted run.
    for model in ("tiny-strong", "tiny-weak"):
        resumed = store.unit_dir(Path("killed"), model, TASK_NAME)
        reference = store.unit_dir(Path("reference"), model, TASK_NAME)
        assert json.loads(resumed.results.read_text())["results"] == json.loads(reference.results.read_text())[
            "results"]
        assert read_samples(resumed.path) == read_samples(reference.path)
    weak_results = json.loads(weak.results.read_text())["results"][TASK_NAME]
    # weak: right only at 1K and depths 0, 50 -> 4 of 12; strong: depths 0, 50 at both lengths -> 8 of 12
    assert weak_results["acc,none"] == pytest.approx(100 * 4 / 12)
    assert weak_results["acc_2048,none"] == 0.0
    meta = json.loads(weak.meta.read_text())
    assert meta["requests_from_cache"] == 5 and meta["requests_computed"] == N_DOCS - 5

    # A third run does nothing at all and loads no model.
    fake_world.calls.clear()
    fake_world.loads.clear()
    result = invoke(*RUN_ARGS, *models, "--output", "killed")
    assert result.exit_code == 0 and fake_world.calls == [] and fake_world.loads == []
    assert "2 skipped" in result.output


def test_run_stores_lm_eval_results_samples_and_metadata(fake_world, tmp_path):
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--seed", "3", "--output", "out")
    assert result.exit_code == 0, result.output
    unit = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME)
    stored = json.loads(unit.results.read_text())
    assert stored["results"][TASK_NAME]["acc,none"] == pytest.approx(100 * 8 / 12)
    assert stored["n-samples"][TASK_NAME]["effective"] == N_DOCS
    assert stored["config"]["model"] == "tiny-strong"
    samples = read_samples(unit.path)
    assert len(samples) == N_DOCS
    assert {(s["doc"]["length"], s["doc"]["depth"]) for s in samples} == {
        (length, depth) for length in (1024, 2048) for depth in (0.0, 50.0, 100.0)}
    assert set(samples[0]["arguments"]) == {"gen_args_0"}  # lm-eval's tracker format
    meta = json.loads(unit.meta.read_text())
    assert meta["seed"] == 3 and meta["device"] == "cpu" and meta["model"] == "tiny-strong"
    assert meta["spec"]["task_metadata"] == {"seed": 3, "lengths": [1024, 2048], "depths": [0.0, 50.0, 100.0],
                                             "samples_per_cell": 2}
    assert meta["versions"]["lm_eval"] and meta["wall_time_s"] >= 0
    assert meta["gpu_kernels"] is None  # a CPU run: no GPU kernels ran
    assert meta["cuda_graphs"] is False
    assert "--samples-per-cell" in meta["command_line"]
    # the seed reached the task's document generator (values depend on it)
    assert samples[0]["doc"]["value"] == str(1000000 + 7919 + 3)
    # no temporary files left behind
    assert not [p for p in unit.path.iterdir() if p.name.endswith(".tmp")]


def test_run_progress_names_model_task_and_cell(fake_world, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich shortens lines to the terminal width
    result = invoke(*[a for a in RUN_ARGS if a != "--quiet"], "--progress", "--model", "tiny-weak", "--output", "out")
    assert result.exit_code == 0, result.output
    assert "done: tiny-weak / ccq_s_niah_fake" in result.output
    assert re.search(r"\[len (1024|2048), depth (0|50|100)\]", result.output)  # the cell being evaluated
    assert "tiny-weak / ccq_s_niah_fake" in result.output
    assert "ETA" in result.output


def test_default_run_uses_registry_defaults(fake_world, monkeypatch):
    plan = run_plan.plan_run(run_plan.RunOptions(tasks=["fake"], lengths="1k", depths="0"))
    assert [u.model for u in plan.units] == ["tiny-strong", "tiny-weak"]
    monkeypatch.setattr(task_selection, "DEFAULT_TASKS", ["fake"])
    plan = run_plan.plan_run(run_plan.RunOptions())
    assert {u.model for u in plan.units} == {"tiny-strong", "tiny-weak"}
    assert plan.task_metadata["samples_per_cell"] == options.DEFAULT_SAMPLES_PER_CELL
    assert plan.lengths == options.parse_lengths(options.DEFAULT_LENGTHS)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--limit", "3"], "--limit and --samples-per-cell conflict"),
        (["--lengths", "1x"], "cannot parse '1x'"),
        (["--depths", "0,150"], "outside [0, 100]"),
        (["--model", "nope"], "tiny-other, tiny-strong, tiny-weak"),
        (["--task", "nope"], "valid choices: ccq_s_niah_fake, fake"),
        (["--lm-eval-arg", "use_cache=x"], "set by the runner"),
        (["--lm-eval-arg", "bogus=1"], "not an lm_eval.simple_evaluate argument"),
        (["--lm-eval-arg", "novalue"], "expected key=value"),
        (["--dtype", "int3"], "'int3' is not one of 'float32', 'fp32', 'bfloat16'"),
        (["--max-length", "1000"], "shorter than the longest of --lengths"),
        (["--longbench-dir", "missing-folder"], "no such folder"),
        (["--cuda-graphs", "--device", "cpu"], "--cuda-graphs needs a CUDA device (--device cuda); got --device cpu"),
        (["--suite", "paper"], "--suite paper sets the tasks and lengths itself; drop --task, --lengths"),
    ],
)
def test_bad_options_fail_before_any_model_loads(fake_world, args, expected):
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", *args)
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.replace("│", " ").split())  # an error box may wrap lines
    assert fake_world.evaluators_made == 0 and fake_world.loads == []
    assert not Path("results").exists()


def test_depths_without_sniah_task_is_rejected(fake_world, monkeypatch):
    class NoSniah(FakeCatalog):
        def resolve(self, name):
            return ["ccq_ppl_sweep"]

    monkeypatch.setattr(run_plan, "default_task_catalog", lambda: NoSniah(Path(".")))
    result = invoke("run", "--model", "tiny-strong", "--task", "ppl", "--depths", "0,50")
    assert result.exit_code == 2 and "--depths applies only to tasks that place their needles at a depth (" \
        "S-NIAH, NIAH with competitors, variable tracking, RULER QA), and none was selected" in result.output


def test_rerun_with_other_settings_into_same_output_is_refused(fake_world):
    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 0
    unit = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME)
    before = {p.name: p.read_bytes() for p in unit.path.iterdir()}
    changed = [a if a != "2" else "3" for a in RUN_ARGS]  # --samples-per-cell 3
    result = invoke(*changed, "--model", "tiny-strong", "--output", "out")
    assert result.exit_code == 2
    assert "different settings" in result.output and "samples_per_cell" in result.output
    assert {p.name: p.read_bytes() for p in unit.path.iterdir()} == before


def test_corrupt_results_file_in_output_is_named_and_left_alone(fake_world):
    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 0
    unit = store.unit_dir(Path("out"), "tiny-strong", TASK_NAME)
    unit.results.write_text('{"results": {')
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert result.exit_code == 2
    assert str(unit.results) in result.output and "not valid JSON" in result.output
    assert unit.results.read_text() == '{"results": {'


def test_keep_going_records_failure_and_continues(fake_world):
    fake_world.fail_after = 3
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--model", "tiny-weak", "--keep-going", "--output", "kg")
    assert result.exit_code == 1
    assert "failed: tiny-strong" in result.output and "failed: tiny-weak" in result.output


def test_parse_lengths_and_depths():
    assert options.parse_lengths("1k, 2K,512") == [512, 1024, 2048]
    assert options.parse_lengths("0.5k") == [512]
    assert options.parse_depths("0,50%,100") == [0.0, 50.0, 100.0]
    with pytest.raises(run_plan.PlanError, match="repeats"):
        options.parse_lengths("1k,1024")
    with pytest.raises(run_plan.PlanError, match="whole number"):
        options.parse_lengths("0.3k")


def test_response_cache_round_trips_token_nll(tmp_path):
    """Per-token NLLs survive the resume cache (perplexity tasks need them), as TokenNLL again."""
    from ccq_eval.harness.adapter import TokenNLL

    cache = store.ResponseCache(tmp_path / "r.sqlite")

    class Request:
        def __init__(self, text):
            self.args, self.doc = (text,), {"length": 4}

    class Rolling:
        calls = 0

        def loglikelihood_rolling(self, requests):
            Rolling.calls += len(requests)
            return [TokenNLL.from_token_nll([0.5, 1.25, float(len(r.args[0]))]) for r in requests]

    requests = [Request("ab"), Request("abcd")]
    first = resume.ResumableLM(Rolling(), cache).loglikelihood_rolling(requests)
    second = resume.ResumableLM(Rolling(), cache).loglikelihood_rolling(requests)
    assert Rolling.calls == 2  # the second pass came from the cache
    for a, b in zip(first, second):
        assert isinstance(b, TokenNLL) and b.token_nll == a.token_nll and float(b) == float(a)
    assert resume.decode_response("loglikelihood", resume.encode_response("loglikelihood", (-1.5, True))) == (
        -1.5, True)


def test_grid_and_dataset_options_are_checked_against_the_tasks(fake_world, monkeypatch):
    # --limit would take only the shortest lengths of a grid task
    result = invoke("run", "--model", "tiny-strong", "--task", "fake", "--limit", "4")
    assert result.exit_code == 2 and "use --samples-per-cell" in result.output

    class Mixed(FakeCatalog):
        def resolve(self, name):
            return {"lb": ["ccq_longbench_qasper"], "ppl": ["ccq_ppl_sweep"]}[name]

    monkeypatch.setattr(run_plan, "default_task_catalog", lambda: Mixed(Path(".")))
    result = invoke("run", "--model", "tiny-strong", "--task", "lb", "--samples-per-cell", "2")
    assert result.exit_code == 2 and "does not apply to LongBench" in result.output
    assert fake_world.evaluators_made == 0

    # each unit's spec holds only the settings that change its documents
    plan = run_plan.plan_run(run_plan.RunOptions(models=["tiny-strong"], tasks=["ppl"], lengths="1k",
                                             samples_per_cell=2))
    assert plan.units[0].spec["task_metadata"] == {"seed": 0, "lengths": [1024], "samples_per_cell": 2}
    assert run_plan.metadata_for_task("ccq_longbench_qasper", {"seed": 0, "lengths": [1024], "depths": [0.0],
                                                             "data_dir": "/d"}) == {"seed": 0, "data_dir": "/d"}
    assert run_plan.metadata_for_task("ccq_s_niah_2", {"lengths": [1024], "depths": [0.0], "data_dir": "/d"}) == {
        "lengths": [1024], "depths": [0.0]}


def test_retrained_checkpoint_is_not_mixed_with_cached_answers(fake_world, monkeypatch, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gla"}')
    save_file({"w": np.full(1000, 1.0, dtype=np.float32)}, str(folder / "model.safetensors"))
    registry = dict(REGISTRY, **{"tiny-strong": model_registry.ModelEntry("tiny-strong", str(folder), "", True)})
    monkeypatch.setattr(run_plan, "load_model_registry", lambda *a, **k: registry)
    assert invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out").exit_code == 0
    save_file({"w": np.full(1000, 2.0, dtype=np.float32)}, str(folder / "model.safetensors"))  # same size
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert result.exit_code == 2 and "different settings (checkpoint:" in result.output


def test_bad_kernel_setting_fails_before_any_unit_runs(fake_world, monkeypatch):
    monkeypatch.setenv("CCQ_EVAL_TOKEN_LOGPROB", "numpy")
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out")
    assert result.exit_code != 0
    assert "CCQ_EVAL_TOKEN_LOGPROB must be 'triton' or 'torch', got 'numpy'" in result.output + str(result.exception)
    assert not list(Path("out").glob("**/results.json"))


def test_kernel_settings_are_read_from_the_environment(monkeypatch):
    from ccq_eval.harness.runner import gpu_kernel_settings

    monkeypatch.delenv("CCQ_EVAL_TOKEN_LOGPROB", raising=False)
    monkeypatch.setenv("CCQ_EVAL_CCQ_KERNEL", "unfused")
    assert gpu_kernel_settings() == {"ccq_read": "unfused", "token_logprob": "triton"}
    monkeypatch.delenv("CCQ_EVAL_CCQ_KERNEL")
    assert gpu_kernel_settings()["ccq_read"] == "fused"  # the default
