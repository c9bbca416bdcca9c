"""`ccq-eval inspect` end to end on embedded models (CPU), its one-line errors, and the GPU path."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from ccq_eval import cli


@pytest.mark.slow
def test_inspect_writes_tables_and_figures(tmp_path):
    out = tmp_path / "inspect"
    result = CliRunner().invoke(cli.app, ["inspect", "-m", "tiny-gla-ccq", "-m", "tiny-gdn", "-t", "s-niah-1",
                                          "--lengths", "1024", "--depths", "0,100", "--positions", "8", "-o", str(out)])
    assert result.exit_code == 0, result.output
    reads = pd.read_csv(out / "reads.csv")
    # 2 models x 2 depths x 4 layers x 2 heads, at the answer position
    assert len(reads) == 2 * 2 * 4 * 2
    assert set(reads["lambda_source"]) == {"gate", "constant"}
    assert reads["read_residual"].max() < 1e-5  # the decomposition is the kernel's read
    assert reads.loc[reads["ccq_trained"], "ccq_residual"].max() < 1e-5
    assert reads[["needle_share_on", "needle_share_off"]].stack().between(0, 1).all()
    assert (reads["needle_end"] > reads["needle_start"]).all()
    assert (reads["needle_end"] <= reads["answer_position"]).all()
    spectra = pd.read_csv(out / "spectra.csv")
    assert len(spectra) == len(reads) * 64  # head_k = 64 eigenvalues per head
    positions = pd.read_csv(out / "positions.csv")
    assert positions["in_needle"].any() and set(positions["model"]) == {"tiny-gla-ccq", "tiny-gdn"}
    for figure in ("needle_share", "needle_share_layers", "lambda_tiny-gla-ccq", "sigma_spectrum", "sigma_rank",
                   "query_move", "top_direction_energy"):
        assert (out / f"{figure}.png").stat().st_size > 0
    assert not (out / "lambda_tiny-gdn.png").exists()  # a baseline's lambda is one constant
    assert json.loads((out / "inspect.json").read_text())["models"] == ["tiny-gla-ccq", "tiny-gdn"]


def test_inspect_on_distractor_needles(tmp_path):
    """RULER multi-key NIAH: the target needle's and the distractor needles' shares of the same read, from
    disjoint token sets, so together they never exceed the whole read."""
    out = tmp_path / "inspect"
    result = CliRunner().invoke(cli.app, ["inspect", "-m", "tiny-gdn", "-t", "niah-multikey-1", "--lengths", "1024",
                                          "--depths", "50", "--positions", "4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    reads = pd.read_csv(out / "reads.csv")
    assert len(reads) == 4 * 2 and (reads["distractors"] == 3).all()  # RULER multikey_1: 3 distractor needles
    assert reads["read_residual"].max() < 1e-5
    for side in ("on", "off"):
        shares = reads[[f"needle_share_{side}", f"distractor_share_{side}"]]
        assert shares.stack().between(0, 1).all() and (shares.sum(axis=1) <= 1 + 1e-6).all()
    assert reads["distractor_token_fraction"].between(0, 1).all()


@pytest.mark.parametrize(("args", "message"), [
    (["-m", "tiny-transformer"], "a llama model"),
    (["-m", "tiny-gla", "-t", "ppl"], "choose one of s-niah-1"),
    (["-m", "tiny-gla", "-t", "ruler-cwe"], "niah-multikey-1"),
    (["-m", "tiny-gla", "--lengths", "1q"], "--lengths: cannot parse"),
    (["-m", "tiny-gla", "--depths", "150"], "outside [0, 100]"),
    (["-m", "no-such-model"], "unknown model 'no-such-model'"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, args, message):
    out = tmp_path / "inspect"
    result = CliRunner().invoke(cli.app, ["inspect", *args, "-o", str(out)])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.gpu
def test_inspect_on_gpu_matches_cpu(tmp_path):
    """fla's triton kernels on CUDA: the decomposition reproduces their output, and the measures agree
    with the CPU run of the same prompt."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA and fla's kernels")
    from ccq_eval.inspection.run import InspectOptions, check_models, inspect_model

    for name in ("tiny-gla-ccq", "tiny-gdn-ccq"):
        options = InspectOptions(models=[name], lengths=[1024], depths=[50.0], positions=8)
        folder = check_models([name])[name]
        gpu = pd.DataFrame(inspect_model(name, folder, options, "cuda")[0])
        cpu = pd.DataFrame(inspect_model(name, folder, options, "cpu")[0])
        # fla's triton kernels may multiply fp32 in TF32 (10-bit mantissa): per-mille, not 1e-7
        assert gpu["read_residual"].max() < 1e-2
        for column in ("needle_share_on", "needle_share_off", "sigma_eff_rank", "q_move_answer"):
            assert (gpu[column] - cpu[column]).abs().max() < 2e-2 * max(1.0, cpu[column].abs().max()), column


def test_inspect_and_run_share_one_default_seed():
    """`inspect` without --seed reads the prompts `run` without --seed evaluates."""
    import inspect as signature_of

    from ccq_eval.cli.inspect import inspect
    from ccq_eval.cli.run import run
    from ccq_eval.harness.run_options import DEFAULT_SEED, RunOptions
    from ccq_eval.inspection.prompts import needle_prompts
    from ccq_eval.inspection.run import InspectOptions

    defaults = {signature_of.signature(function).parameters["seed"].default
                for function in (inspect, run, needle_prompts)}
    assert defaults == {RunOptions().seed} == {InspectOptions(models=[]).seed} == {DEFAULT_SEED}


@pytest.mark.parametrize(("task", "message"), [
    ("niah_multikey_1", "ours is niah-multikey-1 (ccq_niah_multikey_1)"),  # lm-eval's port: run's line
    ("niah_single_2", "ours is s-niah-2 (ccq_s_niah_2)"),
    ("s_niah_1", "choose one of s-niah-1"),  # not a name `run` takes
    ("niah-multikey", "choose one of s-niah-1"),  # three tasks
    ("ruler_vt", "choose one of s-niah-1"),  # the port's, but inspect does not read vt
])
def test_inspect_takes_runs_task_names_only(tmp_path, task, message):
    out = tmp_path / "inspect"
    result = CliRunner().invoke(cli.app, ["inspect", "-m", "tiny-gdn", "-t", task, "-o", str(out)])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert "\n" not in result.output.strip() and not out.exists()
