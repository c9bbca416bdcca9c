"""`ccq-eval run` on zero-shot units at lm-eval HFLM's lengths: a document longer than the model's max length
(its config's, or --max-length) scored as stock HFLM scores it, the cut requests counted; the units' identity
(context_truncation, max_length); and wikitext's protocol recorded by its own units only. Offline, on
tiny-transformer (its config says 2048 tokens; byte tokens, one per character) in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval.harness import plan as run_plan

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "zeroshot"
TOLERANCE = 1e-4  # float32: per request, a continuation's log-likelihood after up to 2048 tokens of context
SENTENCE = "Cells use energy from food to grow, move and repair themselves; plants make their food from light. "
# 3.7K characters of support: longer than tiny-transformer's 2048 tokens, as the SciQ document of issue 57 was.
LONG_SCIQ = {"question": "What do plants make their food from?", "distractor1": "soil", "distractor2": "water",
             "distractor3": "air", "correct_answer": "light", "support": SENTENCE * 37}


def invoke(*args: object):
    return CliRunner().invoke(cli.app, [str(arg) for arg in args])


def _long_sciq_folder(tmp_path: Path) -> Path:
    """--zeroshot-dir with sciq/test.jsonl: the long document, then the fixtures' first (short) one."""
    folder = tmp_path / "data"
    (folder / "sciq").mkdir(parents=True)
    short = (FIXTURES / "sciq" / "test.jsonl").read_text().splitlines()[0]
    (folder / "sciq" / "test.jsonl").write_text(json.dumps(LONG_SCIQ) + "\n" + short + "\n")
    return folder


def _unit_file(out: Path, model: str, task: str, name: str) -> dict:
    return json.loads((out / model / task / name).read_text())


@pytest.mark.slow
@pytest.mark.parametrize("max_length", [None, 1024], ids=["config", "max-length-1024"])
def test_a_document_longer_than_the_max_length_scores_as_stock_hflm(tmp_path, max_length):
    from lm_eval.models.huggingface import HFLM

    from ccq_eval.harness import zeroshot
    from ccq_eval.harness.task_registry import make_task_manager
    from ccq_eval.model.loading import load_model

    folder, out = _long_sciq_folder(tmp_path), tmp_path / "out"
    asked = ["--max-length", max_length] if max_length else []
    result = invoke("run", "-m", "tiny-transformer", "-t", "sciq", "--zeroshot-dir", folder, "-o", out, "--device",
                    "cpu", "--no-report", *asked)
    assert result.exit_code == 0, result.output
    samples = [json.loads(line) for line in (out / "tiny-transformer" / "sciq" / "samples_sciq.jsonl").open()]
    ours = {(s["doc_id"], choice): (float(resp[0][0]), resp[0][1] == "True")
            for s in samples for choice, resp in enumerate(s["resps"])}

    model, tokenizer = load_model("tiny-transformer", device="cpu", dtype="float32")
    task = zeroshot.load_tasks(make_task_manager(), ["sciq"], folder)["tasks"]["sciq"]
    task.set_config(key="num_fewshot", value=0)
    task.build_all_requests(rank=0, world_size=1)
    hflm = HFLM(pretrained=model, tokenizer=tokenizer, backend="causal", max_length=max_length, batch_size=1,
                add_bos_token=False)  # max_length None: HFLM resolves the config's 2048
    resolved = hflm.max_length
    long_context = len(tokenizer.encode(task.instances[0].args[0], add_special_tokens=False))
    assert long_context > resolved  # the long document's requests are cut
    want = hflm.loglikelihood(task.instances, disable_tqdm=True)
    assert len(ours) == len(want) == 8
    for request, (logprob, greedy) in zip(task.instances, want, strict=True):
        got = ours[(request.doc_id, request.idx)]
        assert got[0] == pytest.approx(logprob, abs=TOLERANCE), (request.doc_id, request.idx)
        assert got[1] == greedy

    meta = _unit_file(out, "tiny-transformer", "sciq", "meta.json")
    assert meta["truncation"]["by_task"] == {"sciq": {"policy": "left", "n_requests": 8, "n_truncated": 4}}
    scoring = _unit_file(out, "tiny-transformer", "sciq", "results.json")["config"]["ccq_scoring"]
    assert (scoring["max_length"], scoring["loglikelihood_truncation"]) == (resolved, "left")
    spec = _unit_file(out, "tiny-transformer", "sciq", "unit.json")
    assert (spec["max_length"], spec["context_truncation"]) == (max_length, "left")


def test_zero_shot_units_take_their_max_length_from_max_length_alone(tmp_path):
    """--lengths sizes the long-context units, not the zero-shot ones (HFLM's max length: --max-length, else
    the config's); the loglikelihood units record the cut, wikitext its protocol instead."""
    options = {"models": ["tiny-transformer"], "tasks": ["wikitext", "piqa", "ppl-sweep"], "lengths": "1024,2048",
               "zeroshot_dir": FIXTURES, "output": tmp_path / "out"}
    specs = {unit.task: unit.spec for unit in run_plan.plan_run(run_plan.RunOptions(**options)).units}
    assert {task: spec["max_length"] for task, spec in specs.items()} == {
        "wikitext": None, "piqa": None, "ccq_ppl_sweep": 2048}
    assert {task: spec.get("context_truncation") for task, spec in specs.items()} == {
        "wikitext": None, "piqa": "left", "ccq_ppl_sweep": None}
    given = run_plan.plan_run(run_plan.RunOptions(**options | {"max_length": 4096, "output": tmp_path / "out2"}))
    assert {unit.task: unit.spec["max_length"] for unit in given.units} == {
        "wikitext": 4096, "piqa": 4096, "ccq_ppl_sweep": 4096}


@pytest.mark.slow
def test_carry_and_hflm_units_each_record_their_own_protocol(tmp_path):
    """A carry run's wikitext unit records carry and its copa unit no rolling protocol (it had none); a default
    run's wikitext unit records HFLM's windows."""
    carried, default = tmp_path / "carry", tmp_path / "hflm"
    result = invoke("run", "-m", "tiny-transformer", "-t", "wikitext", "-t", "copa", "--rolling-windows", "carry",
                    "--zeroshot-dir", FIXTURES, "-o", carried, "--device", "cpu", "--no-report")
    assert result.exit_code == 0, result.output
    result = invoke("run", "-m", "tiny-transformer", "-t", "wikitext", "--zeroshot-dir", FIXTURES, "-o", default,
                    "--device", "cpu", "--no-report")
    assert result.exit_code == 0, result.output

    def recorded(out: Path, task: str) -> dict:
        return _unit_file(out, "tiny-transformer", task, "results.json")["config"]["ccq_scoring"][
            "rolling_protocol_by_task"]

    assert recorded(carried, "wikitext") == {"wikitext": "carry"}
    assert recorded(carried, "copa") == {}
    assert recorded(default, "wikitext") == {"wikitext": "hflm"}
