"""lm_eval_call.evaluate_tasks is lm_eval.simple_evaluate for an LM object, without git's stderr.

Both are run on the same tiny generate_until task with the same fake model: the results dicts must be
equal except for the evaluation date, and evaluate_tasks must take every simple_evaluate argument that
`run --lm-eval-arg` may pass.
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ccq_eval.harness.options import MANAGED_LMEVAL_ARGS

TASK = "ccq_call_fake"
TASK_YAML = f"""
task: {TASK}
dataset_path: ""
dataset_name: ""
custom_dataset: !function call_utils.make_docs
test_split: test
output_type: generate_until
doc_to_text: "{{{{input}}}}"
doc_to_target: "{{{{value}}}}"
generation_kwargs:
  until: []
  max_gen_toks: 8
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
TASK_UTILS = '''
import datasets


def make_docs(seed=0, **_other):
    rows = [{"input": f"needle={1000 + 7 * i + int(seed)}", "value": str(1000 + 7 * i + int(seed))} for i in range(5)]
    return {"test": datasets.Dataset.from_list(rows)}
'''


def _model():
    from lm_eval.api.model import LM

    class Echo(LM):
        """Answers the needle of every third prompt, something else otherwise."""

        def generate_until(self, requests, disable_tqdm=False):
            return [r.args[0].split("=")[1] if i % 3 == 0 else "no" for i, r in enumerate(requests)]

        def loglikelihood(self, requests):
            raise NotImplementedError

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError

    return Echo()


@pytest.fixture
def task_manager(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "call.yaml").write_text(TASK_YAML)
    (folder / "call_utils.py").write_text(TASK_UTILS)
    outside = tmp_path / "not-a-checkout"  # git finds no repository here
    outside.mkdir()
    monkeypatch.chdir(outside)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    return lambda: TaskManager(include_path=str(folder), include_defaults=False, metadata={"seed": 3})


def _comparable(results: dict) -> dict:
    return {key: value for key, value in results.items() if key != "date"}


@pytest.mark.parametrize("extra", [{}, {"gen_kwargs": "max_gen_toks=4", "bootstrap_iters": 10}])
def test_results_equal_simple_evaluates(task_manager, capfd, extra):
    from lm_eval.evaluator import simple_evaluate

    from ccq_eval.harness.lm_eval_call import evaluate_tasks

    arguments = {"limit": None, "batch_size": 1, "device": "cpu"}
    seeds = {"random_seed": 5, "numpy_random_seed": 5, "torch_random_seed": 5, "fewshot_random_seed": 5}
    theirs = simple_evaluate(model=_model(), tasks=[TASK], task_manager=task_manager(), log_samples=True,
                             **arguments, **seeds, **({"bootstrap_iters": 100000} | extra))
    if shutil.which("git"):  # lm-eval's own lookup lets git complain: what evaluate_tasks avoids
        assert "not a git repository" in capfd.readouterr().err
    ours = evaluate_tasks(_model(), task_manager(), [TASK], model_name="Echo", seed=5, **arguments, **extra)
    assert ours is not None and theirs is not None
    assert _comparable(ours) == _comparable(theirs)
    assert ours["results"][TASK]["exact_match,none"] == pytest.approx(0.4)  # 2 of 5 needles found
    assert "not a git repository" not in capfd.readouterr().err


def test_git_hash_is_lm_evals_in_a_checkout(tmp_path, monkeypatch):
    from lm_eval.loggers.utils import get_git_commit_hash

    from ccq_eval.harness.lm_eval_call import git_commit_hash

    monkeypatch.chdir(Path(__file__).resolve().parent)
    inside = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], capture_output=True, text=True)
    if inside.returncode != 0:
        pytest.skip("the tests run outside a git checkout")
    assert git_commit_hash() == get_git_commit_hash()


def test_every_argument_lm_eval_arg_may_pass_is_taken():
    from lm_eval.evaluator import simple_evaluate

    from ccq_eval.harness.lm_eval_call import evaluate_tasks

    passed_through = set(inspect.signature(simple_evaluate).parameters) - set(MANAGED_LMEVAL_ARGS)
    taken = {name for name, parameter in inspect.signature(evaluate_tasks).parameters.items()
             if parameter.default is not inspect.Parameter.empty}
    assert passed_through == taken - {"zeroshot_dir"}  # ccq-eval's own keyword: the zero-shot suite's data
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest: nothing here reaches the hub
