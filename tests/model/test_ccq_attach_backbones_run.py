"""`ccq-eval run --ccq-attach` on a plain checkpoint of a backbone beyond GLA and Gated DeltaNet (DeltaNet): the
sweep runs on the CPU, and a CCQ checkpoint of the same weights at lambda = 0, evaluated as a model of its own,
answers every S-NIAH sample exactly as the plain checkpoint's unit does."""

from __future__ import annotations

import json

import pytest
import torch
from family_support import byte_level_tokenizer, tiny_checkpoint
from typer.testing import CliRunner

from ccq_eval import cli
from ccq_eval.model.loading import load_model

TASK = "ccq_s_niah_1"


def _answers(unit):
    # by doc_id and prompt: doc_hash also covers the document's "tokenizer" field, each model's own folder
    return [(s["doc_id"], s["doc"]["input"], s["resps"], s["filtered_resps"])
            for s in map(json.loads, (unit / f"samples_{TASK}.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_the_lambda_zero_unit_of_a_delta_net_sweep_equals_the_ccq_model_at_lambda_zero(tmp_path):
    plain = tiny_checkpoint("delta_net", tmp_path / "tiny-delta_net")
    ccq_model, _ = load_model(str(plain), ccq_lambda=0.0)
    assert bool(torch.isinf(ccq_model.model.layers[0].attn.ccq_gate_bias).all())  # lambda = sigmoid(-inf) = 0
    at_zero = tmp_path / "tiny-delta_net-ccq0"
    ccq_model.save_pretrained(at_zero)
    byte_level_tokenizer("delta_net").save_pretrained(at_zero)
    grid = ["-t", "s-niah-1", "--lengths", "1k", "--depths", "0,100", "--samples-per-cell", "2", "--no-report",
            "--quiet"]
    runner = CliRunner()
    sweep = runner.invoke(cli.app, ["run", "-m", str(plain), "--ccq-attach", "lambda=0,1", *grid,
                                    "-o", str(tmp_path / "sweep")])
    assert sweep.exit_code == 0, sweep.output
    alone = runner.invoke(cli.app, ["run", "-m", str(at_zero), *grid, "-o", str(tmp_path / "alone")])
    assert alone.exit_code == 0, alone.output
    baseline = _answers(tmp_path / "sweep" / "tiny-delta_net" / TASK)
    assert len(baseline) == 4  # 2 samples x 2 depths
    assert _answers(tmp_path / "alone" / "tiny-delta_net-ccq0" / TASK) == baseline
    assert [a[0] for a in _answers(tmp_path / "sweep" / "tiny-delta_net+ccq-lambda1" / TASK)] == [
        a[0] for a in baseline]  # lambda = 1 ran on the same documents
