"""`ccq-eval run` with nothing faked: tiny random CCQ-GLA checkpoints, the lm-eval adapter and our
S-NIAH and perplexity tasks, then `table` and `compare` on what it wrote."""

from __future__ import annotations

import io
import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from ccq_eval import cli


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import torch
    from transformers import ByT5Tokenizer

    from ccq_eval.model.modeling_ccq import prepare_runtime

    prepare_runtime()  # fla's CPU backend and the CCQ model types
    from ccq_eval.model.modeling_ccq import CCQGLAConfig, CCQGLAForCausalLM

    folder = tmp_path_factory.mktemp("models")
    tokenizer = ByT5Tokenizer()
    for name, ccq in (("tiny-gla", False), ("tiny-gla-ccq", True)):
        torch.manual_seed(0)
        config = CCQGLAConfig(hidden_size=32, num_hidden_layers=1, num_heads=2, vocab_size=len(tokenizer), ccq=ccq,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        CCQGLAForCausalLM(config).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    return folder


@pytest.mark.slow
def test_run_table_compare_on_real_models(checkpoints, tmp_path, monkeypatch):
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest on a busy 2-core machine
    try:
        out = tmp_path / "results"
        args = ["run", "--model", str(checkpoints / "tiny-gla"), "--model", str(checkpoints / "tiny-gla-ccq"),
                "--task", "s-niah-1", "--task", "ppl-sweep", "--lengths", "1k", "--depths", "50",
                "--samples-per-cell", "1", "--output", str(out), "--quiet",
                "--lm-eval-arg", "bootstrap_iters=0"]
        result = CliRunner().invoke(cli.app, args)
        assert result.exit_code == 0, result.output
        assert "4 evaluated" in result.output
    finally:
        torch.set_num_threads(previous)

    for model in ("tiny-gla", "tiny-gla-ccq"):
        stored = json.loads((out / model / "ccq_s_niah_1" / "results.json").read_text())
        assert stored["n-samples"]["ccq_s_niah_1"]["effective"] == 1
        meta = json.loads((out / model / "ccq_ppl_sweep" / "meta.json").read_text())
        assert meta["model_config_sha256"] and meta["truncation"]["n_truncated"] == 0
        [sample] = [json.loads(line) for line in
                    (out / model / "ccq_s_niah_1" / "samples_ccq_s_niah_1.jsonl").read_text().splitlines()]
        assert sample["doc"]["length"] == 1024 and sample["doc"]["depth"] == 50

    # Re-running is a no-op.
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0 and "0 evaluated, 4 skipped" in result.output

    result = CliRunner().invoke(cli.app, ["table", str(out), "--format", "csv", "--view", "tidy"])
    assert result.exit_code == 0, result.output
    tidy = pd.read_csv(io.StringIO(result.output))
    ppl = tidy[(tidy["task"] == "ccq_ppl_sweep") & (tidy["metric"] == "ppl") & (tidy["length"] == 1024)]
    assert len(ppl) == 2
    # an untrained byte-level model is close to uniform over its vocabulary
    assert ((ppl["value"] > 50) & (ppl["value"] < 2000)).all()

    result = CliRunner().invoke(cli.app, ["compare", str(out), "--baseline", "tiny-gla", "--variant",
                                          "tiny-gla-ccq", "--format", "csv", "--n-boot", "200"])
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(io.StringIO(result.output))
    assert set(frame["task"]) == {"ccq_s_niah_1", "ccq_ppl_sweep"}
    # same tokenizer, so the same model inputs (S-NIAH docs differ only in the tokenizer path they record)
    pairing = dict(zip(frame["task"], frame["pairing"]))
    assert pairing == {"ccq_s_niah_1": "prompt_hash", "ccq_ppl_sweep": "doc_hash"}
