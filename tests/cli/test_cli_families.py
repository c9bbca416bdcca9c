"""The model families from the command line: `models --families` reads them off fla and transformers, a
checkpoint of a family with no CPU ops stops `run` before anything loads, and `run` + `table` work on tiny
random checkpoints of new families as they do on GLA."""

from __future__ import annotations

import pytest
from family_support import tiny_checkpoint
from typer.testing import CliRunner

from ccq_eval import cli


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def test_models_families_lists_fla_and_transformers_families():
    result = invoke("models", "--families")
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.output.splitlines() if line.strip()}
    for model_type in ("delta_net", "kda", "mamba2", "rwkv7", "precond_gated_deltanet", "precond_kda", "retnet",
                       "hgrn2", "gla", "gated_deltanet", "ccq_gla", "ccq_gated_deltanet"):
        assert "cpu, cuda" in rows[model_type], rows[model_type]
    assert "flash-attn" in rows["transformer"] and "cpu" not in rows["transformer"].split("fla 0.6.0")[1][:12]
    assert "Any transformers" in result.output and "llama, qwen2, mistral" in result.output


def test_run_refuses_a_family_without_cpu_ops_before_loading(tmp_path):
    import fla  # noqa: F401  (registers gsa)
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / "my-gsa"
    config = AutoConfig.for_model("gsa", hidden_size=64, num_hidden_layers=1, num_heads=2, vocab_size=384)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)  # built, never run: the plan stops first
    result = invoke("run", "-m", str(folder), "-t", "s-niah-1", "--lengths", "1k", "-o", str(tmp_path / "out"))
    assert result.exit_code == 2
    message = result.output.strip()
    assert message.count("\n") == 0 and "a gsa model cannot run on cpu" in message and "--device cuda" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_run_and_table_on_new_families(tmp_path):
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models = [tiny_checkpoint(model_type, tmp_path / f"tiny-{model_type}") for model_type in ("kda", "mamba2")]
        out = tmp_path / "results"
        args = ["run", "--task", "s-niah-1", "--task", "ppl-sweep", "--lengths", "1k", "--depths", "50",
                "--samples-per-cell", "1", "--output", str(out), "--quiet", "--lm-eval-arg", "bootstrap_iters=0"]
        for folder in models:
            args += ["--model", str(folder)]
        result = CliRunner().invoke(cli.app, args)
        assert result.exit_code == 0, result.output
    finally:
        torch.set_num_threads(previous)
    table = invoke("table", str(out), "--view", "tidy", "--format", "csv")
    assert table.exit_code == 0, table.output
    for name in ("tiny-kda", "tiny-mamba2"):
        assert table.output.count(name) >= 2  # S-NIAH and perplexity rows
