"""A NaN or infinite log-likelihood fails its unit, as NaN logits while generating do (the same error,
scoring.NonFiniteOutputError): a multiple-choice task would otherwise pick the first choice of every
document and report a score. Nothing of the unit is stored and the run exits non-zero with one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from adapter_support import byte_tokenizer, tiny_model
from lm_eval.api.instance import Instance
from typer.testing import CliRunner

from ccq_eval.harness.adapter import CCQEvalLM
from ccq_eval.harness.generation import NonFiniteGenerationError
from ccq_eval.harness.scoring import NonFiniteOutputError

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "zeroshot"


def choice_requests() -> list[Instance]:
    documents = [("Question: which is warm?\nAnswer:", [" the sun", " snow"]),
                 ("The kettle boiled, so she", [" made tea", " went to sleep on the roof"])]
    return [Instance("loglikelihood", {}, (context, choice), i, ("piqa", d, 1))
            for d, (context, choices) in enumerate(documents) for i, choice in enumerate(choices)]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_loglikelihoods_fail_naming_task_and_document(value):
    tokenizer = byte_tokenizer()
    model = tiny_model(tokenizer)
    requests = choice_requests()
    healthy = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=64, batch_size=4)
    assert len(healthy.loglikelihood(requests, disable_tqdm=True)) == len(requests)
    with torch.no_grad():
        model.lm_head.weight.fill_(value)
    broken = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=64, batch_size=4)
    with pytest.raises(NonFiniteOutputError) as info:
        broken.loglikelihood(requests, disable_tqdm=True)
    message = str(info.value)
    assert message.startswith("the model gave NaN or infinite log-likelihoods (task piqa: nan for doc 0, non-finite "
                              "in 4 of the 4 loglikelihood requests scored together), so its answers mean nothing "
                              "and the unit failed"), message
    assert "look for NaN / inf weights in the checkpoint" in message and "\n" not in message
    assert not isinstance(info.value, NonFiniteGenerationError)  # one base, two places it is raised


@pytest.mark.slow
def test_a_nan_weight_model_fails_its_zeroshot_unit_and_stores_nothing(tmp_path):
    from safetensors.torch import load_file, save_file

    from ccq_eval import cli

    broken = tmp_path / "nan-gla"
    shutil.copytree(REPO / "models" / "tiny-gla", broken)
    weights = load_file(broken / "model.safetensors")
    name = next(key for key in weights if key.endswith("embeddings.weight"))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    result = CliRunner().invoke(cli.app, ["run", "-m", str(broken), "-t", "piqa", "--zeroshot-dir", str(FIXTURES),
                                          "-o", str(out), "--no-report"])
    assert result.exit_code == 1, result.output
    (error,) = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert error.startswith("Error: the model gave NaN or infinite log-likelihoods (task piqa: nan for doc 0,"), error
    assert "piqa: 66.67" not in result.output
    stored = [p.name for p in out.rglob("*") if p.name.startswith(("results", "samples", "checksums", "meta"))]
    assert not stored and not (out / "table.md").exists()
