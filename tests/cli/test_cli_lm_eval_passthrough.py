"""`ccq-eval lm-eval ...` is lm-eval's own CLI with the `ccq` model registered with lm-eval and the CCQ
model types with transformers' Auto classes."""

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ccq_eval.cli import app

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def lm_eval_logging():
    """lm-eval's CLI adds its own handler to the lm_eval logger (once per process); it writes to the
    stream the test runner had then, so it leaves with the test."""
    before = list(logging.getLogger("lm_eval").handlers)
    yield
    lm_eval_logger = logging.getLogger("lm_eval")
    for handler in [h for h in lm_eval_logger.handlers if h not in before]:
        lm_eval_logger.removeHandler(handler)


@pytest.mark.slow
def test_lm_eval_cli_runs_our_model_on_our_task(tmp_path, monkeypatch, lm_eval_logging):
    monkeypatch.chdir(REPO)
    document = tmp_path / "doc.txt"
    document.write_text("The quick brown fox jumps over the lazy dog. " * 20, encoding="utf-8")
    metadata = {"tokenizer": str(REPO / "models" / "tiny-gla"), "lengths": [256], "data_files": [str(document)]}
    result = CliRunner().invoke(app, [
        "lm-eval", "run", "--model", "ccq", "--model_args", "pretrained=tiny-gla,max_length=256",
        "--tasks", "ccq_ppl_sweep", "--include_path", "tasks/ppl", "--metadata", json.dumps(metadata),
        "--output_path", str(tmp_path / "out"),
    ])
    assert result.exit_code == 0, result.output
    # no CUDA warning on a CPU machine (lm-eval's default device), no --metadata hint (it was given)
    assert "CUDA is not available" not in result.output and "Custom kwargs" not in result.output
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    values = json.loads(results_file.read_text())["results"]["ccq_ppl_sweep"]
    assert values["tokens@256,none"] == 255  # 256 tokens in, 255 predictions
    assert 1.0 < values["ppl@256,none"] < 256 and math.isfinite(values["ppl@256,none"])


def _s_niah_sample(tmp_path: Path, name: str, model: str, model_args: str) -> tuple[dict, str]:
    """The first S-NIAH-1 sample (1K tokens, depth 50) of `ccq-eval lm-eval run --model MODEL`, and its stderr."""
    output = tmp_path / name
    metadata = {"tokenizer": "byt5", "lengths": [1024], "depths": [50]}
    done = subprocess.run(
        [sys.executable, "-m", "ccq_eval", "lm-eval", "run", "--model", model, "--model_args", model_args,
         "--tasks", "ccq_s_niah_1", "--include_path", str(REPO / "tasks"), "--metadata", json.dumps(metadata),
         "--limit", "1", "--log_samples", "--output_path", str(output)],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    (samples,) = output.rglob("samples_ccq_s_niah_1_*.jsonl")
    return json.loads(samples.read_text(encoding="utf-8").splitlines()[0]), done.stderr


@pytest.mark.slow
def test_lm_eval_cli_hf_model_loads_a_ccq_checkpoint_and_answers_as_our_adapter(tmp_path):
    """`--model hf` builds the CCQ model from a CCQ checkpoint folder and, decoding greedily the same prompt
    (no special tokens added), gives the same answer as the `ccq` adapter; neither run prints a warning
    of fla or transformers."""
    checkpoint = REPO / "models" / "tiny-gla-ccq"
    ours, our_log = _s_niah_sample(tmp_path, "ccq", "ccq", f"pretrained={checkpoint}")
    hf, hf_log = _s_niah_sample(tmp_path, "hf", "hf", f"pretrained={checkpoint},add_bos_token=False")
    assert hf["arguments"] == ours["arguments"]  # the same prompt
    assert hf["filtered_resps"] == ours["filtered_resps"] and hf["acc"] == ours["acc"]
    for log in (our_log, hf_log):
        assert "Warning:" not in log and "[transformers]" not in log, log[-3000:]


def _unknown_type_checkpoint(folder: Path, model_type: str) -> Path:
    """A checkpoint folder whose config.json names `model_type` (nothing else is read before the error)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}), encoding="utf-8")
    return folder


def test_transformers_unrecognized_model_type_is_one_line_naming_fla_and_the_fix(tmp_path):
    from transformers import AutoConfig

    from ccq_eval.model.loading import unrecognized_type_error

    with pytest.raises(ValueError, match="does not recognize this architecture") as raised:
        AutoConfig.from_pretrained(_unknown_type_checkpoint(tmp_path / "ckpt", "mystery_lm"))
    unknown = str(unrecognized_type_error(raised.value))
    assert "'mystery_lm'" in unknown and "installed fla" in unknown and "`ccq-eval models --families`" in unknown
    # what transformers says of fla's own type in a process that has not imported fla (stock lm_eval)
    fla_type = str(unrecognized_type_error(ValueError(str(raised.value).replace("mystery_lm", "gla"))))
    assert "'gla' is an fla" in fla_type and "`ccq-eval lm-eval ...`" in fla_type
    for line in (unknown, fla_type):
        assert "\n" not in line and "pip install" not in line
    assert unrecognized_type_error(ValueError("another error")) is None


@pytest.mark.slow
def test_lm_eval_cli_hf_model_of_an_unknown_type_stops_in_one_line(tmp_path, lm_eval_logging):
    checkpoint = _unknown_type_checkpoint(tmp_path / "ckpt", "mystery_lm")
    metadata = {"tokenizer": "byt5", "lengths": [1024], "depths": [50]}
    result = CliRunner().invoke(app, [
        "lm-eval", "run", "--model", "hf", "--model_args", f"pretrained={checkpoint}", "--tasks", "ccq_s_niah_1",
        "--include_path", str(REPO / "tasks" / "s_niah"), "--metadata", json.dumps(metadata), "--limit", "1"])
    assert result.exit_code == 1
    error = result.output.strip().splitlines()[-1]
    assert error.startswith("Error: unknown model_type 'mystery_lm'") and "fla" in error
    assert "pip install" not in result.output
