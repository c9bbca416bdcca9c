"""The recall table's `lm-eval` protocol against stock lm-eval: `ccq-eval run --recall-protocol lm-eval` on
tiny-transformer gives, document by document, the prompts, generation arguments and scores of lm-eval's own
`--model hf` (HFLM) on the same fixture documents of swde, fda and squad_completion, and each stored score is
what lm-eval's task scores our output. (The greedy texts themselves are the adapter's: on this untrained-size
model a near-tie can flip a later token between the adapter's and HFLM's generate, seen on one FDA document.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ccq_eval.tasks.recall.data import dataset_for
from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval.task_families import RECALL_LMEVAL_TASKS

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "recall"
MODEL = REPO / "models" / "tiny-transformer"


def _stock_samples(monkeypatch) -> dict[str, list[dict]]:
    """lm_eval.simple_evaluate(model="hf") with lm-eval's own tasks, `datasets.load_dataset` answering the
    tasks' hub ids with the fixture files (the only change: where the rows come from)."""
    import datasets
    import lm_eval

    real_load = datasets.load_dataset
    files = {dataset_for(task).hub_id: FIXTURES / dataset_for(task).file_name for task in RECALL_LMEVAL_TASKS}

    def load_dataset(path, name=None, **kwargs):
        if path in files:
            return real_load("json", data_files={"validation": str(files[path])})
        return real_load(path, name, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={MODEL},backend=causal,add_bos_token=False",
                                      tasks=list(RECALL_LMEVAL_TASKS), device="cpu", batch_size=1,
                                      bootstrap_iters=0, log_samples=True)
    return results["samples"]


@pytest.mark.slow
def test_prompts_and_scores_equal_stock_lm_eval_hf(tmp_path, monkeypatch):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli.app, ["run", "-m", "tiny-transformer", "-t", "recall", "--recall-protocol",
                                          "lm-eval", "--recall-dir", str(FIXTURES), "-o", str(out), "--no-report"])
    assert result.exit_code == 0, result.output
    stock = _stock_samples(monkeypatch)
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager, get_task_dict

    # their classes (data from the patched loader): lm-eval's own configs, their folders indexed alone (the
    # entries lm-eval's whole index holds for them, without the seconds of indexing its whole tree again)
    folders = [str(Path(lm_eval.tasks.__file__).parent / task) for task in RECALL_LMEVAL_TASKS]
    tasks = get_task_dict(list(RECALL_LMEVAL_TASKS), TaskManager(include_defaults=False, include_path=folders))
    for task in RECALL_LMEVAL_TASKS:
        ours = [json.loads(line) for line in
                (out / "tiny-transformer" / task / f"samples_{task}.jsonl").read_text().splitlines()]
        theirs = sorted(stock[task], key=lambda sample: sample["doc_id"])
        rows = (FIXTURES / dataset_for(task).file_name).read_text().splitlines()
        assert len(ours) == len(theirs) == len(rows), task  # lm-eval's protocol drops no document
        for mine, reference in zip(sorted(ours, key=lambda s: s["doc_id"]), theirs, strict=True):
            # lm-eval keeps (context, generation arguments) in memory and writes them as gen_args_0 / arg_0, arg_1
            (context, generation), = reference["arguments"]
            assert mine["arguments"] == {"gen_args_0": {"arg_0": context, "arg_1": generation}}, task
            assert mine["contains"] == reference["contains"], task
            # The score is lm-eval's own: its task's process_results on our output gives the stored score.
            assert tasks[task].process_results(reference["doc"], [mine["filtered_resps"][0]]) == {
                "contains": mine["contains"]}, task
