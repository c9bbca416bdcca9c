"""A model that cannot produce numbers fails its units: NaN logits while generating fail the unit as a
NaN log-likelihood does while scoring, and a failure stored by another process of the same run (a helper
of `--workers`) is counted as failed, never as "finished by another worker"."""

from __future__ import annotations

from pathlib import Path

import pytest
from lm_eval.api.instance import Instance
from test_cli_run import RUN_ARGS, TASK_NAME, fake_world, invoke  # noqa: F401  (a fixture)

from ccq_eval.harness import plan as run_plan


def test_nan_logits_while_generating_fail_instead_of_answering():
    import torch
    from adapter_support import byte_tokenizer, tiny_model

    from ccq_eval.harness.adapter import CCQEvalLM
    from ccq_eval.harness.generation import NonFiniteGenerationError

    tokenizer = byte_tokenizer()
    model = tiny_model(tokenizer)
    request = Instance("generate_until", {}, ("a needle in a haystack", {"until": ["\n"], "max_gen_toks": 4}), 0)
    healthy = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=64, batch_size=1)
    assert len(healthy.generate_until([request], disable_tqdm=True)) == 1
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    broken = CCQEvalLM(model=model, tokenizer=tokenizer, max_length=64, batch_size=1)
    with pytest.raises(NonFiniteGenerationError, match="NaN or infinite logits while generating"):
        broken.generate_until([request], disable_tqdm=True)


def test_a_failure_stored_by_a_helper_counts_as_failed(fake_world, monkeypatch):
    plan_run = run_plan.plan_run

    def plan_then_helper_stores_a_nan_unit(options):
        plan = plan_run(options)
        for unit in plan.units:  # what a helper process of this run stores for a NaN model
            plan.store.open(unit.dir, unit.spec).close()
            plan.store.commit(unit.dir, unit.model, {"results": {TASK_NAME: {"acc,none": float("nan")}}},
                              {TASK_NAME: []}, {"model": unit.model, "spec": unit.spec})
        return plan

    monkeypatch.setattr(run_plan, "plan_run", plan_then_helper_stores_a_nan_unit)
    result = invoke(*RUN_ARGS, "--model", "tiny-strong", "--output", "out", "--keep-going")
    assert result.exit_code != 0, result.output
    assert "non-finite result of tiny-strong" in result.output and "another worker" not in result.output
    assert Path("out").is_dir()


def test_inspect_on_a_nan_checkpoint_says_so_and_writes_nothing(tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from ccq_eval import cli

    models = Path(__file__).resolve().parents[2] / "models"
    broken = tmp_path / "nan-gla"
    shutil.copytree(models / "tiny-gla", broken)
    weights = load_file(broken / "model.safetensors")
    name = next(key for key in weights if key.endswith("embeddings.weight"))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "inspect"
    result = CliRunner().invoke(cli.app, ["inspect", "-m", str(broken), "-t", "s-niah-1", "--lengths", "1024",
                                          "--depths", "0", "--positions", "2", "-o", str(out)])
    assert result.exit_code != 0 and "gives NaN or infinite logits" in result.output, result.output
    assert not out.exists()
